"""The lab's statistics against hand-computed values and scipy-independent references (closed forms, simulation)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

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
    assert p == pytest.approx(scipy_stats.ttest_ind(a, b, equal_var=False).pvalue)  # Welch-Satterthwaite df
    assert stats.welch([1.0], [2.0, 3.0]) is None
    assert stats.welch([1.0, 1.0], [1.0, 1.0]) is None
    assert stats.welch([1.0, 1.0], [2.0, 2.0]) == (-math.inf, 0.0)


def test_compare_paired_finding_on_consistent_differences():
    low = {0: 1.0, 1: 1.1, 2: 0.9}
    high = {0: 2.0, 1: 2.2, 2: 1.9}
    c = stats.compare("kl_k3", "r3", low, "base", high)
    assert c.verdict == "lower" and c.is_finding and not c.sign_flips and c.diffs == pytest.approx((-1.0, -1.1, -1.0))
    assert c.ratio == pytest.approx(2.0333, abs=1e-3)
    # diffs -1, -1.1, -1: mean -1.0333, sd 0.057735, se 0.033333: t = -31.0 on 2 df
    assert c.paired.t == pytest.approx(-31.0) and c.paired.n == 3
    assert c.reason.startswith("paired t-test over 3 seeds: p = 0.001 < 0.05; every seed's difference has one sign")
    assert c.test_text().startswith("paired over n = 3 seeds: mean difference -1.03 [-1.18, -0.89], t = -31.00")
    assert "sign-flip p = 0.25 (8 flips)" in c.test_text() and "unpaired Welch p = " in c.test_text()
    assert stats.compare("kl_k3", "base", high, "r3", low).verdict == "higher"


def test_paired_test_finds_an_effect_hidden_by_the_spread_between_seeds():
    # seeds differ by far more than the effect; every seed's a is 0.08-0.12 above its b
    a = {0: 0.30, 1: 0.60, 2: 0.45}
    b = {0: 0.20, 1: 0.52, 2: 0.33}
    c = stats.compare("late_reward", "a", a, "b", b)
    assert c.ia.overlaps(c.ib)  # the old rule (separated intervals) would say no effect
    assert c.test[1] > 0.4  # so does Welch: p = 0.47
    pt = c.paired
    # diffs 0.10, 0.08, 0.12: mean 0.1, sd 0.02, se 0.02 / sqrt(3); t = 5 sqrt(3) = 8.6603 on 2 df, whose two-sided p
    # is 1 - t / sqrt(2 + t^2) = 1 - 8.6603 / sqrt(77) = 0.013072 (the t distribution's closed form at df 2)
    assert (pt.mean, pt.sd) == pytest.approx((0.1, 0.02))
    assert pt.t == pytest.approx(5 * math.sqrt(3)) and pt.p == pytest.approx(1 - 5 * math.sqrt(3) / math.sqrt(77))
    half = 4.302653 * 0.02 / math.sqrt(3)  # t_{0.975, 2} * se
    assert (pt.lo, pt.hi) == pytest.approx((0.1 - half, 0.1 + half), abs=1e-6)
    assert pt.effect == pytest.approx(5.0) and pt.p_flip == pytest.approx(2 / 8)
    assert pt.mde == pytest.approx(5.6534893 * 0.02 / math.sqrt(3), rel=1e-6)  # lambda(df 2) = 5.6535 (test_mde_...)
    assert c.verdict == "higher" and c.reason == (
        "paired t-test over 3 seeds: p = 0.013 < 0.05; every seed's difference has one sign"
    )


def test_compare_sign_flip_is_no_effect_and_says_what_it_could_have_seen():
    # seed 2 reverses the direction: means differ by a lot, but the effect is not consistent
    a = {0: 0.0, 1: 0.0, 2: 0.9}
    b = {0: 0.5, 1: 0.5, 2: 0.6}
    c = stats.compare("late_reward", "a", a, "b", b)
    assert c.verdict == "no effect" and c.sign_flips and "changes sign" in c.reason
    # diffs -0.5, -0.5, +0.3: mean -0.23333, sd 0.46188; MDE = 5.6535 * 0.46188 / sqrt(3) = 1.5076
    assert c.mde == pytest.approx(5.6534893 * 0.4618802 / math.sqrt(3), rel=1e-6)
    assert c.reason.endswith(": no effect measured (none larger than 1.5)")
    assert c.reason.startswith("paired t-test over 3 seeds: p = 0.")


def test_disjoint_seeds_fall_back_to_welch_and_claim_nothing_about_seeds():
    a, b = {0: 0.1, 1: 0.12, 2: 0.11}, {3: 0.3, 4: 0.31, 5: 0.29}
    c = stats.compare("clip_frac", "a", a, "b", b)
    assert c.paired is None and c.diffs == () and not c.sign_flips
    assert c.verdict == "lower" and c.test[1] < 0.05
    assert (
        c.reason == f"seeds not paired (no seed in common): Welch t-test over 3 / 3 seeds: p = {c.test[1]:.2g} < 0.05"
    )
    assert "agree" not in c.reason and "every seed" not in c.reason and "sign" not in c.reason
    assert c.test_text().startswith("unpaired (seeds not shared), n = 3 / 3 seeds: Welch t = ")
    # no effect: means 0.5 vs 0.45, sd 0.1 a side: se = sqrt(2 * 0.01 / 3) = 0.08165 on df 4 (equal variances)
    c = stats.compare("late_reward", "a", {0: 0.4, 1: 0.6, 2: 0.5}, "b", {3: 0.35, 4: 0.55, 5: 0.45})
    assert c.verdict == "no effect" and "agree" not in c.reason and "every seed" not in c.reason
    assert c.mde == pytest.approx(stats.mde(math.sqrt(2 * 0.01 / 3), 4))
    assert c.reason.endswith(f"no effect measured (none larger than {c.mde:.2g})")
    # one shared seed pairs nothing: still Welch, and said so
    c = stats.compare("late_reward", "a", {0: 0.4, 1: 0.6}, "b", {1: 0.35, 4: 0.55})
    assert c.paired is None and c.reason.startswith("seeds not paired (1 seed in common): Welch")


def test_sign_flip_p_is_exact():
    # n = 3, diffs 4, 1, -2 (|sum| 3): the sums of +-4 +-1 +-2 are +-7, +-5, +-3, +-1; six of eight reach 3
    assert stats.sign_flip_p([4.0, 1.0, -2.0]) == pytest.approx(6 / 8)
    assert stats.sign_flip_p([1.0, 2.0, 4.0]) == pytest.approx(2 / 8)  # one sign: only +-7
    # n = 4, one sign: only "as observed" and "all flipped" reach the observed |sum|: 2 / 16 two-sided
    assert stats.sign_flip_p([0.1, 0.2, 0.3, 0.4]) == pytest.approx(2 / 16)
    # n = 4, diffs 1, 1, 1, -1 (|sum| 2): sum = 2k - 4 for k plus signs; |sum| >= 2 for k in {0, 1, 3, 4}: 1+4+4+1
    assert stats.sign_flip_p([1.0, 1.0, 1.0, -1.0]) == pytest.approx(10 / 16)
    # ties by rounding still count the observed pattern: 0.1 + 0.2 - 0.3 is not exactly 0
    assert stats.sign_flip_p([0.1, 0.2, -0.3]) == 1.0
    # beyond 16 pairs: sampled with a fixed seed, p >= 1 / (1 + draws); one sign at n = 20: exact would be 2 / 2^20
    many = stats.sign_flip_p([1.0 + i / 100 for i in range(20)])
    assert many == pytest.approx(1 / (1 + stats.SAMPLED_FLIPS), abs=2 / (1 + stats.SAMPLED_FLIPS))
    with pytest.raises(ValueError, match="no values"):
        stats.sign_flip_p([])


def test_mde_is_the_80_percent_power_difference():
    # the noncentrality giving 80 % power at alpha 0.05 (two-sided): 5.6535 at df 2, -> z_0.975 + z_0.8 = 2.8016
    assert stats.mde(1.0, 2) == pytest.approx(5.6534893, rel=1e-6)
    assert stats.mde(1.0, 10_000) == pytest.approx(1.959964 + 0.841621, abs=2e-3)
    assert stats.mde(0.5, 2) == pytest.approx(0.5 * 5.6534893, rel=1e-6) and stats.mde(0.0, 3) == 0.0
    # checked by simulation, without scipy's noncentral t: 3 seeds, differences ~ N(delta, 1) with delta the MDE of
    # the paired test (sd 1: se = 1 / sqrt(3)); the share of |t| > t_{0.975, 2} = 4.302653 is the power, 0.80
    delta = stats.paired([0.0, 1.0, 2.0]).mde  # mean 1, sd 1
    assert delta == pytest.approx(5.6534893 / math.sqrt(3), rel=1e-6)
    rng = np.random.default_rng(0)
    d = rng.normal(delta, 1.0, size=(200_000, 3))
    t = d.mean(axis=1) / (d.std(axis=1, ddof=1) / math.sqrt(3))
    assert float(np.mean(np.abs(t) > 4.302653)) == pytest.approx(0.80, abs=0.005)
    with pytest.raises(ValueError, match="degrees of freedom"):
        stats.mde(1.0, 0)


def test_paired_power_is_the_inverse_of_the_mde_and_matches_simulation():
    # at the MDE (5.6534893 standard errors at df 2) the power is 80 %: effect size 5.6534893 / sqrt(3) on 3 seeds
    assert stats.paired_power(5.6534893 / math.sqrt(3), 3) == pytest.approx(0.80, abs=1e-6)
    assert stats.paired_power(-5.6534893 / math.sqrt(3), 3) == pytest.approx(0.80, abs=1e-6)  # two-sided
    assert stats.paired_power(0.0, 6) == pytest.approx(0.05, abs=1e-9)  # no effect: the test's level
    # simulation, without scipy's noncentral t: 6 seeds, differences ~ N(1.8, 1); share of |t| > t_{0.975, 5}
    rng = np.random.default_rng(1)
    d = rng.normal(1.8, 1.0, size=(200_000, 6))
    t = d.mean(axis=1) / (d.std(axis=1, ddof=1) / math.sqrt(6))
    simulated = float(np.mean(np.abs(t) > scipy_stats.t.ppf(0.975, 5)))
    assert stats.paired_power(1.8, 6) == pytest.approx(simulated, abs=0.005)
    assert stats.paired_power(1.8, 4) < stats.paired_power(1.8, 6) < stats.paired_power(1.8, 8)
    for bad, match in (((math.nan, 4), "effect size"), ((1.0, 1), ">= 2 seeds")):
        with pytest.raises(ValueError, match=match):
            stats.paired_power(*bad)


def test_paired_edge_cases():
    one = stats.paired([0.3])
    assert (one.n, one.mean, one.sd, one.p, one.mde) == (1, 0.3, None, None, None) and one.p_flip == 1.0
    same = stats.paired([0.2, 0.2, 0.2])
    assert (same.t, same.p, same.effect, same.mde) == (math.inf, 0.0, None, 0.0)
    rounded = stats.paired([0.4 - 0.35, 0.6 - 0.55, 0.5 - 0.45])  # 0.05 each, up to rounding: no spread
    assert (rounded.sd, rounded.t, rounded.p) == (0.0, math.inf, 0.0)
    zero = stats.paired([0.0, 0.0])
    assert (zero.t, zero.p, zero.p_flip) == (0.0, 1.0, 1.0)
    assert stats.compare("late_reward", "a", {0: 0.5, 1: 0.5}, "b", {0: 0.5, 1: 0.5}).verdict == "no effect"


def test_compare_one_seed_is_too_few():
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
    assert c.verdict == "lower" and c.test_text().startswith("paired over n = 3 seeds (log10): ratio a/b x0.05 [")
    # per-seed log10 differences, the mean of which is log10 of the ratio of geometric means
    assert c.diffs == pytest.approx(tuple(math.log10(low[s] / spiky[s]) for s in range(3)))
    assert 10**c.paired.mean == pytest.approx(c.ia.mean / c.ib.mean)
