"""Routing export of the ``hf`` rollout server: the experts each token was routed to, in vLLM 0.24's layout.

With ``rollout.enable_rollout_routing_replay`` the server records its model's routing while it samples and returns it
as ``TokenOutput.routed_experts`` (:func:`routed_experts_array`: [rows, decoder layers, top_k], uint8 or uint16).
:func:`routing_exporter` binds a model once, through :mod:`verl_stable.routing`, and picks the recorder: the lean
:class:`RouterIdsRecorder` for router-output families, the general capture for the others.

Fault injection (tests only): with ``corrupt_every=k`` (``engine_kwargs.hf.corrupt_routing_every``, see
:mod:`verl_stable.backends.hf.options`) every k-th exported request carries a malformed payload
(:func:`corrupt_routing_payload`), so the rollout boundary's refusal, ``on_invalid=skip_sample`` and the replay
coverage metrics can be exercised in a real run.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch


def routed_experts_array(
    trace: torch.Tensor, moe_layer_to_decoder_layer: list[int], num_hidden_layers: int, num_experts: int
) -> Any:
    """Lay out captured routing like vLLM 0.24's ``CompletionOutput.routed_experts``.

    Args:
        trace: LongTensor [rows, moe_layers, top_k] of expert ids (rows = prompt tokens + fed-back outputs).
        moe_layer_to_decoder_layer: absolute decoder layer of each MoE-layer ordinal.
        num_hidden_layers: decoder layers L (dense layers get zero rows).
        num_experts: routed experts per layer (chooses uint8 up to 256, else uint16).

    Returns:
        numpy array [rows, L, top_k], uint8 or uint16.
    """
    import numpy as np

    if trace.dim() != 3:
        raise ValueError(f"routing trace must be [tokens, moe_layers, top_k], got shape {tuple(trace.shape)}")
    if trace.shape[1] != len(moe_layer_to_decoder_layer):
        raise ValueError(
            f"routing trace has {trace.shape[1]} MoE layers, mapping has {len(moe_layer_to_decoder_layer)}"
        )
    if trace.numel() and (int(trace.min()) < 0 or int(trace.max()) >= num_experts):
        raise ValueError(f"routing trace expert ids outside [0, {num_experts})")
    dtype = np.uint8 if num_experts <= 256 else np.uint16
    out = np.zeros((trace.shape[0], num_hidden_layers, trace.shape[2]), dtype=dtype)
    for ordinal, layer in enumerate(moe_layer_to_decoder_layer):
        out[:, layer, :] = trace[:, ordinal, :].cpu().numpy().astype(dtype)
    return out


def corrupt_routing_payload(array: Any, moe_layer_to_decoder_layer: list[int], num_experts: int) -> Any:
    """FAULT INJECTION: a copy of an exported routing array whose every MoE-layer id is ``num_experts``.

    Out of range for the model, so the rollout boundary refuses the sample (``ExpertIdRangeError``), as it would an
    engine's garbage; the row count and dense layers are kept, so nothing else about the payload is wrong. The copy
    is uint16 (an id of 256 does not fit the uint8 that up to 256 experts travel in).

    Args:
        array: ``[rows, decoder layers, top_k]`` as :func:`routed_experts_array` returns it.
        moe_layer_to_decoder_layer: absolute decoder layer of each MoE-layer ordinal.
        num_experts: routed experts per layer.
    """
    import numpy as np

    bad = np.array(array, dtype=np.uint16, copy=True)
    bad[:, list(moe_layer_to_decoder_layer), :] = num_experts
    return bad


class RouterIdsRecorder:
    """Routing capture specialised to the sampler's forwards (one sequence, no padding): one hook per router.

    The general :func:`verl_stable.routing.capture` tracks batch shapes and attention masks with model-level pre/post
    hooks and a per-site state machine; for KV-cached generation of a single sequence every routed row is a token,
    so a forward hook per router that appends its top-k ids is all that is needed (about a third of the hook work
    per decode step). Rows come out in call order: prompt tokens, then every fed-back sampled token -- the same rows
    the general capture records. :meth:`ids` checks that every MoE layer routed the same rows (a router that a hub
    kernel bypassed would come up short).
    """

    def __init__(self, routing: Any) -> None:
        self.routing = routing
        self.layers = routing.layout.moe_layers
        self.rows: list[list[torch.Tensor]] = [[] for _ in routing.sites]
        self._ids: torch.Tensor | None = None

    @contextlib.contextmanager
    def recording(self) -> Iterator[RouterIdsRecorder]:
        """Within the block, every router's forward appends its ids; the hooks are removed on exit."""
        handles = []
        try:
            for site in self.routing.sites:
                handles.append(site.module.register_forward_hook(self.make_hook(self.rows[site.ordinal])))
            yield self
        finally:
            for handle in handles:
                handle.remove()

    @staticmethod
    def make_hook(rows: list[torch.Tensor]) -> Any:
        """The forward hook of one router: appends the ids of its output ``(logits, weights, ids)``."""

        def hook(_module: Any, _args: Any, out: Any) -> None:
            rows.append(out[2])

        return hook

    def ids(self) -> torch.Tensor:
        """``[rows, moe_layers, top_k]`` expert ids of every routed row, in call order (computed once per recording)."""
        from verl_stable.routing import UnsupportedModelError

        if self._ids is not None and self._ids.shape[0] == sum(int(t.shape[0]) for t in self.rows[0]):
            return self._ids
        per_layer = [torch.cat(rows) if rows else torch.empty(0, self.routing.layout.top_k) for rows in self.rows]
        counts = {int(t.shape[0]) for t in per_layer}
        if len(counts) != 1:
            short = [self.layers[i] for i, t in enumerate(per_layer) if t.shape[0] < max(counts)]
            raise UnsupportedModelError(
                f"the routers of MoE decoder layers {short} did not run on every token: the MoE block was bypassed "
                "(hub kernel or a custom forward?), so routing was not captured"
            )
        self._ids = torch.stack(per_layer, dim=1)
        return self._ids


