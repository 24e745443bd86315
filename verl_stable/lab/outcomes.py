"""The sweep's record of each run (``runs/<name>/outcome.json``) and the report's account of the runs it gives.

The report's numbers come from ``metrics.jsonl`` (:mod:`verl_stable.lab.summaries`); the records only say how many
attempts a run took, which were retried after a start-up failure, which failed and why, and so which seeds a
comparison lacks (:mod:`verl_stable.lab.switches`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

OUTCOME_NAME = "outcome.json"
_RECORD_KEYS = {"variant": str, "staleness": int, "seed": int, "name": str, "returncode": int, "steps": int}


def run_records(out_dir: str | Path) -> list[dict]:
    """The sweep's record of each run under ``out_dir/runs/*/outcome.json`` (written by the sweep), by run name.

    A record says how many attempts the run took, the first attempt's error line when a start-up failure was retried,
    and the error line of a run that failed. A record that cannot be read, or lacks or mistypes a key, is skipped:
    the report's numbers come from ``metrics.jsonl``, the records only name what is missing and why.
    """
    records = []
    for path in sorted(Path(out_dir).glob(f"runs/*/{OUTCOME_NAME}")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and all(
            isinstance(record.get(k), t) and not isinstance(record.get(k), bool) for k, t in _RECORD_KEYS.items()
        ):
            records.append(record)
    return records


def runs_section(runs: Sequence[Mapping]) -> list[str]:
    """The report's account of the runs: how many, which were retried after a start-up failure, which failed, why.

    Args:
        runs: :func:`run_records` (``expected_steps``, when a record has it, gives "k of n steps").
    """
    if not runs:
        return []
    retried = [r for r in runs if r.get("retried")]
    stopped = [r for r in runs if isinstance(r.get("guard_stopped"), str) and not r.get("error")]
    failed = [r for r in runs if r.get("error") or (r["returncode"] != 0 and r not in stopped)]
    lines = [
        f"{len(runs)} run(s) recorded: {len(runs) - len(failed)} finished"
        + (f" ({len(stopped)} of them stopped early by the acting guard)" if stopped else "")
        + f", {len(retried)} retried once after a start-up failure, {len(failed)} failed."
    ]
    for r in stopped:
        of = f" of {r['expected_steps']}" if isinstance(r.get("expected_steps"), int) else ""
        lines.append(f"Stopped by the guard: `{r['name']}` after {r['steps']}{of} steps: {r['guard_stopped']}.")
    for r in retried:
        after = "failed again" if r in failed else f"finished on attempt {r.get('attempts', 2)}"
        lines.append(f"Retried: `{r['name']}` -- the first attempt failed while starting: `{r['retried']}`; {after}.")
    for r in failed:
        of = f" of {r['expected_steps']}" if isinstance(r.get("expected_steps"), int) else ""
        error = r.get("error") or "no error line in its log"
        lines.append(
            f"Failed: `{r['name']}` (exit {r['returncode']}, {r['steps']}{of} steps, {r.get('attempts', 1)} "
            f"attempt(s)): `{error}` (log: runs/{r['name']}/main_ppo.log)."
        )
    return lines
