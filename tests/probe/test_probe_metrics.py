"""The probe's pure parts on hand-made tensors: the monitor's formulas as the probe keys them, the sampling errors,
the routing flips, the lab finding nearest a flip rate, the advice per regime, and the prompt plumbing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from verl_stable.probe import advice, prompts
from verl_stable.probe.metrics import flip_metrics, mismatch_metrics, padded, ratio_standard_error


def test_ratio_standard_error_is_the_cluster_formula():
    y, n = torch.tensor([1.0, 3.0, 0.0]), torch.tensor([2.0, 4.0, 4.0])
    q = 4 / 10
    expected = math.sqrt(3 / 2 * ((1 - q * 2) ** 2 + (3 - q * 4) ** 2 + (0 - q * 4) ** 2)) / 10
    assert ratio_standard_error(y, n) == pytest.approx(expected)
    assert math.isnan(ratio_standard_error(torch.tensor([1.0]), torch.tensor([2.0])))
    with pytest.raises(ValueError):
        ratio_standard_error(torch.ones(2), torch.ones(3))


def test_mismatch_metrics_on_ragged_samples_equal_numpy():
    mu = [torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-3.0])]
    pi = [torch.tensor([-1.1, -2.0, -0.2]), torch.tensor([-1.0])]
    d = np.array([0.1, 0.0, -0.3, -2.0])
    out = mismatch_metrics(mu, pi, taus=(2.0, 5.0))
    assert out["stable/train_inf/kl_k3"] == pytest.approx(np.mean(np.exp(-d) - 1 + d))
    assert out["stable/train_inf/kl_k1"] == pytest.approx(d.mean())
    assert out["stable/train_inf/extreme_frac_tau2"] == pytest.approx(0.25)  # |d| = 2 > log 2
    assert out["stable/train_inf/extreme_frac_tau5"] == pytest.approx(0.25)  # |d| = 2 > log 5 = 1.61
    r = np.exp(-d)
    assert out["probe/is_ess"] == pytest.approx(r.sum() ** 2 / (4 * (r**2).sum()))
    assert out["probe/tokens"] == 4
    k3 = np.exp(-d) - 1 + d
    y, n = np.array([k3[:3].sum(), k3[3]]), np.array([3, 1])
    q = y.sum() / 4
    assert out["probe/kl_k3_se"] == pytest.approx(math.sqrt(2 * ((y - q * n) ** 2).sum()) / 4)
    with pytest.raises(ValueError, match="sample 1"):
        mismatch_metrics(mu, [pi[0], torch.tensor([-1.0, -2.0])])
    values, mask = padded(mu)
    assert values.shape == (2, 3) and mask.tolist() == [[True] * 3, [True, False, False]]


def _ids(rows):
    return torch.tensor(rows, dtype=torch.long)


def test_flip_metrics_count_expert_sets_per_layer_token_and_response():
    # two samples, 2 MoE layers, top-2 of 4 experts; sample 0 has a prompt of 2 tokens, sample 1 of 1
    rollout = [
        _ids([[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[1, 2], [0, 3]]]),
        _ids([[[0, 3], [1, 2]], [[-1, -1], [-1, -1]]]),  # a row without data: not compared
    ]
    train = [
        _ids([[[1, 0], [2, 3]], [[0, 2], [2, 3]], [[1, 2], [3, 1]], [[0, 1], [0, 1]]]),  # order ignored; extra row
        _ids([[[0, 3], [2, 1]], [[0, 1], [0, 1]]]),
    ]
    out = flip_metrics(rollout, train, [2, 1], num_experts=4, moe_layers=[1, 3])
    # compared rows: sample 0: 3 tokens x 2 layers, sample 1: 1 token x 2 layers = 8; flips: (0,1,L0), (0,2,L1)
    assert out["stable/routing/disagreement"] == pytest.approx(2 / 8)
    assert out["stable/routing/disagreement/layer_0"] == pytest.approx(1 / 4)
    assert out["stable/routing/disagreement/layer_1"] == pytest.approx(1 / 4)
    assert out["stable/routing/disagreement/layer_max"] == pytest.approx(1 / 4)
    assert out["stable/routing/disagreement/token_any_layer"] == pytest.approx(2 / 4)
    assert out["probe/disagreement_response"] == pytest.approx(1 / 2)  # sample 0's response row: 1 flip of 2
    assert out["probe/disagreement_rows"] == 8
    assert out["probe/disagreement_se"] == pytest.approx(
        ratio_standard_error(torch.tensor([2, 0]), torch.tensor([6, 2]))
    )
    hidden = flip_metrics(rollout, train, [2, 1], 4, [1, 3], name="router_disagreement")
    assert hidden["stable/routing/router_disagreement"] == pytest.approx(2 / 8)
    assert "stable/routing/router_disagreement/layer_0" not in hidden


def test_nearest_lab_finding_on_a_log_scale():
    assert advice.nearest_finding(0.10).flips == 0.105
    assert advice.nearest_finding(0.0).flips == 0.006
    assert advice.nearest_finding(0.02).flips == 0.053
    assert advice.nearest_finding(0.9).flips == 0.325
    with pytest.raises(ValueError):
        advice.nearest_finding(float("nan"))


def _metrics(flips, kl, kl_r3):
    none = {"stable/train_inf/kl_k3": kl, "stable/train_inf/extreme_frac_tau5": 0.0}
    none.update({"stable/routing/disagreement": flips, "stable/routing/disagreement/token_any_layer": 2 * flips})
    return {"none": none, "r3": {"stable/train_inf/kl_k3": kl_r3}}


def test_advice_per_regime():
    routed = advice.advise(_metrics(0.1, 8e-4, 8e-5), moe=True)
    assert "routing flips explain 90.0 %" in routed["summary"] and "x0.10" in routed["summary"]
    assert "R3 is the switch for these flips" in routed["N >= 4"]
    assert "paired p = 0.0027" in routed["lab"] and "10.5 % flips" in routed["lab"]
    assert "Here R3 changed KL(mu||pi_old) x0.10" in routed["lab"]
    assert "an extrapolation" in routed["N = 2"]
    assert "well below the lab's 10 %, the recipe as it is" in advice.advise(_metrics(0.012, 6e-7, 5e-7), True)["N = 2"]
    numerics = advice.advise(_metrics(0.3, 7e-4, 6.9e-4), moe=True)
    assert "only 1.4 % of KL" in numerics["N >= 4"] and "numerics outside routing" in numerics["N >= 4"]
    alarm = advice.advise(_metrics(0.3, 0.02, 0.001), moe=True)
    assert "ABOVE the guard's train_inference_kl alarm (0.01, default action: stop) without replay" in alarm["summary"]
    none = advice.advise(_metrics(0.0, 1e-14, 1e-14), moe=True)
    assert "no measurable train-inference mismatch" in none["summary"] and "flips no routing" in none["N >= 4"]
    dense = advice.advise({"none": {"stable/train_inf/kl_k3": 1e-3}}, moe=False)
    assert dense["summary"].startswith("Dense model: no routing to flip, so R2 / R3 do not apply")
    assert set(dense) == set(routed) == {"summary", "lab", *advice.RECIPES}


def test_prompts_follow_verls_format_and_order(toy):
    from transformers import AutoTokenizer

    assert prompts.sample_prompts(3, 7, 2) == [0, 0, 1, 1, 2, 2, 0]
    with pytest.raises(ValueError):
        prompts.sample_prompts(3, 0, 1)
    chats = prompts.read_chats(toy.train_file)
    assert len(chats) == 32 and chats[0][0]["role"] == "user"
    tokenizer = AutoTokenizer.from_pretrained(toy.model_dir)
    expected = tokenizer.apply_chat_template(chats[0], add_generation_prompt=True, tokenize=True)["input_ids"]
    assert prompts.render_prompt(tokenizer, chats[0], "qwen3_moe") == list(expected)
    assert len(prompts.builtin_chats()) == len(prompts.BUILTIN_PROMPTS) >= 8
