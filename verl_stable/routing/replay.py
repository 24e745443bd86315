"""Record (``capture``) and force (``replay``) the expert routing of a Hugging Face MoE model.

Both context managers install a small state machine on the model's routing sites (see ``families.py``): a forward
hook on every router module, or an instance-level wrapper of the MoE block's ``route_tokens_to_experts``, plus a
pre/post forward hook on the model itself. Everything is removed when the context exits, also on exceptions.

Rows. A routing site sees the hidden states flattened row-major over ``[batch, seq]``. The model-level pre-hook
reads the call's ``input_ids`` (or ``inputs_embeds``) and 2-D ``attention_mask``; the rows of a trace are the
valid tokens (``attention_mask[:, -seq:] != 0``) in row-major order. Without a mask every row is a token (packed,
padding-removed inputs: batch 1, consecutive rows). An explicit ``token_mask`` overrides the attention mask.

Capture with a KV cache (rollout). Every forward appends its rows in call order: the prefill forward gives the
prompt's valid tokens, each decode forward (``input_ids`` [B, 1], ``attention_mask`` [B, past + 1]) one row per
sequence. ``RoutingRecorder.per_sequence()`` regroups them per batch row (left padding dropped), i.e. the
routing of every token that was *fed* to the model: ``prompt_len + generated - 1`` rows per sequence, the same
convention as vLLM's ``routed_experts``. The caller trims rows of tokens fed after a sequence finished.

Replay. Only the selection is replaced: gate weights are recomputed by the family's own formula from the live,
differentiable router output at the replayed ids, so gradients reach the router, and replaying a model's own
captured trace reproduces its outputs bit for bit. Rows without routing data (``valid`` False / ``-1``) and rows
outside the trace (padding) keep the model's own routing and are counted in ``ReplayStats``. Replay is keyed by
MoE layer, not by a consuming cursor, so the recompute of gradient checkpointing (which re-runs layers during
backward, outside the model's forward) sees the same rows. Run ``backward`` inside the context; to switch
micro-batches call ``set_trace`` instead of leaving the context.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from verl_stable.routing.families import (
    ROUTE_METHOD,
    ROUTER_OUTPUT,
    ModelRouting,
    RoutingSite,
    UnsupportedModelError,
    bind_model,
)
from verl_stable.routing.trace import RoutingLayout, RoutingTrace, RoutingTraceError, storage_dtype

_ROUTE_METHOD_NAME = "route_tokens_to_experts"


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


@dataclass
class _Forward:
    rows: int | None  # B * S when known
    batch: tuple[int, int] | None
    mask: torch.Tensor | None  # [B, S] bool, True = token row
    ids: list[torch.Tensor | None] = field(default_factory=list)


def _token_shape(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int] | None:
    tokens = kwargs.get("input_ids")
    if tokens is None and args and isinstance(args[0], torch.Tensor):
        tokens = args[0]
    if isinstance(tokens, torch.Tensor) and tokens.dim() == 2:
        return int(tokens.shape[0]), int(tokens.shape[1])
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, torch.Tensor) and embeds.dim() == 3:
        return int(embeds.shape[0]), int(embeds.shape[1])
    return None


def _row_mask(
    batch: tuple[int, int] | None, attention_mask: Any, token_mask: torch.Tensor | None
) -> torch.Tensor | None:
    """``[B, S]`` bool of token rows, or None when every routed row is a token."""
    if token_mask is not None:
        if batch is not None and token_mask.numel() != batch[0] * batch[1]:
            raise RoutingTraceError(
                f"token_mask has {token_mask.numel()} entries ({tuple(token_mask.shape)}) but the forward has "
                f"{batch[0]}x{batch[1]} token rows"
            )
        return token_mask.reshape(batch if batch is not None else (1, -1)).bool()
    if batch is None or not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        return None
    b, s = batch
    if attention_mask.shape[0] != b or attention_mask.shape[1] < s:
        raise RoutingTraceError(
            f"attention_mask of shape {tuple(attention_mask.shape)} does not cover input of shape ({b}, {s})"
        )
    return attention_mask[:, -s:] != 0


class _RouteDispatcher:
    """Instance-level ``route_tokens_to_experts`` shared by every open routing context on one MoE block.

    Contexts attach in entry order and each sees the output of the previous one (like chained forward hooks), so
    they may exit in any order; the block's original attribute state is restored when the last one detaches.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.had_instance_attr = _ROUTE_METHOD_NAME in vars(module)
        self.previous = vars(module).get(_ROUTE_METHOD_NAME)
        self.inner = getattr(module, _ROUTE_METHOD_NAME)
        self.listeners: list[tuple[_RoutingSession, RoutingSite]] = []

    def __call__(self, router_logits: torch.Tensor) -> Any:
        out = self.inner(router_logits)
        for session, site in list(self.listeners):
            new = session._on_site(site, router_logits, out)
            out = out if new is None else new
        return out

    def detach(self, session: _RoutingSession) -> None:
        self.listeners = [(s, site) for s, site in self.listeners if s is not session]
        if self.listeners:
            return
        if self.had_instance_attr:
            setattr(self.module, _ROUTE_METHOD_NAME, self.previous)
        else:
            delattr(self.module, _ROUTE_METHOD_NAME)


