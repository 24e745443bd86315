"""Rollout backend ``hf``: a Hugging Face model served from a Ray actor, for verl's agent loop on CPU.

Three pieces, each where verl looks for it:

* :class:`HFReplica` -- ``RolloutReplicaRegistry.register("hf", ...)``; built in the task runner, it launches one
  :class:`~verl_stable.backends.hf.server.HFRolloutServer` Ray actor per replica, named ``hf_server_{replica_rank}_0`` like
  vLLM's servers, on the node of the replica's actor rank.
* :class:`~verl_stable.backends.hf.server.HFRolloutServer` -- the server actor (:mod:`verl_stable.backends.hf.server`).
* :class:`HFServerAdapter` -- the worker-side ``BaseRollout`` in ``_ROLLOUT_REGISTRY[("hf", "async")]``
  (:data:`ADAPTER_FQN`, imported by name in every worker). verl's weight sync hands it a generator of full tensors
  (every rank must drain it: gathering a DTensor is a collective); rollout rank 0 streams them in buckets to the
  server actor found by name, which writes them into its model (:mod:`verl_stable.backends.hf.weights`).

This module owns the two verl subclasses (built lazily: verl's base classes are imported only when asked for), the
registration (:func:`register`) and the verl interfaces the backend relies on (:data:`CONTRACTS`). Backend options
live in ``actor_rollout_ref.rollout.engine_kwargs.hf`` (:mod:`verl_stable.backends.hf.options`); the routing export is
:mod:`verl_stable.backends.hf.routing`. Their public names (``HFOptions``, ``resolve_options``, ``HFRolloutServer``,
``WeightLoader``, ``routing_exporter`` ...) stay importable from here.
"""

from __future__ import annotations

import inspect
import os
import re
from typing import Any

import torch

from verl_stable.backends.hf.options import BACKEND, HFOptions, resolve_options
from verl_stable.backends.hf.routing import RouterIdsRecorder, RoutingExporter, routed_experts_array, routing_exporter
from verl_stable.backends.hf.server import SERVER_NAME_PREFIX, HFRolloutServer, server_actor_name
from verl_stable.backends.hf.weights import EXPERT_NAME_RE, WeightLoader
from verl_stable.compat import contracts
from verl_stable.compat.contracts import Contract, ContractError, ContractResult

__all__ = [
    "ADAPTER_FQN",
    "BACKEND",
    "CONTRACTS",
    "SERVER_NAME_PREFIX",
    "HFOptions",
    "HFRolloutServer",
    "RouterIdsRecorder",
    "RoutingExporter",
    "WeightLoader",
    "check_contracts",
    "register",
    "replica_class",
    "resolve_options",
    "routed_experts_array",
    "routing_exporter",
    "server_actor_name",
    "server_methods_called",
]

ADAPTER_FQN = "verl_stable.backends.hf.rollout.HFServerAdapter"


# ---------------------------------------------------------------------------------------------------------------------
# Replica (task-runner side) and adapter (worker side): verl base classes, built lazily.


def _replica_class() -> type:
    import ray
    from verl.workers.rollout.replica import RolloutReplica

    class HFReplica(RolloutReplica):
        """One ``hf`` server actor per replica (CPU rollout; tensor parallel 1)."""

        async def launch_servers(self) -> None:
            if self.world_size != 1 or self.nnodes != 1:
                raise ValueError(
                    f"hf rollout backend serves one process per replica; got world_size={self.world_size} "
                    "(set actor_rollout_ref.rollout.tensor_model_parallel_size=1)"
                )
            name = server_actor_name(self.replica_rank) + self.name_suffix
            env_vars = {k: v for k, v in os.environ.items() if k.startswith(("VERL_", "OMP_NUM_THREADS"))}
            server_cls = ray.remote(HFRolloutServer)
            server = server_cls.options(
                name=name,
                max_concurrency=self.max_concurrency,
                num_cpus=0,
                runtime_env={"env_vars": env_vars},
                **await self._on_workers_node(),
            ).remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank)
            address, _ = await server.get_server_address.remote()
            self.servers = [server]
            self._server_handle = server
            self._server_address = address

        async def _on_workers_node(self) -> dict[str, Any]:
            """Pin the server to the node of this replica's worker (hybrid and colocated modes), as verl's vLLM
            replica pins its servers: in a cluster of several nodes each replica then serves next to its actor rank
            and weight syncs stay on that node. Without workers (none yet), Ray places the server."""
            if not self.workers:
                return {}
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            node_id = await self.workers[0].__ray_call__.remote(lambda worker: ray.get_runtime_context().get_node_id())
            return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)}

        def rollout_worker_use_gpu(self) -> bool:
            return False

    HFReplica.__qualname__ = "HFReplica"
    HFReplica.__module__ = __name__
    return HFReplica


_CLASSES: dict[str, type] = {}


def replica_class() -> type:
    """The ``RolloutReplica`` subclass for backend ``hf`` (loader for ``RolloutReplicaRegistry``)."""
    if "replica" not in _CLASSES:
        _CLASSES["replica"] = _replica_class()
    return _CLASSES["replica"]


def __getattr__(name: str) -> Any:
    # verl's get_rollout_class imports ADAPTER_FQN and reads the attribute: build the subclass on demand.
    if name == "HFServerAdapter":
        if "adapter" not in _CLASSES:
            _CLASSES["adapter"] = _adapter_class()
        return _CLASSES["adapter"]
    if name == "HFReplica":
        return replica_class()
    raise AttributeError(name)


