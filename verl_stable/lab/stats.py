"""Statistics of the lab's comparisons across seeds: intervals, the paired test, Welch's test and the rule for a finding.

Pure functions of per-seed numbers (one number per run: e.g. the median KL(mu||pi_old) over a run's steps); no verl.

* :func:`interval`: mean and the two-sided 95 % Student-t confidence interval of the mean over ``n`` seeds,
  ``m +- t_{0.975, n-1} * s / sqrt(n)`` with ``s`` the sample standard deviation.
  With ``log=True`` (for positive quantities spanning decades, such as a KL whose per-step values spike) the interval
  is taken over ``log10`` of the values and mapped back: the geometric mean with a multiplicative interval.
* :func:`paired`: the runs of variants ``a`` and ``b`` with one seed share data order and sampling seeds, so they pair:
  the test is on the per-seed differences ``d_s = a_s - b_s`` (of ``log10`` values with ``log``). Over the ``n``
  common seeds, with ``m`` the mean and ``s`` the sample standard deviation of the ``d_s``:

  - mean difference ``m`` with its 95 % interval ``m +- t_{0.975, n-1} * s / sqrt(n)``;
  - the paired t-test: ``t = m / (s / sqrt(n))`` on ``n - 1`` degrees of freedom, two-sided p;
  - the exact sign-flip permutation p (:func:`sign_flip_p`): under "no effect" each ``d_s`` is as likely ``+|d_s|`` as
    ``-|d_s|``; p is the share of the ``2^n`` sign patterns whose ``|sum|`` reaches the observed one (distribution
    free; its smallest value is ``2 / 2^n``, so it cannot fall below 0.05 with fewer than 6 seeds);
  - the effect size ``m / s`` (Cohen's d_z);
  - the minimum detectable effect (:func:`mde`): the smallest ``|m|`` the paired t-test at alpha 0.05 would detect with
    80 % power were the true spread of the differences the observed ``s``.

* :func:`welch`: Welch's unequal-variance t-test, the fallback when the two sides share fewer than :data:`MIN_SEEDS`
  seeds (nothing pairs them), with its own minimum detectable effect (:func:`welch_mde`).
* :func:`compare`: variant ``a`` against variant ``b`` on one metric. A **finding** ("a lowers X") is stated only when
  the paired t-test (Welch's when the seeds do not pair) gives p < :data:`ALPHA` = 0.05 over at least
  :data:`MIN_SEEDS` seeds; the direction is the sign of the mean difference. Otherwise the verdict is "no effect",
  stated as "no effect measured (none larger than <MDE>)": the design could not see an effect smaller than that.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

CONFIDENCE = 0.95
ALPHA = 0.05
"""Two-sided significance level of the test behind a finding."""
POWER = 0.8
"""Power at which the minimum detectable effect is quoted."""
MIN_SEEDS = 2
"""Fewer seeds than this on either side (or in common, for the paired test): no interval, no test, no finding."""
EXACT_FLIPS = 16
"""Up to this many pairs the sign-flip p enumerates all ``2^n`` patterns; above it, :data:`SAMPLED_FLIPS` random ones."""
SAMPLED_FLIPS = 2**16


@dataclass(frozen=True)
class Interval:
    """Mean of ``n`` per-seed values with its two-sided confidence interval (``lo``/``hi`` None when ``n`` < 2)."""

    mean: float
    lo: float | None
    hi: float | None
    n: int
    log: bool = False  # mean / lo / hi are 10 ** (the interval of log10 values): a geometric mean

    def overlaps(self, other: Interval) -> bool:
        """Whether the two intervals share a point (True when either has no interval)."""
        if None in (self.lo, self.hi, other.lo, other.hi):
            return True
        return not (self.hi < other.lo or other.hi < self.lo)


def _check(values: Sequence[float]) -> None:
    if not values:
        raise ValueError("interval of no values")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"non-finite value among {list(values)}")


def _mean_sd(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for one value; 0 for a spread within the values' rounding, 1e-12 of
    the largest |value|, e.g. 0.4 - 0.35 against 0.6 - 0.55)."""
    n = len(values)
    mean = math.fsum(values) / n
    if n < 2:
        return mean, None
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, 0.0 if sd <= 1e-12 * max(abs(v) for v in values) else sd


