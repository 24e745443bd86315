"""A CPU platform for verl's ``PlatformRegistry``, chosen only when the user asks for it.

verl resolves its platform once per process (``verl.plugin.platform.get_platform``) from ``VERL_PLATFORM``, else by
probing registered platforms, else "nvidia". This module registers :class:`PlatformCPU` under the name ``"cpu"``;
it is never picked by auto-detection (``is_platform_available`` is False unless requested), so a GPU machine keeps
its accelerator. A run asks for CPU with ``VERL_PLATFORM=cpu`` or with the hydra override ``trainer.device=cpu`` on
the driver's command line: :func:`register` then exports ``VERL_PLATFORM=cpu`` before Ray starts, so every process
of a Ray instance the driver starts itself (task runner, workers, rollout servers) inherits the choice.

A cluster started beforehand (``ray start`` on each node, the driver joining with ``ray_kwargs.ray_init.address``)
inherits nothing from the driver: its workers take their environment from the ``ray start`` that started their node,
so they would select verl's default platform (NVIDIA: NCCL, CUDA). The choice therefore also travels in the Ray job's
``runtime_env``: verl passes ``ray_kwargs.ray_init.runtime_env`` to ``ray.init`` and Ray sets its ``env_vars`` in
every process of the job on every node. The CPU launcher's overrides carry ``VERL_PLATFORM=cpu`` there
(:data:`verl_stable.toy.launch.RUNTIME_OVERRIDES`) and its subprocess forwards the other variables it sets
(:func:`verl_stable.toy.trainer_process.job_env`).

Two things verl assumes of an accelerator are answered here:

* ``current_device()`` returns the string ``"cpu"``: verl calls ``module.to(get_device_id())`` in many places and an
  integer id means "accelerator device 0".
* verl builds the process-group backend string ``f"cpu:gloo,{device}:{backend}"``, i.e. ``"cpu:gloo,cpu:gloo"`` here,
  which torch rejects as a duplicate device. :func:`gloo_backend_fix` normalises duplicate ``device:backend`` pairs
  in ``torch.distributed.init_process_group``; it is installed (restorably) only in processes that selected CPU.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from verl_stable import SUPPORTED_VERL_VERSION
from verl_stable.compat import contracts
from verl_stable.compat.contracts import Contract, ContractError, ContractResult

PLATFORM_NAME = "cpu"
ENV_PLATFORM = "VERL_PLATFORM"
_DEVICE_OVERRIDES = ("trainer.device=cpu", "+trainer.device=cpu", "++trainer.device=cpu")


def cpu_requested(environ: dict[str, str] | os._Environ | None = None, argv: Sequence[str] | None = None) -> bool:
    """Whether this process was asked to run verl on CPU.

    ``VERL_PLATFORM`` wins when set (any other value means "not CPU"); otherwise the hydra override
    ``trainer.device=cpu`` among the command-line arguments counts as a request.
    """
    environ = os.environ if environ is None else environ
    argv = sys.argv if argv is None else argv
    chosen = environ.get(ENV_PLATFORM, "").strip().lower()
    if chosen:
        return chosen == PLATFORM_NAME
    return any(arg.strip() in _DEVICE_OVERRIDES for arg in list(argv)[1:])


def cpu_selected(environ: dict[str, str] | os._Environ | None = None) -> bool:
    """Whether ``VERL_PLATFORM`` names this platform (what verl's own detection reads)."""
    environ = os.environ if environ is None else environ
    return environ.get(ENV_PLATFORM, "").strip().lower() == PLATFORM_NAME


def _process_memory_bytes() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001 - psutil is optional; memory logging is informational
        return 0


def _host_memory() -> tuple[int, int]:
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
    except Exception:  # noqa: BLE001
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return pages * size, pages * size


class CpuDeviceModule(types.ModuleType):
    """Answers the ``torch.cuda``-style calls verl makes on ``get_torch_device()`` for the host CPU.

    Memory queries report the process RSS / host memory, cache and peak-statistics calls are no-ops, RNG state is
    torch's CPU generator. Anything else is looked up on ``torch.cpu``; a name neither defines raises an
    ``AttributeError`` that names the missing call, so a new verl call site fails loudly instead of silently.
    """

    def __init__(self) -> None:
        super().__init__("verl_stable_cpu_device")

    # -- device ------------------------------------------------------------------------------------------
    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_capability(device: Any = None) -> tuple[None, None]:
        return (None, None)

    @staticmethod
    def get_device_properties(device: Any = None) -> types.SimpleNamespace:
        _, total = _host_memory()
        return types.SimpleNamespace(name="cpu", total_memory=total, major=None, minor=None, multi_processor_count=0)

    # -- memory ------------------------------------------------------------------------------------------
    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return _process_memory_bytes()

    memory_reserved = memory_allocated
    max_memory_allocated = memory_allocated
    max_memory_reserved = memory_allocated

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        return _host_memory()

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        return {}

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def ipc_collect() -> None:
        return None

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
        return None

    # -- random numbers ----------------------------------------------------------------------------------
    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        raise AttributeError(
            f"verl-stable CPU platform: verl called get_torch_device().{name}, which the CPU device module does not "
            "provide; add it to verl_stable.cpu.platform.CpuDeviceModule"
        )


CPU_DEVICE_MODULE = CpuDeviceModule()


def normalize_backend(backend: str | None) -> str | None:
    """Collapse a torch backend spec whose ``device:backend`` pairs repeat a device.

    ``"cpu:gloo,cpu:gloo"`` -> ``"gloo"`` (torch refuses duplicate device types). A device mapped to two *different*
    backends is a real conflict and raises ``ValueError``. Anything else is returned unchanged.
    """
    if not backend or "," not in backend:
        return backend
    pairs: dict[str, str] = {}
    for part in backend.split(","):
        device, sep, name = part.strip().partition(":")
        if not sep:
            return backend
        if device in pairs and pairs[device] != name:
            raise ValueError(f"process-group backend {backend!r} maps device {device!r} to two backends")
        pairs[device] = name
    if len(pairs) == 1:
        return next(iter(pairs.values()))
    return ",".join(f"{d}:{b}" for d, b in pairs.items())


@contextlib.contextmanager
def gloo_backend_fix() -> Iterator[None]:
    """Within the block, ``torch.distributed.init_process_group`` normalises its backend with :func:`normalize_backend`."""
    original: Callable[..., Any] = torch.distributed.init_process_group

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if "backend" in kwargs:
            kwargs["backend"] = normalize_backend(kwargs["backend"])
        elif args:
            args = (normalize_backend(args[0]), *args[1:])
        return original(*args, **kwargs)

    init_process_group.__verl_stable_wrapped__ = original  # type: ignore[attr-defined]
    # patch: gloo_process_group (verl_stable.compat.catalogue)
    torch.distributed.init_process_group = init_process_group
    try:
        yield
    finally:
        torch.distributed.init_process_group = original


# The process-lifetime installation made by register(): an ExitStack so it can be undone (tests, doctor).
_INSTALLED = contextlib.ExitStack()


def uninstall() -> None:
    """Undo the process-level patches :func:`register` installed (the registry entry stays)."""
    _INSTALLED.close()


def _platform_class() -> type:
    from verl.plugin.platform import PlatformBase

    class PlatformCPU(PlatformBase):
        """verl platform for the host CPU (gloo collectives, fake Ray "GPU" resources for placement)."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> types.ModuleType:
            return CPU_DEVICE_MODULE

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            # Auto-detection must never land on CPU: only an explicit request selects it.
            return cpu_selected()

        def current_device(self) -> str:  # type: ignore[override]
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return (None, None)

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            # Ray sets it for actors holding (fake) GPU resources; torch-cpu ignores it.
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str) -> Iterator[None]:
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            # Placement uses a fake Ray "GPU" resource (ray_init.num_gpus): verl's pools count GPUs.
            return "GPU"

        def ray_noset_envvars(self) -> list[str]:
            return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> None:
            return None

    PlatformCPU.__qualname__ = "PlatformCPU"
    PlatformCPU.__module__ = __name__
    return PlatformCPU


_REGISTERED: dict[str, type] = {}


def platform_class() -> type:
    """The registered ``PlatformBase`` subclass (created on first use)."""
    if "cls" not in _REGISTERED:
        _REGISTERED["cls"] = _platform_class()
    return _REGISTERED["cls"]


def register() -> list[str]:
    """Register the CPU platform; select it (export ``VERL_PLATFORM=cpu``) only when this process asked for CPU.

    Idempotent. Returns what was registered / installed in this process.
    """
    from verl.plugin.platform import PlatformRegistry

    done: list[str] = []
    cls = platform_class()
    if PlatformRegistry.get(PLATFORM_NAME) is not cls:
        PlatformRegistry.register(platform=PLATFORM_NAME)(cls)
    done.append("platform:cpu")
    if cpu_requested() and not cpu_selected():
        # Exported before ray.init so every process Ray spawns inherits the choice.
        os.environ[ENV_PLATFORM] = PLATFORM_NAME
    if cpu_selected():
        if not hasattr(torch.distributed.init_process_group, "__verl_stable_wrapped__"):
            _INSTALLED.enter_context(gloo_backend_fix())
        done.append("selected:cpu(gloo)")
    return done


# ---------------------------------------------------------------------------------------------------------------------
# Contracts: the verl version the CPU runtime is written against, and the verl interfaces the platform relies on,
# checked by name (``verl-stable doctor``).
SUPPORTED_VERL = SUPPORTED_VERL_VERSION


def _verl_version() -> str:
    import verl

    if verl.__version__ != SUPPORTED_VERL:
        raise ContractError(f"verl {verl.__version__} installed, the CPU runtime is pinned to verl=={SUPPORTED_VERL}")
    return f"verl {verl.__version__}"


def _platform_registry() -> str:
    from verl.plugin.platform import PlatformRegistry, get_platform, platform_manager

    for attr in ("register", "get", "registered_names"):
        if not hasattr(PlatformRegistry, attr):
            raise ContractError(f"PlatformRegistry.{attr} missing")
    if ENV_PLATFORM not in inspect.getsource(platform_manager._detect_platform_name):
        raise ContractError("platform detection no longer reads VERL_PLATFORM")
    platform_class()()  # TypeError if PlatformBase grew abstract methods we do not implement
    return f"PlatformBase subclass instantiates; get_platform={get_platform.__name__}"


def _device_id_string() -> str:
    from verl.utils import device

    src = inspect.getsource(device.get_device_id)
    if "current_device()" not in src:
        raise ContractError("verl.utils.device.get_device_id no longer returns platform.current_device()")
    return "get_device_id() -> platform.current_device() == 'cpu'"


def _device_module_calls() -> str:
    import verl

    root = Path(verl.__file__).parent
    called: set[str] = set()
    pattern = re.compile(r"get_torch_device\(\)\.([A-Za-z_]+)")
    for path in root.rglob("*.py"):
        if "third_party" in path.parts:
            continue
        called.update(pattern.findall(path.read_text(errors="ignore")))
    missing = sorted(name for name in called if not hasattr(CPU_DEVICE_MODULE, name))
    if missing:
        raise ContractError(f"verl calls get_torch_device().{missing} which the CPU device module lacks")
    return f"{len(called)} torch.cuda-style calls answered"


def _backend_string() -> str:
    from verl.utils import distributed

    src = inspect.getsource(distributed.initialize_global_process_group_ray)
    if 'f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"' not in src:
        raise ContractError("verl's process-group backend string changed (expected 'cpu:gloo,{device}:{backend}')")
    if normalize_backend("cpu:gloo,cpu:gloo") != "gloo":
        raise ContractError("backend normalisation broken")
    return "'cpu:gloo,cpu:gloo' -> 'gloo'"


CONTRACTS: tuple[Contract, ...] = (
    Contract("verl_version", f"verl == {SUPPORTED_VERL}", _verl_version),
    Contract("platform_registry", "PlatformRegistry + VERL_PLATFORM selection + PlatformBase ABC", _platform_registry),
    Contract("device_id_string", "get_device_id() returns platform.current_device() ('cpu')", _device_id_string),
    Contract(
        "device_module_calls", "every get_torch_device().X verl calls exists on the CPU module", _device_module_calls
    ),
    Contract("backend_string", "process-group backend 'cpu:gloo,{device}:{backend}' normalised", _backend_string),
)


def check_contracts(names: tuple[str, ...] | list[str] | None = None) -> list[ContractResult]:
    """Run the platform's contracts (all by default); never raises."""
    return contracts.check(CONTRACTS, names)
