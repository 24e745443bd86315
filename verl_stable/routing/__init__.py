"""MoE routing capture and replay (R2/R3) for Hugging Face models: pure torch + transformers, no verl import.

Usage::

    from verl_stable.routing import RoutingTrace, capture, replay

    with capture(model) as rec:  # records, outputs unchanged
        model(input_ids, attention_mask=mask)
    trace = rec.trace  # RoutingTrace of the valid tokens, row-major over the batch
    ids = trace.to_tensor()  # LongTensor [valid_tokens, moe_layers, top_k], -1 = no data (ids only)
    # the dense form drops the per-sequence lengths and the decoder layer of each MoE ordinal: pass them back
    trace2 = RoutingTrace.from_tensor(ids, trace.num_experts, trace.lengths, trace.layer_indices)
    with replay(model, trace2) as rp:  # forces that routing in every MoE layer
        model(input_ids, attention_mask=mask)
    rp.stats  # replayed / missing / padding rows

``trace.state_dict()`` / ``RoutingTrace.from_state_dict`` keep every field (for ``torch.save`` or a Ray object).
Every entry point validates what it is given (ids in range and distinct per row, integer counts, matching
layouts) before narrowing it, and raises a typed error (``RoutingTraceError``, ``codecs.RoutingFormatError``,
``UnsupportedModelError``) that names what was expected.

Modules: ``trace`` (RoutingTrace, RoutingLayout, storage dtype), ``families`` (per-family facts, model binding,
doctor report) with ``gates`` (gate-weight formulas), ``replay`` (capture / replay) on ``hooks`` (hook machinery),
``disagreement``, ``codecs`` (engine boundary), ``transport`` (rollout -> actor carriers), ``alignment`` (verl's
token layouts), ``checks`` (every input check, in one place) and ``errors`` (the typed errors).
"""

from verl_stable.routing.describe import describe_model_routing, format_routing_report
from verl_stable.routing.disagreement import expert_sets_differ, routing_disagreement
from verl_stable.routing.families import (
    FAMILIES,
    SUPPORTED_FAMILIES,
    FamilySpec,
    ModelRouting,
    UnsupportedModelError,
    bind_model,
    layout_from_config,
)
from verl_stable.routing.replay import ReplayStats, RoutingRecorder, RoutingReplayer, capture, replay
from verl_stable.routing.trace import MISSING, RoutingLayout, RoutingTrace, RoutingTraceError, storage_dtype

__all__ = [
    "FAMILIES",
    "MISSING",
    "SUPPORTED_FAMILIES",
    "FamilySpec",
    "ModelRouting",
    "ReplayStats",
    "RoutingLayout",
    "RoutingRecorder",
    "RoutingReplayer",
    "RoutingTrace",
    "RoutingTraceError",
    "UnsupportedModelError",
    "bind_model",
    "capture",
    "describe_model_routing",
    "expert_sets_differ",
    "format_routing_report",
    "layout_from_config",
    "replay",
    "routing_disagreement",
    "storage_dtype",
]
