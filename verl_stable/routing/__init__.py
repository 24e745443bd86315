"""MoE routing capture and replay (R2/R3) for Hugging Face models: pure torch + transformers, no verl import.

Usage::

    from verl_stable.routing import RoutingTrace, capture, replay

    with capture(model) as rec:  # records, outputs unchanged
        model(input_ids, attention_mask=mask)
    trace = rec.trace  # RoutingTrace of the valid tokens, row-major over the batch
    ids = trace.to_tensor()  # LongTensor [valid_tokens, moe_layers, top_k], -1 = no data
    trace2 = RoutingTrace.from_tensor(ids, num_experts=E)
    with replay(model, trace2) as rp:  # forces that routing in every MoE layer
        model(input_ids, attention_mask=mask)
    rp.stats  # replayed / missing / padding rows
"""

from verl_stable.routing.disagreement import expert_sets_differ, routing_disagreement
from verl_stable.routing.families import (
    FAMILIES,
    SUPPORTED_FAMILIES,
    FamilySpec,
    ModelRouting,
    UnsupportedModelError,
    bind_model,
    describe_model_routing,
    format_routing_report,
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
