"""Stability metrics against hand computations on small tensors."""

import math

import pytest
import torch

from verl_stable.monitor import metrics as M

# Two responses, three tokens each; the last token of the second response is padding.
LOGP_MU = torch.tensor([[-1.0, -0.5, -2.0], [-0.1, -3.0, -9.0]])
LOGP_OLD = torch.tensor([[-1.2, -0.5, -0.2], [-0.1, -1.0, 7.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def _valid_d():
    return [(-1.0) - (-1.2), 0.0, (-2.0) - (-0.2), 0.0, (-3.0) - (-1.0)]  # d = logp_mu - logp_old, valid only


def test_train_inference_kl_and_extreme_fraction_by_hand():
    out = M.train_inference_metrics(LOGP_MU, LOGP_OLD, MASK, taus=(2, 5))
    d = _valid_d()
    k1 = sum(d) / 5
    k3 = sum(math.exp(-x) - 1 + x for x in d) / 5
    ratios = [math.exp(-x) for x in d]
    assert out["stable/train_inf/kl_k1"] == pytest.approx(k1)
    assert out["stable/train_inf/kl_k3"] == pytest.approx(k3)
    # ratios: e^-0.2=0.82, 1, e^1.8=6.05, 1, e^2=7.39 -> F(2)=2/5, F(5)=2/5
    assert out["stable/train_inf/extreme_frac_tau2"] == pytest.approx(2 / 5)
    assert out["stable/train_inf/extreme_frac_tau5"] == pytest.approx(2 / 5)
    assert out["stable/train_inf/ratio_max"] == pytest.approx(max(ratios))
    assert out["stable/train_inf/ratio_min"] == pytest.approx(min(ratios))
    assert out["stable/train_inf/ratio_mean"] == pytest.approx(sum(ratios) / 5)
    assert out["stable/train_inf/nonfinite_frac"] == 0.0
    # |d| over the valid tokens: 0.2, 0, 1.8, 0, 2.0 -> sorted 0, 0, 0.2, 1.8, 2.0: the third
    assert out["stable/train_inf/log_ratio_abs_median"] == pytest.approx(0.2)


def test_the_median_token_gap_ignores_one_outlier_that_decides_the_means():
    # 99 tokens 1 % apart, one the engines disagree on by a factor of 7 (the int4 outlier of a lab run, seed 41)
    logp_mu = torch.zeros(1, 100)
    logp_old = torch.full((1, 100), -0.01)
    logp_old[0, 37] = math.log(0.15)
    out = M.train_inference_metrics(logp_mu, logp_old, torch.ones(1, 100))
    outlier_k3 = 0.15 - 1 - math.log(0.15)
    typical_k3 = math.exp(-0.01) - 1 + 0.01
    assert out["stable/train_inf/kl_k3"] == pytest.approx((99 * typical_k3 + outlier_k3) / 100)
    assert outlier_k3 / 100 > 100 * typical_k3  # the one token is >99 % of the mean
    assert out["stable/train_inf/log_ratio_abs_median"] == pytest.approx(0.01)
    # an even count takes the lower middle value; a padded position never counts
    even = M.train_inference_metrics(
        torch.zeros(1, 5), torch.tensor([[-0.1, -0.2, -0.3, -0.4, -50.0]]), torch.tensor([[1, 1, 1, 1, 0]])
    )
    assert even["stable/train_inf/log_ratio_abs_median"] == pytest.approx(0.2)


def test_extreme_fraction_counts_both_directions():
    logp_mu = torch.zeros(1, 4)
    logp_old = torch.log(torch.tensor([[0.3, 0.6, 1.5, 3.0]]))  # ratios 0.3 (1/r=3.3), 0.6, 1.5, 3.0
    out = M.train_inference_metrics(logp_mu, logp_old, torch.ones(1, 4), taus=(2, 3.2))
    assert out["stable/train_inf/extreme_frac_tau2"] == pytest.approx(2 / 4)
    assert out["stable/train_inf/extreme_frac_tau3.2"] == pytest.approx(1 / 4)


def test_k3_is_nonnegative_and_zero_on_policy():
    out = M.train_inference_metrics(LOGP_OLD, LOGP_OLD, MASK)
    assert out["stable/train_inf/kl_k1"] == 0.0 and out["stable/train_inf/kl_k3"] == 0.0
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 7, generator=g), torch.randn(4, 7, generator=g)
    assert M.train_inference_metrics(a, b, torch.ones(4, 7))["stable/train_inf/kl_k3"] > 0


def test_empty_mask_skips_metrics_without_nan():
    zero = torch.zeros_like(MASK)
    assert M.train_inference_metrics(LOGP_MU, LOGP_OLD, zero) == {}
    assert M.correction_metrics(LOGP_MU, LOGP_OLD, zero, is_weights=torch.ones(2, 3)) == {}
    assert M.staleness_metrics(LOGP_MU, LOGP_OLD, zero) == {}
    assert M.entropy_metrics(LOGP_MU.abs(), zero) == {}
    assert M.is_weight_metrics(torch.ones(2, 3), zero) == {}
    assert M.effective_sample_size(torch.ones(2, 3), zero) is None
    assert M.masked_mean(LOGP_MU, zero) is None


def test_nonfinite_tokens_are_counted_and_excluded():
    logp_old = LOGP_OLD.clone()
    logp_old[0, 2] = float("nan")
    out = M.train_inference_metrics(LOGP_MU, logp_old, MASK)
    assert out["stable/train_inf/nonfinite_frac"] == pytest.approx(1 / 5)
    d = [x for i, x in enumerate(_valid_d()) if i != 2]
    assert out["stable/train_inf/kl_k1"] == pytest.approx(sum(d) / 4)
    assert all(math.isfinite(v) for v in out.values())


def test_correction_fractions_from_weights_and_rejection():
    # raw ratio r = exp(logp_old - logp_mu) on valid tokens: 0.82, 1, 6.05, 1, 7.39
    ratio = torch.exp(LOGP_OLD - LOGP_MU)
    weights = torch.minimum(ratio, torch.tensor(5.0))  # TIS with C = 5 truncates tokens (0,2) and (1,1)
    weights[0, 1] = 0.0  # IcePop-style masked token
    kept = MASK.clone()
    kept[1, 0] = 0  # rejected by rejection sampling
    out = M.correction_metrics(LOGP_MU, LOGP_OLD, MASK, is_weights=weights, kept_mask=kept)
    assert out["stable/train_inf/frac_masked"] == pytest.approx(2 / 5)
    assert out["stable/train_inf/frac_truncated"] == pytest.approx(2 / 5)
    seq = M.correction_metrics(LOGP_MU, LOGP_OLD, MASK, is_weights=weights, token_level=False)
    assert "stable/train_inf/frac_truncated" not in seq and seq["stable/train_inf/frac_masked"] == pytest.approx(1 / 5)


def test_effective_sample_size_by_hand():
    w = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert M.effective_sample_size(w, mask) == pytest.approx(10**2 / (4 * 30))
    assert M.effective_sample_size(torch.full((2, 3), 0.7), torch.ones(2, 3)) == pytest.approx(1.0)
    one_hot = torch.tensor([[5.0, 0.0, 0.0, 0.0]])
    assert M.effective_sample_size(one_hot, torch.ones(1, 4)) == pytest.approx(1 / 4)
    assert M.effective_sample_size(torch.zeros(1, 4), torch.ones(1, 4)) == 0.0
    out = M.is_weight_metrics(w, mask)
    assert out["stable/is/weight_mean"] == pytest.approx(2.5) and out["stable/is/weight_max"] == 4.0
    with pytest.raises(ValueError, match="non-negative"):
        M.effective_sample_size(-w, mask)


def test_staleness_ratio_and_trust_region():
    logp_old = torch.zeros(1, 5)
    logp_theta = torch.log(torch.tensor([[0.7, 0.9, 1.0, 1.2, 1.3]]))
    out = M.staleness_metrics(logp_theta, logp_old, torch.tensor([[1, 1, 1, 1, 1]]), eps_low=0.2, eps_high=0.27)
    assert out["stable/staleness/ratio_mean"] == pytest.approx((0.7 + 0.9 + 1.0 + 1.2 + 1.3) / 5)
    assert out["stable/staleness/ratio_max"] == pytest.approx(1.3)
    assert out["stable/staleness/frac_below"] == pytest.approx(1 / 5)
    assert out["stable/staleness/frac_above"] == pytest.approx(1 / 5)
    assert out["stable/staleness/frac_outside_trust_region"] == pytest.approx(2 / 5)
    assert out["stable/staleness/ratio_dev_max"] == pytest.approx(0.3)
    nan_token = M.staleness_metrics(
        torch.cat([logp_theta, torch.tensor([[math.nan]])], 1), torch.zeros(1, 6), torch.ones(1, 6)
    )
    assert nan_token["stable/staleness/nonfinite_frac"] == pytest.approx(1 / 6)
    assert nan_token["stable/staleness/ratio_max"] == pytest.approx(1.3)
    with pytest.raises(ValueError, match="eps_low"):
        M.staleness_metrics(logp_theta, logp_old, torch.ones(1, 5), eps_low=1.5)


def test_staleness_statistics_by_hand_ignore_masked_positions():
    # r = 0.5, 1.1, 2.0 on valid tokens; the masked positions hold extreme and NaN values that must not count
    logp_old = torch.tensor([[0.0, 0.0, 0.0], [0.0, -1.0, 0.0]])
    logp_theta = torch.tensor([[math.log(0.5), math.log(1.1), 80.0], [math.log(2.0), math.nan, -80.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    stats = M.staleness_statistics(logp_theta, logp_old, mask, eps_low=0.2, eps_high=0.27)
    assert tuple(stats) == M.STALENESS_NAMES
    assert all(v.dim() == 0 and v.dtype == torch.float64 for v in stats.values())
    r = [0.5, 1.1, 2.0]
    d = [math.log(x) for x in r]
    expected = {
        "ratio_mean": sum(r) / 3,
        "ratio_min": 0.5,
        "ratio_max": 2.0,
        "ratio_dev_max": 1.0,  # max(|0.5 - 1|, |1.1 - 1|, |2 - 1|)
        "log_ratio_abs_mean": sum(abs(x) for x in d) / 3,
        "kl_k3": sum(x - 1 - math.log(x) for x in r) / 3,
        "frac_above": 1 / 3,  # 2.0 > 1.27
        "frac_below": 1 / 3,  # 0.5 < 0.8
        "frac_outside_trust_region": 2 / 3,
    }
    for name, value in expected.items():
        assert float(stats[name]) == pytest.approx(value, rel=1e-6), name
    # ratio_min / max are over valid tokens only, not padded with the neutral 1
    above_one = M.staleness_statistics(torch.tensor([[0.5, 0.2]]), torch.zeros(1, 2), torch.ones(1, 2))
    assert float(above_one["ratio_min"]) == pytest.approx(math.exp(0.2))
    assert float(above_one["ratio_dev_max"]) == pytest.approx(math.exp(0.5) - 1)


def test_staleness_on_policy_and_empty_mask_are_neutral():
    logp = torch.tensor([[-0.3, -2.0, -1.0]])
    on_policy = M.staleness_statistics(logp, logp.clone(), torch.ones(1, 3))
    empty = M.staleness_statistics(logp, logp + 5, torch.zeros(1, 3))
    no_tokens = M.staleness_statistics(torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 0))
    neutral = {"ratio_mean": 1.0, "ratio_min": 1.0, "ratio_max": 1.0, "ratio_dev_max": 0.0, "kl_k3": 0.0}
    for stats in (on_policy, empty, no_tokens):
        assert set(stats) == set(M.STALENESS_NAMES)
        for name, value in neutral.items():
            assert float(stats[name]) == value, name
        assert float(stats["frac_outside_trust_region"]) == 0.0
    # the float version skips an empty mask instead
    assert M.staleness_metrics(logp, logp + 5, torch.zeros(1, 3)) == {}


def test_staleness_ratio_is_clamped_finite():
    stats = M.staleness_statistics(torch.tensor([[0.0, 0.0]]), torch.tensor([[-1000.0, 1000.0]]), torch.ones(1, 2))
    assert all(math.isfinite(float(v)) for v in stats.values())
    assert float(stats["ratio_max"]) == pytest.approx(math.exp(M.STALENESS_LOG_RATIO_BOUND))
    with pytest.raises(ValueError, match="eps_low"):
        M.staleness_statistics(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), eps_low=1.0)
    with pytest.raises(TypeError, match="floating point"):
        M.staleness_statistics(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"shape \(1, 3\)"):
        M.staleness_statistics(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2))


def test_entropy_mean_over_valid_tokens_only():
    ent = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 1000.0]])
    assert M.entropy_metrics(ent, MASK)["stable/entropy/mean"] == pytest.approx(3.0)


