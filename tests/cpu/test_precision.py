"""Rollout precision: fp8 row quantisation round trip, precision copies, routing flips measured against fp32."""

from __future__ import annotations

import pytest
import torch

from verl_stable.backends.hf import precision


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


def test_int4_rows_match_hand_computation():
    w = torch.tensor([[0.7, -1.4, 0.35], [0.0, 0.0, 0.0]])
    # row 0: s = 1.4 / 7 = 0.2; w / s = [3.5, -7, 1.75] -> round-half-even [4, -7, 2] -> [0.8, -1.4, 0.4]
    got = precision.quantize_int4_rows(w, torch.float32)
    assert torch.allclose(got, torch.tensor([[0.8, -1.4, 0.4], [0.0, 0.0, 0.0]]), atol=1e-6)
    torch.manual_seed(0)
    big = torch.randn(64, 128)
    levels = (precision.quantize_int4_rows(big, torch.float32) / (big.abs().amax(-1, keepdim=True) / 7)).round()
    assert levels.unique().numel() <= 16 and levels.min() >= -8 and levels.max() <= 7


def test_fp8_token_activations_are_scaled_per_token():
    x = torch.tensor([[448.0, 1.0, -0.5], [0.001, 0.002, -0.003]])
    got = precision.fake_quant_fp8_tokens(x)
    # row 0: scale 1, values representable in e4m3; row 1: scaled by its own max, relative error <= 2^-4
    assert torch.equal(got[0], x[0])
    assert ((got[1] - x[1]).abs() <= 0.003 * 2**-4).all() and got[1].abs().max() == pytest.approx(0.003)


def test_w8a8_quantises_the_inputs_of_quantised_matmuls_only(tiny_moe):
    m = precision.precision_copy(tiny_moe, "fp8_w8a8")
    w8 = precision.precision_copy(tiny_moe, "fp8")
    hooked = {n for n, mod in m.named_modules() if getattr(mod, precision.ACT_QUANT_ATTR, False)}
    assert "model.layers.0.self_attn.q_proj" in hooked and "model.layers.0.mlp.experts" in hooked
    assert "model.layers.0.mlp.gate" not in hooked and "lm_head" not in hooked
    assert precision.install_activation_quant(m) == 0  # idempotent
    for a, b in zip(m.parameters(), w8.parameters(), strict=True):  # same weights as weight-only fp8
        assert torch.equal(a, b)
    seen = []
    m.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0].clone()))
    ids = torch.randint(0, tiny_moe.config.vocab_size, (2, 6))
    with torch.no_grad():
        out_a8, out_w8 = m(input_ids=ids).logits, w8(input_ids=ids).logits
    assert torch.equal(seen[0], precision.fake_quant_fp8_tokens(seen[0]))  # the matmul saw fp8-representable inputs
    assert not torch.equal(out_a8, out_w8)


def test_router_perturbation_is_fixed_relative_and_only_on_routers(tiny_moe):
    name = "model.layers.1.mlp.gate.weight"
    w = dict(tiny_moe.named_parameters())[name]
    e1, e2 = precision.router_perturbation(name, w, 0.3), precision.router_perturbation(name, w, 0.3)
    assert torch.equal(e1, e2)  # the same on every call: every weight sync adds the same perturbation
    assert not torch.equal(e1, precision.router_perturbation("model.layers.0.mlp.gate.weight", w, 0.3))
    rms = lambda t: float(t.detach().float().pow(2).mean().sqrt())  # noqa: E731
    assert rms(e1) / rms(w) == pytest.approx(0.3, rel=0.15)
    m = precision.precision_copy(tiny_moe, "fp32", router_noise=0.3)
    changed = {n for n, p in m.named_parameters() if not torch.equal(p, dict(tiny_moe.named_parameters())[n])}
    assert changed == {n for n, _ in tiny_moe.named_parameters() if precision.is_router_weight(n)} and changed
    with pytest.raises(ValueError, match="sigma must be >= 0"):
        precision.perturb_routers_(m, -1.0)


def test_weight_sync_reapplies_quantisation_and_the_router_perturbation(tiny_moe):
    from verl_stable.backends.hf.weights import WeightLoader

    for prec, noise in (("int4", 0.0), ("fp8", 0.2)):
        served = precision.precision_copy(tiny_moe, prec, router_noise=noise)
        expected = {k: v.clone() for k, v in served.state_dict().items()}
        with torch.no_grad():
            for p in served.parameters():
                p.zero_()
        loader = WeightLoader(served, prec, router_noise=noise)
        for name, value in tiny_moe.state_dict().items():
            loader.load(name, value)
        for k, v in served.state_dict().items():  # a sync of the fp32 weights rebuilds exactly the initial copy
            assert torch.allclose(
                v.float(), expected[k].float(), atol=1e-2 * (expected[k].float().abs().max() + 1e-6)
            ), k


def test_router_perturbation_and_int4_flip_more_routing_than_fp8(moe_config_factory):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = moe_config_factory(hidden_size=64, head_dim=16, num_hidden_layers=4, num_experts=16, num_experts_per_tok=2)
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    ids = torch.randint(0, cfg.vocab_size, (8, 32))
    with torch.no_grad():
        base = _routing(model, ids)
        flips = {
            (p, s): (_routing(precision.precision_copy(model, p, router_noise=s), ids) != base).any(-1).float().mean()
            for p, s in (("fp8", 0.0), ("int4", 0.0), ("fp8", 0.1), ("fp8", 0.3))
        }
    assert flips[("fp8", 0.3)] > flips[("fp8", 0.1)] > flips[("fp8", 0.0)] > 0
    assert flips[("int4", 0.0)] > flips[("fp8", 0.0)]
