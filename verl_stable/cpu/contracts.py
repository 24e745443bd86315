"""Every verl-internal interface the CPU runtime relies on, as named, runnable checks.

verl 0.9.1 exposes public hooks (entry points, ``PlatformRegistry``, ``EngineRegistry``, ``RolloutReplicaRegistry``),
but a working CPU rollout also relies on private or implicit contracts. Each is a :class:`Contract` here; a
different verl version that breaks one makes :func:`check_contracts` report it by name (``verl-stable doctor``) and
:func:`require` raise :class:`ContractError` naming it (registration).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass

SUPPORTED_VERL = "0.9.1"


class ContractError(RuntimeError):
    """A verl interface the CPU runtime relies on is missing or changed."""


@dataclass(frozen=True)
class ContractResult:
    """Outcome of one contract check."""

    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class Contract:
    name: str
    description: str
    check: Callable[[], str]  # returns a detail string, raises on violation


def _verl_version() -> str:
    import verl

    if verl.__version__ != SUPPORTED_VERL:
        raise ContractError(f"verl {verl.__version__} installed, the CPU runtime is pinned to verl=={SUPPORTED_VERL}")
    return f"verl {verl.__version__}"


def _platform_registry() -> str:
    from verl.plugin.platform import PlatformRegistry, get_platform, platform_manager

    from verl_stable.cpu.platform import platform_class

    for attr in ("register", "get", "registered_names"):
        if not hasattr(PlatformRegistry, attr):
            raise ContractError(f"PlatformRegistry.{attr} missing")
    if "VERL_PLATFORM" not in inspect.getsource(platform_manager._detect_platform_name):
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
    import pathlib

    import verl

    from verl_stable.cpu.platform import CPU_DEVICE_MODULE

    root = pathlib.Path(verl.__file__).parent
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

    from verl_stable.cpu.platform import normalize_backend

    src = inspect.getsource(distributed.initialize_global_process_group_ray)
    if 'f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"' not in src:
        raise ContractError("verl's process-group backend string changed (expected 'cpu:gloo,{device}:{backend}')")
    if normalize_backend("cpu:gloo,cpu:gloo") != "gloo":
        raise ContractError("backend normalisation broken")
    return "'cpu:gloo,cpu:gloo' -> 'gloo'"


def _engine_registry() -> str:
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl

    if not isinstance(getattr(EngineRegistry, "_engines", None), dict):
        raise ContractError("EngineRegistry._engines is no longer a dict")
    for name in ("FSDPEngineWithLMHead", "FSDPEngineWithValueHead"):
        if not hasattr(transformer_impl, name):
            raise ContractError(f"verl.workers.engine.fsdp.transformer_impl.{name} missing")
    return "FSDP engines registrable for device cpu"


def _replica_registry() -> str:
    from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry

    if not callable(getattr(RolloutReplicaRegistry, "register", None)):
        raise ContractError("RolloutReplicaRegistry.register missing")
    init_src = inspect.getsource(RolloutReplica.__init__)
    for attr in ("self.servers", "self._server_handle", "self._server_address", "self.config", "self.model_config"):
        if attr not in init_src:
            raise ContractError(f"RolloutReplica no longer sets {attr}")
    if "launch_servers" not in getattr(RolloutReplica, "__abstractmethods__", ()):
        raise ContractError("RolloutReplica.launch_servers is no longer the abstract launch hook")
    return "RolloutReplica(servers, _server_handle, _server_address, launch_servers)"


def _rollout_registry() -> str:
    from verl.workers.rollout import base

    table = getattr(base, "_ROLLOUT_REGISTRY", None)
    if not isinstance(table, dict) or ("vllm", "async") not in table:
        raise ContractError("verl.workers.rollout.base._ROLLOUT_REGISTRY[(name, 'async')] table missing")
    if "_ROLLOUT_REGISTRY" not in inspect.getsource(base.get_rollout_class):
        raise ContractError("get_rollout_class no longer reads _ROLLOUT_REGISTRY")
    abstract = set(getattr(base.BaseRollout, "__abstractmethods__", ()))
    if abstract != {"resume", "update_weights", "release"}:
        raise ContractError(f"BaseRollout abstract methods changed: {sorted(abstract)}")
    return "_ROLLOUT_REGISTRY maps (name, 'async') -> adapter FQN"


def server_methods_called() -> set[str]:
    """Methods verl's replica / server manager call on a server actor (read from verl's source)."""
    from verl.workers.rollout import llm_server, replica

    called: set[str] = set()
    for src in (inspect.getsource(replica.RolloutReplica), inspect.getsource(llm_server)):
        called.update(re.findall(r"server\w*\.(\w+)\.remote\(", src))
    return called


def _server_methods() -> str:
    from verl_stable.cpu.hf_rollout import HFRolloutServer

    called = server_methods_called()
    missing = sorted(m for m in called if not hasattr(HFRolloutServer, m))
    if missing:
        raise ContractError(f"verl calls server methods the hf server lacks: {missing}")
    if "generate" not in called:
        raise ContractError("verl no longer calls server.generate (token-in/token-out contract changed)")
    return f"{len(called)} server methods: {sorted(called)}"


def _token_output() -> str:
    from verl.workers.rollout import llm_server
    from verl.workers.rollout.replica import TokenOutput

    fields = set(TokenOutput.model_fields)
    need = {"token_ids", "log_probs", "routed_experts", "stop_reason", "num_preempted", "extra_fields"}
    if not need <= fields:
        raise ContractError(f"TokenOutput lacks fields {sorted(need - fields)}")
    if 'extra_fields.get("global_steps")' not in inspect.getsource(llm_server):
        raise ContractError('llm_server no longer reads TokenOutput.extra_fields["global_steps"]')
    return "TokenOutput fields + extra_fields['global_steps']"


def _weight_sync() -> str:
    import torch
    from verl.workers import engine_workers
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    from verl_stable.cpu.hf_rollout import _EXPERT_RE

    src = inspect.getsource(engine_workers.ActorRolloutRefWorker.update_weights)
    for token in ("self.rollout.update_weights(", "peft_config=", "global_steps="):
        if token not in src:
            raise ContractError(f"worker weight sync no longer calls rollout.update_weights with {token!r}")
    fused = {
        "model.layers.0.mlp.experts.gate_up_proj": torch.zeros(2, 6, 4),
        "model.layers.0.mlp.experts.down_proj": torch.zeros(2, 4, 3),
    }
    names = [n for n, _ in unfuse_moe_params(fused.items(), "qwen3_moe")]
    if len(names) != 6 or not all(_EXPERT_RE.match(n) for n in names):
        raise ContractError(f"verl's MoE weight names changed: {names}")
    return "unfused expert names model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight"


def _replay_buffer_poll() -> str:
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    if "poll_interval" not in inspect.signature(ReplayBuffer.__init__).parameters:
        raise ContractError("ReplayBuffer.__init__ has no poll_interval argument")
    if "self.poll_interval" not in inspect.getsource(ReplayBuffer._wait_for_next_poll):
        raise ContractError("ReplayBuffer._wait_for_next_poll no longer sleeps self.poll_interval")
    return "ReplayBuffer(poll_interval=...)"


def _fsdp2_offload_policy() -> str:
    from verl.workers.engine.fsdp import transformer_impl

    from verl_stable.cpu.engines import host_offload_policy

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
    Contract("verl_version", f"verl == {SUPPORTED_VERL}", _verl_version),
    Contract("platform_registry", "PlatformRegistry + VERL_PLATFORM selection + PlatformBase ABC", _platform_registry),
    Contract("device_id_string", "get_device_id() returns platform.current_device() ('cpu')", _device_id_string),
    Contract(
        "device_module_calls", "every get_torch_device().X verl calls exists on the CPU module", _device_module_calls
    ),
    Contract("backend_string", "process-group backend 'cpu:gloo,{device}:{backend}' normalised", _backend_string),
    Contract("engine_registry", "EngineRegistry + FSDP engine classes", _engine_registry),
    Contract("replica_registry", "RolloutReplicaRegistry + RolloutReplica private attributes", _replica_registry),
    Contract("rollout_registry", "_ROLLOUT_REGISTRY + BaseRollout abstract methods", _rollout_registry),
    Contract("server_methods", "the implicit server method list", _server_methods),
    Contract("token_output", "TokenOutput fields and extra_fields['global_steps']", _token_output),
    Contract("weight_sync", "rollout.update_weights keywords and vLLM-style MoE weight names", _weight_sync),
    Contract("replay_buffer_poll", "ReplayBuffer poll_interval", _replay_buffer_poll),
    Contract(
        "fsdp2_offload_policy", "FSDP2 engines build CPUOffloadPolicy from their module's name", _fsdp2_offload_policy
    ),
)


def check_contracts(names: tuple[str, ...] | list[str] | None = None) -> list[ContractResult]:
    """Run the named contracts (all by default); never raises."""
    results = []
    for contract in CONTRACTS:
        if names is not None and contract.name not in names:
            continue
        try:
            results.append(ContractResult(contract.name, True, contract.check()))
        except Exception as exc:  # noqa: BLE001 - report every failure by name
            results.append(ContractResult(contract.name, False, f"{contract.description}: {type(exc).__name__}: {exc}"))
    return results


def require(*names: str) -> None:
    """Raise :class:`ContractError` naming every failed contract among ``names``."""
    unknown = set(names) - {c.name for c in CONTRACTS}
    if unknown:
        raise ValueError(f"unknown contracts {sorted(unknown)}")
    failed = [r for r in check_contracts(list(names)) if not r.ok]
    if failed:
        raise ContractError("verl contract broken: " + "; ".join(f"[{r.name}] {r.detail}" for r in failed))
