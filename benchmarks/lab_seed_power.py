"""How many seeds a lab question needs: the paired t-test's power from per-seed differences already measured.

Reads the step-1 KL(mu || pi_old) of two variants (default: ``minirl_r3`` against ``minirl`` at N = 4, the
`default` preset's question) from finished sweeps (each ``--out``'s ``metrics.jsonl``, summarised as the report does:
:func:`verl_stable.lab.summaries.summarize`), takes the per-seed log10 differences of the seeds both ran (``--seeds``
keeps only those), adds any given with ``--diffs`` (differences measured in sweeps no longer on disk), and prints their
mean, sd and effect size, then the power of the two-sided paired t-test at alpha 0.05 for 3-8 seeds: from the
noncentral t at that effect size (:func:`verl_stable.lab.stats.paired_power`) and by resampling the measured
differences with replacement (no normality assumed). Use differences measured without looking first.

``--scale linear`` takes plain differences ``a - b`` instead of log10 ratios: the scale on which the lab judges a
reward (``--metric late_reward`` or ``mean_reward``); ratios are the scale of the KL.

    python benchmarks/lab_seed_power.py [OUT ...] [--seeds S ...] [--diffs D ...] [--metric kl_k3_first]
        [--scale log10|linear] [--a minirl_r3] [--b minirl] [--staleness 4] [--resamples 20000]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
from scipy import stats as scipy_stats

from verl_stable.lab import stats
from verl_stable.lab.results import load_rows
from verl_stable.lab.summaries import cells_of, summarize


def _diffs(
    out: Path, metric: str, a: str, b: str, n: int, seeds: set[int] | None, scale: str = "log10"
) -> dict[int, float]:
    """Per-seed log10(a / b) (or a - b, ``scale="linear"``) of ``metric`` in one sweep, on the seeds both variants
    have (and ``seeds`` keeps)."""
    cells = summarize(load_rows(out))
    (ca,), (cb,) = cells_of(cells, a, n), cells_of(cells, b, n)
    va, vb = ca.per_seed.get(metric, {}), cb.per_seed.get(metric, {})
    common = sorted(set(va) & set(vb) & (seeds if seeds is not None else set(va)))
    if scale == "linear":
        return {s: va[s] - vb[s] for s in common}
    return {s: math.log10(va[s]) - math.log10(vb[s]) for s in common}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="*", type=Path, help="finished sweeps' --out directories")
    parser.add_argument("--seeds", nargs="+", type=int, help="only these seeds of the sweeps")
    parser.add_argument("--diffs", nargs="+", type=float, default=[], help="more per-seed log10 differences")
    parser.add_argument("--metric", default="kl_k3_first")
    parser.add_argument("--scale", choices=("log10", "linear"), default="log10")
    parser.add_argument("--a", default="minirl_r3")
    parser.add_argument("--b", default="minirl")
    parser.add_argument("--staleness", type=int, default=4)
    parser.add_argument("--resamples", type=int, default=20_000)
    args = parser.parse_args()

    seeds = set(args.seeds) if args.seeds else None
    values = []
    for out in args.out:
        found = _diffs(out, args.metric, args.a, args.b, args.staleness, seeds, args.scale)
        print(f"{out}: seeds {sorted(found)}: {', '.join(f'{d:+.3f}' for d in found.values())}")
        values += found.values()
    values += args.diffs
    if len(values) < 3:
        raise SystemExit(f"{len(values)} differences: need at least 3 to estimate their spread")
    d = np.array(values)
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    size = mean / sd
    shown = f"log10 {args.a} / {args.b}" if args.scale == "log10" else f"{args.a} - {args.b}"
    ratio = f" (x{10**mean:.3g})" if args.scale == "log10" else ""
    print(f"{len(d)} differences ({shown}, {args.metric}): mean {mean:+.4f}{ratio}, "
          f"sd {sd:.4f}, effect size {size:+.2f}, {int((d < 0).sum())} negative")  # fmt: skip
    rng = np.random.default_rng(0)
    for n in range(3, 13):
        sample = rng.choice(d, size=(args.resamples, n))
        with np.errstate(divide="ignore", invalid="ignore"):  # a resample of n equal values has sd 0
            t = sample.mean(axis=1) / (sample.std(axis=1, ddof=1) / math.sqrt(n))
        resampled = float(np.mean(np.abs(t) > scipy_stats.t.ppf(0.975, n - 1)))
        print(f"n = {n}: power {stats.paired_power(size, n):.2f} (noncentral t), {resampled:.2f} (resampled)")


if __name__ == "__main__":
    main()
