"""Metrics on extreme and non-finite values: what overflows must read as infinite, what is broken must be counted.

The guard stops a run on an infinite train-inference KL, so the metrics must neither skip a token whose mismatch
is infinite nor overflow where the true value is finite.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_stable.monitor import metrics as M

INF = math.inf
NAN = math.nan
TI = "stable/train_inf"


def _ti(mu, old, mask=None, **kwargs):
    mu = torch.tensor([mu], dtype=torch.float64)
    old = torch.tensor([old], dtype=torch.float64)
    return M.train_inference_metrics(mu, old, torch.ones_like(mu) if mask is None else mask, **kwargs)


def test_k3_that_overflows_float64_is_infinite():
    # d = -800: the token's k3 = e^800 - 801 is beyond float64, so the KL reads as infinite, not as NaN or 0
    out = _ti([-800.0, -1.0], [0.0, -1.0])
    assert out[f"{TI}/kl_k3"] == INF
    assert out[f"{TI}/ratio_max"] == INF and out[f"{TI}/ratio_mean"] == INF
    assert out[f"{TI}/kl_k1"] == pytest.approx(-400.0)
    assert out[f"{TI}/extreme_frac_tau2"] == 0.5 and out[f"{TI}/nonfinite_frac"] == 0.0


def test_k3_mean_is_finite_when_only_the_sum_overflows():
    # three tokens with k3 ~ e^709 = 8.2e307 each: the sum overflows float64, the mean does not
    out = _ti([-709.0] * 3, [0.0] * 3)
    expected = math.exp(709) - 1 - 709
    assert out[f"{TI}/kl_k3"] == pytest.approx(expected, rel=1e-12)
    assert out[f"{TI}/ratio_mean"] == pytest.approx(math.exp(709), rel=1e-12)


def test_k3_mean_is_finite_when_one_token_term_overflows_but_the_mean_does_not():
    # one token with e^710 (> float64 max) among 999 on-policy ones: the mean e^710 / 1000 = 2.2e305 is finite
    mu, old = [-710.0] + [-1.0] * 999, [0.0] + [-1.0] * 999
    out = _ti(mu, old)
    assert out[f"{TI}/kl_k3"] == pytest.approx(math.exp(710 - math.log(1000)), rel=1e-12)
    assert out[f"{TI}/ratio_mean"] == pytest.approx(math.exp(710 - math.log(1000)), rel=1e-9)
    assert out[f"{TI}/ratio_max"] == INF


def test_k3_keeps_its_precision_for_a_tiny_mismatch():
    # exp(-d) - 1 + d cancels catastrophically at d ~ 1e-8; the true value is d^2/2 - d^3/6
    mu, old = -1.0, -1.0 - 1e-8
    d = mu - old
    out = _ti([mu], [old])
    assert out[f"{TI}/kl_k3"] == pytest.approx(d * d / 2 - d**3 / 6, rel=1e-6, abs=0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(-60, 0), st.floats(-60, 0)), min_size=1, max_size=12))
def test_k3_is_finite_non_negative_and_matches_the_plain_formula(pairs):
    mu, old = zip(*pairs, strict=True)
    out = _ti(list(mu), list(old))
    plain = sum(math.exp(o - m) - 1 + (m - o) for m, o in pairs) / len(pairs)
    assert 0.0 <= out[f"{TI}/kl_k3"] < INF
    assert out[f"{TI}/kl_k3"] == pytest.approx(plain, rel=1e-9, abs=1e-12)
    assert out[f"{TI}/kl_k1"] == pytest.approx(sum(m - o for m, o in pairs) / len(pairs), rel=1e-9, abs=1e-12)


def test_probability_zero_under_pi_old_is_an_infinite_mismatch_not_a_skipped_token():
    # pi_old(y) = 0 for a token mu sampled: KL(mu || pi_old) is infinite, the guard must see it
    out = _ti([-1.0, -0.5], [-INF, -0.5])
    assert out[f"{TI}/kl_k3"] == INF and out[f"{TI}/kl_k1"] == INF
    assert out[f"{TI}/ratio_min"] == 0.0 and out[f"{TI}/nonfinite_frac"] == 0.0
    assert out[f"{TI}/extreme_frac_tau5"] == 0.5 and out[f"{TI}/log_ratio_abs_mean"] == INF


def test_probability_zero_under_mu_is_an_infinite_mismatch():
    out = _ti([-INF, -0.5], [-1.0, -0.5])
    assert out[f"{TI}/kl_k3"] == INF and out[f"{TI}/kl_k1"] == -INF and out[f"{TI}/ratio_max"] == INF


def test_infinite_mismatch_in_both_directions_leaves_k1_undefined_and_k3_infinite():
    out = _ti([-INF, -1.0], [-1.0, -INF])
    assert f"{TI}/kl_k1" not in out  # +inf and -inf log ratios: the mean of d has no value
    assert out[f"{TI}/kl_k3"] == INF


@pytest.mark.parametrize(
    ("mu", "old"),
    [(NAN, -1.0), (-1.0, NAN), (INF, -1.0), (-1.0, INF), (-INF, -INF)],
    ids=["nan_mu", "nan_old", "pos_inf_mu", "pos_inf_old", "both_neg_inf"],
)
def test_unusable_log_probs_are_excluded_and_counted(mu, old):
    out = _ti([mu, -0.5], [old, -0.7])
    assert out[f"{TI}/nonfinite_frac"] == 0.5
    assert out[f"{TI}/kl_k1"] == pytest.approx(0.2)
    assert all(not math.isnan(v) for v in out.values())


def test_correction_metrics_see_an_infinite_ratio_as_truncated():
    mu = torch.tensor([[-INF, -1.0, -1.0]])
    old = torch.tensor([[-1.0, -INF, -1.0]])
    w = torch.tensor([[5.0, 0.0, 1.0]])  # TIS capped the infinite ratio; the zero ratio gives weight 0
    out = M.correction_metrics(mu, old, torch.ones(1, 3), is_weights=w)
    assert out[f"{TI}/frac_truncated"] == pytest.approx(1 / 3)
    assert out[f"{TI}/frac_masked"] == pytest.approx(1 / 3)


def test_masked_mean_excludes_non_finite_values_as_promised():
    values = torch.tensor([[1.0, NAN, 3.0], [INF, 5.0, -INF]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    assert M.masked_mean(values, mask) == pytest.approx(2.0)
    assert M.masked_mean(torch.tensor([NAN, INF]), torch.ones(2)) is None
    assert M.masked_mean(torch.tensor([1e308] * 3, dtype=torch.float64), torch.ones(3)) == pytest.approx(1e308)


def test_effective_sample_size_does_not_overflow():
    # (1e200 + 1)^2 / (2 (1e400 + 1)) = 1/2; the naive squares overflow to inf / inf = NaN
    assert M.effective_sample_size(torch.tensor([1e200, 1.0], dtype=torch.float64), torch.ones(2)) == pytest.approx(0.5)
    assert M.effective_sample_size(torch.tensor([1e-200, 1e-200], dtype=torch.float64), torch.ones(2)) == 1.0


def test_infinite_importance_weights_carry_everything():
    # as k of n weights grow without bound together, ESS -> k / n; dropping them would report a healthy ESS
    w = torch.tensor([INF, INF, 1.0, 2.0])
    assert M.effective_sample_size(w, torch.ones(4)) == pytest.approx(2 / 4)
    out = M.is_weight_metrics(w, torch.ones(4))
    assert out["stable/is/ess"] == pytest.approx(0.5) and out["stable/is/weight_max"] == INF
    assert out["stable/is/weight_mean"] == INF and out["stable/is/nonfinite_frac"] == 0.0


def test_nan_importance_weights_are_excluded_and_counted():
    out = M.is_weight_metrics(torch.tensor([NAN, 1.0, 1.0, 4.0]), torch.ones(4))
    assert out["stable/is/nonfinite_frac"] == pytest.approx(1 / 4)
    assert out["stable/is/weight_mean"] == pytest.approx(2.0)
    assert out["stable/is/ess"] == pytest.approx(36 / (3 * 18))
    assert M.is_weight_metrics(torch.tensor([NAN, 1.0]), torch.tensor([0, 1])) == {
        "stable/is/ess": 1.0,
        "stable/is/weight_mean": 1.0,
        "stable/is/weight_max": 1.0,
        "stable/is/nonfinite_frac": 0.0,
    }
    with pytest.raises(ValueError, match="non-negative"):
        M.effective_sample_size(torch.tensor([-INF, 1.0]), torch.ones(2))


def test_entropy_excludes_non_finite_tokens_and_counts_them():
    out = M.entropy_metrics(torch.tensor([[NAN, 1.0, -INF, 3.0]]), torch.ones(1, 4))
    assert out == {"stable/entropy/nonfinite_frac": 0.5, "stable/entropy/mean": 2.0}
    assert M.entropy_metrics(torch.tensor([[NAN]]), torch.ones(1, 1)) == {"stable/entropy/nonfinite_frac": 1.0}


def test_staleness_counts_nan_tokens_and_clamps_a_zero_probability():
    theta = torch.tensor([[-INF, NAN, 0.0]])
    out = M.staleness_metrics(theta, torch.zeros(1, 3), torch.ones(1, 3))
    assert out["stable/staleness/nonfinite_frac"] == pytest.approx(1 / 3)
    assert out["stable/staleness/ratio_min"] == pytest.approx(math.exp(-M.STALENESS_LOG_RATIO_BOUND))
    assert out["stable/staleness/frac_below"] == pytest.approx(1 / 2)


def test_window_slope_does_not_overflow_on_large_values():
    # y = 1e308, 0, -1e308 over t = 0, 1, 2: slope -1e308; the plain sums overflow to -inf
    assert M.window_slope([1e308, 0.0, -1e308]) == pytest.approx(-1e308)
    assert M.window_slope([1e308, 1e308, 1e308]) == 0.0
