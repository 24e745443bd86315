"""Fit the lab's pre-start estimate (:mod:`verl_stable.lab.timing`) to sweeps measured from an empty ``--out``.

A sweep prints an estimate before it starts: each run costs ``STARTUP_S + steps x N x STEP_S_PER_MINI_BATCH`` of wall
time, runs go ``--jobs`` at a time. This script reads the runs of one or more finished sweeps (each ``--out``'s
``runs/*/outcome.json``, whose ``started`` and ``finished`` the sweep wrote, and the run's step count and N), fits the
two constants by least squares over every run (``wall = a + b x steps x N``), and prints, for every sweep, the span it
took (first run's start to last run's end; the cold start before it is not in the records) against the estimate with
the shipped constants and with the fitted ones. Runs must have gone two at a time on an otherwise idle host, as the
constants assume; a run that failed or was retried is left out.

    python benchmarks/fit_lab_timing.py OUT [OUT ...] [--jobs 2]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from verl_stable.lab import timing
from verl_stable.lab.outcomes import run_records


def _timed(record: dict) -> tuple[float, float, int, int] | None:
    """(started, finished, steps, N) of a run that finished on its first attempt, else None."""
    times = timing.run_times(record)
    if times is None or record.get("returncode") != 0 or record.get("attempts", 1) != 1:
        return None
    return *times, int(record["steps"]), int(record["staleness"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="+", type=Path, help="finished sweeps' --out directories")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once in those sweeps (default 2)")
    args = parser.parse_args()

    sweeps = {}
    for out in args.out:
        runs = [t for t in (_timed(r) for r in run_records(out)) if t is not None]
        if not runs:
            raise SystemExit(f"{out}: no run with a start and end time that finished on its first attempt")
        sweeps[out] = runs
    everything = [run for runs in sweeps.values() for run in runs]
    if len({steps * n for _, _, steps, n in everything}) < 2:
        raise SystemExit(
            "every run has the same steps x N: the start-up and the per-step cost cannot be told apart; "
            "give sweeps of different lengths or staleness (e.g. the default and stability presets)"
        )
    design = np.array([[1.0, steps * n] for _, _, steps, n in everything])
    walls = np.array([finished - started for started, finished, _, _ in everything])
    (a, b), *_ = np.linalg.lstsq(design, walls, rcond=None)
    residual = walls - design @ np.array([a, b])
    print(f"{len(everything)} runs from {len(sweeps)} sweep(s): wall = {a:.1f} s + {b:.3f} s x steps x N "
          f"(residual sd {residual.std(ddof=2) if len(everything) > 2 else float('nan'):.1f} s); shipped: "
          f"{timing.STARTUP_S:.1f} s + {timing.STEP_S_PER_MINI_BATCH:.3f} s")  # fmt: skip

    for out, runs in sweeps.items():
        span = max(f for _, f, _, _ in runs) - min(s for s, _, _, _ in runs)
        # as the CLI estimates before a sweep: every run the preset's step count
        steps, staleness = max(st for _, _, st, _ in runs), [n for _, _, _, n in runs]
        shipped = timing.estimate_seconds(len(runs), steps, staleness, args.jobs)
        fitted = timing.estimate_seconds(len(runs), steps, staleness, args.jobs, startup_s=a, step_s=b)
        print(f"{out}: {len(runs)} runs in {span / 60:.1f} min; estimate {shipped / 60:.1f} min shipped "
              f"({shipped / span:.2f}x), {fitted / 60:.1f} min fitted ({fitted / span:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