def interval(values: Sequence[float], confidence: float = CONFIDENCE, log: bool = False) -> Interval:
    """Mean and Student-t confidence interval of ``values`` (one per seed); of their ``log10`` when ``log``.

    Raises:
        ValueError: No values, a non-finite value, a value <= 0 with ``log``, or a confidence outside (0, 1).
    """
    from scipy import stats

    _check(values)
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    if log:
        if min(values) <= 0:
            raise ValueError(f"a log-scale interval needs positive values, got {list(values)}")
        iv = interval([math.log10(v) for v in values], confidence)
        back = lambda x: None if x is None else 10**x  # noqa: E731
        return Interval(10**iv.mean, back(iv.lo), back(iv.hi), iv.n, log=True)
    n = len(values)
    mean, sd = _mean_sd(values)
    if sd is None:
        return Interval(mean, None, None, n)
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def _t_power(lam: float, df: float, t_crit: float) -> float:
    """``P(|T| > t_crit)`` for ``T`` noncentral t with ``df`` degrees of freedom and noncentrality ``lam``."""
    from scipy import stats

    lower = float(stats.nct.sf(t_crit, df, -lam))  # = P(T < -t_crit); scipy's far tail can come back nan: it is ~0
    return float(stats.nct.sf(t_crit, df, lam)) + (0.0 if math.isnan(lower) else lower)


