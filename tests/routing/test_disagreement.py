"""Routing disagreement: hand-computed fractions, and a real bf16-vs-fp32 mismatch that replay removes."""

from __future__ import annotations

import copy

import pytest
import torch
from routing_testkit import FAMILY_MODEL_TYPES, mismatch_model, padded_batch

from verl_stable.routing import RoutingTrace, RoutingTraceError, capture, replay, routing_disagreement


def test_disagreement_fractions_by_hand():
    # 3 tokens, 2 layers, top-2 of 4 experts
    a = torch.tensor([[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[3, 0], [1, 2]]])
    b = torch.tensor([[[1, 0], [2, 3]], [[1, 3], [0, 3]], [[3, 0], [2, 0]]])
    # token 0: same sets (order differs); token 1: layer 0 differs; token 2: layer 1 differs
    out = routing_disagreement(RoutingTrace.from_tensor(a, 4), RoutingTrace.from_tensor(b, 4))
    assert out["per_layer"] == [1 / 3, 1 / 3] and out["layer_max"] == 1 / 3
    assert out["overall"] == 2 / 6
    assert out["token_any_layer"] == 2 / 3
    assert (out["compared_rows"], out["tokens"]) == (6, 3)


def test_rows_missing_in_either_trace_are_not_compared():
    a = torch.tensor([[[0, 1], [2, 3]], [[1, 2], [0, 3]]])
    b = torch.tensor([[[-1, -1], [2, 1]], [[1, 3], [-1, -1]]])
    out = routing_disagreement(RoutingTrace.from_tensor(a, 4), RoutingTrace.from_tensor(b, 4))
    assert out["per_layer"] == [1.0, 1.0]
    assert out["compared_rows"] == 2 and out["overall"] == 1.0 and out["token_any_layer"] == 1.0


def test_layer_max_names_the_drift_that_overall_averages_away():
    # 4 tokens, 3 layers: layer 2 flips on 3 of 4 tokens, the others never; layer 1 has no data in b at all
    a = torch.tensor([[[0, 1], [2, 3], [0, 1]]] * 4)
    b = a.clone()
    b[:3, 2] = torch.tensor([2, 3])
    b[:, 1] = -1
    out = routing_disagreement(RoutingTrace.from_tensor(a, 4), RoutingTrace.from_tensor(b, 4))
    assert out["per_layer"] == [0.0, 0.0, 0.75]
    assert out["layer_max"] == 0.75 and out["overall"] == 3 / 8
    assert out["token_any_layer"] == 3 / 4


def test_layer_max_is_zero_when_nothing_is_compared():
    a = torch.tensor([[[0, 1]]])
    out = routing_disagreement(RoutingTrace.from_tensor(a, 4), RoutingTrace.from_tensor(torch.full_like(a, -1), 4))
    assert out["layer_max"] == 0.0 and out["compared_rows"] == 0


def test_disagreement_rejects_different_shapes():
    a = RoutingTrace.from_tensor(torch.tensor([[[0, 1]]]), 4)
    with pytest.raises(RoutingTraceError, match="different token counts: expected 1, received 2"):
        routing_disagreement(a, RoutingTrace.from_tensor(torch.tensor([[[0, 1]], [[0, 1]]]), 4))
    with pytest.raises(RoutingTraceError, match="num_experts: expected 4, received 5"):
        routing_disagreement(a, RoutingTrace.from_tensor(torch.tensor([[[0, 1]]]), 5))


def _kl(logp: torch.Tensor, logq: torch.Tensor) -> float:
    """Mean over tokens of KL(p || q) = sum_v p (log p - log q)."""
    return float((logp.exp() * (logp - logq)).sum(-1).mean())


@pytest.mark.parametrize("model_type", FAMILY_MODEL_TYPES)
def test_replaying_bf16_routing_in_fp32_removes_the_mismatch(model_type):
    fp32 = mismatch_model(model_type)
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    ids, mask = padded_batch([32] * 8, 32, seed=3)
    rows = mask.bool()
    with torch.no_grad():
        with capture(fp32) as r32:
            lp32 = fp32(ids, attention_mask=mask).logits.float().log_softmax(-1)[rows]
        with capture(bf16) as r16:
            lp16 = bf16(ids, attention_mask=mask).logits.float().log_softmax(-1)[rows]
        with replay(fp32, r16.trace), capture(fp32) as replayed:
            lp_replay = fp32(ids, attention_mask=mask).logits.float().log_softmax(-1)[rows]
    before = routing_disagreement(r16.trace, r32.trace)
    after = routing_disagreement(r16.trace, replayed.trace)
    kl_before, kl_after = _kl(lp16, lp32), _kl(lp16, lp_replay)
    print(
        f"{model_type}: bf16 vs fp32 routing differs on {before['overall']:.2%} of (token, layer) decisions "
        f"({before['token_any_layer']:.1%} of tokens); KL(bf16||fp32) {kl_before:.3e} -> {kl_after:.3e} with replay"
    )
    assert before["overall"] > 0
    assert after["overall"] == 0.0 and after["token_any_layer"] == 0.0
    assert kl_after < kl_before
