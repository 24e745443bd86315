"""How a lab run's attempt ended, read from what it left in its run directory: stopped by the acting guard, failed
while starting (the infrastructure: started once more), or failed with an error line that names why.

The sweep (:mod:`verl_stable.lab.sweep`) asks after every attempt: :func:`guard_stop_reason` (a run the guard ended
early is finished, not failed), :func:`startup_failure` (retried once, :data:`START_RETRIES`) and
:func:`first_error_line` (what the report and the CLI print for a failed run).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from verl_stable import env_vars
from verl_stable.monitor.run_summary import SUMMARY_FILE

GUARD_STOPPED = "guard_stopped"
"""``done.json`` / ``outcome.json`` key: why the guard ended the run early (a run the acting guard stopped is a
finished run, not a failed one)."""


def guard_stop_reason(run_dir: Path) -> str | None:
    """Why verl-stable's guard stopped the run in ``run_dir``, from the run summary the trainer writes at the end of
    ``fit`` (``checkpoints/verl_stable_summary.json``); None when it did not (or wrote no summary)."""
    try:
        report = json.loads((run_dir / "checkpoints" / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(report, dict) or report.get("ended") != "stopped by the guard":
        return None
    reason = report.get("stop_reason")
    return reason if isinstance(reason, str) and reason else "stopped by the guard"


START_RETRIES = 1
"""Extra attempts of a run that failed while starting (:func:`startup_failure`); a second failure is final."""

READY_MARKER = "all initialize finished, ready to fit"
"""What verl's trainer logs once every worker, engine and TransferQueue is up, just before its training loop."""

# Lines with which hydra / OmegaConf refuse a run's overrides or config: the same arguments fail the same way again.
CONFIG_ERRORS = (
    "Could not override",
    "ConfigCompositionException",
    "omegaconf.errors",
    "ConfigAttributeError",
    "ConfigKeyError",
    "MissingMandatoryValue",
    "Error merging override",
    "hydra.errors",
)
# Errors of the machinery rather than of the training code: a Ray actor or node that died or could not start, a lost
# connection, a timeout while waiting, memory. After verl's READY_MARKER a run that logged no step is retried only
# when its first error line names one of these.
INFRA_ERRORS = re.compile(
    r"ray\.exceptions\.|ActorDiedError|ActorUnavailableError|RaySystemError|GetTimeoutError|WorkerCrashedError|"
    r"NodeDiedError|ObjectLostError|OutOfMemoryError|MemoryError|ConnectionError|TimeoutError|ZMQError|"
    r"Address already in use|timed out during startup"
)
TIMEOUT_NOTE = "TimeoutExpired"
FORCE_START_FAILURE_ENV = env_vars.LAB_FORCE_START_FAILURE.name
"""Test-only: comma-separated run-name prefixes whose first attempt is made to fail while Ray starts (see
:data:`FORCED_START_FAILURE`); how the retry is exercised end to end without waiting for a real flake."""
FORCED_START_FAILURE = "+ray_kwargs.ray_init._temp_dir=/dev/null/forced_start_failure"
"""Appended to a forced first attempt: Ray cannot create its session directory below ``/dev/null`` and ``ray.init``
raises before any worker starts, a real start-up failure of verl's own launch."""

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# an exception's name where a traceback prints it: ``pkg.SomeError: message`` or Ray's ``RayTaskError(ValueError):``
_EXCEPTION = re.compile(r"(?:^|[\s(])[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)(?:\([\w.]+\))?:(?:\s|$)")
_ERROR_LEVEL = re.compile(r"\b(?:ERROR|FATAL|CRITICAL)\b|^E\d{4} ")
# hydra's wrapper line names no error; the exception follows it
_NOT_THE_ERROR = ("Error executing job with overrides",)
ERROR_LINE_MAX = 300


def first_error_line(run_dir: str | Path) -> str | None:
    """The first line that names the error of the run in ``run_dir``; None when nothing there names one.

    The launcher's own failure (``error.txt``: a timeout, a process that could not start) comes first; then the
    first line of ``main_ppo.log`` that names an exception (``SomeError: ...``), else the first line logged at
    ERROR / FATAL level. Colour codes are removed and the line is cut to :data:`ERROR_LINE_MAX` characters.
    """
    run_dir = Path(run_dir)
    note = run_dir / "error.txt"
    if note.is_file() and note.read_text(errors="replace").strip():
        return _clip(note.read_text(errors="replace").strip().splitlines()[0])
    try:
        lines = [
            _ANSI.sub("", line).strip() for line in (run_dir / "main_ppo.log").read_text(errors="replace").splitlines()
        ]
    except FileNotFoundError:
        return None
    lines = [line for line in lines if line and not any(m in line for m in _NOT_THE_ERROR)]
    for pattern in (_EXCEPTION, _ERROR_LEVEL):
        found = next((line for line in lines if pattern.search(line)), None)
        if found is not None:
            return _clip(found)
    return None


def _clip(line: str) -> str:
    return line if len(line) <= ERROR_LINE_MAX else line[: ERROR_LINE_MAX - 3] + "..."


def startup_failure(returncode: int, rows: Sequence[dict], run_dir: str | Path) -> str | None:
    """Why a failed attempt counts as a start-up failure of the infrastructure (and is retried); None when it does not.

    The rule: the attempt exited non-zero **before logging its first step**, it was not stopped by the sweep's
    timeout, its log holds no configuration error (:data:`CONFIG_ERRORS`: the same overrides would fail again), and
    either verl's trainer never reached its training loop (no :data:`READY_MARKER` in the log: Ray, the workers,
    TransferQueue or an engine failed to come up) or the first error line names the machinery
    (:data:`INFRA_ERRORS`: a Ray actor or node that died, a lost connection, memory). A run that fails after a
    step, or with an error of the training code inside the loop, is not retried.

    Returns:
        The attempt's first error line (or a description when its log names none).
    """
    if returncode == 0 or rows:
        return None
    run_dir = Path(run_dir)
    note = run_dir / "error.txt"
    if note.is_file() and TIMEOUT_NOTE in note.read_text(errors="replace"):
        return None
    try:
        log = (run_dir / "main_ppo.log").read_text(errors="replace")
    except FileNotFoundError:
        log = ""
    if any(marker in log for marker in CONFIG_ERRORS):
        return None
    line = first_error_line(run_dir)
    if READY_MARKER in log and not (line and INFRA_ERRORS.search(line)):
        return None
    return line or f"exit {returncode} before verl's training loop started"


def is_forced(name: str, prefixes: Sequence[str]) -> bool:
    return any(p and name.startswith(p) for p in prefixes)


def forced_start_failures() -> tuple[str, ...]:
    """The run-name prefixes of :data:`FORCE_START_FAILURE_ENV` (test-only)."""
    return env_vars.LAB_FORCE_START_FAILURE.read()