class _RoutingSession:
    """Shared machinery: hooks on the model and on every routing site, forward bookkeeping, clean removal."""

    def __init__(self, model: nn.Module, routing: ModelRouting, use_attention_mask: bool = True) -> None:
        self.model = model
        self.routing = routing
        self.use_attention_mask = use_attention_mask
        self.token_mask: torch.Tensor | None = None
        self._in_forward = False
        self._current: _Forward | None = None
        self._seen: set[int] = set()
        self._handles: list[Any] = []
        self._wrapped: list[nn.Module] = []

    @property
    def layout(self) -> RoutingLayout:
        """The model's routing layout."""
        return self.routing.layout

    # -------------------------------------------------------------- install / remove
    def install(self) -> None:
        try:
            self._handles.append(self.model.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            self._handles.append(self.model.register_forward_hook(self._post_forward))
            for site in self.routing.sites:
                self._install_site(site)
        except BaseException:
            self.remove()
            raise

    def _install_site(self, site: RoutingSite) -> None:
        module = site.module
        if self.routing.spec.site_kind == ROUTER_OUTPUT:

            def hook(_module: nn.Module, _args: Any, out: Any, _site: RoutingSite = site) -> Any:
                return self._on_site(_site, out[0], out)

            self._handles.append(module.register_forward_hook(hook))
            return
        assert self.routing.spec.site_kind == ROUTE_METHOD
        dispatcher = vars(module).get(_ROUTE_METHOD_NAME)
        if not isinstance(dispatcher, _RouteDispatcher):
            dispatcher = _RouteDispatcher(module)
            setattr(module, _ROUTE_METHOD_NAME, dispatcher)
        dispatcher.listeners.append((self, site))
        self._wrapped.append(module)

    def remove(self) -> None:
        for handle in reversed(self._handles):
            handle.remove()
        self._handles.clear()
        for module in self._wrapped:
            dispatcher = vars(module).get(_ROUTE_METHOD_NAME)
            if isinstance(dispatcher, _RouteDispatcher):
                dispatcher.detach(self)
        self._wrapped.clear()

    # ------------------------------------------------------------- forward tracking
    def _pre_forward(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        batch = _token_shape(args, kwargs)
        attention_mask = kwargs.get("attention_mask")
        if attention_mask is None and len(args) > 1:
            attention_mask = args[1]
        mask = _row_mask(batch, attention_mask if self.use_attention_mask else None, self.token_mask)
        rows = None if batch is None else batch[0] * batch[1]
        self._current = _Forward(rows=rows, batch=batch, mask=mask, ids=[None] * len(self.routing.sites))
        self._seen = set()
        self._in_forward = True
        self._begin_forward(self._current)

    def _post_forward(self, _module: nn.Module, _args: Any, _out: Any) -> None:
        self._in_forward = False
        missing = [s.layer for s in self.routing.sites if s.ordinal not in self._seen]
        if missing:
            raise UnsupportedModelError(
                f"the routers of MoE decoder layers {missing} did not run during this forward: the MoE block was "
                "bypassed (hub kernel or a custom forward?), so routing was neither captured nor replayed"
            )

    def _on_site(self, site: RoutingSite, live: torch.Tensor, out: Any) -> Any:
        first_call = self._in_forward and site.ordinal not in self._seen
        self._seen.add(site.ordinal)
        own = out[2] if self.routing.spec.site_kind == ROUTER_OUTPUT else out[0]
        fwd = self._current
        if fwd is not None and fwd.rows is not None and own.shape[0] != fwd.rows:
            raise RoutingTraceError(
                f"MoE layer {site.layer} routed {own.shape[0]} rows but the forward input has "
                f"{fwd.batch[0]}x{fwd.batch[1]} tokens"  # type: ignore[index]
            )
        return self._route(site, live, out, own, first_call)

    # ------------------------------------------------------------ subclass points
    def _begin_forward(self, fwd: _Forward) -> None:
        pass

    def _route(self, site: RoutingSite, live: torch.Tensor, out: Any, own: torch.Tensor, first_call: bool) -> Any:
        raise NotImplementedError

    def _rebuild(self, site: RoutingSite, live: torch.Tensor, out: Any, ids: torch.Tensor) -> Any:
        weights = self.routing.spec.gate_weights(site.module, live, ids)
        if self.routing.spec.site_kind == ROUTER_OUTPUT:
            return (out[0], weights, ids)
        return (ids, weights)


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
        trace: RoutingTrace,
        token_mask: torch.Tensor | None = None,
    ) -> None:
        super().__init__(model, routing)
        self.stats = ReplayStats()
        self.set_trace(trace, token_mask)

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
        if token_mask is not None:
            if not isinstance(token_mask, torch.Tensor) or token_mask.dtype != torch.bool:
                raise RoutingTraceError("token_mask must be a bool tensor")
            if int(token_mask.sum()) != trace.num_tokens:
                raise RoutingTraceError(
                    f"token_mask marks {int(token_mask.sum())} token rows but the trace has {trace.num_tokens}"
                )
        self.trace = trace
        self.token_mask = token_mask
        ids = trace.to_tensor()
        self._ids_cpu = [ids[:, layer].contiguous() for layer in range(trace.num_layers)]
        valid = trace.valid
        self._valid_cpu = [None if valid is None else valid[:, layer].contiguous() for layer in range(trace.num_layers)]
        self._missing = [0 if v is None else int((~v).sum()) for v in self._valid_cpu]
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
        n = self.trace.num_tokens
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
