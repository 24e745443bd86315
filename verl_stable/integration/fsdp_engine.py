"""The replay-capable FSDP engine and its registration in verl: the ``fsdp_router_replay`` plugin step.

``actor_rollout_ref.actor.fsdp_config.router_replay.mode`` (verl's ``EngineRouterReplayConfig``: ``disabled``, ``R2``
or ``R3``) is served by ``FSDPEngineWithLMHeadReplay`` = :class:`~verl_stable.integration.fsdp_replay.RouterReplayMixin`
+ verl's ``FSDPEngineWithLMHead``. This module owns building that class (lazily, :func:`engine_class`; it is also
importable as ``verl_stable.integration.fsdp_engine.FSDPEngineWithLMHeadReplay``, the name it pickles under) and
selecting it in verl's engine registry for every FSDP backend and (device, vendor) key (:func:`register_engine`),
right after verl imports its engine package (:func:`register`, through
:func:`~verl_stable.compat.import_hooks.when_imported`), unless the installed verl replays routing itself.

What replay does, its metrics and how rows are aligned: :mod:`verl_stable.integration.fsdp_replay` (the engine
mixin) and :mod:`verl_stable.routing.replay_pass` (one pass's decision and routing sessions). Their public names
are re-exported here, where they lived before the split.
"""

from __future__ import annotations

import logging
from typing import Any

from verl_stable.compat.import_hooks import pending_hooks, when_imported
from verl_stable.integration import fsdp_replay
from verl_stable.integration.engine_keys import hold_engine_key
from verl_stable.integration.fsdp_replay import RouterReplayMixin
from verl_stable.routing.replay_pass import (
    METRIC_PREFIX,
    MODES,
    ROUTED_EXPERTS,
    ReplayAction,
    RouterReplayError,
    r2_drift_per_layer,
    replay_action,
)

__all__ = [
    # the replay itself, importable from here as before the split
    "METRIC_PREFIX",
    "MODES",
    "ROUTED_EXPERTS",
    "ReplayAction",
    "RouterReplayError",
    "RouterReplayMixin",
    "r2_drift_per_layer",
    "replay_action",
    # the engine class and its registration (FSDPEngineWithLMHeadReplay is a module attribute, built on access)
    "BACKENDS",
    "ENGINE_PACKAGE",
    "MODEL_TYPE",
    "NATIVE_REPLAY_MODULE",
    "VENDOR_KEYS",
    "engine_class",
    "register",
    "register_engine",
    "verl_has_native_replay",
]

logger = logging.getLogger("verl_stable")

_ENGINE_CLASS: type | None = None  # built once, on first use


def engine_class() -> type:
    """``FSDPEngineWithLMHeadReplay = (RouterReplayMixin, verl's FSDPEngineWithLMHead)``, built on first use.

    Built lazily so that importing this module (which verl's plugin loader does in every process) does not import
    verl's engine package; ``from verl_stable.integration.fsdp_engine import FSDPEngineWithLMHeadReplay`` works too.
    """
    global _ENGINE_CLASS
    if _ENGINE_CLASS is None:
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

        _ENGINE_CLASS = type(
            "FSDPEngineWithLMHeadReplay",
            (RouterReplayMixin, FSDPEngineWithLMHead),
            {"__module__": __name__, "__qualname__": "FSDPEngineWithLMHeadReplay", "__doc__": fsdp_replay.__doc__},
        )
    return _ENGINE_CLASS


def __getattr__(name: str) -> Any:
    if name == "FSDPEngineWithLMHeadReplay":
        return engine_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# (device, vendor) keys: verl's ``get_engine_cls`` looks these up before the device-only keys where verl registers
# its own FSDP engine, so ours is selected without replacing (or colliding with) verl's registration.
VENDOR_KEYS: tuple[tuple[str, str], ...] = (("cuda", "nvidia"), ("cuda", "amd"), ("cpu", "cpu"))
BACKENDS: tuple[str, ...] = ("fsdp", "fsdp2")
MODEL_TYPE = "language_model"
# Imported by verl only in processes that build engines; importing it from the plugin in every process (driver,
# rollout servers, agent loops) would cost seconds each.
ENGINE_PACKAGE = "verl.workers.engine"


def register_engine() -> list[str]:
    """Register ``FSDPEngineWithLMHeadReplay`` for every backend and (device, vendor) key (idempotent).

    Raises:
        RuntimeError: another engine class already holds one of the keys.
    """
    cls = engine_class()
    purpose = "router replay for the FSDP engine"
    return [hold_engine_key(MODEL_TYPE, backend, key, cls, purpose) for backend in BACKENDS for key in VENDOR_KEYS]


# The module an upstream verl with its own FSDP router replay ships (patches/verl-0.9.1-fsdp-router-replay.diff).
NATIVE_REPLAY_MODULE = "verl.utils.fsdp_router_replay"


def verl_has_native_replay() -> bool:
    """Whether the installed verl replays MoE routing in its FSDP engine itself (it ships ``NATIVE_REPLAY_MODULE``).

    ``find_spec`` locates the module without importing it; only its parent package ``verl.utils`` is imported.
    """
    from importlib.util import find_spec  # local: only this check needs it

    try:
        return find_spec(NATIVE_REPLAY_MODULE) is not None
    except ModuleNotFoundError:  # no verl.utils at all: not a verl we can step aside for
        return False


def register() -> list[str]:
    """Plugin step: select the replay-capable FSDP engine for cuda (nvidia, amd) and cpu.

    Registers at once when verl's engine package is already imported, else right after it is (importing it here
    would cost seconds in every process verl starts); a failure of the deferred registration fails that import, as
    a registry conflict must not leave router replay silently off. Returns what is (or will be) registered.

    Steps aside when verl already replays routing in its own FSDP engine (it has ``NATIVE_REPLAY_MODULE``):
    our subclass on top of verl's replaying engine would record / replay every routing site twice. verl's own
    engine then serves ``router_replay.mode`` unchanged, and the returned entry says the step was skipped.
    """
    if verl_has_native_replay():
        for hook in pending_hooks(ENGINE_PACKAGE):
            if hook.callback is register_engine:
                hook.uninstall()
        return [f"skipped: verl has native FSDP router replay ({NATIVE_REPLAY_MODULE})"]
    hook = when_imported(ENGINE_PACKAGE, register_engine)
    if hook.fired:
        return hook.result
    keys = [f"{k[0]}:{k[1]}" for k in VENDOR_KEYS]
    return [f"engine:{MODEL_TYPE}/{'|'.join(BACKENDS)}/{'|'.join(keys)} (on import of {ENGINE_PACKAGE})"]
