"""Rollout backend ``hf``: a Hugging Face model served from a Ray actor, for verl's agent loop on CPU.

Three pieces, each where verl looks for it (see :mod:`verl_stable.cpu.contracts` for the interfaces relied on):

* :class:`HFReplica` -- ``RolloutReplicaRegistry.register("hf", ...)``; built in the task runner, it launches one
  :class:`HFRolloutServer` Ray actor per replica, named ``hf_server_{replica_rank}_0`` like vLLM's servers.
* :class:`HFRolloutServer` -- the server actor: ``async generate(prompt_ids, sampling_params, request_id, ...)
  -> TokenOutput`` (KV-cached sampling, vLLM-style processed log-probs, optional routed experts) and every lifecycle
  method verl calls on a server.
* :class:`HFServerAdapter` -- the worker-side ``BaseRollout`` in ``_ROLLOUT_REGISTRY[("hf", "async")]``. verl's
  weight sync hands it a generator of full tensors (every rank must drain it: gathering a DTensor is a collective);
  rollout rank 0 streams them in buckets to the server actor found by name. MoE experts arrive unfused under
  vLLM names (``...mlp.experts.{e}.gate_proj.weight``); the server writes them into transformers 5's fused
  ``gate_up_proj`` [E, 2I, H] (gate rows first) and ``down_proj`` [E, H, I].

Backend options live in ``actor_rollout_ref.rollout.engine_kwargs.hf`` (verl's per-backend dict):
``precision`` (fp32 | bf16 | fp16 | fp8; default from ``rollout.dtype``, or fp8 when ``rollout.quantization=fp8``),
``sync_weights`` (default true; false keeps the rollout at its initial weights -- a deliberate-drift control),
``num_threads`` (torch threads in the server, default: torch's), ``max_batch_size`` (default 64: concurrent requests with
prompts of one length are sampled as one batch, see :mod:`verl_stable.cpu.batching`; 1 samples one request at a time).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from verl_stable.cpu.batching import RequestBatcher
from verl_stable.cpu.generation import KVCachedSampler, SamplingSpec
from verl_stable.cpu.precision import canonical_precision, dequantize_fp8_rows, fp8_weight_names, quantize_fp8_rows

logger = logging.getLogger(__name__)

BACKEND = "hf"
ADAPTER_FQN = "verl_stable.cpu.hf_rollout.HFServerAdapter"
SERVER_NAME_PREFIX = f"{BACKEND}_"
_DTYPE_TO_PRECISION = {"float32": "fp32", "fp32": "fp32", "bfloat16": "bf16", "bf16": "bf16"}
_DTYPE_TO_PRECISION.update({"float16": "fp16", "fp16": "fp16", "half": "fp16"})
_EXPERT_RE = re.compile(r"^(?P<base>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
# Sampling keys accepted but without effect here (bookkeeping or already implied).
_IGNORED_SAMPLING_KEYS = {"logprobs", "n", "detokenize", "skip_special_tokens", "spaces_between_special_tokens"}
_SAMPLING_KEYS = {"temperature", "top_p", "top_k", "repetition_penalty", "stop_token_ids", "ignore_eos", "seed"}


@dataclass(frozen=True)
class HFOptions:
    """Resolved ``engine_kwargs.hf`` options."""

    precision: str = "bf16"
    sync_weights: bool = True
    num_threads: int | None = None
    max_batch_size: int = 64


def resolve_options(config: Any) -> HFOptions:
    """Read the ``hf`` backend options from a rollout config (dataclass or DictConfig).

    Raises:
        ValueError: unknown precision or option names.
    """
    engine_kwargs = dict(_get(config, "engine_kwargs", {}) or {})
    raw = dict(engine_kwargs.get(BACKEND, {}) or {})
    unknown = set(raw) - set(HFOptions.__dataclass_fields__)
    if unknown:
        raise ValueError(
            f"unknown rollout.engine_kwargs.hf options {sorted(unknown)}; known: {sorted(HFOptions.__dataclass_fields__)}"
        )
    if raw.get("precision") is not None:
        precision = canonical_precision(raw["precision"])
    elif str(_get(config, "quantization", None) or "").lower() == "fp8":
        precision = "fp8"
    else:
        dtype = str(_get(config, "dtype", "bfloat16")).lower()
        if dtype not in _DTYPE_TO_PRECISION:
            raise ValueError(
                f"rollout.dtype={dtype!r} is not supported by the hf backend; use one of {sorted(_DTYPE_TO_PRECISION)}"
            )
        precision = _DTYPE_TO_PRECISION[dtype]
    threads = raw.get("num_threads")
    max_batch = int(raw.get("max_batch_size", HFOptions.max_batch_size))
    if max_batch < 1:
        raise ValueError(f"rollout.engine_kwargs.hf.max_batch_size must be >= 1, got {max_batch}")
    return HFOptions(precision, bool(raw.get("sync_weights", True)), int(threads) if threads else None, max_batch)


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(key, default)
    if hasattr(obj, "get") and not hasattr(obj, key):
        return obj.get(key, default)
    return getattr(obj, key, default)


# --------------------------------------------------------------------------------------------------------------
# Weight loading: vLLM-style names -> the HF model's (fused) parameters
# --------------------------------------------------------------------------------------------------------------
class WeightLoader:
    """Writes streamed ``(name, tensor)`` pairs into a HF model, re-packing unfused MoE experts.

    Each slice is written in place, so no expert buffering is needed; fp8 re-quantises per output row, and the rows
    of a gate/up slice are rows of the fused ``gate_up_proj``, so quantising a slice equals quantising the fused
    tensor.
    """

    def __init__(self, model: torch.nn.Module, precision: str) -> None:
        self.params = dict(model.named_parameters())
        self.params.update(dict(model.named_buffers()))
        self.precision = canonical_precision(precision)
        self.fp8_names = set(fp8_weight_names(model)) if self.precision == "fp8" else set()
        self.loaded: set[str] = set()

    def target(self, name: str) -> tuple[str, tuple]:
        """(model parameter name, index into it) for an incoming weight name. Raises KeyError if unknown."""
        if name in self.params:
            return name, ()
        m = _EXPERT_RE.match(name)
        if m:
            base, expert, proj = m["base"], int(m["expert"]), m["proj"]
            if proj == "down_proj":
                fused = f"{base}.down_proj"
                if fused in self.params:
                    return fused, (expert,)
            else:
                fused = f"{base}.gate_up_proj"
                if fused in self.params:
                    half = self.params[fused].shape[-2] // 2
                    rows = slice(0, half) if proj == "gate_proj" else slice(half, 2 * half)
                    return fused, (expert, rows)
        raise KeyError(f"weight {name!r} has no counterpart in the rollout model (hf backend weight-name contract)")

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        target_name, index = self.target(name)
        dst = self.params[target_name][index] if index else self.params[target_name]
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {name!r} -> {target_name}{list(index)}: shape {tuple(tensor.shape)} != {tuple(dst.shape)}"
            )
        value = tensor.detach().to(device=dst.device)
        if target_name in self.fp8_names:
            value = dequantize_fp8_rows(*quantize_fp8_rows(value), dtype=dst.dtype)
        dst.copy_(value.to(dst.dtype))
        self.loaded.add(target_name)


# --------------------------------------------------------------------------------------------------------------
# Routing export (vLLM 0.24 layout)
# --------------------------------------------------------------------------------------------------------------
def routed_experts_array(
    trace: torch.Tensor, moe_layer_to_decoder_layer: list[int], num_hidden_layers: int, num_experts: int
) -> Any:
    """Lay out captured routing like vLLM 0.24's ``CompletionOutput.routed_experts``.

    Args:
        trace: LongTensor [rows, moe_layers, top_k] of expert ids (rows = prompt tokens + fed-back outputs).
        moe_layer_to_decoder_layer: absolute decoder layer of each MoE-layer ordinal.
        num_hidden_layers: decoder layers L (dense layers get zero rows).
        num_experts: routed experts per layer (chooses uint8 up to 256, else uint16).

    Returns:
        numpy array [rows, L, top_k], uint8 or uint16.
    """
    import numpy as np

    if trace.dim() != 3:
        raise ValueError(f"routing trace must be [tokens, moe_layers, top_k], got shape {tuple(trace.shape)}")
    if trace.shape[1] != len(moe_layer_to_decoder_layer):
        raise ValueError(
            f"routing trace has {trace.shape[1]} MoE layers, mapping has {len(moe_layer_to_decoder_layer)}"
        )
    if trace.numel() and (int(trace.min()) < 0 or int(trace.max()) >= num_experts):
        raise ValueError(f"routing trace expert ids outside [0, {num_experts})")
    dtype = np.uint8 if num_experts <= 256 else np.uint16
    out = np.zeros((trace.shape[0], num_hidden_layers, trace.shape[2]), dtype=dtype)
    for ordinal, layer in enumerate(moe_layer_to_decoder_layer):
        out[:, layer, :] = trace[:, ordinal, :].cpu().numpy().astype(dtype)
    return out


class RouterIdsRecorder:
    """Routing capture specialised to the sampler's forwards (one sequence, no padding): one hook per router.

    The general :func:`verl_stable.routing.capture` tracks batch shapes and attention masks with model-level pre/post
    hooks and a per-site state machine; for KV-cached generation of a single sequence every routed row is a token,
    so a forward hook per router that appends its top-k ids is all that is needed (about a third of the hook work
    per decode step). Rows come out in call order: prompt tokens, then every fed-back sampled token -- the same rows
    the general capture records. :meth:`ids` checks that every MoE layer routed the same rows (a router that a hub
    kernel bypassed would come up short).
    """

    def __init__(self, routing: Any) -> None:
        self.routing = routing
        self.layers = routing.layout.moe_layers
        self.rows: list[list[torch.Tensor]] = [[] for _ in routing.sites]
        self._ids: torch.Tensor | None = None

    @contextlib.contextmanager
    def recording(self) -> Iterator[RouterIdsRecorder]:
        handles = []
        try:
            for site in self.routing.sites:
                handles.append(site.module.register_forward_hook(self.make_hook(self.rows[site.ordinal])))
            yield self
        finally:
            for handle in handles:
                handle.remove()

    @staticmethod
    def make_hook(rows: list[torch.Tensor]) -> Any:
        """The forward hook of one router: appends the ids of its output ``(logits, weights, ids)``."""

        def hook(_module: Any, _args: Any, out: Any) -> None:
            rows.append(out[2])

        return hook

    def ids(self) -> torch.Tensor:
        """``[rows, moe_layers, top_k]`` expert ids of every routed row, in call order (computed once per recording)."""
        from verl_stable.routing import UnsupportedModelError

        if self._ids is not None and self._ids.shape[0] == sum(int(t.shape[0]) for t in self.rows[0]):
            return self._ids
        per_layer = [torch.cat(rows) if rows else torch.empty(0, self.routing.layout.top_k) for rows in self.rows]
        counts = {int(t.shape[0]) for t in per_layer}
        if len(counts) != 1:
            short = [self.layers[i] for i, t in enumerate(per_layer) if t.shape[0] < max(counts)]
            raise UnsupportedModelError(
                f"the routers of MoE decoder layers {short} did not run on every token: the MoE block was bypassed "
                "(hub kernel or a custom forward?), so routing was not captured"
            )
        self._ids = torch.stack(per_layer, dim=1)
        return self._ids


class RoutingExporter(NamedTuple):
    """How the server exports routing: ``capture(model)`` context, ``to_array(recorder, rows=None)`` (vLLM layout of
    all recorded rows, or of the given row indices), and whether one recording may span a batch of requests."""

    capture: Any
    to_array: Any
    batched: bool


def routing_exporter(model: torch.nn.Module) -> RoutingExporter:
    """Return a :class:`RoutingExporter` of ``model``'s routing via :mod:`verl_stable.routing`.

    The model is bound once, here. Router-output families (qwen3_moe, mixtral, ...) get :class:`RouterIdsRecorder`,
    whose rows follow the flattened ``[batch * tokens]`` order of each forward, so one recording serves a batch of
    requests; the others (an instance-level routing method) the general :func:`verl_stable.routing.capture`, one
    request per recording.

    Raises:
        verl_stable.routing.UnsupportedModelError: a model family the routing package cannot route (a ValueError
            naming the model type and the supported ones).
    """
    from verl_stable.routing import bind_model, capture
    from verl_stable.routing.families import ROUTER_OUTPUT

    routing = bind_model(model)  # fails loudly here, at server start, for unroutable models
    layout = routing.layout

    if routing.spec.site_kind == ROUTER_OUTPUT:

        def capture_factory(_model: torch.nn.Module) -> contextlib.AbstractContextManager:
            return RouterIdsRecorder(routing).recording()

    else:
        capture_factory = capture

    def to_array(recorder: Any, rows: Any = None) -> Any:
        ids = recorder.ids() if isinstance(recorder, RouterIdsRecorder) else recorder.trace.to_tensor()
        if rows is not None:
            ids = ids[torch.as_tensor(rows, dtype=torch.long)]
        return routed_experts_array(ids, list(recorder.layers), layout.num_hidden_layers, layout.num_experts)

    return RoutingExporter(capture_factory, to_array, routing.spec.site_kind == ROUTER_OUTPUT)


# --------------------------------------------------------------------------------------------------------------
# Server actor
# --------------------------------------------------------------------------------------------------------------
class HFRolloutServer:
    """The rollout server actor (wrapped with ``ray.remote`` by :class:`HFReplica`)."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int = 0, node_rank: int = 0) -> None:
        from transformers import AutoModelForCausalLM
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig

        from verl_stable.cpu.precision import apply_precision_

        self.config = omega_conf_to_dataclass(config)
        self.model_config = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.options = resolve_options(self.config)
        if self.options.num_threads:
            torch.set_num_threads(self.options.num_threads)
        self.replica_rank, self.node_rank = replica_rank, node_rank
        path = self.model_config.local_path or self.model_config.path
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        self.model = apply_precision_(model, self.options.precision).eval()
        hf_config = self.model.config
        max_len = self.config.max_model_len or (self.config.prompt_length + self.config.response_length)
        self.max_model_len = int(min(max_len, getattr(hf_config, "max_position_embeddings", max_len)))
        self.sampler = KVCachedSampler(self.model, self.max_model_len, _eos_ids(self.model_config, hf_config))
        self.routing = routing_exporter(self.model) if self.config.enable_rollout_routing_replay else None
        batched = self.routing is None or self.routing.batched
        self.batcher = RequestBatcher(
            self._generate_batch, key=lambda request: len(request[0]), max_batch_size=self.options.max_batch_size
        )
        if not batched:
            self.batcher.max_batch_size = 1
        self.global_steps = 0
        self._lock = threading.Lock()
        self._loader: WeightLoader | None = None
        self._gate = asyncio.Event()
        self._gate.set()
        self._server_address = f"{BACKEND}-replica-{replica_rank}-node-{node_rank}"

    # -- generation -------------------------------------------------------------------------------------
    def _spec(self, prompt_len: int, sampling_params: dict[str, Any]) -> SamplingSpec:
        params = dict(sampling_params)
        if "max_tokens" in params:
            max_tokens = params.pop("max_tokens")
        elif "max_new_tokens" in params:
            max_tokens = params.pop("max_new_tokens")
        else:
            max_tokens = min(
                self.config.response_length, self.config.prompt_length + self.config.response_length - prompt_len
            )
        unknown = set(params) - _SAMPLING_KEYS - _IGNORED_SAMPLING_KEYS
        if unknown:
            raise ValueError(f"hf backend: unsupported sampling parameters {sorted(unknown)}")
        top_k = params.get("top_k", self.config.top_k)
        return SamplingSpec(
            max_tokens=max(1, int(max_tokens)),
            temperature=float(params.get("temperature", self.config.temperature)),
            top_p=float(params.get("top_p", self.config.top_p)),
            top_k=int(top_k) if top_k is not None else -1,
            repetition_penalty=float(params.get("repetition_penalty", self.config.repetition_penalty)),
            stop_token_ids=tuple(int(t) for t in (params.get("stop_token_ids") or ())),
            ignore_eos=bool(params.get("ignore_eos", self.config.ignore_eos)),
            seed=params.get("seed"),
        )

    def _generate_batch(self, requests: list[tuple[list[int], SamplingSpec]]) -> list[Any]:
        """Blocking: sample a batch of equal-length prompts (under the weight lock) and export each one's routing."""
        with self._lock:
            capture = self.routing.capture if self.routing else None
            prompts, specs = [r[0] for r in requests], [r[1] for r in requests]
            gens = self.sampler.generate_batch(prompts, specs, routing_capture=capture)
            if self.routing:
                for gen in gens:
                    gen.routing = self.routing.to_array(gen.routing, gen.extra["routing_rows"])
            return gens

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Token-in, token-out generation (verl's server contract). Returns a ``TokenOutput``."""
        from verl.workers.rollout.replica import TokenOutput

        if image_data is not None or video_data is not None or kwargs.get("audio_data") is not None:
            raise NotImplementedError("hf backend: multimodal inputs are not supported")
        prompt_ids = [int(t) for t in prompt_ids]
        self.sampler.check_prompt(prompt_ids)
        spec = self._spec(len(prompt_ids), sampling_params)
        await self._gate.wait()
        gen = await self.batcher.submit((prompt_ids, spec))
        want_logprobs = bool(sampling_params.get("logprobs", False))
        return TokenOutput(
            token_ids=gen.token_ids,
            log_probs=gen.log_probs if want_logprobs else None,
            routed_experts=gen.routing,
            stop_reason="completed",
            num_preempted=0,
            extra_fields={"global_steps": int(self.global_steps)},
        )

    # -- weights ----------------------------------------------------------------------------------------
    async def load_weight_bucket(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """Write one bucket of streamed weights into the model (under the generation lock)."""

        def _load() -> int:
            with self._lock:
                if self._loader is None:
                    self._loader = WeightLoader(self.model, self.options.precision)
                for name, tensor in named:
                    self._loader.load(name, tensor)
                return len(named)

        return await asyncio.to_thread(_load)

    async def finish_weight_update(self, global_steps: int | None = None) -> dict[str, int]:
        """End of one sync: report how many model tensors were touched, then adopt ``global_steps``."""
        loaded = len(self._loader.loaded) if self._loader else 0
        self._loader = None
        if global_steps is not None:
            self.global_steps = int(global_steps)
        return {"tensors": loaded}

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = int(global_steps)

    async def get_weights(self) -> dict[str, torch.Tensor]:
        """The server model's state dict (tests compare it to the actor's)."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    # -- lifecycle verl calls (no device memory to free on CPU) ------------------------------------------
    async def launch_server(self, **kwargs: Any) -> None:
        return None

    def get_server_address(self) -> tuple[str, None]:
        return self._server_address, None

    def get_rollout_config(self) -> Any:
        return self.config

    async def wake_up(self, tags: list[str] | None = None) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None  # caches live per request

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None

    async def wait_for_requests_to_drain(self) -> None:
        with self._lock:
            return None

    async def abort_all_requests(self, reject_request: bool = False, **kwargs: Any) -> dict[str, Any]:
        """Hold new requests until :meth:`resume_generation`; running requests finish (they are short)."""
        self._gate.clear()
        return {"aborted_count": 0, "request_ids": []}

    async def abort_request(self, request_id: str, **kwargs: Any) -> dict[str, Any]:
        return {"aborted": False, "request_id": request_id}

    async def resume_generation(self) -> None:
        self._gate.set()

    async def resume_engine_generation(self) -> None:
        self._gate.set()

    async def open_submission_gate(self) -> None:
        self._gate.set()


def _eos_ids(model_config: Any, hf_config: Any) -> list[int]:
    ids: list[int] = []
    for source in (
        getattr(model_config, "generation_config", None),
        hf_config,
        getattr(model_config, "tokenizer", None),
    ):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        ids.extend(value if isinstance(value, (list, tuple)) else [value])
    return sorted({int(i) for i in ids})


def server_actor_name(replica_rank: int, node_rank: int = 0) -> str:
    """Ray actor name of a replica's server (vLLM's naming scheme with the ``hf_`` prefix)."""
    return f"{SERVER_NAME_PREFIX}server_{replica_rank}_{node_rank}"


# --------------------------------------------------------------------------------------------------------------
# Replica (task-runner side) and adapter (worker side) -- verl base classes, built lazily
# --------------------------------------------------------------------------------------------------------------
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
                name=name, max_concurrency=self.max_concurrency, num_cpus=0, runtime_env={"env_vars": env_vars}
            ).remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank)
            address, _ = await server.get_server_address.remote()
            self.servers = [server]
            self._server_handle = server
            self._server_address = address

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


def register() -> list[str]:
    """Register backend ``hf`` with verl's replica registry and worker rollout table (idempotent)."""
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from verl_stable.cpu import contracts

    contracts.require("rollout_registry", "replica_registry")
    RolloutReplicaRegistry.register(BACKEND, replica_class)
    rollout_base._ROLLOUT_REGISTRY[(BACKEND, "async")] = ADAPTER_FQN
    return [f"rollout_replica:{BACKEND}", f"rollout_adapter:{BACKEND}/async"]
