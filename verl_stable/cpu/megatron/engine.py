"""verl's Megatron engines on device ``"cpu"``: subclasses that run every engine call inside the Megatron CPU runtime.

verl 0.9.1 registers ``MegatronEngineWithLMHead`` / ``MegatronEngineWithValueHead`` for ``cuda`` and ``npu``. On the
CPU platform :mod:`verl_stable.cpu.engines` registers the two classes built here from verl's own, for ``("megatron",
"cpu")``; the plugin's Megatron step registers the one built on the engine the project uses on GPU too (verl's class
with the replay metrics of :mod:`verl_stable.integration.megatron_replay`) for the ``("cpu", "cpu")`` key, which
verl's registry looks up first. Either is verl's engine, whose construction first installs the runtime (:mod:`.runtime`: the fixes for megatron-core 0.16.1 on a CPU build of
torch) and mbridge's local-spec bridges (:mod:`.bridge`: no Transformer Engine, the packed attention of
:mod:`.attention`), and each of whose calls runs with the runtime's device mode on the calling thread.

Why per call: the device mode is a ``TorchFunctionMode``, which torch keeps per thread, and verl's workers may call an
engine from another thread than the one that built it (Ray runs an actor with ``async`` methods on its event loop's
thread). A call that finds the mode on its thread adds nothing; one that does not enters it for the call, and a
generator the call returns (the weight export verl's rollout sync iterates) is resumed under it as well.

Installing at construction, not at the CPU runtime's registration, keeps megatron-core and mbridge out of every
process that never builds a Megatron engine (the driver, rollout servers, FSDP workers).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Generator, Iterator
from typing import Any

from verl_stable.cpu.megatron import bridge, device, runtime

ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"
# model_type -> verl class name
BASES = {"language_model": "MegatronEngineWithLMHead", "value_model": "MegatronEngineWithValueHead"}
CPU_PREFIX = "Cpu"
# Methods defined in these modules are wrapped: verl's, and a verl-stable mixin's (whose methods call verl's through
# super(), which would otherwise reach verl's unwrapped functions outside the device mode).
WRAPPED_MODULES = ("verl.", "verl_stable.")

_CLASSES: dict[tuple[str, type | None], type] = {}  # (model_type, base given) -> CPU class


def _resumed_under_mode(generator: Generator[Any, Any, Any]) -> Iterator[Any]:
    """``generator``'s items, each produced with the device mode on the consuming thread."""
    while True:
        with _device_mode():
            try:
                item = next(generator)
            except StopIteration:
                return
        yield item


def _device_mode() -> Any:
    """The device mode on this thread for a block (nothing new when it is already on)."""
    if device.active_mode() is not None:
        return contextlib.nullcontext()
    return runtime.megatron_cpu_runtime()


def under_cpu_runtime(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` run with the Megatron CPU runtime's device mode on the calling thread."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _device_mode():
            result = method(*args, **kwargs)
        if inspect.isgenerator(result):
            return _resumed_under_mode(result)
        return result

    call.__verl_stable_cpu_runtime__ = True  # type: ignore[attr-defined]
    return call


def install_runtime() -> list[str]:
    """Install the Megatron CPU runtime and the local-spec bridges for the rest of the process (idempotent)."""
    return runtime.install() + bridge.install()


def _wrapped_methods(base: type) -> dict[str, Callable[..., Any]]:
    """Every method verl or the mixin defines on ``base`` and its bases (public and private, not dunders), wrapped."""
    methods = {}
    for name, member in inspect.getmembers(base, predicate=inspect.isfunction):
        if name.startswith("__") or not member.__module__.startswith(WRAPPED_MODULES):
            continue
        if not inspect.isfunction(inspect.getattr_static(base, name)):  # static / class methods keep their binding
            continue
        methods[name] = under_cpu_runtime(member)
    return methods


def cpu_engine_class(model_type: str, base: type | None = None) -> type:
    """The CPU subclass of a Megatron engine class for ``model_type`` (built once per base, on first use).

    Args:
        model_type: ``language_model`` or ``value_model``.
        base: the engine class to run on CPU; ``None``: verl's own class for ``model_type``. The plugin's Megatron
            step passes verl's engine with the replay metrics
            (:func:`verl_stable.integration.megatron_replay.engine_class`) and registers the result for the
            ``("cpu", "cpu")`` key, which verl looks up before the plain ``"cpu"`` key the CPU runtime registers.

    Raises:
        KeyError: an unknown model type.
    """
    key = (model_type, base)
    if key not in _CLASSES:
        if base is None:
            import importlib

            base = getattr(importlib.import_module(ENGINE_MODULE), BASES[model_type])
        name = CPU_PREFIX + base.__name__

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807 - the class's constructor
            install_runtime()
            with _device_mode():
                base.__init__(self, *args, **kwargs)

        attrs = {
            **_wrapped_methods(base),
            "__init__": __init__,
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"``{base.__name__}`` on device ``cpu``, under the Megatron CPU runtime.",
        }
        _CLASSES[key] = type(name, (base,), attrs)
    return _CLASSES[key]


def __getattr__(name: str) -> type:
    # the classes built in this process are importable (and picklable) by name, e.g. CpuMegatronEngineWithLMHead
    for cls in _CLASSES.values():
        if cls.__name__ == name:
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