class RoutingExporter(NamedTuple):
    """How the server exports routing: ``capture(model)`` context, ``to_array(recorder, rows=None)`` (vLLM layout of
    all recorded rows, or of the given row indices), and whether one recording may span a batch of requests."""

    capture: Any
    to_array: Any
    batched: bool


def routing_exporter(model: torch.nn.Module, *, corrupt_every: int = 0) -> RoutingExporter:
    """Return a :class:`RoutingExporter` of ``model``'s routing via :mod:`verl_stable.routing`.

    The model is bound once, here. Router-output families (qwen3_moe, mixtral, ...) get :class:`RouterIdsRecorder`,
    whose rows follow the flattened ``[batch * tokens]`` order of each forward, so one recording serves a batch of
    requests; the others (an instance-level routing method) the general :func:`verl_stable.routing.capture`, one
    request per recording.

    Args:
        model: the served model.
        corrupt_every: FAULT INJECTION for tests: ``k > 0`` makes the k-th, 2k-th, ... ``to_array`` call (one per
            request) return :func:`corrupt_routing_payload`; 0 (default) exports faithfully.

    Raises:
        verl_stable.routing.UnsupportedModelError: a model family the routing package cannot route (a ValueError
            naming the model type and the supported ones).
        ValueError: a negative ``corrupt_every``.
    """
    if isinstance(corrupt_every, bool) or not isinstance(corrupt_every, int) or corrupt_every < 0:
        raise ValueError(f"corrupt_every must be an int >= 0, got {corrupt_every!r}")
    from verl_stable.routing import bind_model, capture
    from verl_stable.routing.families import ROUTER_OUTPUT

    routing = bind_model(model)  # fails loudly here, at server start, for unroutable models
    layout = routing.layout

    if routing.spec.site_kind == ROUTER_OUTPUT:

        def capture_factory(_model: torch.nn.Module) -> contextlib.AbstractContextManager:
            return RouterIdsRecorder(routing).recording()

    else:
        capture_factory = capture

    requests = itertools.count(1)
    lock = threading.Lock()  # the server exports from its batching threads

    def to_array(recorder: Any, rows: Any = None) -> Any:
        ids = recorder.ids() if isinstance(recorder, RouterIdsRecorder) else recorder.trace.to_tensor()
        if rows is not None:
            ids = ids[torch.as_tensor(rows, dtype=torch.long)]
        array = routed_experts_array(ids, list(recorder.layers), layout.num_hidden_layers, layout.num_experts)
        if corrupt_every:
            with lock:
                request = next(requests)
            if request % corrupt_every == 0:
                return corrupt_routing_payload(array, list(recorder.layers), layout.num_experts)
        return array

    return RoutingExporter(capture_factory, to_array, routing.spec.site_kind == ROUTER_OUTPUT)
