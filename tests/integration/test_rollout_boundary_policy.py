"""Issue #25: every refusal at the rollout boundary goes through the user's policy, and the all-zero routing that
monolithic MoE kernels return is never replayed.

``+verl_stable.routing.on_invalid=raise`` refuses such a sample with its error class; ``skip_sample`` trains it with
the model's own routing and counts it (``BoundaryStats`` and the per-sample boundary counters the trainer logs as
``stable/routing/transport/*``). Payloads are shaped as verl's vLLM server hands ``TokenOutput.routed_experts`` over:
an ``np.ndarray [prompt_len + response_len - 1, num_hidden_layers, top_k]``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from verl_stable.integration import rollout
from verl_stable.routing.codecs import BoundaryStats, RowCountError, ZeroRoutingError
from verl_stable.routing.trace import RoutingLayout
from verl_stable.transport.boundary import (
    BOUNDARY_FIELD,
    TRANSPORT_METRIC_PREFIX,
    compact_token_routing,
    transport_metrics,
)
from verl_stable.transport.expansion import expand_compact_routing
from verl_stable.transport.fields import IDS_FIELD, SPAN_FIELD, sample_fields
from verl_stable.transport.options import RolloutRoutingOptions

LAYOUT = RoutingLayout("qwen3_moe", "qwen3_moe", 5, (1, 2, 4), 2, 8)  # top-2, decoder layers 0 and 3 dense
TOP1 = RoutingLayout("qwen3_moe", "qwen3_moe", 4, (1, 3), 1, 8)  # top-1 (switch-style), 2 MoE layers
TOP1_ONE_LAYER = RoutingLayout("qwen3_moe", "qwen3_moe", 2, (1,), 1, 8)
RAISE = RolloutRoutingOptions(on_invalid="raise")
SKIP = RolloutRoutingOptions(on_invalid="skip_sample")


def vllm_routing(layout: RoutingLayout, rows: int, seed: int = 0, dtype=np.int32) -> np.ndarray:
    """Valid engine routing in vLLM's layout: distinct ids per row, never expert 0 (so zeroed rows stand out)."""
    scores = np.random.default_rng(seed).random((rows, layout.num_moe_layers, layout.num_experts - 1))
    out = np.zeros((rows, layout.num_hidden_layers, layout.top_k), dtype=dtype)
    out[:, list(layout.moe_layers)] = np.argsort(scores, axis=-1)[..., : layout.top_k] + 1
    return out


def boundary(payload, *, layout=LAYOUT, prompt_len, mask, options, response_length=None):
    stats = BoundaryStats()
    rows = compact_token_routing(
        payload,
        prompt_len=prompt_len,
        response_mask=mask,
        layout=layout,
        options=options,
        stats=stats,
        response_length=response_length,
    )
    return rows, stats


def assert_refused_and_counted(payload, error, match, **kwargs):
    """Refused with ``error`` under raise; under skip_sample no rows, one skipped sample counted by that class."""
    with pytest.raises(error, match=match) as info:
        boundary(payload, options=RAISE, **kwargs)
    assert type(info.value) is error
    rows, stats = boundary(payload, options=SKIP, **kwargs)
    assert rows is None
    assert (stats.samples, stats.skipped_samples, stats.errors) == (1, 1, {error.__name__: 1})
    assert (stats.truncated_samples, stats.trimmed_rows) == (0, 0)  # a refused sample is never trimmed
    return stats


# ----------------------------------------------------------------------------- 2: no generated token, same policy
@pytest.mark.parametrize("mask", [[0, 0, 0], []], ids=["tool-output-only", "empty-response"])
def test_routing_for_a_sample_without_a_generated_token_goes_through_the_policy(mask):
    payload = vllm_routing(LAYOUT, 3)
    assert_refused_and_counted(
        payload, RowCountError, "routing was returned for a sample without any generated token", prompt_len=4, mask=mask
    )


def test_no_generated_token_is_counted_in_the_transport_counters():
    """Through the agent-loop output (verl's ``AgentLoopOutput``): the trainer's metrics see the skipped sample."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    output = AgentLoopOutput(
        prompt_ids=[5, 6, 7, 8],
        response_ids=[9, 9],
        response_mask=[0, 0],
        routed_experts=vllm_routing(LAYOUT, 3),
        metrics=AgentLoopMetrics(),
    )
    with pytest.raises(RowCountError, match="without any generated token"):
        rollout.compact_agent_loop_output(output.model_copy(deep=True), LAYOUT, RAISE)
    stats = BoundaryStats()
    compact = rollout.compact_agent_loop_output(output, LAYOUT, SKIP, stats)
    fields = compact.as_dict()
    assert fields[SPAN_FIELD].tolist() == [0, 0] and compact.extra_fields["stable_routing_skipped"] == 1
    metrics = transport_metrics(fields[BOUNDARY_FIELD].unsqueeze(0))
    prefix = TRANSPORT_METRIC_PREFIX
    assert metrics[f"{prefix}skipped_samples"] == 1 and metrics[f"{prefix}error/RowCountError"] == 1
    assert stats.as_metrics()["stable/routing/error/RowCountError"] == 1


# -------------------------------------------------------------------- 3: all-zero routing of fused MoE kernels
def test_all_zero_vllm_payload_is_refused_or_counted_never_replayed():
    """The known failure: vLLM's int32 array of zeros, every row and layer (top-2: each row repeats expert 0)."""
    prompt_len, response_len = 6, 5
    zeros = np.zeros((prompt_len + response_len - 1, LAYOUT.num_hidden_layers, LAYOUT.top_k), dtype=np.int32)
    assert_refused_and_counted(
        zeros, ZeroRoutingError, "all-zero .* first at token position 0", prompt_len=prompt_len, mask=[1] * 5
    )
    # a response verl cut at response_length carries one more row: refused whole, not trimmed and kept
    cut = np.zeros((prompt_len + response_len, LAYOUT.num_hidden_layers, LAYOUT.top_k), dtype=np.int32)
    assert_refused_and_counted(
        cut, ZeroRoutingError, "all-zero", prompt_len=prompt_len, mask=[1] * 5, response_length=response_len
    )


