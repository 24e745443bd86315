"""Keep packages a run will not use from being imported: ``VERL_STABLE_SKIP_IMPORTS=megatron,vllm``.

verl imports its optional back ends wherever they are installed, each in a ``try``/``except ImportError``: the engine
package (``verl.workers.engine.__init__``) every optional engine, megatron-core among them (about 1.9 s of CPU per
process on the development machine, a third of ``import verl.workers.engine``); the checkpoint-engine package
(``verl.checkpoint_engine.__init__``) its HCCL engine, which imports ``vllm.distributed`` and with it
``torch._inductor`` (about 1.3 s). Every verl process of a run -- driver, task runner, each actor, rollout server,
agent-loop worker -- pays for them, also in an FSDP run with the ``hf`` rollout that uses neither. With the variable
set, a finder placed first on ``sys.meta_path`` refuses those packages with an ``ImportError`` that names the
variable: verl's ``try`` takes it as "not available" (its warning or import-error record quotes the message), and
everything else goes on as on a machine without them.

The CPU launcher (:func:`verl_stable.toy.trainer_process.run_main_ppo`) sets it for the groups a run does not need
(:func:`verl_stable.toy.trainer_process.skip_groups`); anyone else may set it the same way (it travels to Ray's
workers with the job's environment). The plugin installs the finder first of all its steps, before anything imports
verl's engines.

Groups (:data:`GROUPS`) name the top-level packages they refuse; an unknown group name raises, so a typo never passes
silently. :func:`skipped` is the restorable form (tests); :func:`install` / :func:`uninstall` the process form.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

ENV_SKIP_IMPORTS = "VERL_STABLE_SKIP_IMPORTS"
GROUPS: dict[str, tuple[str, ...]] = {
    # megatron-core and the bridge built on it (mbridge imports megatron.core at module level)
    "megatron": ("megatron", "mbridge"),
    # vLLM: verl's checkpoint-engine package imports vllm.distributed (and with it torch._inductor) wherever vLLM is
    # installed, also in runs whose rollout is another engine
    "vllm": ("vllm",),
}


class SkippedImportError(ImportError):
    """Raised for a package a skip group refuses."""


class _SkipFinder(importlib.abc.MetaPathFinder):
    """Refuses the top-level packages of the given groups, and everything below them."""

    def __init__(self, groups: Sequence[str]) -> None:
        self.groups = tuple(groups)
        self.packages = frozenset(p for g in self.groups for p in GROUPS[g])

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 - importlib's signature
        top = fullname.partition(".")[0]
        if top in self.packages:
            raise SkippedImportError(
                f"{fullname} not imported: {ENV_SKIP_IMPORTS}={','.join(self.groups)} (verl-stable) keeps it out of "
                "this process; unset the variable for a run that uses it",
                name=fullname,
            )
        return None


def requested(environ: os._Environ | dict[str, str] | None = None) -> tuple[str, ...]:
    """The groups ``VERL_STABLE_SKIP_IMPORTS`` names (comma-separated), in order, without repeats
    (:data:`verl_stable.env_vars.SKIP_IMPORTS`).

    Raises:
        ValueError: a name that is not a group of :data:`GROUPS`.
    """
    # imported here: compat imports nothing of the project at its top (docs/explanation/architecture.md)
    from verl_stable import env_vars

    return env_vars.SKIP_IMPORTS.read(environ)


def active_groups() -> tuple[str, ...]:
    """The groups this process refuses (those of the installed finder; empty when none is)."""
    return tuple(g for f in sys.meta_path if isinstance(f, _SkipFinder) for g in f.groups)


def is_skipped(package: str) -> bool:
    """Whether this process refuses ``package`` (a top-level name such as ``"megatron"``)."""
    return any(package.partition(".")[0] in f.packages for f in sys.meta_path if isinstance(f, _SkipFinder))


def install(groups: Sequence[str]) -> list[str]:
    """Put one finder refusing ``groups`` first on ``sys.meta_path`` for the rest of the process (idempotent).

    Raises:
        ValueError: an unknown group, or one of its packages already imported here (refusing it later would leave
            the process half one way, half the other).
    """
    groups = tuple(g for g in dict.fromkeys(groups) if g not in active_groups())
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise ValueError(f"unknown skip groups {unknown}; known: {', '.join(GROUPS)}")
    if not groups:
        return []
    finder = _SkipFinder(groups)
    loaded = sorted(m for m in sys.modules if m.partition(".")[0] in finder.packages)
    if loaded:
        raise ValueError(f"cannot skip {list(groups)}: already imported in this process ({', '.join(loaded[:3])})")
    # patch: skip_imports (verl_stable.compat.catalogue)
    sys.meta_path.insert(0, finder)
    return [f"skip-import:{p}" for g in groups for p in GROUPS[g]]


def uninstall() -> None:
    """Remove every finder :func:`install` put on ``sys.meta_path``."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _SkipFinder)]


@contextmanager
def skipped(groups: Sequence[str]) -> Iterator[None]:
    """Refuse ``groups`` for the span of the block; ``sys.meta_path`` is as before afterwards."""
    before = list(sys.meta_path)
    try:
        install(groups)
        yield
    finally:
        sys.meta_path[:] = before


def register() -> list[str]:
    """Plugin step: install the finder for the groups ``VERL_STABLE_SKIP_IMPORTS`` names (nothing when unset)."""
    return install(requested())
