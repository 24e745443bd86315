"""What the end-to-end tests read from a verl run's log."""

from __future__ import annotations

import re


def actors(log: str, name: str) -> set[str]:
    """The pids of the Ray actors of class ``name`` that wrote to ``log`` (Ray's ``(Name pid=N)`` prefix)."""
    return set(re.findall(rf"\({name} pid=(\d+)\)", log))
