"""verl's training engines on device ``"cpu"``: registration, and host memory that is never pinned.

verl 0.9.1 registers ``FSDPEngineWithLMHead`` / ``FSDPEngineWithValueHead`` for ``cuda`` and ``npu`` only; torch FSDP2
(``fully_shard``) works on CPU with gloo, so the same classes serve the CPU platform. Its Megatron engines
(``MegatronEngineWithLMHead`` / ``MegatronEngineWithValueHead``) are registered for ``cpu`` too where megatron-core is
installed: they run on CPU inside the Megatron CPU runtime (:mod:`verl_stable.cpu.megatron`), which the CPU runtime
installs in the same processes. Registration goes through the
public ``EngineRegistry.register`` decorator, which refuses duplicate keys, so an existing ``cpu`` entry (ours from an
earlier call, or someone else's engine) is left alone.

Forward-only engines (verl's reference policy, built when ``actor.use_kl_loss=True`` or ``use_kl_in_reward=True``)
and ``fsdp_config.offload_policy=True`` make verl's FSDP2 build use ``CPUOffloadPolicy(pin_memory=True)``. Pinning
page-locks host memory for fast copies to an accelerator; without CUDA torch refuses it ("Cannot access accelerator
device when none is available"). On the CPU platform the "device" *is* host memory, so the same policy without
pinning is exact: :func:`unpinned_offload_policy` makes the name verl's engine module constructs the policy from
build ``HostOffloadPolicy`` (:func:`host_offload_policy`: a ``CPUOffloadPolicy`` whose ``pin_memory`` is always
False). It is installed, restorably, only in processes that selected the CPU platform, and applies to whichever engine
class (verl's, or the project's replay subclass) ends up building the module.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from verl_stable.compat import contracts, skip_imports
from verl_stable.compat.contracts import Contract, ContractError, ContractResult
from verl_stable.cpu.platform import cpu_selected

DEVICE = "cpu"
BACKENDS = ("fsdp", "fsdp2")
# model_type -> class name in verl.workers.engine.fsdp.transformer_impl
ENGINES = {"language_model": "FSDPEngineWithLMHead", "value_model": "FSDPEngineWithValueHead"}
MEGATRON_BACKEND = "megatron"
# model_type -> class name in verl.workers.engine.megatron.transformer_impl
MEGATRON_ENGINES = {"language_model": "MegatronEngineWithLMHead", "value_model": "MegatronEngineWithValueHead"}
MEGATRON_ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"
# The module whose global ``CPUOffloadPolicy`` verl's FSDP2 build calls (contract fsdp2_offload_policy below).
OFFLOAD_POLICY_MODULE = "verl.workers.engine.fsdp.transformer_impl"

_INSTALLED = contextlib.ExitStack()


_CLASSES: dict[str, type] = {}


def host_offload_policy() -> type:
    """:class:`HostOffloadPolicy`, created on first use (importing ``torch.distributed.fsdp`` costs ~1 s, and this
    module is imported in every process verl starts)."""
    if "policy" not in _CLASSES:
        from torch.distributed.fsdp import CPUOffloadPolicy

        @dataclass
        class HostOffloadPolicy(CPUOffloadPolicy):
            """FSDP2 ``CPUOffloadPolicy`` that never pins memory (there is no accelerator to copy to).

            Accepts the same arguments; a requested ``pin_memory=True`` is dropped, since the parameters' compute
            device is the host itself.
            """

            def __post_init__(self) -> None:
                self.pin_memory = False

        HostOffloadPolicy.__module__ = __name__
        _CLASSES["policy"] = HostOffloadPolicy
    return _CLASSES["policy"]


def __getattr__(name: str) -> Any:
    if name == "HostOffloadPolicy":
        return host_offload_policy()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@contextlib.contextmanager
def unpinned_offload_policy() -> Iterator[type]:
    """Within the block, verl's FSDP engine module builds ``HostOffloadPolicy`` where it asks for
    ``CPUOffloadPolicy``; the module's original name is restored on exit. Yields the policy class in use.

    Raises:
        verl_stable.compat.contracts.ContractError: verl's engine module no longer has that module-level name.
    """
    module = importlib.import_module(OFFLOAD_POLICY_MODULE)
    original = getattr(module, "CPUOffloadPolicy", None)
    if original is None:
        raise ContractError(f"{OFFLOAD_POLICY_MODULE}.CPUOffloadPolicy missing (fsdp2_offload_policy contract)")
    policy = host_offload_policy()
    # patch: host_offload_policy (verl_stable.compat.catalogue)
    module.CPUOffloadPolicy = policy
    try:
        yield policy
    finally:
        module.CPUOffloadPolicy = original


def uninstall() -> None:
    """Undo the process-level patch :func:`register` installed (registry entries stay)."""
    _INSTALLED.close()


def register(force: bool = False) -> list[str]:
    """Register the FSDP engines for device cpu and unpinned FSDP2 offload (idempotent).

    Only done in processes that selected the CPU platform (importing the engine module is slow and useless
    elsewhere), unless ``force``.
    """
    if not (force or cpu_selected()):
        return []
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl

    done = []
    for model_type, class_name in ENGINES.items():
        engine_cls = getattr(transformer_impl, class_name)
        table = EngineRegistry._engines.get(model_type, {})
        missing = [b for b in BACKENDS if DEVICE not in table.get(b, {})]
        if missing:
            EngineRegistry.register(model_type=model_type, backend=missing, device=DEVICE)(engine_cls)
        done += [f"engine:{model_type}/{b}/{DEVICE}" for b in BACKENDS]
    if transformer_impl.CPUOffloadPolicy is not host_offload_policy():
        _INSTALLED.enter_context(unpinned_offload_policy())
    done.append("fsdp2_offload:unpinned")
    done += register_megatron()
    return done


def megatron_installed() -> bool:
    """Whether megatron-core is importable here (verl's Megatron engines import it at module level); False where
    ``VERL_STABLE_SKIP_IMPORTS`` keeps it out of the process (:mod:`verl_stable.compat.skip_imports`)."""
    if skip_imports.is_skipped("megatron"):
        return False
    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


def register_megatron() -> list[str]:
    """Register verl's Megatron engines for device cpu (nothing where megatron-core is not installed).

    The classes registered are verl's, run under the Megatron CPU runtime
    (:func:`verl_stable.cpu.megatron.engine.cpu_engine_class`), which they install when first built; the plugin's
    Megatron step puts verl's engine with the replay metrics, under the same runtime, ahead of them for the
    ``("cpu", "cpu")`` key. An entry registered by someone else for ``("megatron", "cpu")`` is left alone, as for FSDP.
    """
    if not megatron_installed():
        return []
    from verl.workers.engine.base import EngineRegistry

    from verl_stable.cpu.megatron.engine import cpu_engine_class

    done = []
    for model_type in MEGATRON_ENGINES:
        table = EngineRegistry._engines.get(model_type, {})
        if DEVICE not in table.get(MEGATRON_BACKEND, {}):
            EngineRegistry.register(model_type=model_type, backend=MEGATRON_BACKEND, device=DEVICE)(
                cpu_engine_class(model_type)
            )
        done.append(f"engine:{model_type}/{MEGATRON_BACKEND}/{DEVICE}")
    return done


# ---------------------------------------------------------------------------------------------------------------------
# Contracts: the verl interfaces the CPU engines rely on, checked by name (``verl-stable doctor``).


def _engine_registry() -> str:
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl

    if not isinstance(getattr(EngineRegistry, "_engines", None), dict):
        raise ContractError("EngineRegistry._engines is no longer a dict")
    for name in ENGINES.values():
        if not hasattr(transformer_impl, name):
            raise ContractError(f"verl.workers.engine.fsdp.transformer_impl.{name} missing")
    if megatron_installed():
        megatron_impl = importlib.import_module(MEGATRON_ENGINE_MODULE)
        for name in MEGATRON_ENGINES.values():
            if not hasattr(megatron_impl, name):
                raise ContractError(f"{MEGATRON_ENGINE_MODULE}.{name} missing")
        return "FSDP and Megatron engines registrable for device cpu"
    return "FSDP engines registrable for device cpu (megatron-core not installed)"


def _fsdp2_offload_policy() -> str:
    from verl.workers.engine.fsdp import transformer_impl

    HostOffloadPolicy = host_offload_policy()  # noqa: N806 - a class
    policy = getattr(transformer_impl, "CPUOffloadPolicy", None)
    if policy is None:
        raise ContractError("verl.workers.engine.fsdp.transformer_impl no longer imports CPUOffloadPolicy by name")
    src = inspect.getsource(transformer_impl.FSDPEngine._build_fsdp_module)
    if "CPUOffloadPolicy(" not in src:
        raise ContractError("FSDPEngine._build_fsdp_module no longer builds CPUOffloadPolicy(...) from the module name")
    if policy is not HostOffloadPolicy and not issubclass(HostOffloadPolicy, policy):
        raise ContractError(f"transformer_impl.CPUOffloadPolicy is {policy!r}, not torch's FSDP2 CPUOffloadPolicy")
    return "forward-only / offload_policy FSDP2 engines build transformer_impl.CPUOffloadPolicy (made unpinned)"


CONTRACTS: tuple[Contract, ...] = (
    Contract("engine_registry", "EngineRegistry + FSDP engine classes", _engine_registry),
    Contract(
        "fsdp2_offload_policy", "FSDP2 engines build CPUOffloadPolicy from their module's name", _fsdp2_offload_policy
    ),
)


def check_contracts(names: tuple[str, ...] | list[str] | None = None) -> list[ContractResult]:
    """Run the engines' contracts (all by default); never raises."""
    return contracts.check(CONTRACTS, names)
