"""The ``hf`` rollout server: a Hugging Face model served from a Ray actor, token in, token out.

:class:`HFRolloutServer` is the actor that :class:`verl_stable.backends.hf.rollout.HFReplica` launches (wrapped with
``ray.remote``, named :func:`server_actor_name` like vLLM's servers). It answers ``async generate(prompt_ids,
sampling_params, request_id, ...) -> TokenOutput`` with KV-cached sampling (:mod:`verl_stable.backends.hf.generation`),
vLLM-style processed log-probs and, when asked, the routed experts (:mod:`verl_stable.backends.hf.routing`); concurrent
requests are batched (:mod:`verl_stable.backends.hf.batching`), and a request whose sampling params carry ``seed``
(verl-stable's agent loop sends one per sample) is sampled from a generator of that seed, whatever it is batched with.
It takes streamed weights in buckets (:mod:`verl_stable.backends.hf.weights`) and answers every lifecycle method verl calls
on a server (nothing to free on CPU).
"""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Any

import torch

from verl_stable.backends.hf.batching import RequestBatcher
from verl_stable.backends.hf.generation import KVCachedSampler, SamplingSpec
from verl_stable.backends.hf.options import BACKEND, resolve_options
from verl_stable.backends.hf.routing import routing_exporter
from verl_stable.backends.hf.weights import WeightLoader

SERVER_NAME_PREFIX = f"{BACKEND}_"
# Sampling keys accepted but without effect here (bookkeeping or already implied).
_IGNORED_SAMPLING_KEYS = {"logprobs", "n", "detokenize", "skip_special_tokens", "spaces_between_special_tokens"}
_SAMPLING_KEYS = {"temperature", "top_p", "top_k", "repetition_penalty", "stop_token_ids", "ignore_eos", "seed"}


class HFRolloutServer:
    """The rollout server actor (wrapped with ``ray.remote`` by :class:`verl_stable.backends.hf.rollout.HFReplica`)."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int = 0, node_rank: int = 0) -> None:
        from transformers import AutoModelForCausalLM
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig

        from verl_stable.backends.hf.precision import apply_precision_, perturb_routers_

        self.config = omega_conf_to_dataclass(config)
        self.model_config = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.options = resolve_options(self.config)
        if self.options.num_threads:
            torch.set_num_threads(self.options.num_threads)
        self.replica_rank, self.node_rank = replica_rank, node_rank
        path = self.model_config.local_path or self.model_config.path
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        self.model = apply_precision_(model, self.options.precision).eval()
        perturb_routers_(self.model, self.options.router_noise)  # 0: off (an inference-only stand-in, see options)
        hf_config = self.model.config
        max_len = self.config.max_model_len or (self.config.prompt_length + self.config.response_length)
        self.max_model_len = int(min(max_len, getattr(hf_config, "max_position_embeddings", max_len)))
        self.sampler = KVCachedSampler(self.model, self.max_model_len, _eos_ids(self.model_config, hf_config))
        self.routing = (
            routing_exporter(self.model, corrupt_every=self.options.corrupt_routing_every)  # fault injection: tests
            if self.config.enable_rollout_routing_replay
            else None
        )
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
            # verl-stable's agent loop sends one per sample; None keeps the server's shared random stream
            seed=None if params.get("seed") is None else int(params["seed"]),
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
        log_probs = gen.log_probs
        if want_logprobs and self.global_steps in self.options.nan_logprobs_at_versions:  # fault injection: tests
            log_probs = [math.nan] * len(gen.log_probs)
        return TokenOutput(
            token_ids=gen.token_ids,
            log_probs=log_probs if want_logprobs else None,
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
                    self._loader = WeightLoader(self.model, self.options.precision, self.options.router_noise)
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
    # every end-of-sequence id any of verl's model config, the HF config or the tokenizer names
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
