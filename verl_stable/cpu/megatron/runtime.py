"""The Megatron CPU runtime: every fix megatron-core 0.16.1 needs to build, train and route on a CPU build of torch.

What each fix answers (the numbers of the Megatron CPU probe; one module per concept):

==  ===========================================================  ===============================================
#   megatron-core assumes                                        answered by
==  ===========================================================  ===============================================
1   a CUDA generator behind its RNG-state tracker                :mod:`~verl_stable.cpu.megatron.rng`
2   a device-to-host stream and numpy split sizes (alltoall)     :mod:`~verl_stable.cpu.megatron.moe`
3   ``torch.cuda.current_device()``, streams, events             :mod:`~verl_stable.cpu.megatron.device` (stubs)
4   the local attention's causal mask on ``device="cuda"``,      :mod:`~verl_stable.cpu.megatron.device` (mode,
    also while activations are recomputed in the backward         recomputation under the mode)
5   Transformer Engine names in the MoE router (``NameError``)   :mod:`~verl_stable.cpu.megatron.moe`
6   ~70 ``device="cuda"`` / ``.cuda()`` / ``"torch.cuda.*"``     :mod:`~verl_stable.cpu.megatron.device` (mode)
7   no sequence parallelism with the torch norm                  :mod:`~verl_stable.cpu.megatron.norm`
8   NCCL's uneven all-gather / reduce-scatter (expert-tensor     :mod:`~verl_stable.cpu.megatron.collectives`
    parallel token exchange); gloo takes even sizes only
==  ===========================================================  ===============================================

Two ways in, sharing one installation (reference-counted: the fixes are removed when the last holder leaves):

* :func:`megatron_cpu_runtime`, a context manager for tests and scripts: installs everything, runs the block with the
  device mode on the calling thread, restores everything on exit. It nests (an inner block reuses the installation
  and the mode), and it works whether or not the CPU platform is selected: callers ask for it explicitly.
* :func:`install` / :func:`uninstall`, the process-scope version for worker processes. The CPU runtime calls
  ``install()`` only where :func:`verl_stable.cpu.platform.cpu_selected` holds; nothing here checks that, and nothing
  is installed at import. ``install()`` is idempotent, and works before or after megatron-core is imported: a fix
  whose megatron module is not imported yet waits for it (:func:`verl_stable.compat.import_hooks.when_imported`).

Threads. The attribute fixes are process-wide; the device mode (fixes 4 and 6) is a ``TorchFunctionMode`` and torch
keeps those per thread. ``install()`` puts it on the calling thread's stack and may be called again from any thread
that will run megatron code (a Ray actor's task thread, say): each call covers its own thread. ``uninstall()`` takes
the mode off the calling thread and disables it wherever else it was installed.

:data:`CONTRACTS` / :func:`check_contracts` gather the contracts of every fix module: each private megatron-core
attribute patched (or relied on) must exist with the shape it has in 0.16.1.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from torch.overrides import _get_current_function_mode_stack

from verl_stable.compat import contracts
from verl_stable.compat.contracts import Contract, ContractResult
from verl_stable.compat.import_hooks import ImportHook, when_imported
from verl_stable.cpu.megatron import collectives, device, moe, norm, rng
from verl_stable.cpu.megatron.patching import AttributePatcher

__all__ = [
    "CONTRACTS",
    "FIXES",
    "Fix",
    "check_contracts",
    "install",
    "installed",
    "megatron_cpu_runtime",
    "uninstall",
]

PREFIX = "megatron_cpu"


@dataclass(frozen=True)
class Fix:
    """One fix: what it is called, which module must be imported before it applies, and how it applies.

    Attributes:
        name: reported by :func:`install` as ``megatron_cpu:<name>``.
        module: the megatron module whose attributes it patches (applied right after that module's import);
            ``None``: applies at once (``torch.cuda`` attributes).
        apply: sets its attributes through the runtime's patcher, which restores them.
    """

    name: str
    module: str | None
    apply: Callable[[AttributePatcher], None]


FIXES: tuple[Fix, ...] = (
    Fix("cuda_device_stubs", None, device.apply_cuda_stubs),
    Fix("cuda_rng_stubs", None, rng.apply_cuda_rng_stubs),
    Fix("rng_tracker", rng.MODULE, rng.apply_tracker_fix),
    Fix("recompute_under_device_mode", device.RECOMPUTE_MODULE, device.apply_recompute_fix),
    Fix("moe_te_fallback", moe.MOE_UTILS, moe.apply_te_fallback),
    Fix("dispatcher_host_splits", moe.DISPATCHER, moe.apply_dispatcher_fix),
    Fix("torch_norm_sequence_parallel", norm.MODULE, norm.apply),
    Fix("uneven_tp_collectives", collectives.MODULE, collectives.apply),
)
"""Every attribute fix, in the order applied (the device mode comes on top, per thread)."""


@dataclass
class _Installation:
    """The one installation shared by every holder (guarded by ``_LOCK``)."""

    patcher: AttributePatcher = field(default_factory=AttributePatcher)
    hooks: list[ImportHook] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)
    holders: int = 0
    # modes install() pushed, by thread: disabled on uninstall wherever they are
    thread_modes: dict[int, device.CudaToCpuMode] = field(default_factory=dict)

    def apply(self, fix: Fix) -> None:
        with _LOCK:
            if _CURRENT is not self:  # the runtime was removed before the module was imported
                return
            fix.apply(self.patcher)
            self.applied.append(fix.name)


_LOCK = threading.RLock()
_CURRENT: _Installation | None = None
_PROCESS_HOLD = False  # whether install() holds the installation (once per process, however often it is called)


def _acquire() -> _Installation:
    """Hold the installation, creating it (and applying or deferring every fix) for the first holder. Holds _LOCK."""
    global _CURRENT
    if _CURRENT is None:
        installation = _CURRENT = _Installation()
        try:
            for fix in FIXES:
                if fix.module is None:
                    installation.apply(fix)
                else:
                    hook = when_imported(fix.module, functools.partial(installation.apply, fix))
                    if not hook.fired:
                        installation.hooks.append(hook)
        except BaseException:
            _teardown(installation)
            raise
    _CURRENT.holders += 1
    return _CURRENT


def _release() -> None:
    """Drop one hold; the last one removes every fix. Holds _LOCK."""
    if _CURRENT is None:
        return
    _CURRENT.holders -= 1
    if _CURRENT.holders <= 0:
        _teardown(_CURRENT)


def _teardown(installation: _Installation) -> None:
    global _CURRENT
    for hook in installation.hooks:
        hook.uninstall()
    for mode in installation.thread_modes.values():
        mode.enabled = False
    installation.patcher.restore()
    if _CURRENT is installation:
        _CURRENT = None


def installed() -> bool:
    """Whether the fixes are installed in this process (by :func:`install` or an open :func:`megatron_cpu_runtime`)."""
    return _CURRENT is not None


def _report(installation: _Installation) -> list[str]:
    done = [f"{PREFIX}:{name}" for name in installation.applied]
    waiting = [
        f"{PREFIX}:{fix.name} (on import of {fix.module})" for fix in FIXES if fix.name not in installation.applied
    ]
    return done + waiting


@contextlib.contextmanager
def megatron_cpu_runtime() -> Iterator[list[str]]:
    """Install every fix for the block (and the device mode on this thread); restore everything on exit.

    Nesting, or using it while :func:`install` holds the runtime, shares that installation: only the last holder to
    leave removes the fixes. The platform is not consulted: callers ask for the runtime explicitly.

    Yields:
        What is installed, as :func:`install` reports it.
    """
    with _LOCK:
        installation = _acquire()
    try:
        with device.device_mode():
            yield _report(installation)
    finally:
        with _LOCK:
            _release()


def install() -> list[str]:
    """Install every fix for the rest of the process, and the device mode on the calling thread (idempotent).

    Call it again from each other thread that will run megatron code; every call after the first only adds the
    device mode to its thread. Only for processes that selected the CPU platform (the caller checks).

    Returns:
        ``megatron_cpu:<fix>`` for each fix applied, with ``(on import of <module>)`` for one that waits for its
        megatron module, then ``megatron_cpu:device_mode:<thread name>``.
    """
    global _PROCESS_HOLD
    with _LOCK:
        installation = _acquire() if not _PROCESS_HOLD else _CURRENT
        assert installation is not None
        _PROCESS_HOLD = True
        ident = threading.get_ident()
        if device.active_mode() is None:
            mode = device.CudaToCpuMode()
            mode.__enter__()
            installation.thread_modes[ident] = mode
        return [*_report(installation), f"{PREFIX}:device_mode:{threading.current_thread().name}"]


def uninstall() -> None:
    """Undo :func:`install`: the fixes go once no :func:`megatron_cpu_runtime` block holds them either.

    The device mode is taken off the calling thread's stack when it is on top there; elsewhere it is disabled.
    """
    global _PROCESS_HOLD
    with _LOCK:
        if not _PROCESS_HOLD or _CURRENT is None:
            return
        _PROCESS_HOLD = False
        mode = _CURRENT.thread_modes.pop(threading.get_ident(), None)
        if mode is not None:
            mode.enabled = False
            stack = _get_current_function_mode_stack()
            if stack and stack[-1] is mode:
                mode.__exit__(*sys.exc_info())
        for other in _CURRENT.thread_modes.values():
            other.enabled = False
        _CURRENT.thread_modes.clear()
        _release()


# --------------------------------------------------------------------------------------------------------- contracts
CONTRACTS: tuple[Contract, ...] = (
    *device.CONTRACTS,
    *rng.CONTRACTS,
    *moe.CONTRACTS,
    *norm.CONTRACTS,
    *collectives.CONTRACTS,
)
"""Every private megatron-core interface the fixes patch or rely on, with the shape it has in 0.16.1."""


def check_contracts(names: tuple[str, ...] | list[str] | None = None) -> list[ContractResult]:
    """Run the runtime's contracts (all by default); never raises (a missing megatron-core is reported by name)."""
    return contracts.check(CONTRACTS, names)