def _adapter_class() -> type:
    import ray
    from verl.workers.rollout.base import BaseRollout

    class HFServerAdapter(BaseRollout):
        """Worker-side rollout: forwards weight syncs to this replica's ``hf`` server actor."""

        def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1, **kwargs: Any):
            super().__init__(config, model_config, device_mesh)
            self.options = resolve_options(self.config)
            rank = int(os.environ.get("RANK", 0))
            world = self.config.tensor_model_parallel_size * self.config.data_parallel_size
            world *= self.config.pipeline_model_parallel_size
            self.replica_rank = rank // world if replica_rank == -1 else replica_rank
            self.rollout_rank = rank % world
            self.server_handle = None
            self.bucket_bytes = max(1, int(self.config.checkpoint_engine.update_weights_bucket_megabytes)) << 20

        def _server(self) -> Any:
            if self.rollout_rank != 0:
                return None
            if self.server_handle is None:
                self.server_handle = ray.get_actor(server_actor_name(self.replica_rank))
            return self.server_handle

        async def resume(self, tags: list[str]) -> None:
            return None

        async def release(self) -> None:
            return None

        @torch.no_grad()
        async def update_weights(
            self, weights: Any, global_steps: int | None = None, wire_format: str = "named_tensors", **kwargs: Any
        ) -> None:
            """Drain ``weights`` (collective on every rank); rank 0 streams them to the server in buckets."""
            if wire_format != "named_tensors":
                raise NotImplementedError(f"hf backend supports wire_format='named_tensors' only, got {wire_format!r}")
            if kwargs.get("peft_config") is not None:
                raise NotImplementedError("hf backend: LoRA adapter sync is not supported (use lora.merge=True)")
            server = self._server() if self.options.sync_weights else None
            bucket: list[tuple[str, torch.Tensor]] = []
            size = 0
            for name, tensor in weights:
                if server is None:
                    continue
                t = tensor.detach().to("cpu")
                bucket.append((name, t))
                size += t.numel() * t.element_size()
                if size >= self.bucket_bytes:
                    await server.load_weight_bucket.remote(bucket)
                    bucket, size = [], 0
            if server is not None:
                if bucket:
                    await server.load_weight_bucket.remote(bucket)
                await server.finish_weight_update.remote(global_steps)
            elif self.rollout_rank == 0 and global_steps is not None:
                await self._server_for_steps().set_global_steps.remote(global_steps)

        def _server_for_steps(self) -> Any:
            if self.server_handle is None:
                self.server_handle = ray.get_actor(server_actor_name(self.replica_rank))
            return self.server_handle

    HFServerAdapter.__qualname__ = "HFServerAdapter"
    HFServerAdapter.__module__ = __name__
    return HFServerAdapter


# ---------------------------------------------------------------------------------------------------------------------
# Contracts: the verl interfaces the hf backend relies on, checked by name (``verl-stable doctor``, :func:`register`).


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
    from verl.workers import engine_workers
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    src = inspect.getsource(engine_workers.ActorRolloutRefWorker.update_weights)
    for token in ("self.rollout.update_weights(", "peft_config=", "global_steps="):
        if token not in src:
            raise ContractError(f"worker weight sync no longer calls rollout.update_weights with {token!r}")
    fused = {
        "model.layers.0.mlp.experts.gate_up_proj": torch.zeros(2, 6, 4),
        "model.layers.0.mlp.experts.down_proj": torch.zeros(2, 4, 3),
    }
    names = [n for n, _ in unfuse_moe_params(fused.items(), "qwen3_moe")]
    if len(names) != 6 or not all(EXPERT_NAME_RE.match(n) for n in names):
        raise ContractError(f"verl's MoE weight names changed: {names}")
    return "unfused expert names model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight"


CONTRACTS: tuple[Contract, ...] = (
    Contract("replica_registry", "RolloutReplicaRegistry + RolloutReplica private attributes", _replica_registry),
    Contract("rollout_registry", "_ROLLOUT_REGISTRY + BaseRollout abstract methods", _rollout_registry),
    Contract("server_methods", "the implicit server method list", _server_methods),
    Contract("token_output", "TokenOutput fields and extra_fields['global_steps']", _token_output),
    Contract("weight_sync", "rollout.update_weights keywords and vLLM-style MoE weight names", _weight_sync),
)


def check_contracts(names: tuple[str, ...] | list[str] | None = None) -> list[ContractResult]:
    """Run this backend's contracts (all by default); never raises."""
    return contracts.check(CONTRACTS, names)


def register() -> list[str]:
    """Register backend ``hf`` with verl's replica registry and worker rollout table (idempotent).

    Raises:
        verl_stable.compat.contracts.ContractError: verl's rollout tables are not the ones this backend registers into.
    """
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    contracts.require(CONTRACTS, "rollout_registry", "replica_registry")
    RolloutReplicaRegistry.register(BACKEND, replica_class)
    # patch: hf_rollout_adapter (verl_stable.compat.catalogue)
    rollout_base._ROLLOUT_REGISTRY[(BACKEND, "async")] = ADAPTER_FQN
    return [f"rollout_replica:{BACKEND}", f"rollout_adapter:{BACKEND}/async"]
