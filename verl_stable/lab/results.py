"""The lab's results on disk: every run's per-step rows in ``out/metrics.jsonl``, merged without losing any.

Each row is one training step of one run, verl's metrics with the run's identity in front (:func:`tag_rows`: variant,
staleness, seed). :func:`merge_rows` writes the rows of a sweep into the file atomically (a temporary file renamed over
it): a run measured again replaces its own rows, every other run's rows stay, and a reader or a crash never sees a
truncated file. Sweeps sharing ``out`` merge one at a time: the read-modify-write holds a file lock
(``out/.metrics.jsonl.lock``, the ``filelock`` library), so no sweep's rows are lost to another's rewrite.
:func:`load_rows` reads the file back and names the file, line and key of a row that is not a JSON object or whose run
identity or step is missing or mistyped (:func:`verl_stable.lab.report.row_problem`); :func:`coldstart_line`
summarises the cold start recorded beside them (``out/coldstart.json``) for the report.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from verl_stable.lab.presets import RunSpec
from verl_stable.lab.report import row_problem
from verl_stable.lab.summaries import SUPERSEDED


@dataclass
class RunOutcome:
    """What a run produced.

    Attributes:
        spec: the run.
        rows: its per-step rows (:func:`tag_rows`).
        returncode: the last attempt's exit code (-1: the launcher itself failed or the run timed out).
        skipped: the run was complete on disk and not started.
        log: the last attempt's ``main_ppo.log``.
        attempts: attempts started (2 when a start-up failure was retried, see :mod:`verl_stable.lab.sweep`).
        retried: the first line of the failed first attempt's log that names its error, when it was retried.
        error: the first error line of the last attempt's log when the run failed (None when it succeeded).
        guard_stopped: why verl-stable's guard ended the run early (a finished run: the guard acted as configured).
    """

    spec: RunSpec
    rows: list[dict]
    returncode: int
    skipped: bool
    log: Path
    attempts: int = 1
    retried: str | None = None
    error: str | None = None
    guard_stopped: str | None = None

    @property
    def failed(self) -> bool:
        """Whether the run ended without success (the sweep may still count its rows, as far as they go); a run the
        guard stopped did not fail."""
        return (self.returncode != 0 and self.guard_stopped is None) or self.error is not None

    def record(self) -> dict[str, Any]:
        """What the report says about the run (``runs/<name>/outcome.json``): identity, steps, attempts, errors."""
        return {
            "variant": self.spec.variant,
            "staleness": self.spec.staleness,
            "seed": self.spec.seed,
            "name": self.spec.name,
            "returncode": self.returncode,
            "steps": len({r["step"] for r in self.rows}),
            "attempts": self.attempts,
            "retried": self.retried,
            "error": self.error,
            "guard_stopped": self.guard_stopped,
        }


def tag_rows(rows: list[dict], spec: RunSpec) -> list[dict]:
    """verl's per-step rows (in the order logged) with the run's identity in front.

    A step logged again later in the run (redone after a guard rollback) marks its earlier rows
    ``superseded: true`` (:data:`verl_stable.lab.summaries.SUPERSEDED`): both stay on record, the last one is the
    run's trajectory.
    """
    last = {r.get("step"): i for i, r in enumerate(rows)}
    tagged = []
    for i, r in enumerate(rows):
        row = {"variant": spec.variant, "staleness": spec.staleness, "seed": spec.seed, **r}
        if last[r.get("step")] != i:
            row[SUPERSEDED] = True
        tagged.append(row)
    return tagged


def _run_key(row: Any) -> tuple | None:
    if not isinstance(row, dict):
        return None
    return (row.get("variant"), row.get("staleness"), row.get("seed"))


def merge_rows(path: str | Path, outcomes: Sequence[RunOutcome]) -> list[dict]:
    """Merge the outcomes' rows into the JSON-lines file ``path`` atomically; returns the rows now in it.

    A run with new rows replaces that run's old rows (same variant, N and seed); a run that produced no rows leaves
    its old rows in place, and so do all runs not in ``outcomes``. The merged rows go to a temporary file in the same
    directory that is then renamed over ``path``, so a reader (or a crash) never sees a truncated file. The read, merge
    and rename hold the lock :func:`lock_path` (waiting for another process's merge to finish), so concurrent sweeps
    into one directory keep each other's rows.

    Raises:
        ValueError: ``path`` exists but is not JSON lines, or holds a malformed row (it is left untouched).
    """
    path = Path(path)
    with FileLock(lock_path(path)):
        old = load_rows(path.parent, path.name)
        fresh = [o for o in outcomes if o.rows]
        replaced = {(o.spec.variant, o.spec.staleness, o.spec.seed) for o in fresh}
        merged = [r for r in old if _run_key(r) not in replaced] + [r for o in fresh for r in o.rows]
        if not fresh and path.exists():
            return merged  # nothing new: the file stays byte for byte as it is
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                for row in merged:
                    f.write(json.dumps(row) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return merged


def lock_path(path: str | Path) -> Path:
    """The lock file that serialises merges into ``path``: hidden, beside it, empty; it stays after a merge (the
    lock is the kernel's ``flock`` on it, released when its holder ends, even by a crash)."""
    path = Path(path)
    return path.with_name(f".{path.name}.lock")


def load_rows(out: str | Path, name: str = "metrics.jsonl") -> list[dict]:
    """The sweep's rows from ``out/metrics.jsonl`` (empty if absent).

    Raises:
        ValueError: The path is not a regular file, or a line is not a JSON object or lacks or mistypes the run's
            identity or step (:func:`verl_stable.lab.report.row_problem`); the message names the file, the line and
            the key.
    """
    path = Path(out) / name
    if not path.exists():
        return []
    if not path.is_file():  # a directory (or a device) would make the final merge fail after every run
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise ValueError(f"{path} is {kind}; expected a JSON-lines file of metric rows")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} line {i} is not JSON ({exc.msg}); expected one JSON object per line") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path} line {i} is a {type(row).__name__}; expected one JSON object per line")
        problem = row_problem(row)
        if problem is not None:
            raise ValueError(f"{path} line {i}: {problem}")
        rows.append(row)
    return rows


def coldstart_line(out: str | Path) -> str:
    """One line on the cold start recorded under ``out`` (for the report header)."""
    path = Path(out) / "coldstart.json"
    if not path.exists():
        return "unknown"
    try:
        info = json.loads(path.read_text())
        return (
            f"{info['steps']} supervised steps, expected exact-match reward {info['initial_expected_reward']:.3f} -> "
            f"{info['expected_reward']:.3f}" + (" (cached)" if info.get("cached") else "")
        )
    except (ValueError, KeyError, TypeError, AttributeError):  # a hand-edited file must not cost the report
        return f"unknown ({path} is unreadable)"
