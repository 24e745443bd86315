"""Compact transport of rollout routing from the rollout workers to the actors.

verl 0.9.1 moves routing as int16 ``[prompt_len + response_len, num_hidden_layers, top_k]`` per sample (zero rows
for dense layers, and in the legacy trainer zero-padded to ``prompt_length + response_length`` for every sample).
Here routing travels as the smallest unsigned dtype over MoE layers only, without padding, and -- in the batch
form :class:`PackedRouting` -- with the prompt rows of the ``rollout.n`` responses of one prompt stored once.

Bytes per real token, for ``L`` MoE layers of ``H`` decoder layers, top-``K``, ``n`` responses per prompt of
``P`` prompt and ``R`` response tokens, ``W`` padded width (verl legacy) and storage itemsize ``b`` (1 for <= 256
experts):

* verl: ``2 * H * K * W / (P + R)``;
* per-sample fields (:func:`sample_fields`): ``b * L * K``;
* packed batch: ``b * L * K * (P / n + R) / (P + R)`` plus a few int64 per sample.

Two carriers:

* per-sample fields (:data:`IDS_FIELD`, :data:`SPAN_FIELD`) for verl's V1 trainer, where every sample is its own
  TransferQueue row and verl stacks ragged tensors as jagged nested tensors;
* :class:`PackedRouting` for a whole batch in one object (Ray object store, legacy ``DataProto``), with group
  deduplication of prompt rows and :meth:`PackedRouting.select` to split it per data-parallel rank.

Both expand, on the actor, to a token-aligned :class:`~verl_stable.routing.trace.RoutingTrace` whose invalid rows
(positions the engine did not record: the last sampled token, prefix offsets, tool output after the last turn)
keep the model's own routing. Pure torch/numpy; no verl import.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from verl_stable.routing.codecs import LayerMapError, RoutedRows, RowCountError, rows_to_trace, smallest_uint_dtype
from verl_stable.routing.trace import RoutingLayout, RoutingTrace, storage_dtype

__all__ = [
    "IDS_FIELD",
    "SPAN_FIELD",
    "PackStats",
    "PackedRouting",
    "dense_rows_from_fields",
    "rows_from_fields",
    "sample_fields",
    "trace_from_fields",
]

IDS_FIELD = "stable_routed_experts"
"""Per-sample ``[stop - start, num_moe_layers, top_k]`` ids of the recorded positions (smallest unsigned dtype)."""
SPAN_FIELD = "stable_routing_span"
"""Per-sample int64 ``[2]``: the token positions ``[start, stop)`` that :data:`IDS_FIELD` covers."""


def _empty(layout: RoutingLayout) -> torch.Tensor:
    return torch.zeros(0, layout.num_moe_layers, layout.top_k, dtype=storage_dtype(layout.num_experts))


def _ids_tensor(rows: RoutedRows, layout: RoutingLayout) -> torch.Tensor:
    if rows.ids.shape[1:] != (layout.num_moe_layers, layout.top_k):
        raise LayerMapError(
            f"rows are {rows.ids.shape[1]} MoE layers x top-{rows.ids.shape[2]}, the layout has "
            f"{layout.num_moe_layers} x top-{layout.top_k}"
        )
    # engines may hand out read-only buffers: copy those rather than let torch alias them
    return torch.from_numpy(
        np.require(rows.ids.astype(smallest_uint_dtype(layout.num_experts), copy=False), requirements="CW")
    )


# ------------------------------------------------------------------------------------------- per-sample fields
def sample_fields(rows: RoutedRows | None, layout: RoutingLayout) -> dict[str, torch.Tensor]:
    """The two per-sample tensors that carry one sample's routing (``None``: no routing, replay nothing)."""
    if rows is None or rows.num_rows == 0:
        return {IDS_FIELD: _empty(layout), SPAN_FIELD: torch.zeros(2, dtype=torch.int64)}
    return {IDS_FIELD: _ids_tensor(rows, layout), SPAN_FIELD: torch.tensor([rows.start, rows.stop], dtype=torch.int64)}


