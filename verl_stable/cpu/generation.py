"""KV-cached token sampling for a Hugging Face causal LM, with vLLM-style processed log-probs.

Pure torch + transformers (no verl import): the ``hf`` rollout server wraps this.

Sampling of one next token from fp32 logits ``z`` (vLLM's order):

1. repetition penalty ``r`` on every token already in prompt or output: ``z_t / r`` if ``z_t > 0`` else ``z_t * r``;
2. temperature: ``z / T`` (``T = 0`` means greedy: argmax of ``z``);
3. top-k: keep the ``k`` largest, set the rest to ``-inf`` (``k <= 0`` disables);
4. top-p: keep the smallest set of largest-probability tokens whose mass reaches ``p`` (always at least one);
5. ``log p = log_softmax(z')``; the sampled token is drawn from ``p`` and reported with its ``log p`` --
   vLLM's default ``logprobs_mode="processed_logprobs"``. With ``T=1, k<=0, p=1, r=1`` this is the model's own
   log-probability, so a teacher-forced forward of the same model reproduces it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class SamplingSpec:
    """What to sample. ``max_tokens`` >= 1; ``stop_token_ids`` end generation (the stop token is kept)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if int(self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


@dataclass
class Generation:
    """One completion: sampled ids, their processed log-probs, why it ended, and optional routing."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str  # "stop" (a stop/eos token) or "length"
    routing: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


def process_logits(logits: torch.Tensor, spec: SamplingSpec, seen_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Apply repetition penalty, temperature, top-k and top-p to fp32 ``logits`` [..., V] (see module docstring).

    Returns processed logits with excluded tokens at ``-inf``. ``T = 0`` returns the (penalised) logits unscaled.
    """
    z = logits.float().clone()
    if spec.repetition_penalty != 1.0 and seen_ids is not None and seen_ids.numel():
        seen = torch.zeros(z.shape[-1], dtype=torch.bool, device=z.device)
        seen[seen_ids.to(z.device)] = True
        penalised = torch.where(z > 0, z / spec.repetition_penalty, z * spec.repetition_penalty)
        z = torch.where(seen, penalised, z)
    if spec.temperature > 0:
        z = z / spec.temperature
    vocab = z.shape[-1]
    if 0 < spec.top_k < vocab:
        kth = torch.topk(z, spec.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if spec.top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= spec.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return z


def sample_token(
    logits: torch.Tensor, spec: SamplingSpec, generator: torch.Generator | None, seen_ids: torch.Tensor | None = None
) -> tuple[int, float]:
    """Sample one token from 1-D ``logits``; return ``(token_id, processed log-prob)``."""
    z = process_logits(logits, spec, seen_ids)
    logp = torch.log_softmax(z, dim=-1)
    if spec.temperature == 0:
        token = int(torch.argmax(z))
    else:
        token = int(torch.multinomial(logp.exp(), 1, generator=generator))
    return token, float(logp[token])


RoutingCapture = Callable[[nn.Module], contextlib.AbstractContextManager]


class KVCachedSampler:
    """Samples completions from ``model`` one request at a time with a KV cache.

    Args:
        model: a ``transformers`` causal LM in eval mode.
        max_model_len: prompt + completion limit; longer prompts raise ``ValueError``.
        eos_token_ids: ids that end generation unless ``spec.ignore_eos``.
    """

    def __init__(self, model: nn.Module, max_model_len: int, eos_token_ids: Sequence[int] = ()) -> None:
        self.model = model
        self.max_model_len = int(max_model_len)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Raise ``ValueError`` for an empty prompt, out-of-vocabulary ids, or no room to generate."""
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("empty prompt: at least one prompt token is required")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt length {n} leaves no room to generate within max_model_len={self.max_model_len} "
                "(need at least 1 token of headroom)"
            )
        vocab = self.model.get_input_embeddings().weight.shape[0]
        bad = [t for t in prompt_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[int],
        spec: SamplingSpec,
        routing_capture: RoutingCapture | None = None,
    ) -> Generation:
        """Sample one completion of ``prompt_ids``.

        ``max_tokens`` is clamped to the room left under ``max_model_len``. With ``routing_capture``, the model's
        forward passes run inside ``routing_capture(model)`` and the recorder it yields is returned as
        ``Generation.routing`` (rows: every prompt token, then every sampled token that was fed back).
        """
        self.check_prompt(prompt_ids)
        max_tokens = max(1, min(int(spec.max_tokens), self.max_model_len - len(prompt_ids)))
        stop_ids = set(spec.stop_token_ids)
        if not spec.ignore_eos:
            stop_ids |= set(self.eos_token_ids)
        generator = None
        if spec.seed is not None:
            generator = torch.Generator().manual_seed(int(spec.seed))
        device = next(self.model.parameters()).device
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
        seen = ids[0].clone()
        out_ids: list[int] = []
        out_logp: list[float] = []
        finish = "length"
        ctx = routing_capture(self.model) if routing_capture is not None else contextlib.nullcontext()
        with ctx as recorder:
            outputs = self.model(input_ids=ids, use_cache=True)
            past = outputs.past_key_values
            logits = outputs.logits[0, -1]
            for step in range(max_tokens):
                token, logp = sample_token(logits, spec, generator, seen)
                out_ids.append(token)
                out_logp.append(logp)
                if token in stop_ids:
                    finish = "stop"
                    break
                if step + 1 == max_tokens:
                    break
                seen = torch.cat([seen, seen.new_tensor([token])])
                step_ids = torch.tensor([[token]], dtype=torch.long, device=device)
                outputs = self.model(input_ids=step_ids, past_key_values=past, use_cache=True)
                past = outputs.past_key_values
                logits = outputs.logits[0, -1]
        return Generation(out_ids, out_logp, finish, routing=recorder)


@torch.no_grad()
def teacher_forced_logprobs(model: nn.Module, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> torch.Tensor:
    """log p(response_t | prompt, response_<t) from one full forward (no cache), fp32 [len(response)]."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(response_ids)], dtype=torch.long, device=device)
    logits = model(input_ids=ids).logits[0].float()
    n = len(prompt_ids)
    logp = torch.log_softmax(logits[n - 1 : -1], dim=-1)
    return logp.gather(-1, ids[0, n:, None]).squeeze(-1)