def paired_power(effect_size: float, n: int, alpha: float = ALPHA) -> float:
    """Power of the two-sided paired t-test on ``n`` seeds when the true mean difference is ``effect_size`` standard
    deviations of the per-seed differences: ``P(|T_{n-1, lambda}| > t_{1 - alpha/2, n-1})``, ``lambda = effect_size
    * sqrt(n)`` (the inverse of :func:`mde`: at the effect :func:`mde` returns, the power is :data:`POWER`).

    Raises:
        ValueError: ``effect_size`` non-finite, ``n`` < 2, or ``alpha`` outside (0, 1).
    """
    from scipy import stats

    if not math.isfinite(effect_size):
        raise ValueError(f"effect size must be finite, got {effect_size}")
    if n < 2:
        raise ValueError(f"a paired t-test needs >= 2 seeds, got {n}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    return _t_power(abs(effect_size) * math.sqrt(n), n - 1, float(stats.t.ppf(1 - alpha / 2, n - 1)))


def seeds_needed(effect_size: float, power: float = POWER, alpha: float = ALPHA, max_seeds: int = 64) -> int | None:
    """The fewest seeds at which the paired t-test detects an effect of ``effect_size`` standard deviations of the
    per-seed differences with probability ``power`` (:func:`paired_power`); None beyond ``max_seeds`` or for no effect.
    """
    if not math.isfinite(effect_size) or effect_size == 0:
        return None
    return next((n for n in range(2, max_seeds + 1) if paired_power(effect_size, n, alpha) >= power), None)


def mde(se: float, df: float, alpha: float = ALPHA, power: float = POWER) -> float:
    """Minimum detectable effect of a two-sided t-test with standard error ``se`` on ``df`` degrees of freedom.

    The smallest true difference ``delta`` the test at level ``alpha`` detects with probability ``power``:
    ``delta = lambda * se``, where ``lambda`` solves ``P(|T_{df, lambda}| > t_{1 - alpha/2, df}) = power`` for
    ``T_{df, lambda}`` the noncentral t (the t statistic when the true difference is ``lambda`` standard errors).
    For many degrees of freedom ``lambda -> z_{1-alpha/2} + z_{power}`` = 1.96 + 0.84 = 2.80; for the paired test on
    3 seeds (df 2) ``lambda`` = 5.65, i.e. ``delta = 5.65 * s / sqrt(3)`` = 3.26 ``s``.

    Raises:
        ValueError: ``se`` negative or non-finite, ``df`` <= 0, or ``alpha`` / ``power`` outside (0, 1).
    """
    from scipy import optimize, stats

    if not (math.isfinite(se) and se >= 0):
        raise ValueError(f"standard error must be finite and >= 0, got {se}")
    if not df > 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    if not (0 < alpha < 1 and 0 < power < 1):
        raise ValueError(f"alpha and power must lie in (0, 1), got {alpha}, {power}")
    if se == 0:
        return 0.0
    t_crit = float(stats.t.ppf(1 - alpha / 2, df))
    hi = 1.0
    while _t_power(hi, df, t_crit) < power:
        hi *= 2
    lam = optimize.brentq(lambda lam: _t_power(lam, df, t_crit) - power, 0.0, hi, xtol=1e-10)
    return lam * se


def sign_flip_p(diffs: Sequence[float]) -> float:
    """Two-sided sign-flip permutation p of ``mean(diffs) != 0``.

    ``p = #{signs e in {-1, +1}^n : |sum_s e_s d_s| >= |sum_s d_s|} / 2^n``, exact (all ``2^n`` patterns) for
    ``n <= 16``; above, over :data:`SAMPLED_FLIPS` random patterns drawn with a fixed seed, ``p = (1 + hits) / (1 +
    draws)``. All differences of one sign and distinct from zero at n = 4: only the two patterns "as observed" and "all
    flipped" reach the observed ``|sum|``, p = 2/16.

    Raises:
        ValueError: No differences or a non-finite one.
    """
    import numpy as np

    _check(diffs)
    d = np.asarray(diffs, dtype=float)
    n = len(d)
    observed = abs(math.fsum(diffs))
    tol = 1e-9 * max(1.0, float(np.abs(d).sum()))  # the observed pattern itself must count despite rounding
    if n <= EXACT_FLIPS:
        signs = ((np.arange(2**n)[:, None] >> np.arange(n)) & 1) * 2 - 1
        return float(np.mean(np.abs(signs @ d) >= observed - tol))
    signs = np.random.default_rng(0).choice(np.array([-1.0, 1.0]), size=(SAMPLED_FLIPS, n))
    hits = int(np.sum(np.abs(signs @ d) >= observed - tol))
    return (1 + hits) / (1 + SAMPLED_FLIPS)


@dataclass(frozen=True)
class Paired:
    """The paired test of ``n`` per-seed differences (:func:`paired`); the fields past ``sd`` are None when n < 2.

    Attributes:
        mean, sd: mean and sample standard deviation of the differences (sd None for one difference).
        lo, hi: the 95 % t-interval of the mean difference.
        t, p: the paired t statistic and its two-sided p (t = +-inf, p = 0 when the differences are equal and not 0).
        p_flip: the sign-flip permutation p (:func:`sign_flip_p`).
        effect: ``mean / sd`` (None when sd is 0).
        mde: the minimum detectable effect (:func:`mde` with ``se = sd / sqrt(n)``, ``df = n - 1``).
    """

    n: int
    mean: float
    sd: float | None
    lo: float | None
    hi: float | None
    t: float | None
    p: float | None
    p_flip: float
    effect: float | None
    mde: float | None


def paired(diffs: Sequence[float], confidence: float = CONFIDENCE) -> Paired:
    """The paired test of per-seed differences ``d_s = a_s - b_s`` (formulas in the module docstring).

    Raises:
        ValueError: No differences or a non-finite one.
    """
    from scipy import stats

    _check(diffs)
    n = len(diffs)
    mean, sd = _mean_sd(diffs)
    p_flip = sign_flip_p(diffs)
    if sd is None:
        return Paired(n, mean, None, None, None, None, None, p_flip, None, None)
    se = sd / math.sqrt(n)
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * se
    if sd == 0:
        t, p = (0.0, 1.0) if mean == 0 else (math.copysign(math.inf, mean), 0.0)
        effect = None
    else:
        t = mean / se
        p = float(2 * stats.t.sf(abs(t), n - 1))
        effect = mean / sd
    return Paired(n, mean, sd, mean - half, mean + half, t, p, p_flip, effect, mde(se, n - 1))


def _welch_se_df(a: Sequence[float], b: Sequence[float]) -> tuple[float, float | None]:
    """Welch's standard error ``sqrt(s_a^2 / n_a + s_b^2 / n_b)`` and Welch-Satterthwaite degrees of freedom
    ``se^4 / ((s_a^2 / n_a)^2 / (n_a - 1) + (s_b^2 / n_b)^2 / (n_b - 1))`` (None when neither side has spread)."""
    (_, sa), (_, sb) = _mean_sd(a), _mean_sd(b)
    va, vb = sa**2 / len(a), sb**2 / len(b)
    if va + vb == 0:
        return 0.0, None
    return math.sqrt(va + vb), (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))


