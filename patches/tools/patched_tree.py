"""Copies of verl with our diffs applied: the one way the maintainer's check, the tests and the benchmarks build them.

A diff under ``patches/`` is relative to verl's repository root (``verl/``, ``tests/``, ``docs/``), so it applies with
``git apply -p1`` in any directory that holds a ``verl/`` package: a pristine sdist tree (``check_series.py``), a copy
of the installed package (:func:`copy_verl`; pass ``include="verl/*"`` when only the package was copied and the
diff's tests and docs should be left out), or the installed site-packages itself for a ``--check`` that writes
nothing (:func:`check_diff`).

Every ``git apply`` here runs with ``GIT_CEILING_DIRECTORIES`` set to the tree's parent. Without it, a tree inside
some git work tree (a ``.venv`` in a checkout, a ``TMPDIR`` under one) makes git take the paths relative to that
repository and skip every one outside the current directory: the check and the apply then succeed without touching
a file.

Not a package: ``check_series.py`` imports it as a sibling, the tests and benchmarks load it by path (as they load
``check_series.py``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# Byte code and pytest's cache are left over from the source tree's own runs: never part of a diff, only bulk to copy.
_CACHES = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")


@dataclass
class Applied:
    """Outcome of applying (or checking) one diff on one tree.

    Attributes:
        ok: Whether git accepted the diff.
        message: Empty when ``ok``; otherwise the stage that refused (``git apply --check`` or ``git apply``) and
            git's stderr, which names the file and hunk.
    """

    ok: bool
    message: str = ""


class DiffDoesNotApply(RuntimeError):
    """A diff that :func:`patched_copy` had to apply was refused; the message names the diff and quotes git."""

    def __init__(self, diff: Path, applied: Applied) -> None:
        super().__init__(f"{diff.name}: {applied.message}")
        self.diff = diff
        self.applied = applied


def installed_verl() -> Path:
    """The directory of the verl package this interpreter would import, found without importing it.

    Importing verl would run its plugin entry points and pin the installed ``verl`` in ``sys.modules``, after which a
    caller could no longer import a patched copy put first on ``sys.path``.

    Returns:
        The resolved ``.../site-packages/verl`` (or wherever verl is installed).

    Raises:
        ModuleNotFoundError: verl is not importable here.
    """
    spec = importlib.util.find_spec("verl")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("verl is not importable by this interpreter: there is no installed verl to copy")
    return Path(spec.origin).resolve().parent


def copy_tree(src: Path, dst: Path) -> Path:
    """Copy the tree ``src`` to the new directory ``dst``, without byte-code or pytest caches.

    Args:
        src: A verl tree (a checkout, an extracted sdist) or a ``verl/`` package.
        dst: Where the copy goes; must not exist yet.

    Returns:
        ``dst``.
    """
    shutil.copytree(src, dst, ignore=_CACHES)
    return dst


def copy_verl(dest_root: Path, source: Path | None = None) -> Path:
    """Copy a verl package to ``dest_root/verl``, without caches.

    Args:
        dest_root: An existing directory, which will hold the copy; apply diffs here and put it on ``PYTHONPATH``.
        source: The ``verl/`` package directory to copy; default :func:`installed_verl`.

    Returns:
        ``dest_root``, the directory holding ``verl/`` (what ``git apply -p1`` needs as its working directory).
    """
    copy_tree(source or installed_verl(), dest_root / "verl")
    return dest_root


def _git_apply(tree: Path, diff: Path, include: str | None, check: bool) -> Applied:
    """One ``git apply -p1`` of ``diff`` in ``tree`` (``--check`` only when ``check``), git kept out of enclosing repos."""
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(Path(tree).resolve().parent))
    cmd = ["git", "apply", "-p1", *(["--check"] if check else []), *([f"--include={include}"] if include else [])]
    proc = subprocess.run([*cmd, str(diff)], cwd=tree, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return Applied(False, f"{'git apply --check' if check else 'git apply'}: {proc.stderr.strip()}")
    return Applied(True)


def check_diff(tree: Path, diff: Path, include: str | None = None) -> Applied:
    """``git apply --check -p1`` of ``diff`` in ``tree``: would it apply? Writes nothing.

    Safe on the installed site-packages, which is how the tests check that each diff fits the installed verl.

    Args:
        tree: The directory holding ``verl/`` (and ``tests/``, ``docs/`` in a full tree).
        diff: The diff file.
        include: A ``git apply --include`` pattern (``"verl/*"``: only the package's files); default every file.

    Returns:
        The outcome; a refusal's message starts with ``git apply --check:``.
    """
    return _git_apply(tree, diff, include, check=True)


def apply_diff(tree: Path, diff: Path, include: str | None = None) -> Applied:
    """Apply ``diff`` in ``tree``: ``git apply --check`` first, then ``git apply`` (``-p1``).

    The check first means a refused diff leaves the tree as it was, and the message says which stage refused.

    Args:
        tree: The directory holding ``verl/`` (and ``tests/``, ``docs/`` in a full tree).
        diff: The diff file.
        include: A ``git apply --include`` pattern (``"verl/*"``: only the package's files); default every file.

    Returns:
        The outcome; never raises on a refusal (the maintainer's check reports every diff, applied or not).
    """
    checked = _git_apply(tree, diff, include, check=True)
    return _git_apply(tree, diff, include, check=False) if checked.ok else checked


def patched_copy(
    dest_root: Path, diffs: Iterable[Path], include: str | None = None, source: Path | None = None
) -> Path:
    """:func:`copy_verl`, then :func:`apply_diff` of each of ``diffs`` in order, failing at the first refusal.

    For callers that need the patched verl to exist (a test fixture, a benchmark) rather than a report.

    Args:
        dest_root: An existing directory, which will hold ``verl/``.
        diffs: The diffs, applied in this order.
        include: Passed to :func:`apply_diff`; ``"verl/*"`` when the diffs' tests and docs should not be written.
        source: The ``verl/`` package to copy; default the installed one.

    Returns:
        ``dest_root``, the directory to put on ``PYTHONPATH``.

    Raises:
        DiffDoesNotApply: A diff was refused (naming it, with git's stderr); earlier diffs stay applied.
        ModuleNotFoundError: ``source`` is not given and verl is not installed.
    """
    root = copy_verl(dest_root, source)
    for diff in diffs:
        applied = apply_diff(root, diff, include)
        if not applied.ok:
            raise DiffDoesNotApply(diff, applied)
    return root
