"""argparse types shared by the command lines (``run``, ``recipe``, ``lab``): a bad value is refused by argparse with
exit code 2 and a message saying what was expected, before anything starts; and :func:`resolve_path`, the one way
they (and the APIs behind them) resolve a directory argument. Imports nothing from the project."""

from __future__ import annotations

import argparse
import errno
import math
import os
from pathlib import Path


def resolve_path(path: str | os.PathLike, what: str) -> Path:
    """``path`` made absolute, every symlink resolved, as the runs will name it.

    Raises:
        ValueError: The path cannot be resolved (it runs into a symlink loop); the message starts with ``what`` (e.g.
            ``--out``) and the path as given.
    """
    try:
        return Path(path).resolve()
    except (RuntimeError, OSError) as exc:  # a symlink loop: RuntimeError up to Python 3.12, OSError (ELOOP) after
        loop = isinstance(exc, RuntimeError) or getattr(exc, "errno", None) == errno.ELOOP
        why = "it runs into a symlink loop" if loop else str(exc)
        raise ValueError(f"{what} {os.fspath(path)} cannot be resolved ({why}); expected a directory path") from None


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _int_at_least(text, 0)


def _finite_above_zero(text: str, expected: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0."""
    return _finite_above_zero(text, "a number of seconds > 0")


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    return _finite_above_zero(text, "a finite number > 0")
