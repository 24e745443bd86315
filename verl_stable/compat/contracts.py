"""The contract mechanism: a verl (or vLLM) interface that the CPU runtime relies on, as a named, runnable check.

verl 0.9.1 exposes public hooks (entry points, ``PlatformRegistry``, ``EngineRegistry``, ``RolloutReplicaRegistry``),
but a working CPU runtime also relies on private or implicit interfaces. Each module that relies on one declares it
next to the code that needs it, as a :class:`Contract` in its ``CONTRACTS`` tuple, and offers ``check_contracts()``
(a list of :class:`ContractResult`, never raising); :func:`verl_stable.cpu.runtime.doctor` collects them from every
such module for ``verl-stable doctor``, and registration code calls :func:`require` to stop with a
:class:`ContractError` that names each broken contract.

This module knows no other module: it only runs the checks it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass


class ContractError(RuntimeError):
    """A verl interface the CPU runtime relies on is missing or changed."""


@dataclass(frozen=True)
class ContractResult:
    """Outcome of one contract check.

    Attributes:
        name: the contract's name (what ``verl-stable doctor`` prints).
        ok: whether the interface is as relied on.
        detail: what was found (ok) or what broke, prefixed with the contract's description.
    """

    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class Contract:
    """One interface relied on.

    Attributes:
        name: unique name (``verl-stable doctor`` and :func:`require` use it).
        description: what is relied on, in a few words.
        check: returns a detail string when the interface holds; raises when it is broken.
    """

    name: str
    description: str
    check: Callable[[], str]


def check(contracts: Iterable[Contract], names: Collection[str] | None = None) -> list[ContractResult]:
    """Run ``contracts`` (only those called ``names``, when given) in order; never raises.

    Args:
        contracts: the contracts to run, usually a module's ``CONTRACTS``.
        names: restrict to these contract names; None runs every one.

    Returns:
        One result per contract run; a failed one says which description broke and with what exception.
    """
    results = []
    for contract in contracts:
        if names is not None and contract.name not in names:
            continue
        try:
            results.append(ContractResult(contract.name, True, contract.check()))
        except Exception as exc:  # noqa: BLE001 - report every failure by name
            results.append(ContractResult(contract.name, False, f"{contract.description}: {type(exc).__name__}: {exc}"))
    return results


def require(contracts: Iterable[Contract], *names: str) -> None:
    """Raise :class:`ContractError` naming every failed contract among ``names``.

    Args:
        contracts: the contracts ``names`` are looked up in, usually a module's ``CONTRACTS``.
        names: the contracts that must hold.

    Raises:
        ValueError: A name that is not among ``contracts`` (a typo in the caller, not a verl change).
        ContractError: One or more of the named contracts is broken; the message names each with its detail.
    """
    contracts = tuple(contracts)
    unknown = set(names) - {c.name for c in contracts}
    if unknown:
        raise ValueError(f"unknown contracts {sorted(unknown)}")
    failed = [r for r in check(contracts, names) if not r.ok]
    if failed:
        raise ContractError("verl contract broken: " + "; ".join(f"[{r.name}] {r.detail}" for r in failed))
