"""The lab's report: per-step metric rows in, a markdown report and PNG figures out (pure: no verl, no runs).

This module assembles the report from its parts and is where callers import it from:

* :mod:`verl_stable.lab.summaries`: rows (checked) -> one summary per run -> one cell per (variant, N) holding a
  number per seed (late reward, final entropy, KL(mu||pi_old) mean, median step and step 1, F(2), routing disagreement,
  clipped fraction);
* :mod:`verl_stable.lab.outcomes`: the sweep's record of each run (retried, failed, why);
* :mod:`verl_stable.lab.switches`: each switch of the paper (the IS weight, R2, R3, clipping, VESPO) at each N, and
  MiniRL + R3 against verl's own answers (token TIS, DPPO, plain GRPO), compared by
  :func:`verl_stable.lab.stats.compare` (a paired t-test over the seeds both sides ran; Welch's when none pairs);
* :mod:`verl_stable.lab.report_tables`: the answer table, the table per cell, every comparison with its rule;
* :mod:`verl_stable.lab.figures`: one figure per regime (reward, entropy, KL, clipped fraction, routing disagreement
  per step, the mean over seeds with the band from the lowest to the highest seed).

The report starts with the answer (for each regime and switch, whether the switch changed what it should; then
whether MiniRL + R3 is ahead of each of verl's own answers that ran), then the runs, the setup, the table per cell,
the comparisons in full, the observations, the limits and the figures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from verl_stable.lab.figures import PLOTTED, plot_regimes
from verl_stable.lab.outcomes import OUTCOME_NAME, run_records, runs_section
from verl_stable.lab.report_tables import (
    BASELINE_RULE,
    DIGITS,
    RULE,
    TABLE_FIELDS,
    answer_table,
    comparison_lines,
    missing_text,
    observations,
    table,
)
from verl_stable.lab.summaries import (
    LABELS,
    LOG_SCALE,
    METRICS,
    REQUIRED_FIELDS,
    SUMMARY_FIELDS,
    CellSummary,
    RunSummary,
    check_rows,
    group_runs,
    metric,
    row_problem,
    summarize,
    summarize_run,
)
from verl_stable.lab.switches import (
    BASELINES,
    JUDGED,
    REWARD_JUDGED,
    SWITCHES,
    Switch,
    SwitchResult,
    regime_name,
    switch_results,
)
from verl_stable.lab.timing import timing_lines

__all__ = [  # the names callers use from here (lab/cli.py, lab/sweep.py, lab/results.py, tests)
    "BASELINES",
    "BASELINE_RULE",
    "DIGITS",
    "JUDGED",
    "LABELS",
    "LIMITS",
    "LOG_SCALE",
    "METRICS",
    "OUTCOME_NAME",
    "PLOTTED",
    "REQUIRED_FIELDS",
    "REWARD_JUDGED",
    "RULE",
    "SUMMARY_FIELDS",
    "SWITCHES",
    "TABLE_FIELDS",
    "CellSummary",
    "RunSummary",
    "Switch",
    "SwitchResult",
    "answer_table",
    "check_rows",
    "comparison_lines",
    "findings",
    "group_runs",
    "metric",
    "missing_text",
    "observations",
    "output_problem",
    "plot_regimes",
    "regime_name",
    "render_markdown",
    "row_problem",
    "run_records",
    "runs_section",
    "summarize",
    "summarize_run",
    "switch_results",
    "table",
    "write_report",
]


def findings(cells: Sequence[CellSummary]) -> list[str]:
    """The comparisons in full, then the observations (kept for callers that want plain sentences)."""
    return comparison_lines(switch_results(cells)) + observations(cells)


LIMITS = (
    "The model is a 4-layer MoE with hidden size 64 on a one-digit toy task, batches are a few dozen responses and runs "
    "a few dozen steps: the paper's long-horizon effects (late collapse after hundreds of steps) cannot appear, and a "
    "switch called 'no effect' here may matter at scale. Each run is verl's own trainer with the project's recipe; "
    "the numbers are what it logged."
)


def render_markdown(
    rows: Sequence[Mapping],
    plots: Sequence[Path] = (),
    header: Mapping[str, str] | None = None,
    relative_to=None,
    runs: Sequence[Mapping] = (),
) -> str:
    """The report: the answer table first, the runs (retried, failed), setup, the table per cell, every comparison,
    limits, figures. ``runs``: :func:`run_records` (empty: the runs section is left out)."""
    cells = summarize(rows)
    results = switch_results(cells, runs)
    own = [r for r in results if r.switch not in BASELINES]
    against = [r for r in results if r.switch in BASELINES]
    lines = ["# verl-stable CPU lab report", "", "## The answer: which switch does each regime need?", ""]
    lines += [answer_table(own) if own else "No switch has both of its variants at one N in these runs.", ""]
    lines += [RULE, ""]
    if against:
        lines += ["## Against verl's own answers: is MiniRL + R3 ahead?", ""]
        lines += [answer_table(against, baselines=True), "", BASELINE_RULE, ""]
    if runs:
        lines += ["## Runs", ""] + [f"- {s}" for s in runs_section(runs) + timing_lines(runs, rows)] + [""]
    if header:
        lines += ["## Setup", ""] + [f"- {k}: {v}" for k, v in header.items()] + [""]
    lines += ["## Results per variant and N (mean [95 % interval] over seeds)", "", table(cells), ""]
    lines += ["## Every comparison", ""] + [f"- {s}" for s in comparison_lines(results)]
    lines += ["", "## Observations", ""] + [f"- {s}" for s in observations(cells)]
    lines += ["", "## What this does not show", "", LIMITS, ""]
    if plots:
        lines += ["## Figures (one per regime)", ""]
        for p in plots:
            rel = Path(p).relative_to(relative_to) if relative_to else Path(p)
            lines.append(f"![{Path(p).stem}]({rel})")
        lines.append("")
    return "\n".join(lines)


def output_problem(out_dir: str | Path) -> str | None:
    """What keeps :func:`write_report` from writing under ``out_dir`` (``report.md`` or ``plots/`` in the way); None
    when nothing does."""
    out_dir = Path(out_dir)
    report, plots = out_dir / "report.md", out_dir / "plots"
    if report.exists() and not report.is_file():
        kind = "a directory" if report.is_dir() else "not a regular file"
        return f"{report} is {kind}; expected the report file (or nothing there)"
    if plots.exists() and not plots.is_dir():
        return f"{plots} is a file; expected the figures' directory (or nothing there)"
    return None


def write_report(rows: Sequence[Mapping], out_dir: str | Path, header: Mapping[str, str] | None = None) -> Path:
    """Write ``out_dir/report.md`` and ``out_dir/plots/regime_N<n>.png`` from the rows; returns the report path.

    The runs' records under ``out_dir/runs/*/outcome.json`` (:func:`run_records`) add the runs section and the seeds
    each comparison lacks.

    Raises:
        ValueError: A malformed row (:func:`check_rows`).
        OSError: The report or a figure cannot be written (:func:`output_problem`, or the file system's refusal).
    """
    out_dir = Path(out_dir)
    check_rows(rows)  # a message naming the bad row, before any figure is drawn
    problem = output_problem(out_dir)
    if problem is not None:
        raise OSError(problem)
    plots = plot_regimes(rows, out_dir / "plots")
    path = out_dir / "report.md"
    path.write_text(render_markdown(rows, plots, header, relative_to=out_dir, runs=run_records(out_dir)))
    return path
