"""The lab's statistics against hand-computed values and scipy-independent references."""

from __future__ import annotations

import math

import pytest

from verl_stable.lab import stats


def test_interval_is_the_student_t_interval():
    iv = stats.interval([1.0, 2.0, 3.0])
    # mean 2, sd 1, t_{0.975, 2} = 4.302653: half-width 4.302653 / sqrt(3) = 2.48414
    assert iv.mean == 2.0 and iv.n == 3
    assert (iv.lo, iv.hi) == pytest.approx((2 - 2.48414, 2 + 2.48414), abs=1e-5)
    one = stats.interval([0.5])
    assert (one.mean, one.lo, one.hi) == (0.5, None, None)
    assert one.overlaps(iv) and iv.overlaps(one)  # no interval: never a separation


def test_interval_refuses_bad_input():
    with pytest.raises(ValueError, match="no values"):
        stats.interval([])
    with pytest.raises(ValueError, match="non-finite"):
        stats.interval([1.0, float("nan")])
    with pytest.raises(ValueError, match="confidence"):
        stats.interval([1.0, 2.0], confidence=1.0)


def test_welch_matches_the_formula():
    a, b = [1.0, 2.0, 3.0, 4.0], [2.0, 4.0, 6.0]
    ma, mb = 2.5, 4.0
    va, vb = 5 / 3, 4.0  # sample variances
    t = (ma - mb) / math.sqrt(va / 4 + vb / 3)
    got_t, p = stats.welch(a, b)
    assert got_t == pytest.approx(t) and 0 < p < 1
    assert stats.welch([1.0], [2.0, 3.0]) is None
    assert stats.welch([1.0, 1.0], [1.0, 1.0]) is None
    assert stats.welch([1.0, 1.0], [2.0, 2.0]) == (-math.inf, 0.0)


def test_compare_finding_needs_separated_intervals_and_one_sign():
    low = {0: 1.0, 1: 1.1, 2: 0.9}
    high = {0: 2.0, 1: 2.2, 2: 1.9}
    c = stats.compare("kl_k3", "r3", low, "base", high)
    assert c.verdict == "lower" and c.is_finding and not c.sign_flips and c.diffs == pytest.approx((-1.0, -1.1, -1.0))
    assert c.ratio == pytest.approx(2.0333, abs=1e-3)
    assert "95% t-intervals over n = 3 / 3 seeds, Welch t = " in c.test_text()
    assert stats.compare("kl_k3", "base", high, "r3", low).verdict == "higher"


def test_compare_sign_flip_is_no_effect_even_with_a_big_mean_gap():
    # seed 2 reverses the direction: means differ by a lot, but the effect is not consistent
    a = {0: 0.0, 1: 0.0, 2: 0.9}
    b = {0: 0.5, 1: 0.5, 2: 0.6}
    c = stats.compare("late_reward", "a", a, "b", b)
    assert c.verdict == "no effect" and c.sign_flips and "changes sign" in c.reason


def test_compare_overlap_is_no_effect_and_one_seed_is_too_few():
    c = stats.compare("late_reward", "a", {0: 0.4, 1: 0.6, 2: 0.5}, "b", {0: 0.35, 1: 0.55, 2: 0.45})
    assert c.verdict == "no effect" and c.reason == "the intervals overlap"
    c = stats.compare("late_reward", "a", {0: 0.4}, "b", {0: 0.9})
    assert c.verdict == "too few seeds" and not c.is_finding and "n/a" in c.test_text()


def test_log_scale_interval_is_geometric():
    iv = stats.interval([1e-4, 1e-3, 1e-2], log=True)
    # log10 values -4, -3, -2: mean -3 (geometric mean 1e-3), half-width t_{0.975, 2} / sqrt(3) = 2.48414 decades
    assert iv.log and iv.mean == pytest.approx(1e-3)
    assert (math.log10(iv.lo), math.log10(iv.hi)) == pytest.approx((-3 - 2.48414, -3 + 2.48414), abs=1e-5)
    with pytest.raises(ValueError, match="positive values"):
        stats.interval([1e-3, 0.0], log=True)
    # one spiky seed: on a linear scale the intervals overlap, on a log scale they separate
    low, spiky = {0: 2e-4, 1: 3e-4, 2: 2.5e-4}, {0: 1e-2, 1: 3e-3, 2: 4e-3}
    assert stats.compare("kl_k3", "r3", low, "base", spiky).verdict == "no effect"
    c = stats.compare("kl_k3", "r3", low, "base", spiky, log=True)
    assert c.verdict == "lower" and "log-scale" in c.test_text()
