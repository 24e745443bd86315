"""Faults injected into a CPU run on purpose, to test that the guard's actions recover from them.

Only the learning-rate spike exists: ``VERL_STABLE_FAULT_LR_SPIKE=<k>:<factor>`` makes the ``k``-th optimizer step of
every verl FSDP training engine in the run (counted per engine, from 1) run at ``factor`` times its learning rate; the
learning rate is restored right after that step, so the schedule goes on as before. One step at a large factor is the
classic way a run is wrecked by a single bad update (a warm-up misconfigured, a loss-scale glitch), and it is what the
``rollback`` action must undo: the damage is in the weights and the optimizer state, not in the data.

The fault is installed by the CPU runtime (:mod:`verl_stable.cpu.runtime`) only in processes that selected the CPU
platform and only when the variable is set; the launcher forwards ``VERL_*`` variables to every process of the Ray
job. The count lives in the engine instance, so it is not reset by a checkpoint load: a run that rolls back past the
faulty step does not meet the fault again, while a new process that resumes from a checkpoint counts from 1 again
(tests that compare with a plain resume leave the variable unset there).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from verl_stable import env_vars
from verl_stable.compat.import_hooks import when_imported
from verl_stable.cpu.platform import cpu_selected

LR_SPIKE_ENV = env_vars.FAULT_LR_SPIKE.name
FSDP_ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"

_INSTALLED: dict[str, Any] = {}  # "optimizer_step" -> verl's original, while the fault is installed
_REQUESTED: dict[str, tuple[int, float]] = {}  # "lr_spike" -> (k, factor) asked for by register()


def parse_lr_spike(value: str) -> tuple[int, float]:
    """``"<k>:<factor>"`` -> ``(k, factor)`` (:data:`verl_stable.env_vars.FAULT_LR_SPIKE`).

    Raises:
        ValueError: not two fields, ``k`` not an integer >= 1, or ``factor`` not a finite number > 0; the message
            names :data:`LR_SPIKE_ENV` and the accepted form.
    """
    parsed = env_vars.FAULT_LR_SPIKE.read({LR_SPIKE_ENV: value})
    if parsed is None:
        raise env_vars.EnvVarError(f"{LR_SPIKE_ENV} is empty; expected {env_vars.FAULT_LR_SPIKE.accepted}")
    return parsed


@contextlib.contextmanager
def scaled_lr(optimizer: Any, factor: float) -> Iterator[None]:
    """Within the block every parameter group of ``optimizer`` runs at ``factor`` times its learning rate."""
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr


def _install() -> list[str]:
    import importlib

    step, factor = _REQUESTED["lr_spike"]
    engine = importlib.import_module(FSDP_ENGINE_MODULE).FSDPEngine
    if "optimizer_step" in _INSTALLED:
        return [f"fault:lr_spike@{step}x{factor:g}"]
    original = engine.optimizer_step

    def optimizer_step(self: Any) -> Any:
        count = self._stable_fault_optimizer_steps = getattr(self, "_stable_fault_optimizer_steps", 0) + 1
        if count != step:
            return original(self)
        with scaled_lr(self.optimizer, factor):
            return original(self)

    _INSTALLED["optimizer_step"] = original
    # patch: lr_spike_fault (verl_stable.compat.catalogue)
    engine.optimizer_step = optimizer_step
    return [f"fault:lr_spike@{step}x{factor:g}"]


def uninstall() -> None:
    """Restore verl's ``FSDPEngine.optimizer_step`` if the fault was installed."""
    original = _INSTALLED.pop("optimizer_step", None)
    if original is not None:
        import importlib

        importlib.import_module(FSDP_ENGINE_MODULE).FSDPEngine.optimizer_step = original


def register(environ: dict[str, str] | os._Environ | None = None) -> list[str]:
    """Install the faults the environment asks for, in a process that selected the CPU platform (idempotent).

    Raises:
        ValueError: a malformed :data:`LR_SPIKE_ENV` (checked even before verl's engine module is imported).
    """
    environ = os.environ if environ is None else environ
    requested = env_vars.FAULT_LR_SPIKE.read(environ)
    if requested is None or not cpu_selected(environ):
        return []
    step, factor = _REQUESTED["lr_spike"] = requested
    hook = when_imported(FSDP_ENGINE_MODULE, _install)
    if hook.fired:
        return hook.result
    return [f"fault:lr_spike@{step}x{factor:g} (on import of {FSDP_ENGINE_MODULE})"]
