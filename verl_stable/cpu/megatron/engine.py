"""verl's Megatron engines on device ``"cpu"``: subclasses that run every engine call inside the Megatron CPU runtime.

verl 0.9.1 registers ``MegatronEngineWithLMHead`` / ``MegatronEngineWithValueHead`` for ``cuda`` and ``npu``. On the
CPU platform :mod:`verl_stable.cpu.engines` registers the two classes built here instead, for ``("megatron",
"cpu")``: verl's classes, unchanged, whose construction first installs the runtime (:mod:`.runtime`: the fixes for
megatron-core 0.16.1 on a CPU build of torch) and mbridge's local-spec bridges (:mod:`.bridge`: no Transformer
Engine, the packed attention of :mod:`.attention`), and each of whose calls runs with the runtime's device mode on the
calling thread.

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

_CLASSES: dict[str, type] = {}


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
    """Every method verl defines on ``base`` and its bases (public and private, not dunders), wrapped."""
    methods = {}
    for name, member in inspect.getmembers(base, predicate=inspect.isfunction):
        if name.startswith("__") or not member.__module__.startswith("verl."):
            continue
        if not inspect.isfunction(inspect.getattr_static(base, name)):  # static / class methods keep their binding
            continue
        methods[name] = under_cpu_runtime(member)
    return methods


def cpu_engine_class(model_type: str) -> type:
    """The CPU subclass of verl's Megatron engine for ``model_type`` (built once, on first use).

    Raises:
        KeyError: an unknown model type.
    """
    if model_type not in _CLASSES:
        import importlib

        base = getattr(importlib.import_module(ENGINE_MODULE), BASES[model_type])

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807 - the class's constructor
            install_runtime()
            with _device_mode():
                base.__init__(self, *args, **kwargs)

        attrs = {
            **_wrapped_methods(base),
            "__init__": __init__,
            "__module__": __name__,
            "__qualname__": CPU_PREFIX + base.__name__,
            "__doc__": f"verl's ``{base.__name__}`` under the Megatron CPU runtime (device ``cpu``).",
        }
        _CLASSES[model_type] = type(CPU_PREFIX + base.__name__, (base,), attrs)
    return _CLASSES[model_type]


def __getattr__(name: str) -> type:
    # importable (and picklable) by name: verl_stable.cpu.megatron.engine.CpuMegatronEngineWithLMHead
    for model_type, base_name in BASES.items():
        if name == CPU_PREFIX + base_name:
            return cpu_engine_class(model_type)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
