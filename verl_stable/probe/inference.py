"""The inference side of the probe: sample completions with a rollout engine as verl runs it, with their log-probs
``log mu`` and the routed experts the engine exports.

Engines:

* ``hf``: the project's rollout backend, in this process, exactly as its server builds it
  (:class:`verl_stable.backends.hf.server.HFRolloutServer`): the checkpoint loaded in fp32 with sdpa attention, cast to
  the rollout precision (:func:`verl_stable.backends.hf.precision.apply_precision_`), KV-cached sampling
  (:class:`~verl_stable.backends.hf.generation.KVCachedSampler`: temperature 1, no top-k / top-p, verl's defaults)
  over batches of equal-length prompts, each sample with a generator of its own seed, and the routed experts in vLLM's
  layout (:func:`~verl_stable.backends.hf.routing.routing_exporter`);
* ``vllm``: :mod:`verl_stable.probe.vllm_engine`, vLLM in a process of its own.

Both exports are decoded by the codec verl-stable's rollout boundary uses
(:func:`verl_stable.routing.codecs.decode_vllm`): rows for token positions ``[0, P + R - 1)`` (the last sampled token
was never fed back), MoE layers only.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from verl_stable.probe.checks import ProbeInputError

__all__ = [
    "DEFAULT_BATCH",
    "Rollout",
    "decode_routing",
    "eos_token_ids",
    "load_checkpoint",
    "quiet_transformers",
    "sample_hf",
    "sample_seed",
]

DEFAULT_BATCH = 64
"""Requests of one prompt length sampled together at most (the ``hf`` server's ``max_batch_size`` default)."""

Progress = Callable[[int], None]


@dataclass
class Rollout:
    """One sampled completion.

    Attributes:
        prompt_index: index of its prompt in the prompt set.
        prompt_ids: the rendered prompt (``P`` tokens).
        response_ids: the sampled tokens (``R >= 1``; a stop token is kept, as verl keeps it).
        logp: ``log mu`` of each sampled token as the engine reported it (``R`` floats).
        routing: ``[P + R - 1, moe_layers, top_k]`` expert ids the engine routed each fed token to, or None for a
            dense model.
        finish_reason: ``stop`` or ``length``.
    """

    prompt_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    logp: list[float]
    routing: np.ndarray | None
    finish_reason: str


def sample_seed(seed: int, sample: int) -> int:
    """The sampling seed of sample ``sample`` under ``--seed seed``: ``seed * 1_000_003 + sample``, below 2**63."""
    return (int(seed) * 1_000_003 + int(sample)) % (2**63)


def eos_token_ids(model_dir: str | Path, tokenizer: Any) -> list[int]:
    """Every end-of-sequence id the generation config, the model config or the tokenizer names (the ``hf`` server's
    rule)."""
    from transformers import AutoConfig, GenerationConfig

    ids: list[int] = []
    sources: list[Any] = [AutoConfig.from_pretrained(str(model_dir)), tokenizer]
    try:
        sources.append(GenerationConfig.from_pretrained(str(model_dir)))
    except OSError:
        pass  # no generation_config.json
    for source in sources:
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.extend(value if isinstance(value, (list, tuple)) else [value])
    return sorted({int(i) for i in ids})


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' own progress bars off inside the block (they would cut through the probe's), restored after."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def load_checkpoint(model_dir: str | Path) -> Any:
    """The checkpoint as a causal LM in fp32 with sdpa attention (how the ``hf`` server and verl's CPU actor load it).

    Raises:
        ProbeInputError: transformers cannot load it (no weights, a model class it does not know ...).
    """
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with quiet_transformers():
            return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    except (OSError, ValueError, KeyError) as exc:
        first = " ".join(str(exc).split())[:300]
        raise ProbeInputError(
            f"--model {model_dir}: transformers cannot load it ({type(exc).__name__}: {first})"
        ) from None


def decode_routing(array: Any, prompt_len: int, response_len: int, layout: Any) -> np.ndarray:
    """An engine's ``routed_experts`` export (vLLM layout) -> ``[P + R - 1, moe_layers, top_k]`` int64 ids."""
    from verl_stable.routing.codecs import decode_vllm

    rows = decode_vllm(array, prompt_len=prompt_len, response_len=response_len, layout=layout)
    return rows.ids.astype(np.int64)


def sample_hf(
    model_dir: str | Path,
    prompts: Mapping[int, Sequence[int]],
    prompt_of_sample: Sequence[int],
    *,
    precision: str,
    max_tokens: int,
    seed: int,
    eos_ids: Sequence[int],
    layout: Any | None,
    batch: int = DEFAULT_BATCH,
    device: str = "cpu",
    progress: Progress | None = None,
) -> list[Rollout]:
    """Sample one completion per entry of ``prompt_of_sample`` with the ``hf`` backend (module docstring).

    Args:
        model_dir: the checkpoint.
        prompts: rendered prompt ids by prompt index.
        prompt_of_sample: the prompt index of each sample.
        precision: a rollout precision of :data:`verl_stable.backends.hf.precision.PRECISIONS`.
        max_tokens: the most tokens a completion samples (verl's ``response_length``).
        seed: ``--seed``; sample ``s`` draws from a generator seeded :func:`sample_seed` ``(seed, s)``.
        eos_ids: ids that end a completion.
        layout: the model's :class:`~verl_stable.routing.RoutingLayout`, or None for a dense model (no export).
        batch: the most requests sampled together.
        device: where the rollout model runs (``cpu`` or ``cuda``).
        progress: called with the number of samples finished by each batch.

    Returns:
        The rollouts in sample order.
    """
    from verl_stable.backends.hf.generation import KVCachedSampler, SamplingSpec
    from verl_stable.backends.hf.precision import apply_precision_
    from verl_stable.backends.hf.routing import routing_exporter

    model = apply_precision_(load_checkpoint(model_dir), precision).to(device).eval()
    longest = max(len(p) for p in prompts.values())
    sampler = KVCachedSampler(model, longest + max_tokens, eos_ids)
    exporter = routing_exporter(model) if layout is not None else None
    if exporter is not None and not exporter.batched:
        batch = 1  # a family whose capture records one request at a time (the server's rule)
    by_length: dict[int, list[int]] = defaultdict(list)
    for sample, index in enumerate(prompt_of_sample):
        by_length[len(prompts[index])].append(sample)
    out: dict[int, Rollout] = {}
    for samples in by_length.values():
        for start in range(0, len(samples), batch):
            chunk = samples[start : start + batch]
            specs = [SamplingSpec(max_tokens=max_tokens, seed=sample_seed(seed, s)) for s in chunk]
            gens = sampler.generate_batch(
                [prompts[prompt_of_sample[s]] for s in chunk],
                specs,
                routing_capture=exporter.capture if exporter is not None else None,
            )
            for s, gen in zip(chunk, gens, strict=True):
                prompt = list(prompts[prompt_of_sample[s]])
                routing = None
                if exporter is not None:
                    array = exporter.to_array(gen.routing, gen.extra["routing_rows"])
                    routing = decode_routing(array, len(prompt), len(gen.token_ids), layout)
                out[s] = Rollout(
                    prompt_of_sample[s], prompt, list(gen.token_ids), list(gen.log_probs), routing, gen.finish_reason
                )
            if progress is not None:
                progress(len(chunk))
    del model, sampler, exporter
    return [out[s] for s in range(len(prompt_of_sample))]
