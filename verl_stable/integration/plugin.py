"""The ``verl.plugins`` entry point: registers everything verl-stable adds to verl.

verl imports this module from ``import verl`` in every process it starts (driver, task runner, Ray
workers, rollout servers) and swallows any exception at DEBUG level. So this module never raises: each
registration step is run in isolation, its outcome is recorded in :data:`STATUS`, and failures are logged
at WARNING level. ``verl-stable doctor`` reads :data:`STATUS` and fails loudly when a step failed.

``VERL_STABLE_SKIP_STEPS=name[,name...]`` (e.g. ``fsdp_router_replay``) leaves steps out in every process verl starts
(the variable travels with Ray's environment when set before the driver starts): for comparing against an upstream
verl that ships the same feature, or for isolating a problem. Skipped steps are recorded as such, never as failures.

Where a silent fallback would change training, a failed step does more than log. When the replay engine's step
(``fsdp_router_replay``) did not register, verl's own FSDP engine would serve ``router_replay.mode=R2|R3`` by ignoring
it; so :func:`check_replay_engine` makes verl's ``EngineRegistry.new`` raise for such an engine, naming the failed
step, while engines without replay are built as before.
"""

from __future__ import annotations

import importlib
import logging
import sys
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from verl_stable import env_vars
from verl_stable.compat.import_hooks import when_imported

logger = logging.getLogger("verl_stable")

# (step name, module). Each module exposes ``register() -> list[str]`` returning what it registered;
# ``register`` must be idempotent because several import paths can reach it in one process. A step that must wait
# until verl imports a heavy module (the trainers, the FSDP engine) defers through
# ``verl_stable.compat.import_hooks.when_imported`` and returns what it will register on that import.
REGISTRATION_STEPS: tuple[tuple[str, str], ...] = (
    ("skip_imports", "verl_stable.compat.skip_imports"),  # first: before any step imports verl's engines
    ("cpu_runtime", "verl_stable.cpu.runtime"),
    ("losses", "verl_stable.integration.losses"),
    ("advantages", "verl_stable.integration.advantages"),
    ("trainer", "verl_stable.integration.trainer"),
    ("fsdp_router_replay", "verl_stable.integration.fsdp_engine"),
    ("megatron_replay_metrics", "verl_stable.integration.megatron_replay"),
    ("rollout_routing", "verl_stable.integration.rollout"),
    ("driver_checks", "verl_stable.integration.driver_checks"),
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

ENV_SKIP_STEPS = env_vars.SKIP_STEPS.name


def skipped_steps() -> frozenset[str]:
    """Step names listed in ``VERL_STABLE_SKIP_STEPS`` (:data:`verl_stable.env_vars.SKIP_STEPS`).

    Raises:
        ValueError: an unknown name (a typo must not pass silently).
    """
    return env_vars.SKIP_STEPS.read()


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
    if REPLAY_STEP not in skip and not (REPLAY_STEP in STATUS and STATUS[REPLAY_STEP].ok):
        _guard_replay_engine()
    return STATUS


# The replay engine's step, and the engines it replaces (mirrors fsdp_engine.MODEL_TYPE / BACKENDS: this module must
# not import fsdp_engine, whose failure to import is one of the failures the guard is for).
REPLAY_STEP = "fsdp_router_replay"
REPLAY_MODEL_TYPE = "language_model"
REPLAY_BACKENDS: tuple[str, ...] = ("fsdp", "fsdp2")
ENGINE_REGISTRY_MODULE = "verl.workers.engine.base"  # defines verl's EngineRegistry
_REPLAY_OFF = (None, "", "disabled")


class ReplayEngineUnavailableError(RuntimeError):
    """Router replay is configured on the FSDP engine, but the step that registers the replay engine failed."""


def _replay_mode(engine_config: Any) -> Any:
    """``engine_config.router_replay.mode``: a verl dataclass, or a plain dict (``+...router_replay.mode=R3``)."""

    def get(node: Any, key: str) -> Any:
        return node.get(key) if isinstance(node, Mapping) else getattr(node, key, None)

    router_replay = get(engine_config, "router_replay") if engine_config is not None else None
    return get(router_replay, "mode") if router_replay is not None else None


def check_replay_engine(model_type: str, backend: str, engine_config: Any) -> None:
    """Refuse an FSDP engine with router replay when the replay engine is not registered in this process.

    Called by verl's ``EngineRegistry.new`` (see :func:`_guard_replay_engine`) with the engine's own config, so the
    error comes where R2 / R3 is configured, instead of a run that trains without replay.

    Raises:
        ReplayEngineUnavailableError: If ``router_replay.mode`` asks for replay on an FSDP language-model engine and
            the ``fsdp_router_replay`` step failed (or never completed) in this process.
    """
    mode = _replay_mode(engine_config)
    if model_type != REPLAY_MODEL_TYPE or backend not in REPLAY_BACKENDS or mode in _REPLAY_OFF:
        return
    status = STATUS.get(REPLAY_STEP)
    if status is not None and status.ok:
        return  # registered (or skipped on purpose, by VERL_STABLE_SKIP_STEPS) since the guard was installed
    module = dict(REGISTRATION_STEPS)[REPLAY_STEP]
    if status is None:
        why = "did not complete in this process"
    else:
        why = f"failed: {(status.error or '').strip().splitlines()[-1]}"
    raise ReplayEngineUnavailableError(
        f"router_replay.mode={mode} on verl's {backend} engine needs verl-stable's replay engine, but plugin step "
        f"'{REPLAY_STEP}' ({module}) {why}. verl's own engine would train without routing replay: fix that error "
        "(`verl-stable doctor` shows it in full) or set router_replay.mode=disabled"
    )


def _install_replay_guard() -> list[str]:
    """Wrap verl's ``EngineRegistry.new`` with :func:`check_replay_engine` (idempotent)."""
    from verl.workers.engine.base import EngineRegistry

    original = EngineRegistry.new.__func__
    if getattr(original, "_verl_stable_replay_guard", False):
        return ["EngineRegistry.new: replay guard"]

    def new(cls: type, model_type: str, backend: str, *args: Any, **kwargs: Any) -> Any:
        # verl passes the configs by keyword; positionally the engine config follows the model config
        engine_config = kwargs.get("engine_config", args[1] if len(args) > 1 else None)
        check_replay_engine(model_type, backend, engine_config)
        return original(cls, model_type, backend, *args, **kwargs)

    new.__doc__ = original.__doc__
    new._verl_stable_replay_guard = True  # type: ignore[attr-defined]
    # patch: engine_registry_replay_guard (verl_stable.compat.catalogue)
    EngineRegistry.new = classmethod(new)
    return ["EngineRegistry.new: replay guard"]


def _guard_replay_engine() -> None:
    """Install :func:`_install_replay_guard` now, or when verl imports its engine registry; never raises."""
    try:
        # "log": a guard that cannot be installed must not fail the import of verl's engines for runs without replay
        when_imported(ENGINE_REGISTRY_MODULE, _install_replay_guard, deferred_errors="log")
    except Exception as exc:  # noqa: BLE001 - the plugin never raises (verl would swallow it)
        logger.warning("verl-stable: cannot guard the FSDP engine against running without router replay: %s", exc)


register_all()
