"""The guard's run state file beside a verl checkpoint (``global_step_<n>/verl_stable_guard.json``), read strictly.

The trainer writes it (:mod:`verl_stable.integration.guard_actions`) and reads it back when verl resumes from that
checkpoint: the rollbacks each rule asked for (so ``max_rollbacks`` holds per run), the escalations (re-applied) and
the action records. What it holds sets a budget, so a damaged file must never be read as a bigger one: a truncated
file, a count that is negative, fractional or a string, a misspelt section (``"rollback"``, which would read as no
rollbacks yet) is refused, naming the file and the form expected. This module does not import verl.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from verl_stable.monitor.run_summary import check_records

STATE_KEYS = ("guard", "records")
GUARD_KEYS = ("rollbacks", "escalations")
EXPECTED = (
    '{"guard": {"rollbacks": {rule: count >= 0}, "escalations": {rule: step >= 0}}, "records": [action records]}, as '
    "verl-stable writes it"
)


class GuardStateError(ValueError):
    """A guard state file that cannot be trusted; the message starts with the file."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def check_guard_state(state: object, where: str = "guard state") -> dict[str, Any]:
    """``state`` (the file's parsed JSON) as ``{"guard": {...}, "records": [...]}``, checked.

    Args:
        state: the parsed content of a state file.
        where: what to name in a refusal (the file).

    Raises:
        GuardStateError: not a mapping of exactly :data:`STATE_KEYS`; ``guard`` not a mapping of exactly
            :data:`GUARD_KEYS`, each a mapping of rule name to an integer >= 0 (bools and floats refused); or
            ``records`` not a list of action records (:func:`verl_stable.monitor.run_summary.check_records`).
    """

    def refuse(problem: str) -> GuardStateError:
        return GuardStateError(f"{where}: {problem}; expected {EXPECTED}")

    if not isinstance(state, Mapping):
        raise refuse(f"holds a JSON {type(state).__name__}, not an object")
    if sorted(state) != sorted(STATE_KEYS):
        raise refuse(f"has the keys {sorted(state)}, not {list(STATE_KEYS)}")
    guard = state["guard"]
    if not isinstance(guard, Mapping):
        raise refuse(f"'guard' is a JSON {type(guard).__name__}, not an object")
    if sorted(guard) != sorted(GUARD_KEYS):
        raise refuse(f"'guard' has the keys {sorted(guard)}, not {list(GUARD_KEYS)}")
    checked: dict[str, dict[str, int]] = {}
    for section in GUARD_KEYS:
        entries = guard[section]
        if not isinstance(entries, Mapping):
            raise refuse(f"'guard.{section}' is a JSON {type(entries).__name__}, not an object of rule to count")
        for rule, value in entries.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise refuse(f"'guard.{section}.{rule}' is {value!r}, not an integer >= 0")
        checked[section] = {str(rule): int(value) for rule, value in entries.items()}
    try:
        records = check_records(state["records"])
    except (TypeError, ValueError) as exc:
        raise refuse(f"'records': {exc}") from None
    return {"guard": checked, "records": records}


def read_guard_state(path: str | os.PathLike) -> dict[str, Any]:
    """The guard state file at ``path``, checked (:func:`check_guard_state`).

    Raises:
        GuardStateError: the file cannot be read, is not UTF-8 or not complete JSON (a write cut short), holds
            ``NaN`` / ``Infinity``, or fails :func:`check_guard_state`; the message names the file.
    """
    where = f"guard state file {os.fspath(path)}"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise GuardStateError(f"{where}: cannot be read ({exc}); expected {EXPECTED}") from None
    try:
        state = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:  # JSONDecodeError (truncated, empty) or a NaN / Infinity constant
        raise GuardStateError(f"{where}: not complete JSON ({exc}); expected {EXPECTED}") from None
    return check_guard_state(state, where)