@pytest.mark.parametrize(
    "zeroed, position",
    [(slice(7, 10), 7), (slice(0, 1), 0), (slice(9, 10), 9)],
    ids=["response-rows", "first-prompt-row", "last-row"],
)
def test_partly_zero_vllm_payload_is_refused_or_counted(zeroed, position):
    payload = vllm_routing(LAYOUT, 10)
    assert boundary(payload, prompt_len=6, mask=[1] * 5, options=RAISE)[0].num_rows == 10  # valid as it came
    payload[zeroed] = 0  # the kernel failed for some tokens: every layer of those rows reads expert 0
    assert_refused_and_counted(
        payload, ZeroRoutingError, f"all-zero .* first at token position {position},", prompt_len=6, mask=[1] * 5
    )


def test_zero_extra_row_of_a_cut_response_is_refused_before_the_trim():
    payload = vllm_routing(LAYOUT, 11)
    payload[10] = 0  # the row that would be trimmed: validated first
    assert_refused_and_counted(
        payload, ZeroRoutingError, "token position 10", prompt_len=6, mask=[1] * 5, response_length=5
    )


@pytest.mark.parametrize("rows", [8, 40])
def test_top1_all_zero_payload_of_eight_or_more_rows_is_refused(rows):
    """top-1 has no duplicate ids to see: a MoE layer that is expert 0 for all of 8 or more rows is refused (random
    routing does that with probability ``num_experts**-8``)."""
    zeros = np.zeros((rows, TOP1.num_hidden_layers, 1), dtype=np.int32)
    assert_refused_and_counted(
        zeros, ZeroRoutingError, f"is expert 0 for all {rows} rows", layout=TOP1, prompt_len=rows, mask=[1]
    )


@pytest.mark.parametrize("rows", [4, 7])
def test_top1_short_all_zero_payload_over_several_moe_layers_is_refused(rows):
    """Fewer than 8 rows, but 8 or more (row, MoE layer) entries all expert 0: as unlikely as the rule above."""
    zeros = np.zeros((rows, TOP1.num_hidden_layers, 1), dtype=np.int32)
    assert_refused_and_counted(
        zeros,
        ZeroRoutingError,
        f"every MoE layer is expert 0 for all {rows} rows",
        layout=TOP1,
        prompt_len=rows,
        mask=[1],
    )


def test_top1_zeros_it_cannot_tell_from_routing_to_expert_0_are_accepted():
    """The documented limit: with top-1, a zero id is a valid routing to expert 0. A payload of fewer than 8 entries
    (here one MoE layer, 3 rows) or a payload only partly zero is accepted as routing to expert 0."""
    short = np.zeros((3, TOP1_ONE_LAYER.num_hidden_layers, 1), dtype=np.int32)
    rows, stats = boundary(short, layout=TOP1_ONE_LAYER, prompt_len=3, mask=[1], options=RAISE)
    assert rows.num_rows == 3 and not rows.ids.any() and stats.skipped_samples == 0
    partly = vllm_routing(TOP1, 12)
    partly[4:9] = 0  # five rows of expert 0 in every layer
    rows, _ = boundary(partly, layout=TOP1, prompt_len=12, mask=[1], options=RAISE)
    assert rows.num_rows == 12 and not rows.ids[4:9].any()


def test_actor_expands_a_batch_of_short_top1_samples_the_boundary_accepted():
    """The top-1 rule judges one engine payload. The actor validates a batch in one pass; a batch of samples that
    each passed the boundary must not be refused because their rows, put end to end, reach 8 zero rows."""
    payload = np.zeros((2, TOP1_ONE_LAYER.num_hidden_layers, 1), dtype=np.int32)  # 2 entries: accepted
    rows, _ = boundary(payload, layout=TOP1_ONE_LAYER, prompt_len=2, mask=[1], options=RAISE)
    fields = [sample_fields(rows, TOP1_ONE_LAYER)] * 4  # four such samples: 8 zero rows of the one MoE layer
    batch = TensorDict(
        {
            IDS_FIELD: torch.nested.as_nested_tensor([f[IDS_FIELD] for f in fields], layout=torch.jagged),
            SPAN_FIELD: torch.stack([f[SPAN_FIELD] for f in fields]),
            "input_ids": torch.nested.as_nested_tensor([torch.arange(3)] * 4, layout=torch.jagged),
        },
        batch_size=[4],
    )
    assert expand_compact_routing(batch, TOP1_ONE_LAYER)
    expanded = batch["routed_experts"]
    assert expanded.dtype == torch.int16 and not any(t.any() for t in expanded.unbind())
