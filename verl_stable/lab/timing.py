"""Where a sweep's time goes (start-up against training steps) and what a sweep will take, estimated before it starts.

A run's wall time is the sweep's record of it (``outcome.json``: ``started``, ``finished``); its step times are verl's
own ``timing_s/step`` in the run's rows. Everything else is start-up and shutdown: Ray, verl's processes (each imports
torch, tensordict and verl), the engines. Step 1 also pays for processes verl starts lazily (the agent-loop and
reward-loop workers) and first calls, so it is shown apart.

:func:`estimate_seconds` is printed before a sweep starts: runs go ``jobs`` at a time, each taking a start-up plus
``steps`` steps whose time grows with N (a step samples and trains N mini-batches). Its constants were measured on the
development machine (2 cores, two runs at a time, ``docs/explanation/lab.md`` "What a run costs"); a sweep's own report
then gives the measured split.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from verl_stable.lab.summaries import group_runs

STARTUP_S = 40.0
"""Per run, two runs at a time on 2 cores: wall time not spent in verl's later steps (start-up, step 1's extra
seconds, shutdown), with every process forked from the prefork server (:mod:`verl_stable.cpu.prefork`). Fitted with
:data:`STEP_S_PER_MINI_BATCH` by ``python benchmarks/fit_lab_timing.py`` to the 32 runs of the `stability` preset and
a `default` sweep measured from an empty ``--out`` on one host in session 22 (least squares: 32.1 s and 0.700 s per
mini-batch-step, residual sd 14 s), rounded up for slower hosts: the estimate is then 3.5 min for that 4-seed
`default` sweep (measured 3.0 min of runs) and 37 min for `stability` (33.8 min); for the 6-seed presets measured
after the fit, 5 min for `default` (4 min 41 s) and 36 min for `evidence` (30 min 45 s). Before the prefork server:
85 s (sessions 19-20)."""
STEP_S_PER_MINI_BATCH = 0.75
"""Per step and mini-batch of the lab's geometry (4 prompts x 4 samples), two runs at a time on 2 cores; a later step
took 1.1-1.3 s at N = 1, 3.0-3.7 s at N = 4 and 5.9-7.4 s at N = 8 (medians over the `evidence` preset's runs, session
19)."""


def estimate_seconds(
    num_runs: int,
    steps: int,
    staleness: Sequence[int],
    jobs: int,
    *,
    startup_s: float = STARTUP_S,
    step_s: float = STEP_S_PER_MINI_BATCH,
) -> float:
    """Wall seconds a sweep of ``num_runs`` runs (their N in ``staleness``, one per run) will take at ``jobs`` at once.

    Runs start in order, ``jobs`` at a time; each takes ``startup_s`` plus ``steps`` x N x ``step_s`` (by default
    :data:`STARTUP_S` and :data:`STEP_S_PER_MINI_BATCH`; ``benchmarks/fit_lab_timing.py`` passes fitted ones). The
    estimate is the longest of the ``jobs`` queues.
    """
    if num_runs != len(staleness):
        raise ValueError(f"{num_runs} runs but {len(staleness)} staleness values")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    queues = [0.0] * jobs
    for n in staleness:
        i = queues.index(min(queues))
        queues[i] += startup_s + steps * n * step_s
    return max(queues) if queues else 0.0


def run_times(record: Mapping) -> tuple[float, float] | None:
    """``(started, finished)`` of a run's record (``outcome.json``), or None when either is missing, not a finite
    number, or the run did not end after it started."""
    started, finished = record.get("started"), record.get("finished")
    if not all(isinstance(t, (int, float)) and math.isfinite(t) for t in (started, finished)) or finished <= started:
        return None
    return float(started), float(finished)


def run_split(record: Mapping, rows: Sequence[Mapping]) -> dict[str, float] | None:
    """One run's wall time split: ``wall``, ``steps`` (sum of ``timing_s/step``), ``first_step``, ``startup``
    (wall - steps) and ``startup_share``; None when the record has no times or the rows no step time."""
    times_of_run = run_times(record)
    if times_of_run is None:
        return None
    started, finished = times_of_run
    times = []  # (step, seconds) in the order logged: a step a guard rollback redid took its time twice
    for row in rows:
        t = row.get("timing_s/step")
        if isinstance(t, (int, float)) and math.isfinite(t) and t >= 0:
            times.append((int(row["step"]), float(t)))
    if not times:
        return None
    by_step = dict(reversed(times))  # each step's first time (step 1: verl's lazily created workers start)
    wall = finished - started
    steps = sum(t for _, t in times)
    startup = max(wall - steps, 0.0)
    return {
        "wall": wall,
        "steps": steps,
        "first_step": by_step[min(by_step)],
        "startup": startup,
        "startup_share": startup / wall,
    }


def timing_lines(records: Sequence[Mapping], rows: Sequence[Mapping]) -> list[str]:
    """The report's "where the time went": medians over the runs with both a record and step times."""
    by_run = group_runs(rows)
    splits = []
    for record in records:
        key = (record.get("variant"), record.get("staleness"), record.get("seed"))
        split = run_split(record, by_run.get(key, []))
        if split is not None:
            splits.append(split)
    if not splits:
        return []

    def med(name: str) -> float:
        return statistics.median(s[name] for s in splits)

    return [
        f"{len(splits)} run(s) timed: median wall {med('wall'):.0f} s, of which verl's steps {med('steps'):.0f} s "
        f"(step 1 alone {med('first_step'):.0f} s: it starts verl's lazily created workers) and start-up and shutdown "
        f"{med('startup'):.0f} s = {100 * med('startup_share'):.0f} % of the run (median of the runs' shares).",
    ]
