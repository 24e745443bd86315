"""The hook machinery under ``capture`` and ``replay``: install on a model's routing sites, track each forward.

A routing session installs a small state machine on the model's routing sites (see ``families.py``): a forward
hook on every router module, or an instance-level wrapper of the MoE block's ``route_tokens_to_experts`` (shared by
every open session on that block, :class:`_RouteDispatcher`), plus a pre/post forward hook on the model itself.
``remove`` takes everything off again; ``capture`` / ``replay`` call it when their context exits, also on exceptions.

Rows. A routing site sees the hidden states flattened row-major over ``[batch, seq]``. The model-level pre-hook
reads the call's ``input_ids`` (or ``inputs_embeds``) and 2-D ``attention_mask``; the token rows of a forward are
the valid tokens (``attention_mask[:, -seq:] != 0``) in row-major order. Without a mask every row is a token
(packed, padding-removed inputs: batch 1, consecutive rows). An explicit ``token_mask`` (``[B, S]`` like the
input, or flat) overrides the attention mask.

Package-internal: :mod:`verl_stable.routing.replay` builds ``RoutingRecorder`` and ``RoutingReplayer`` on
:class:`_RoutingSession` (subclass points ``_begin_forward``, ``_route``) and re-exports it under the same name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from verl_stable.routing.errors import RoutingTraceError, UnsupportedModelError
from verl_stable.routing.families import ROUTE_METHOD, ROUTER_OUTPUT, ModelRouting, RoutingSite
from verl_stable.routing.trace import RoutingLayout

_ROUTE_METHOD_NAME = "route_tokens_to_experts"


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
        if batch is not None and _sizes(token_mask.shape) not in ((), (batch[0] * batch[1],), _sizes(batch)):
            # same count, other layout (e.g. [S, B]): the row-major reshape would put trace rows on the wrong tokens
            raise RoutingTraceError(
                f"token_mask of shape {tuple(token_mask.shape)} does not match the forward's input: expected "
                f"{batch} (or a flat mask of {batch[0] * batch[1]} entries)"
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


def _sizes(shape: Any) -> tuple[int, ...]:
    """The dimensions of a shape that are not 1 (``[1, N]`` and ``[N]`` are the same flat mask)."""
    return tuple(int(n) for n in shape if n != 1)


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
            # patch: route_tokens_to_experts (verl_stable.compat.catalogue)
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