def _unbind(ids: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(ids, torch.Tensor):
        if ids.is_nested:
            return list(ids.unbind())
        return list(ids.unbind(0))
    return list(ids)


def _spans_tensor(spans: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """``[B, 2]`` int64 spans; TransferQueue hands per-sample fields back as a jagged tensor even when equal-sized."""
    parts = _unbind(spans) if not isinstance(spans, torch.Tensor) or spans.is_nested else None
    if parts is not None:
        if any(p.numel() != 2 for p in parts):
            raise RowCountError(
                f"every {SPAN_FIELD} entry must be [start, stop], got {[tuple(p.shape) for p in parts]}"
            )
        return torch.stack([p.reshape(2) for p in parts]).to(torch.int64) if parts else torch.zeros(0, 2)
    return spans.reshape(-1, 2).to(torch.int64)


def rows_from_fields(ids: torch.Tensor | Sequence[torch.Tensor], spans: torch.Tensor) -> list[RoutedRows]:
    """Per-sample :class:`RoutedRows` from a batch of the two fields (jagged nested ids, ``[B, 2]`` spans)."""
    parts = _unbind(ids)
    spans = _spans_tensor(spans)
    if len(parts) != spans.shape[0]:
        raise RowCountError(f"{len(parts)} routing entries but {spans.shape[0]} spans")
    out = []
    for i, (part, (start, stop)) in enumerate(zip(parts, spans.tolist(), strict=True)):
        if part.dim() != 3 or part.shape[0] != stop - start:
            raise RowCountError(f"sample {i}: span [{start}, {stop}) but {tuple(part.shape)} routing rows")
        out.append(RoutedRows(int(start), part.contiguous().numpy()))
    return out


def trace_from_fields(
    ids: torch.Tensor | Sequence[torch.Tensor],
    spans: torch.Tensor,
    seq_lens: Sequence[int] | torch.Tensor,
    layout: RoutingLayout,
) -> RoutingTrace:
    """Actor side: the token-aligned trace of a (micro-)batch, ``seq_lens[i]`` = prompt + response tokens of i."""
    lens = torch.as_tensor(seq_lens).reshape(-1).tolist()
    return rows_to_trace(rows_from_fields(ids, spans), lens, layout)


def dense_rows_from_fields(
    ids: torch.Tensor | Sequence[torch.Tensor],
    spans: torch.Tensor,
    offsets: torch.Tensor,
    layout: RoutingLayout,
) -> torch.Tensor:
    """Actor side, for the FSDP replay engine: the micro-batch's routing as packed token rows.

    Args:
        ids: the micro-batch's :data:`IDS_FIELD` (jagged).
        spans: its :data:`SPAN_FIELD`, ``[B, 2]``.
        offsets: ``input_ids.offsets()`` of the (jagged) micro-batch, ``[B + 1]``.
        layout: the model's routing layout.

    Returns:
        int64 ``[offsets[-1], num_moe_layers, top_k]``: row ``offsets[i] + t`` is token ``t`` of sample ``i``;
        ``MISSING`` (-1) in every slot of a row the engine did not record.
    """
    lens = torch.as_tensor(offsets).to("cpu", torch.long).diff()
    return trace_from_fields(ids, spans, lens, layout).to_tensor()


# ---------------------------------------------------------------------------------------------- packed batch
@dataclass
class PackStats:
    """What packing saved.

    Attributes:
        prompt_rows: prompt rows over all samples (what a per-sample layout stores).
        prompt_rows_stored: prompt rows actually stored after deduplication within groups.
        prompt_mismatches: samples whose prompt rows differed from a group sibling's and were stored separately
            (batch-variant prefill numerics; kept exact rather than merged).
    """

    prompt_rows: int = 0
    prompt_rows_stored: int = 0
    prompt_mismatches: int = 0


@dataclass
class PackedRouting:
    """A batch's routing with each prompt's rows stored once per group.

    Segment ``s`` is ``ids[segment_offsets[s]:segment_offsets[s + 1]]``. Sample ``i`` covers token positions
    ``[start[i], start[i] + len(prompt segment) + len(response segment))``: its prompt segment (positions before
    ``prompt_lens[i]``, shared by the samples of a group whose rows are identical) then its response segment.
    Segment index ``-1`` means empty.

    Attributes:
        ids: ``[rows, num_moe_layers, top_k]`` in the layout's storage dtype.
        segment_offsets: int64 ``[num_segments + 1]``.
        prompt_segment: int64 ``[B]``.
        response_segment: int64 ``[B]``.
        start: int64 ``[B]`` first covered token position.
        prompt_lens: int64 ``[B]``.
        num_experts: routed experts per layer.
        layer_indices: absolute decoder layer of each MoE-layer ordinal.
    """

    ids: torch.Tensor
    segment_offsets: torch.Tensor
    prompt_segment: torch.Tensor
    response_segment: torch.Tensor
    start: torch.Tensor
    prompt_lens: torch.Tensor
    num_experts: int
    layer_indices: tuple[int, ...]
    stats: PackStats = field(default_factory=PackStats)

    def __len__(self) -> int:
        return int(self.start.numel())

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors (ids + index arrays)."""
        tensors = (self.ids, self.segment_offsets, self.prompt_segment, self.response_segment, self.start)
        return sum(t.numel() * t.element_size() for t in (*tensors, self.prompt_lens))

    @classmethod
    def pack(
        cls,
        samples: Sequence[RoutedRows | None],
        prompt_lens: Sequence[int],
        group_ids: Sequence[Hashable],
        layout: RoutingLayout,
    ) -> PackedRouting:
        """Pack per-sample routing; samples with equal ``group_ids`` share a prompt (verl's ``uid``)."""
        if not len(samples) == len(prompt_lens) == len(group_ids):
            raise ValueError(f"{len(samples)} samples, {len(prompt_lens)} prompt lengths, {len(group_ids)} group ids")
        chunks: list[torch.Tensor] = []
        offsets = [0]
        prompt_seg, response_seg, starts = [], [], []
        shared: dict[tuple[Hashable, int, int], list[tuple[int, torch.Tensor]]] = {}
        stats = PackStats()

        def add(chunk: torch.Tensor) -> int:
            if chunk.shape[0] == 0:
                return -1
            chunks.append(chunk)
            offsets.append(offsets[-1] + chunk.shape[0])
            return len(chunks) - 1

        for i, (rows, plen, group) in enumerate(zip(samples, prompt_lens, group_ids, strict=True)):
            if rows is None or rows.num_rows == 0:
                prompt_seg.append(-1)
                response_seg.append(-1)
                starts.append(0)
                continue
            if rows.start < 0:
                raise RowCountError(f"sample {i}: negative start {rows.start}")
            ids = _ids_tensor(rows, layout)
            split = min(max(int(plen) - rows.start, 0), rows.num_rows)
            prompt_part, response_part = ids[:split], ids[split:]
            stats.prompt_rows += split
            seg = -1
            if split:
                siblings = shared.setdefault((group, rows.start, split), [])
                for index, existing in siblings:
                    if torch.equal(existing, prompt_part):
                        seg = index
                        break
                else:
                    if siblings:
                        stats.prompt_mismatches += 1
                    seg = add(prompt_part)
                    siblings.append((seg, prompt_part))
                    stats.prompt_rows_stored += split
            prompt_seg.append(seg)
            response_seg.append(add(response_part))
            starts.append(rows.start)
        all_ids = torch.cat(chunks) if chunks else _empty(layout)
        return cls(
            ids=all_ids,
            segment_offsets=torch.tensor(offsets, dtype=torch.int64),
            prompt_segment=torch.tensor(prompt_seg, dtype=torch.int64),
            response_segment=torch.tensor(response_seg, dtype=torch.int64),
            start=torch.tensor(starts, dtype=torch.int64),
            prompt_lens=torch.as_tensor(list(prompt_lens), dtype=torch.int64),
            num_experts=layout.num_experts,
            layer_indices=tuple(layout.moe_layers),
            stats=stats,
        )

    def _segment(self, index: int) -> torch.Tensor:
        if index < 0:
            return self.ids[:0]
        lo, hi = int(self.segment_offsets[index]), int(self.segment_offsets[index + 1])
        return self.ids[lo:hi]

    def sample(self, i: int) -> RoutedRows | None:
        """Routing of sample ``i`` (``None`` when it has none)."""
        prompt, response = self._segment(int(self.prompt_segment[i])), self._segment(int(self.response_segment[i]))
        if prompt.shape[0] + response.shape[0] == 0:
            return None
        return RoutedRows(int(self.start[i]), torch.cat([prompt, response]).numpy())

    def unpack(self) -> list[RoutedRows | None]:
        """Every sample's routing, in order."""
        return [self.sample(i) for i in range(len(self))]

    def select(self, indices: Sequence[int] | torch.Tensor) -> PackedRouting:
        """The samples ``indices`` (e.g. one data-parallel rank's share), keeping shared prompt segments shared."""
        index = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
        used = torch.cat([self.prompt_segment[index], self.response_segment[index]])
        keep = torch.unique(used[used >= 0])  # sorted
        remap = torch.full((self.segment_offsets.numel() - 1,), -1, dtype=torch.int64)
        remap[keep] = torch.arange(keep.numel())
        parts = [self._segment(int(s)) for s in keep.tolist()]
        lengths = torch.tensor([p.shape[0] for p in parts], dtype=torch.int64)

        def mapped(seg: torch.Tensor) -> torch.Tensor:
            return torch.where(seg >= 0, remap[seg.clamp_min(0)], seg)

        return PackedRouting(
            ids=torch.cat(parts) if parts else self.ids[:0],
            segment_offsets=torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
            prompt_segment=mapped(self.prompt_segment[index]),
            response_segment=mapped(self.response_segment[index]),
            start=self.start[index],
            prompt_lens=self.prompt_lens[index],
            num_experts=self.num_experts,
            layer_indices=self.layer_indices,
        )

    def to_trace(self, seq_lens: Sequence[int] | torch.Tensor, layout: RoutingLayout) -> RoutingTrace:
        """Token-aligned trace, ``seq_lens[i]`` = prompt + response tokens of sample ``i``."""
        if layout.num_experts != self.num_experts or tuple(layout.moe_layers) != self.layer_indices:
            raise LayerMapError(
                f"packed routing is for {self.num_experts} experts on decoder layers {list(self.layer_indices)}; "
                f"the model has {layout.num_experts} experts on {list(layout.moe_layers)}"
            )
        return rows_to_trace(self.unpack(), torch.as_tensor(seq_lens).reshape(-1).tolist(), layout)
