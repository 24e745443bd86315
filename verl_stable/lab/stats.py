"""Statistics of the lab's comparisons across seeds: confidence intervals, Welch's test, and the rule for a finding.

Pure functions of per-seed numbers (one number per run: e.g. the mean KL(mu||pi_old) over a run's steps); no verl.

* :func:`interval`: mean and the two-sided 95 % Student-t confidence interval of the mean over ``n`` seeds,
  ``m +- t_{0.975, n-1} * s / sqrt(n)`` with ``s`` the sample standard deviation.
  With ``log=True`` (for positive quantities spanning decades, such as a KL whose per-step values spike) the interval
  is taken over ``log10`` of the values and mapped back: the geometric mean with a multiplicative interval.
* :func:`compare`: variant ``a`` against variant ``b`` on one metric. A **finding** ("a lowers X") is stated only when

  1. both sides have at least :data:`MIN_SEEDS` seeds,
  2. the per-seed differences ``a_s - b_s`` (the runs of one seed share data order and sampling seeds) all have the
     same sign -- a difference whose sign flips across seeds is "no effect", whatever the means say, and
  3. the two 95 % intervals do not overlap.

  Welch's unequal-variance t-test (``scipy.stats.ttest_ind(equal_var=False)``) is printed next to every verdict, so a
  reader sees how strong the separation is; the verdict itself is the interval rule, which is stricter than p < 0.05.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

CONFIDENCE = 0.95
MIN_SEEDS = 2
"""Fewer seeds than this on either side: no interval, no finding."""


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


def interval(values: Sequence[float], confidence: float = CONFIDENCE, log: bool = False) -> Interval:
    """Mean and Student-t confidence interval of ``values`` (one per seed); of their ``log10`` when ``log``.

    Raises:
        ValueError: No values, a non-finite value, a value <= 0 with ``log``, or a confidence outside (0, 1).
    """
    from scipy import stats

    if not values:
        raise ValueError("interval of no values")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"non-finite value among {list(values)}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    if log:
        if min(values) <= 0:
            raise ValueError(f"a log-scale interval needs positive values, got {list(values)}")
        iv = interval([math.log10(v) for v in values], confidence)
        back = lambda x: None if x is None else 10**x  # noqa: E731
        return Interval(10**iv.mean, back(iv.lo), back(iv.hi), iv.n, log=True)
    n = len(values)
    mean = math.fsum(values) / n
    if n < 2:
        return Interval(mean, None, None, n)
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def welch(a: Sequence[float], b: Sequence[float]) -> tuple[float, float] | None:
    """Welch's t statistic and two-sided p-value of ``mean(a) != mean(b)``; None with fewer than 2 values a side.

    Two sides without any spread give t = +-inf (p = 0) when their means differ and None when they are equal.
    """
    from scipy import stats

    if len(a) < 2 or len(b) < 2:
        return None
    if max(a) == min(a) and max(b) == min(b):
        if a[0] == b[0]:
            return None
        return (math.copysign(math.inf, a[0] - b[0]), 0.0)
    result = stats.ttest_ind(list(a), list(b), equal_var=False)
    return float(result.statistic), float(result.pvalue)


@dataclass(frozen=True)
class Comparison:
    """Variant ``a`` against ``b`` on ``metric``.

    Attributes:
        verdict: ``"lower"`` / ``"higher"`` (a's value relative to b's: a finding), ``"no effect"`` (intervals
            overlap, or the per-seed difference changes sign), or ``"too few seeds"``.
        reason: why, in words (which rule decided).
        sign_flips: the per-seed differences ``a_s - b_s`` over the common seeds have both signs.
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

    @property
    def is_finding(self) -> bool:
        return self.verdict in ("lower", "higher")

    @property
    def sign_flips(self) -> bool:
        return any(d > 0 for d in self.diffs) and any(d < 0 for d in self.diffs)

    @property
    def ratio(self) -> float | None:
        """``mean(b) / mean(a)`` when both are positive (e.g. how many times lower a's KL is), else None."""
        if self.ia.mean > 0 and self.ib.mean > 0:
            return self.ib.mean / self.ia.mean
        return None

    def test_text(self) -> str:
        """The printed test: the intervals and Welch's t-test."""
        level = f"{CONFIDENCE:.0%}" + (" log-scale" if self.ia.log else "")
        if self.test is None:
            welch_text = "Welch t-test: n/a"
        else:
            t, p = self.test
            welch_text = f"Welch t = {t:.2f}, p = {p:.2g}" if math.isfinite(t) else "Welch: no spread, means differ"
        return f"{level} t-intervals over n = {self.ia.n} / {self.ib.n} seeds, {welch_text}"


def compare(
    metric: str,
    a: str,
    a_by_seed: Mapping[int, float],
    b: str,
    b_by_seed: Mapping[int, float],
    log: bool = False,
) -> Comparison:
    """Compare per-seed values of variant ``a`` with variant ``b`` by the rule of the module docstring.

    With ``log`` the intervals and Welch's test are on ``log10`` of the values (positive quantities spanning decades).

    Raises:
        ValueError: Either side empty or holding a non-finite value (or a value <= 0 with ``log``).
    """
    va, vb = [a_by_seed[s] for s in sorted(a_by_seed)], [b_by_seed[s] for s in sorted(b_by_seed)]
    ia, ib = interval(va, log=log), interval(vb, log=log)
    common = sorted(set(a_by_seed) & set(b_by_seed))
    diffs = tuple(a_by_seed[s] - b_by_seed[s] for s in common)
    test = welch([math.log10(v) for v in va], [math.log10(v) for v in vb]) if log else welch(va, vb)
    base = dict(metric=metric, a=a, b=b, ia=ia, ib=ib, test=test, diffs=diffs)
    if min(ia.n, ib.n) < MIN_SEEDS:
        return Comparison(**base, verdict="too few seeds", reason=f"fewer than {MIN_SEEDS} seeds on a side")
    if any(d > 0 for d in diffs) and any(d < 0 for d in diffs):
        return Comparison(**base, verdict="no effect", reason="the per-seed difference changes sign across seeds")
    if ia.overlaps(ib):
        return Comparison(**base, verdict="no effect", reason="the intervals overlap")
    direction = "lower" if ia.mean < ib.mean else "higher"
    return Comparison(**base, verdict=direction, reason="the intervals are separated and every seed agrees")
