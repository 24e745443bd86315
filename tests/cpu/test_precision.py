"""Rollout precision: fp8 row quantisation round trip, precision copies, routing flips measured against fp32."""

from __future__ import annotations

import pytest
import torch

from verl_stable.cpu import precision


def test_fp8_rows_round_trip_error_is_bounded_by_e4m3_resolution():
    torch.manual_seed(0)
    w = torch.randn(5, 7, 32) * torch.logspace(-3, 2, 7)[None, :, None]  # rows of very different scale
    q, s = precision.quantize_fp8_rows(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 7, 1)
    w_hat = precision.dequantize_fp8_rows(q, s, torch.float32)
    # Each row's max maps to 448; e4m3 has 3 mantissa bits: relative error <= 2^-4 of the row max.
    row_max = w.abs().amax(-1, keepdim=True)
    assert ((w_hat - w).abs() <= row_max * 2**-4 + 1e-12).all()
    assert torch.allclose(w_hat.abs().amax(-1, keepdim=True), row_max, rtol=1e-6)


def test_fp8_zero_row_and_bad_shape():
    q, s = precision.quantize_fp8_rows(torch.zeros(2, 3))
    assert torch.equal(precision.dequantize_fp8_rows(q, s, torch.float32), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="out, in"):
        precision.quantize_fp8_rows(torch.ones(4))


def test_unknown_precision_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown rollout precision 'int3'"):
        precision.canonical_precision("int3")
    assert precision.canonical_precision("BFloat16") == "bf16"


def test_precision_copy_leaves_original_and_quantises_only_decoder_matmuls(tiny_moe):
    ref = {k: v.clone() for k, v in tiny_moe.state_dict().items()}
    m8 = precision.precision_copy(tiny_moe, "fp8")
    for k, v in tiny_moe.state_dict().items():
        assert torch.equal(v, ref[k])
    names = set(precision.fp8_weight_names(m8))
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and "model.layers.0.self_attn.q_proj.weight" in names
    assert "model.layers.0.mlp.gate.weight" not in names and "lm_head.weight" not in names
    p8 = dict(m8.named_parameters())
    assert p8["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(p8["lm_head.weight"], ref["lm_head.weight"].bfloat16())  # not quantised, only cast
    w = ref["model.layers.0.self_attn.q_proj.weight"]
    expected = precision.dequantize_fp8_rows(*precision.quantize_fp8_rows(w), dtype=torch.bfloat16)
    assert torch.equal(p8["model.layers.0.self_attn.q_proj.weight"], expected)


def _routing(model, ids):
    out = model(input_ids=ids, output_router_logits=True)
    k = model.config.num_experts_per_tok
    return torch.stack([torch.topk(r.float(), k, dim=-1).indices.sort(-1).values for r in out.router_logits])


def test_lower_precision_flips_more_routing_decisions(moe_config_factory):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = moe_config_factory(hidden_size=64, head_dim=16, num_hidden_layers=4, num_experts=16, num_experts_per_tok=4)
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    ids = torch.randint(0, cfg.vocab_size, (8, 32))
    with torch.no_grad():
        base = _routing(model, ids)
        flips = {}
        for p in ("fp16", "bf16", "fp8"):
            r = _routing(precision.precision_copy(model, p), ids)
            flips[p] = (r != base).any(-1).float().mean().item()
    # (token, layer) expert sets that differ from fp32: fp8 weights move routing far more than bf16.
    assert flips["fp8"] > flips["bf16"] > 0
    assert flips["fp8"] > 0.03