def test_window_slope_is_least_squares():
    assert M.window_slope([3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert M.window_slope([1.0, 1.0, 1.0, 1.0]) == pytest.approx(0.0)
    # y = [0, 2, 1, 3] over t = 0..3: slope = sum((t-1.5)(y-1.5)) / sum((t-1.5)^2) = 4 / 5
    assert M.window_slope([0.0, 2.0, 1.0, 3.0]) == pytest.approx(0.8)
    assert M.window_slope([1.0]) is None
    assert M.window_slope([1.0, float("nan"), 3.0]) == pytest.approx(1.0)


def test_routing_disagreement_naming():
    d = {"per_layer": torch.tensor([0.1, 0.25]), "overall": 0.175, "token_any_layer": torch.tensor(0.5)}
    out = M.routing_disagreement_metrics(d, "rollout_vs_train")
    assert out == {
        "stable/routing/rollout_vs_train/layer_0": pytest.approx(0.1),
        "stable/routing/rollout_vs_train/layer_1": pytest.approx(0.25),
        "stable/routing/rollout_vs_train/overall": pytest.approx(0.175),
        "stable/routing/rollout_vs_train/token_any_layer": pytest.approx(0.5),
    }
    with pytest.raises(ValueError, match="path segment"):
        M.routing_disagreement_metrics(d, "a/b")
    with pytest.raises(TypeError, match="neither"):
        M.routing_disagreement_metrics({"per_layer": object()}, "x")


def test_expert_load_balance_by_hand():
    # 4 tokens, 2 layers (layer 0 dense: all zero), top-2 of 4 experts.
    ids = torch.tensor(
        [
            [[0, 0], [0, 1]],
            [[0, 0], [0, 1]],
            [[0, 0], [2, 3]],
            [[0, 0], [0, 2]],
        ],
        dtype=torch.int16,
    )
    out = M.expert_load_balance(ids, num_experts=4)
    # layer 1 loads: e0=3, e1=2, e2=2, e3=1; mean = 4*2/4 = 2
    assert "stable/routing/load/layer_0/max_over_mean" not in out
    assert out["stable/routing/load/layer_1/max_over_mean"] == pytest.approx(3 / 2)
    std = math.sqrt(((3 - 2) ** 2 + 0 + 0 + (1 - 2) ** 2) / 4)
    assert out["stable/routing/load/layer_1/cv"] == pytest.approx(std / 2)
    assert out["stable/routing/load/max_over_mean"] == pytest.approx(3 / 2)
    masked = M.expert_load_balance(ids, num_experts=4, row_mask=torch.tensor([1, 1, 0, 0]))
    assert masked["stable/routing/load/layer_1/max_over_mean"] == pytest.approx(2 / 1)
    assert M.expert_load_balance(ids, num_experts=4, row_mask=torch.zeros(4)) == {}


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match=r"shape \(2, 2\)"):
        M.train_inference_metrics(LOGP_MU, LOGP_OLD[:, :2], MASK)
    with pytest.raises(ValueError, match="mask"):
        M.train_inference_metrics(LOGP_MU, LOGP_OLD, MASK[:, :2])
    with pytest.raises(ValueError, match="only 0 and 1"):
        M.entropy_metrics(LOGP_MU, MASK * 2)
    with pytest.raises(ValueError, match="tau"):
        M.train_inference_metrics(LOGP_MU, LOGP_OLD, MASK, taus=(0.5,))
    with pytest.raises(TypeError, match="floating point"):
        M.entropy_metrics(MASK, MASK)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        M.expert_load_balance(torch.tensor([[[0, 4]]]), num_experts=4)
    with pytest.raises(ValueError, match="tokens, layers, top_k"):
        M.expert_load_balance(torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="integer"):
        M.expert_load_balance(torch.zeros(3, 2, 1))