def welch(a: Sequence[float], b: Sequence[float]) -> tuple[float, float] | None:
    """Welch's t statistic ``(mean(a) - mean(b)) / se`` and its two-sided p on the Welch-Satterthwaite degrees of
    freedom (:func:`_welch_se_df`); None with fewer than 2 values a side.

    Two sides without any spread give t = +-inf (p = 0) when their means differ and None when they are equal.
    """
    from scipy import stats

    if len(a) < 2 or len(b) < 2:
        return None
    _check(a)
    _check(b)
    diff = math.fsum(a) / len(a) - math.fsum(b) / len(b)
    se, df = _welch_se_df(a, b)
    if df is None:
        return None if diff == 0 else (math.copysign(math.inf, diff), 0.0)
    t = diff / se
    return t, float(2 * stats.t.sf(abs(t), df))


def welch_mde(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Minimum detectable effect of Welch's test (:func:`mde` with Welch's ``se`` and ``df``); None with fewer than 2
    values a side, 0 when neither side has spread."""
    if len(a) < 2 or len(b) < 2:
        return None
    se, df = _welch_se_df(a, b)
    return 0.0 if df is None else mde(se, df)


@dataclass(frozen=True)
class Comparison:
    """Variant ``a`` against ``b`` on ``metric``.

    Attributes:
        verdict: ``"lower"`` / ``"higher"`` (a's value relative to b's: a finding), ``"no effect"`` (the test is not
            significant), or ``"too few seeds"``.
        reason: why, in words (which test decided, its p, and the minimum detectable effect of a "no effect").
        test: Welch's (t, p) over all seeds of each side (printed; the verdict's test when ``paired`` is None).
        diffs: the per-seed differences ``a_s - b_s`` over the common seeds, of ``log10`` values when ``log``.
        paired: the paired test of ``diffs`` (None when fewer than :data:`MIN_SEEDS` seeds are common).
        mde: the minimum detectable effect of the test that decided (of ``log10`` values when ``log``).
        left_out: (seed, why) for each seed a side ran but has no value for (a non-finite one, or none logged):
            out of both tests, and said so in :meth:`test_text`.
    """

    metric: str
    a: str
    b: str
    ia: Interval
    ib: Interval
    test: tuple[float, float] | None
    diffs: tuple[float, ...]
    verdict: str
    reason: str
    paired: Paired | None = None
    mde: float | None = None
    log: bool = False
    left_out: tuple[tuple[int, str], ...] = ()

    @property
    def is_finding(self) -> bool:
        return self.verdict in ("lower", "higher")

    @property
    def sign_flips(self) -> bool:
        """The per-seed differences over the common seeds have both signs."""
        return any(d > 0 for d in self.diffs) and any(d < 0 for d in self.diffs)

    @property
    def ratio(self) -> float | None:
        """``mean(b) / mean(a)`` when both are positive (e.g. how many times lower a's KL is), else None."""
        if self.ia.mean > 0 and self.ib.mean > 0:
            return self.ib.mean / self.ia.mean
        return None

    def mde_text(self) -> str:
        """The minimum detectable effect in the metric's units (a factor on a log scale), or ``"n/a"``."""
        return _size(self.mde, self.log) if self.mde is not None else "n/a"

    def left_out_text(self) -> str:
        """``""``, or the seeds out of the tests and why: ``seed 2 out: minirl_r3 logged inf at step 1``."""
        return "; ".join(f"seed {seed} out: {why}" for seed, why in self.left_out)

    def test_text(self) -> str:
        """The printed test: paired (mean difference, interval, t-test, sign-flip, effect size, MDE), else Welch's;
        after the seed count, the seeds left out (:meth:`left_out_text`)."""
        welch_p = "n/a" if self.test is None else f"{self.test[1]:.2g}"
        out = self.left_out_text()
        pt = self.paired
        if pt is None or pt.p is None:
            if self.test is None:
                welch_text = "Welch t-test: n/a"
            else:
                t, p = self.test
                welch_text = f"Welch t = {t:.2f}, p = {p:.2g}" if math.isfinite(t) else "Welch: no spread, means differ"
            scale = ", log10 values" if self.log else ""
            return (
                f"unpaired (seeds not shared), n = {self.ia.n} / {self.ib.n} seeds{scale}{f' ({out})' if out else ''}: "
                f"{welch_text}, minimum detectable effect {self.mde_text()}"
            )
        if self.log:
            diff = f"ratio a/b {_ratio(pt.mean)} [{_ratio(pt.lo)}, {_ratio(pt.hi)}]"
        else:
            diff = f"mean difference {pt.mean:+.3g} [{pt.lo:+.3g}, {pt.hi:+.3g}]"
        t = f"{pt.t:.2f}" if math.isfinite(pt.t) else ("+inf" if pt.t > 0 else "-inf")
        effect = "n/a (no spread)" if pt.effect is None else f"{pt.effect:+.2f}"
        flips = f"{2**pt.n} flips" if pt.n <= EXACT_FLIPS else f"{SAMPLED_FLIPS} sampled flips"
        notes = "; ".join(x for x in ("log10" if self.log else "", out) if x)
        return (
            f"paired over n = {pt.n} seeds{f' ({notes})' if notes else ''}: {diff}, t = {t}, p = {pt.p:.2g}; "
            f"sign-flip p = {pt.p_flip:.2g} ({flips}); effect size {effect} sd; "
            f"minimum detectable effect {self.mde_text()}; unpaired Welch p = {welch_p}"
        )


def _ratio(log10_diff: float) -> str:
    return f"x{10**log10_diff:.2g}"


def _size(delta: float, log: bool) -> str:
    """A difference's size: ``delta`` (``.2g``), or on a log scale the factor ``10^delta`` (``"3.2x"``)."""
    return f"{10**delta:.2g}x" if log else f"{delta:.2g}"


def compare(
    metric: str,
    a: str,
    a_by_seed: Mapping[int, float],
    b: str,
    b_by_seed: Mapping[int, float],
    log: bool = False,
    left_out: Mapping[int, str] | None = None,
) -> Comparison:
    """Compare per-seed values of variant ``a`` with variant ``b`` by the rule of the module docstring.

    The paired test runs on the seeds both sides have when there are at least :data:`MIN_SEEDS` of them; otherwise
    Welch's test on every seed of each side (no claim about seeds then: nothing pairs them). With ``log`` every test
    is on ``log10`` of the values (positive quantities spanning decades), the minimum detectable effect a factor.
    ``left_out`` (seed -> why) names the seeds a side ran but has no value for; the comparison carries and prints it.

    Raises:
        ValueError: Either side empty or holding a non-finite value (or a value <= 0 with ``log``).
    """
    va, vb = [a_by_seed[s] for s in sorted(a_by_seed)], [b_by_seed[s] for s in sorted(b_by_seed)]
    ia, ib = interval(va, log=log), interval(vb, log=log)
    f = math.log10 if log else float
    la, lb = [f(v) for v in va], [f(v) for v in vb]
    common = sorted(set(a_by_seed) & set(b_by_seed))
    diffs = tuple(f(a_by_seed[s]) - f(b_by_seed[s]) for s in common)
    test = welch(la, lb)
    out = tuple(sorted((left_out or {}).items()))
    base = dict(metric=metric, a=a, b=b, ia=ia, ib=ib, test=test, diffs=diffs, log=log, left_out=out)
    if len(common) >= MIN_SEEDS:
        pt = paired(diffs)
        base.update(paired=pt, mde=pt.mde)
        p, delta = pt.p, pt.mean
        name = f"paired t-test over {pt.n} seeds"
    elif min(ia.n, ib.n) >= MIN_SEEDS:
        base.update(mde=welch_mde(la, lb))
        p, delta = (1.0 if test is None else test[1]), math.fsum(la) / len(la) - math.fsum(lb) / len(lb)
        shared = f"{len(common)} seed in common" if common else "no seed in common"
        name = f"seeds not paired ({shared}): Welch t-test over {ia.n} / {ib.n} seeds"
    else:
        return Comparison(**base, verdict="too few seeds", reason=f"fewer than {MIN_SEEDS} seeds on a side")
    if p < ALPHA and delta != 0:
        agree = "; every seed's difference has one sign" if base.get("paired") and not _flips(diffs) else ""
        verdict = "lower" if delta < 0 else "higher"
        return Comparison(**base, verdict=verdict, reason=f"{name}: p = {p:.2g} < {ALPHA}{agree}")
    flips = " (the per-seed difference changes sign across seeds)" if base.get("paired") and _flips(diffs) else ""
    mde_text = "n/a" if base.get("mde") is None else _size(base["mde"], log)
    return Comparison(
        **base,
        verdict="no effect",
        reason=f"{name}: p = {p:.2g} >= {ALPHA}{flips}: no effect measured (none larger than {mde_text})",
    )


def _flips(diffs: Sequence[float]) -> bool:
    return any(d > 0 for d in diffs) and any(d < 0 for d in diffs)
