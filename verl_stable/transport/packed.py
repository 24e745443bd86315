"""A batch's routing in one object with each prompt's rows stored once per group: :class:`PackedRouting`.

The carrier for a whole batch (Ray object store, legacy ``DataProto``), with group deduplication of prompt rows and
:meth:`PackedRouting.select` to split it per data-parallel rank. verl's V1 trainer moves routing per sample instead
(:mod:`verl_stable.transport.fields`, with prompt rows shared through :mod:`verl_stable.transport.sharing`); this
layout is the reference the transport benchmarks measure against. Bytes per real token: see
:mod:`verl_stable.transport.fields`. Every index array and id is checked on construction and unpickling.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from verl_stable.routing.checks import (
    counts,
    require_int,
    require_integer_tensor,
    require_layers,
)
from verl_stable.routing.codecs import RoutedRows, rows_to_trace
from verl_stable.routing.codecs.common import _require_layout, validated_ids_tensor
from verl_stable.routing.errors import ExpertIdRangeError, LayerMapError, RoutingFormatError, RowCountError
from verl_stable.routing.trace import RoutingLayout, RoutingTrace, storage_dtype
from verl_stable.transport.fields import empty_rows

__all__ = ["PackStats", "PackedRouting"]


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

    Construction (and unpickling, e.g. out of the Ray object store) checks that the index arrays are consistent
    with ``ids`` and that every id is below ``num_experts``; a :class:`RoutingFormatError` says what is off.
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

    def __post_init__(self) -> None:
        self.num_experts = require_int(self.num_experts, "PackedRouting.num_experts", minimum=1, error=LayerMapError)
        self.layer_indices = require_layers(self.layer_indices, "PackedRouting.layer_indices", error=LayerMapError)
        ids, dtype = self.ids, storage_dtype(self.num_experts)
        if not isinstance(ids, torch.Tensor) or ids.is_nested or ids.dim() != 3 or ids.dtype != dtype:
            got = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise LayerMapError(f"PackedRouting.ids must be a {dtype} [rows, moe_layers, top_k] tensor, got {got}")
        if ids.shape[1] != len(self.layer_indices):
            raise LayerMapError(f"PackedRouting: ids has {ids.shape[1]} MoE layers, layer_indices names "
                                f"{len(self.layer_indices)}")  # fmt: skip
        if ids.numel() and int(ids.max() if dtype != torch.uint16 else ids.to(torch.int32).max()) >= self.num_experts:
            raise ExpertIdRangeError(f"PackedRouting: expert ids outside [0, {self.num_experts})")
        for name in ("segment_offsets", "prompt_segment", "response_segment", "start", "prompt_lens"):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) or value.is_nested or value.dim() != 1:
                raise RowCountError(f"PackedRouting.{name} must be a 1-D int64 tensor, got {type(value).__name__}")
            require_integer_tensor(value, f"PackedRouting.{name}")
            setattr(self, name, value.detach().cpu().to(torch.int64))
        offsets, batch = self.segment_offsets, self.start.numel()
        if (
            offsets.numel() < 1
            or int(offsets[0]) != 0
            or int(offsets[-1]) != ids.shape[0]
            or (offsets.diff() < 0).any()
        ):
            raise RowCountError(f"PackedRouting.segment_offsets must rise from 0 to {ids.shape[0]} rows, got "
                                f"{offsets.tolist()[:16]}")  # fmt: skip
        for name in ("prompt_segment", "response_segment", "prompt_lens"):
            if getattr(self, name).numel() != batch:
                raise RowCountError(f"PackedRouting.{name} has {getattr(self, name).numel()} entries, start {batch}")
        for name in ("prompt_segment", "response_segment"):
            seg = getattr(self, name)
            if bool(((seg < -1) | (seg >= offsets.numel() - 1)).any()):
                raise RowCountError(f"PackedRouting.{name} must index [-1, {offsets.numel() - 1}), got {seg.tolist()}")
        if bool((self.start < 0).any()) or bool((self.prompt_lens < 0).any()):
            raise RowCountError("PackedRouting.start and prompt_lens must be >= 0")

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if self.ids.dtype == torch.uint16:  # torch pickles no uint16 tensor (torch.save does): carry the bits as int16
            state.update(ids=self.ids.view(torch.int16), _uint16_ids=True)
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        if state.pop("_uint16_ids", False) and isinstance(state.get("ids"), torch.Tensor):
            state["ids"] = state["ids"].view(torch.uint16)
        self.__dict__.update(state)
        self.__post_init__()

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
        """Pack per-sample routing; samples with equal ``group_ids`` share a prompt (verl's ``uid``).

        Every sample's ids are validated against ``layout`` before they are narrowed to its storage dtype.
        """
        layout = _require_layout(layout)
        samples, group_ids = list(samples), list(group_ids)
        prompt_lens = counts(prompt_lens, "prompt_lens")
        if not len(samples) == len(prompt_lens) == len(group_ids):
            raise RowCountError(
                f"{len(samples)} samples, {len(prompt_lens)} prompt lengths, {len(group_ids)} group ids"
            )
        for i, group in enumerate(group_ids):
            if not isinstance(group, Hashable):
                raise TypeError(f"group id {i} must be hashable (verl's uid), got {type(group).__name__}")
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
            if rows is not None and not isinstance(rows, RoutedRows):
                raise RoutingFormatError(f"sample {i}: expected RoutedRows or None, got {type(rows).__name__}")
            if rows is None or rows.num_rows == 0:
                prompt_seg.append(-1)
                response_seg.append(-1)
                starts.append(0)
                continue
            ids = validated_ids_tensor(rows, layout, f"sample {i}")
            split = min(max(plen - rows.start, 0), rows.num_rows)
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
        all_ids = torch.cat(chunks) if chunks else empty_rows(layout)
        return cls(
            ids=all_ids,
            segment_offsets=torch.tensor(offsets, dtype=torch.int64),
            prompt_segment=torch.tensor(prompt_seg, dtype=torch.int64),
            response_segment=torch.tensor(response_seg, dtype=torch.int64),
            start=torch.tensor(starts, dtype=torch.int64),
            prompt_lens=torch.tensor(prompt_lens, dtype=torch.int64),
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
        i = require_int(i, "sample index", error=TypeError)
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} packed samples")
        prompt, response = self._segment(int(self.prompt_segment[i])), self._segment(int(self.response_segment[i]))
        if prompt.shape[0] + response.shape[0] == 0:
            return None
        return RoutedRows(int(self.start[i]), torch.cat([prompt, response]).cpu().numpy())

    def unpack(self) -> list[RoutedRows | None]:
        """Every sample's routing, in order."""
        return [self.sample(i) for i in range(len(self))]

    def select(self, indices: Sequence[int] | torch.Tensor) -> PackedRouting:
        """The samples ``indices`` (e.g. one data-parallel rank's share), keeping shared prompt segments shared."""
        index = self._indices(indices)
        used = torch.cat([self.prompt_segment[index], self.response_segment[index]])
        keep = torch.unique(used[used >= 0])  # sorted
        remap = torch.full((self.segment_offsets.numel() - 1,), -1, dtype=torch.int64)
        remap[keep] = torch.arange(keep.numel())
        parts = [self._segment(int(s)) for s in keep.tolist()]
        lengths = torch.tensor([p.shape[0] for p in parts], dtype=torch.int64)

        def mapped(seg: torch.Tensor) -> torch.Tensor:
            out = seg.clone()
            present = seg >= 0
            out[present] = remap[seg[present]]  # no lookup at all when no sample has routing
            return out

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

    def _indices(self, indices: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Integer sample indices in ``[-B, B)`` as a 1-D int64 tensor (a bool mask is refused, not read as 0/1)."""
        try:
            index = torch.as_tensor(indices)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"indices must be integer sample indices, got {type(indices).__name__}") from exc
        if index.numel() == 0:
            return torch.zeros(0, dtype=torch.int64)
        if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
            raise TypeError(f"indices must be integer sample indices, got dtype {index.dtype}")
        index = index.reshape(-1).to(device="cpu", dtype=torch.int64)
        if bool(((index < -len(self)) | (index >= len(self))).any()):
            raise IndexError(f"indices {index.tolist()[:16]} out of range for {len(self)} packed samples")
        return index % max(len(self), 1)

    def to_trace(self, seq_lens: Sequence[int] | torch.Tensor, layout: RoutingLayout) -> RoutingTrace:
        """Token-aligned trace, ``seq_lens[i]`` = prompt + response tokens of sample ``i``."""
        layout = _require_layout(layout)
        if layout.num_experts != self.num_experts or tuple(layout.moe_layers) != self.layer_indices:
            raise LayerMapError(
                f"packed routing is for {self.num_experts} experts on decoder layers {list(self.layer_indices)}; "
                f"the model has {layout.num_experts} experts on {list(layout.moe_layers)}"
            )
        return rows_to_trace(self.unpack(), counts(seq_lens, "seq_lens"), layout)
