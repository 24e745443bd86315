"""The run summary a person reads first: what the guard did in a run, as records and as text.

Each action the guard took is one record (a JSON-able dict): ``{"step", "rule", "action", "message"}`` plus
``"detail"`` for what the trainer did about it (the checkpoint a rollback went to, the settings an escalation
changed). The trainer keeps them with its checkpoints, so a run resumed after a restart still reports what happened
before it, and at the end writes them with the totals to ``verl_stable_summary.json`` and the text of
:func:`summary_text` to the log. This module does not import verl.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

SUMMARY_FILE = "verl_stable_summary.json"
RECORD_KEYS = ("step", "rule", "action", "message")


def action_record(step: int, rule: str, action: str, message: str, detail: str = "") -> dict[str, Any]:
    """One guard action as a record (``detail`` left out when empty)."""
    record: dict[str, Any] = {"step": int(step), "rule": str(rule), "action": str(action), "message": str(message)}
    if detail:
        record["detail"] = str(detail)
    return record


def check_records(records: object) -> list[dict[str, Any]]:
    """``records`` as a list of action records (what a checkpoint's state file holds).

    Raises:
        TypeError: not a list of mappings with the keys of :data:`RECORD_KEYS`.
    """
    if not isinstance(records, list):
        raise TypeError(f"guard action records must be a list, got {type(records).__name__}")
    out = []
    for record in records:
        if not isinstance(record, Mapping) or not set(RECORD_KEYS) <= set(record):
            raise TypeError(f"a guard action record needs the keys {RECORD_KEYS}, got {record!r}")
        out.append(action_record(**{k: record[k] for k in (*RECORD_KEYS, "detail") if k in record}))
    return out


def summary(records: Sequence[Mapping[str, Any]], last_step: int, stopped: str | None) -> dict[str, Any]:
    """The run's totals: last step logged, how it ended, actions counted by kind, and every record."""
    counts = Counter(r["action"] for r in records)
    return {
        "last_step": int(last_step),
        "ended": "stopped by the guard" if stopped else "completed",
        "stop_reason": stopped,
        "actions": dict(sorted(counts.items())),
        "records": [dict(r) for r in records],
    }


TEXT_RECORDS = 20
"""Records the text shows (the first ones, in step order); the JSON file has all."""


def summary_text(report: Mapping[str, Any]) -> str:
    """:func:`summary`'s report as the lines of the log block (the first :data:`TEXT_RECORDS` actions)."""
    lines = [f"verl-stable run summary: {report['ended']} at step {report['last_step']}"]
    if report["stop_reason"]:
        lines.append(f"  stop: {report['stop_reason']}")
    if not report["records"]:
        lines.append("  the guard took no action")
    else:
        counted = ", ".join(f"{n} {action}" for action, n in report["actions"].items())
        lines.append(f"  guard actions: {counted}")
        for r in report["records"][:TEXT_RECORDS]:
            detail = f" ({r['detail']})" if r.get("detail") else ""
            lines.append(f"  step {r['step']}: [{r['rule']} -> {r['action']}] {r['message']}{detail}")
        if len(report["records"]) > TEXT_RECORDS:
            lines.append(f"  ... {len(report['records']) - TEXT_RECORDS} more in {SUMMARY_FILE}")
    return "\n".join(lines)
