"""Record (``capture``) and force (``replay``) the expert routing of a Hugging Face MoE model.

Both context managers install hooks on the model's routing sites and on the model itself (the machinery, and how
the rows of a forward are the valid tokens of its attention mask or ``token_mask``, is in :mod:`.hooks`);
everything is removed when the context exits, also on exceptions.

Capture with a KV cache (rollout). Every forward appends its rows in call order: the prefill forward gives the
prompt's valid tokens, each decode forward (``input_ids`` [B, 1], ``attention_mask`` [B, past + 1]) one row per
sequence. ``RoutingRecorder.per_sequence()`` regroups them per batch row (left padding dropped), i.e. the
routing of every token that was *fed* to the model: ``prompt_len + generated - 1`` rows per sequence, the same
convention as vLLM's ``routed_experts``. The caller trims rows of tokens fed after a sequence finished.

Replay. Only the selection is replaced: gate weights are recomputed by the family's own formula
(:mod:`.gates`) from the live, differentiable router output at the replayed ids, so gradients reach the router,
and replaying a model's own captured trace reproduces its outputs bit for bit. Rows without routing data
(``valid`` False / ``-1``) and rows outside the trace (padding) keep the model's own routing and are counted in
``ReplayStats``: a replay never invents routing. Replay is keyed by MoE layer, not by a consuming cursor, so the
recompute of gradient checkpointing (which re-runs layers during backward, outside the model's forward) sees the
same rows. Run ``backward`` inside the context; to switch micro-batches call ``set_trace`` instead of leaving it.

Every trace handed to a replay is checked against the model (MoE layers, top-k, expert count, decoder layers; the
error names expected and received) and its ids again for range and distinct ids per row with data: a frozen
trace still holds mutable tensors, and an id edited in place after construction would index out of range (a
device-side assert on GPU) or weight one expert twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from verl_stable.routing.checks import check_distinct_ids, check_id_range, ids_checked
from verl_stable.routing.errors import RoutingTraceError
from verl_stable.routing.families import ModelRouting, RoutingSite, bind_model
from verl_stable.routing.hooks import _Forward, _RoutingSession
from verl_stable.routing.trace import RoutingTrace, storage_dtype

__all__ = ["ReplayStats", "RoutingRecorder", "RoutingReplayer", "capture", "replay"]


@dataclass
class ReplayStats:
    """Counters of a replay context (forward passes only; gradient-checkpointing recomputes are not recounted).

    Attributes:
        forwards: model forward passes seen.
        replayed_rows: (token, MoE layer) rows whose experts came from the trace.
        missing_rows: trace rows without routing data; the model's own routing was kept.
        padding_rows: (row, MoE layer) pairs outside the trace (padding); the model's own routing was kept.
        recompute_calls: routing-site calls outside a model forward (gradient checkpointing recompute).
    """

    forwards: int = 0
    replayed_rows: int = 0
    missing_rows: int = 0
    padding_rows: int = 0
    recompute_calls: int = 0

    def as_dict(self) -> dict[str, int]:
        """Plain dict for logging."""
        return dict(self.__dict__)


class RoutingRecorder(_RoutingSession):
    """Records the top-k ids of every MoE layer in every forward pass (yielded by ``capture``)."""

    def __init__(self, model: nn.Module, routing: ModelRouting, use_attention_mask: bool = True) -> None:
        super().__init__(model, routing, use_attention_mask)
        self._dtype = storage_dtype(routing.layout.num_experts)
        self.forwards: list[_Forward] = []

    def _begin_forward(self, fwd: _Forward) -> None:
        self.forwards.append(fwd)

    def _route(self, site: RoutingSite, live: torch.Tensor, out: Any, own: torch.Tensor, first_call: bool) -> Any:
        if first_call and self._current is not None:
            # Stay on the device: a host copy here would synchronise every layer.
            self._current.ids[site.ordinal] = own.detach().to(self._dtype)
        return None

    @property
    def layers(self) -> tuple[int, ...]:
        """Absolute decoder-layer index of each MoE-layer ordinal (the trace's second dimension)."""
        return self.layout.moe_layers

    def clear(self) -> None:
        """Drop everything recorded so far."""
        self.forwards = []

    def _forward_rows(self, fwd: _Forward) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[T, L, K]`` ids of every routed row and the ``[B, S]`` mask (None: every row is a token)."""
        if any(ids is None for ids in fwd.ids):
            raise RoutingTraceError("a forward pass did not complete; its routing is incomplete")
        ids = torch.stack([t.cpu() for t in fwd.ids], dim=1)  # type: ignore[union-attr]
        mask = None if fwd.mask is None else fwd.mask.cpu()
        return ids, mask

    @property
    def trace(self) -> RoutingTrace:
        """Routing of the token rows of every recorded forward, in call order, row-major over each batch.

        ``lengths`` has one entry per (forward, batch row): the valid tokens of that row in that forward.
        """
        layout = self.layout
        if not self.forwards:
            raise RoutingTraceError("nothing was captured: no forward pass ran inside capture()")
        chunks, lengths = [], []
        for fwd in self.forwards:
            ids, mask = self._forward_rows(fwd)
            if mask is not None:
                chunks.append(ids[mask.reshape(-1)])
                lengths.append(mask.sum(dim=1))
            else:
                chunks.append(ids)
                b, s = fwd.batch if fwd.batch is not None else (1, ids.shape[0])
                lengths.append(torch.full((b,), s, dtype=torch.long))
        return RoutingTrace(
            ids=torch.cat(chunks),
            num_experts=layout.num_experts,
            lengths=torch.cat(lengths),
            layer_indices=layout.moe_layers,
        )

    def per_sequence(self) -> RoutingTrace:
        """Routing regrouped per batch row across forwards (prefill + KV-cached decode steps).

        Every forward must have the same batch size B; response ``b`` of the result is the concatenation, in call
        order, of the token rows of batch row ``b`` (padding dropped).
        """
        if not self.forwards:
            raise RoutingTraceError("nothing was captured: no forward pass ran inside capture()")
        sizes = {fwd.batch[0] if fwd.batch is not None else None for fwd in self.forwards}
        if None in sizes or len(sizes) != 1:
            raise RoutingTraceError(
                f"per_sequence needs the same known batch size in every forward, got {sorted(map(str, sizes))}"
            )
        (b,) = sizes
        per_row: list[list[torch.Tensor]] = [[] for _ in range(b)]
        for fwd in self.forwards:
            ids, mask = self._forward_rows(fwd)
            ids = ids.reshape(b, -1, *ids.shape[1:])
            for row in range(b):
                per_row[row].append(ids[row] if mask is None else ids[row][mask[row]])
        rows = [torch.cat(chunks) for chunks in per_row]
        return RoutingTrace(
            ids=torch.cat(rows),
            num_experts=self.layout.num_experts,
            lengths=[r.shape[0] for r in rows],
            layer_indices=self.layout.moe_layers,
        )


class RoutingReplayer(_RoutingSession):
    """Forces a RoutingTrace's experts in every MoE layer (yielded by ``replay``)."""

    def __init__(
        self,
        model: nn.Module,
        routing: ModelRouting,
        trace: RoutingTrace | None,
        token_mask: torch.Tensor | None = None,
        *,
        checked_rows: torch.Tensor | None = None,
    ) -> None:
        super().__init__(model, routing)
        self.stats = ReplayStats()
        if checked_rows is None:
            self.set_trace(trace, token_mask)  # type: ignore[arg-type]  (None raises its TypeError there)
        elif trace is not None:
            raise ValueError("RoutingReplayer takes a trace or checked_rows, not both")
        else:
            self.set_checked_rows(checked_rows, token_mask)

    def set_trace(self, trace: RoutingTrace, token_mask: torch.Tensor | None = None) -> None:
        """Replay ``trace`` from the next forward on (e.g. the next micro-batch).

        Args:
            trace: routing of the token rows of the next forward(s), validated against the model.
            token_mask: optional ``[B, S]`` (or flat) bool marking which hidden rows the trace rows fill, in
                row-major order; overrides the forward's attention mask.
        """
        if not isinstance(trace, RoutingTrace):
            raise TypeError(f"replay needs a RoutingTrace, got {type(trace).__name__} (use RoutingTrace.from_tensor)")
        trace.validate_for(self.layout)
        try:
            check_id_range(trace.ids, trace.num_experts)
            check_distinct_ids(trace.ids, trace.valid)
        except RoutingTraceError as exc:
            raise RoutingTraceError(f"replay: {exc} (the trace's tensors were modified after it was built)") from None
        self._load(trace.to_tensor(), token_mask, trace)

    def set_checked_rows(self, ids: torch.Tensor, token_mask: torch.Tensor | None = None) -> None:
        """Replay dense ids that the caller checked itself, without building and re-checking a trace.

        For a caller that validated the ids in the same call (the FSDP engine checks each micro-batch's rows for
        range and repeated experts as it aligns them): building a :class:`RoutingTrace` and checking it again
        would repeat that work for every micro-batch. Only the shape and the token mask are checked here.

        Args:
            ids: int64 ``[N, moe_layers, top_k]``; every row either holds ``top_k`` distinct ids in
                ``[0, num_experts)`` or is ``-1`` in every slot (no data: the model's own routing is kept).
            token_mask: as in :meth:`set_trace`.
        """
        layout = self.layout
        expected = (len(layout.moe_layers), layout.top_k)
        if not isinstance(ids, torch.Tensor) or ids.is_nested or ids.dtype != torch.long or ids.dim() != 3:
            got = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise RoutingTraceError(
                f"replay: checked rows must be an int64 [tokens, moe_layers, top_k] tensor, got {got}"
            )
        if tuple(ids.shape[1:]) != expected:
            raise RoutingTraceError(
                f"replay: checked rows are [{ids.shape[1]} MoE layers, top_k {ids.shape[2]}], the model expects "
                f"[{expected[0]} MoE layers, top_k {expected[1]}]"
            )
        self._load(ids, token_mask, None)

    @property
    def trace(self) -> RoutingTrace:
        """The routing being replayed (built on first access when it was set by :meth:`set_checked_rows`)."""
        if self._trace is None:
            valid = self._valid_rows
            compact = self._ids.clamp_min(0).cpu().to(storage_dtype(self.layout.num_experts))
            with ids_checked():  # rows the caller checked (set_checked_rows)
                self._trace = RoutingTrace(
                    compact,
                    self.layout.num_experts,
                    valid=None if valid is None else valid.cpu(),
                    layer_indices=self.layout.moe_layers,
                )
        return self._trace

    def _load(self, ids: torch.Tensor, token_mask: torch.Tensor | None, trace: RoutingTrace | None) -> None:
        """Hold dense ``[N, L, K]`` int64 ids (``-1`` rows without data) for the next forward."""
        num_tokens = int(ids.shape[0])
        if token_mask is not None:
            if not isinstance(token_mask, torch.Tensor):
                raise RoutingTraceError(f"token_mask must be a bool tensor, got {type(token_mask).__name__}")
            if token_mask.is_nested or token_mask.dtype != torch.bool:
                got = "a nested tensor" if token_mask.is_nested else token_mask.dtype
                raise RoutingTraceError(f"token_mask must be a bool tensor, got {got}")
            if int(token_mask.sum()) != num_tokens:
                raise RoutingTraceError(
                    f"token_mask marks {int(token_mask.sum())} token rows but the trace has {num_tokens}"
                )
        self._trace = trace
        self.token_mask = token_mask
        self._num_tokens = num_tokens
        self._ids = ids
        valid = ids[:, :, 0] >= 0  # a row without data is -1 in every slot
        missing = (~valid).sum(dim=0).tolist()
        self._valid_rows = valid if any(missing) else None
        # one copy into layer-major order: every layer's rows are then a contiguous view
        self._ids_cpu = list(ids.transpose(0, 1).contiguous().unbind(0))
        self._valid_cpu = [None] * len(missing) if self._valid_rows is None else list(valid.t().contiguous().unbind(0))
        self._missing = missing
        self._device_cache: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor | None]]] = {}
        self._positions: torch.Tensor | None = None

    def _on_device(self, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        cached = self._device_cache.get(device)
        if cached is None:
            ids = [t.to(device) for t in self._ids_cpu]
            valid = [None if v is None else v.to(device) for v in self._valid_cpu]
            cached = self._device_cache[device] = (ids, valid)
        return cached

    def _begin_forward(self, fwd: _Forward) -> None:
        self.stats.forwards += 1
        n = self._num_tokens
        if fwd.mask is None:
            self._positions = None
            if fwd.rows is not None and fwd.rows != n:
                raise RoutingTraceError(
                    f"replay: the trace has {n} token rows but the forward has {fwd.batch[0]}x{fwd.batch[1]} = "  # type: ignore[index]
                    f"{fwd.rows} tokens and no 2-D attention mask (pass token_mask to place the rows)"
                )
            return
        flat = fwd.mask.reshape(-1)
        self._positions = flat.nonzero().squeeze(1)
        valid_tokens = int(self._positions.numel())
        if valid_tokens != n:
            raise RoutingTraceError(
                f"replay: the trace has {n} token rows but the forward has {valid_tokens} valid tokens "
                f"(mask of shape {tuple(fwd.mask.shape)})"
            )

    def _route(self, site: RoutingSite, live: torch.Tensor, out: Any, own: torch.Tensor, first_call: bool) -> Any:
        ordinal = site.ordinal
        ids_all, valid_all = self._on_device(own.device)
        ids, valid = ids_all[ordinal], valid_all[ordinal]
        n, rows = ids.shape[0], own.shape[0]
        if self._positions is None:
            if rows != n:
                raise RoutingTraceError(
                    f"replay: MoE layer {site.layer} routes {rows} rows but the trace has {n} token rows"
                )
            new = ids if valid is None else torch.where(valid.unsqueeze(1), ids, own)
        else:
            positions = self._positions.to(own.device)
            chosen = ids if valid is None else torch.where(valid.unsqueeze(1), ids, own.index_select(0, positions))
            new = own.index_copy(0, positions, chosen)
        if first_call:
            self.stats.replayed_rows += n - self._missing[ordinal]
            self.stats.missing_rows += self._missing[ordinal]
            self.stats.padding_rows += rows - n
        elif not self._in_forward:
            self.stats.recompute_calls += 1
        return self._rebuild(site, live, out, new)


@contextmanager
def capture(
    model: nn.Module, *, use_attention_mask: bool = True, config: Any | None = None
) -> Iterator[RoutingRecorder]:
    """Record the routing of every forward pass of ``model``; outputs are unchanged.

    Args:
        model: a supported transformers MoE model (see ``families.SUPPORTED_FAMILIES``).
        use_attention_mask: drop rows where the call's 2-D ``attention_mask`` is 0 (default); False keeps every
            routed row (padding included).
        config: override for the model's config.

    Yields:
        RoutingRecorder: ``.trace`` (valid tokens of all forwards, row-major), ``.per_sequence()`` (per batch row
        across KV-cached decode steps), ``.forwards`` (raw per-forward records).
    """
    recorder = RoutingRecorder(model, bind_model(model, config), use_attention_mask=use_attention_mask)
    recorder.install()
    try:
        yield recorder
    finally:
        recorder.remove()


@contextmanager
def replay(
    model: nn.Module,
    trace: RoutingTrace,
    *,
    token_mask: torch.Tensor | None = None,
    config: Any | None = None,
) -> Iterator[RoutingReplayer]:
    """Force ``trace``'s expert selection in every MoE layer of ``model``.

    Gate weights are recomputed from the live router output at the replayed ids (family normalisation and
    scaling), so the router still receives gradients. Trace rows fill the valid tokens of each forward in
    row-major order (attention mask, or ``token_mask``); rows without data and padding keep the model's routing.

    Args:
        model: a supported transformers MoE model.
        trace: routing for the token rows of each forward inside the context (``set_trace`` switches it).
        token_mask: optional bool ``[B, S]`` overriding the attention mask to place trace rows.
        config: override for the model's config.

    Yields:
        RoutingReplayer with ``.stats`` (ReplayStats) and ``.set_trace``.

    Raises:
        RoutingTraceError: layer count / top-k / expert count / row count mismatches (expected vs received).
    """
    replayer = RoutingReplayer(model, bind_model(model, config), trace, token_mask=token_mask)
    replayer.install()
    try:
        yield replayer
    finally:
        replayer.remove()
