"""The ``verl.plugins`` entry point: registers everything verl-stable adds to verl.

verl imports this module from ``import verl`` in every process it starts (driver, task runner, Ray
workers, rollout servers) and swallows any exception at DEBUG level. So this module never raises: each
registration step is run in isolation, its outcome is recorded in :data:`STATUS`, and failures are logged
at WARNING level. ``verl-stable doctor`` reads :data:`STATUS` and fails loudly when a step failed.

``VERL_STABLE_SKIP_STEPS=name[,name...]`` (e.g. ``fsdp_router_replay``) leaves steps out in every process verl starts
(the variable travels with Ray's environment when set before the driver starts): for comparing against an upstream
verl that ships the same feature, or for isolating a problem. Skipped steps are recorded as such, never as failures.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import traceback
from dataclasses import dataclass, field

logger = logging.getLogger("verl_stable")

# (step name, module). Each module exposes ``register() -> list[str]`` returning what it registered;
# ``register`` must be idempotent because several import paths can reach it in one process. A step that must wait
# until verl imports a heavy module (the trainers, the FSDP engine) defers through
# ``verl_stable.integration.import_hooks.when_imported`` and returns what it will register on that import.
REGISTRATION_STEPS: tuple[tuple[str, str], ...] = (
    ("cpu_runtime", "verl_stable.cpu.runtime"),
    ("losses", "verl_stable.integration.losses"),
    ("advantages", "verl_stable.integration.advantages"),
    ("trainer", "verl_stable.integration.trainer"),
    ("fsdp_router_replay", "verl_stable.integration.fsdp_engine"),
    ("rollout_routing", "verl_stable.integration.rollout"),
)


@dataclass
class StepStatus:
    """Outcome of one registration step."""

    name: str
    module: str
    ok: bool
    registered: list[str] = field(default_factory=list)
    error: str | None = None


STATUS: dict[str, StepStatus] = {}

ENV_SKIP_STEPS = "VERL_STABLE_SKIP_STEPS"


def skipped_steps() -> frozenset[str]:
    """Step names listed in ``VERL_STABLE_SKIP_STEPS``; an unknown name raises (a typo must not pass silently)."""
    names = frozenset(n.strip() for n in os.environ.get(ENV_SKIP_STEPS, "").split(",") if n.strip())
    unknown = names - {name for name, _ in REGISTRATION_STEPS}
    if unknown:
        known = ", ".join(name for name, _ in REGISTRATION_STEPS)
        raise ValueError(f"{ENV_SKIP_STEPS} names unknown steps {sorted(unknown)}; known steps: {known}")
    return names


def _run_step(name: str, module_name: str) -> StepStatus | None:
    partial = sys.modules.get(module_name)
    if partial is not None and not hasattr(partial, "register"):
        # That module is mid-import and its own `import verl` brought us here; the next register_all() (doctor,
        # or any later `import verl_stable.integration.plugin` caller) completes the step.
        return None
    try:
        module = importlib.import_module(module_name)
        registered = list(module.register())
        return StepStatus(name, module_name, True, registered)
    except Exception as exc:  # noqa: BLE001 - verl would swallow it; we record and report it instead
        logger.warning("verl-stable: registration step %r (%s) failed: %s", name, module_name, exc)
        return StepStatus(name, module_name, False, error="".join(traceback.format_exception(exc)))


def register_all() -> dict[str, StepStatus]:
    """Run every registration step (idempotent) and return the status of each."""
    try:
        skip = skipped_steps()
    except ValueError as exc:
        logger.warning("verl-stable: %s", exc)
        STATUS["skip_steps"] = StepStatus("skip_steps", ENV_SKIP_STEPS, False, error=str(exc))
        skip = frozenset()
    for name, module_name in REGISTRATION_STEPS:
        if name in skip:
            STATUS[name] = StepStatus(name, module_name, True, ["skipped (VERL_STABLE_SKIP_STEPS)"])
            continue
        if name not in STATUS or not STATUS[name].ok:
            status = _run_step(name, module_name)
            if status is not None:
                STATUS[name] = status
    return STATUS


register_all()
