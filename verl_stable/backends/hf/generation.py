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
    """What to sample. ``max_tokens`` >= 1; ``stop_token_ids`` end generation (the stop token is kept).

    ``seed``: None draws from torch's global random stream (shared by every request, so what a request samples
    depends on what was sampled before it); an int gives the request a ``torch.Generator`` of its own, so it samples
    the same tokens alone or as any row of any batch.
    """

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
    """Samples completions from ``model`` with a KV cache, one request or a batch of equal-length prompts at a time.

    A batch of ``B`` prompts of the same length ``T`` runs as one prefill forward ``[B, T]`` and then one decode
    forward ``[B, 1]`` per step: no padding, so every row attends exactly to its own tokens and computes what the
    one-request path computes (up to floating-point summation order in batched matrix products). A row that has
    finished keeps being fed its last token until the longest row ends; its outputs are discarded. Each row samples
    with its own :class:`SamplingSpec` (and its own seeded generator).

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

    def generate(
        self,
        prompt_ids: Sequence[int],
        spec: SamplingSpec,
        routing_capture: RoutingCapture | None = None,
    ) -> Generation:
        """Sample one completion of ``prompt_ids`` (a batch of one, see :meth:`generate_batch`).

        With ``routing_capture``, ``Generation.routing`` is the recorder and every row it recorded belongs to this
        request: every prompt token, then every sampled token that was fed back.
        """
        return self.generate_batch([prompt_ids], [spec], routing_capture)[0]

    @torch.no_grad()
    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        specs: Sequence[SamplingSpec],
        routing_capture: RoutingCapture | None = None,
    ) -> list[Generation]:
        """Sample one completion per prompt; all prompts must have the same length.

        ``max_tokens`` of each row is clamped to the room left under ``max_model_len``. With ``routing_capture``, the
        forwards run inside ``routing_capture(model)``; every Generation gets the shared recorder as ``routing`` and,
        in ``extra["routing_rows"]``, the indices of its own rows among the rows the recorder saw in call order
        (prefill: ``b * T + t``; decode step ``s``: ``B * T + s * B + b``): its prompt tokens, then each of its sampled
        tokens that was fed back.

        Raises:
            ValueError: no prompts, a spec count that differs from the prompt count, prompts of different lengths, or a
                bad prompt (see :meth:`check_prompt`).
        """
        if not prompts or len(prompts) != len(specs):
            raise ValueError(
                f"generate_batch needs one spec per prompt, got {len(prompts)} prompts, {len(specs)} specs"
            )
        lengths = {len(p) for p in prompts}
        if len(lengths) != 1:
            raise ValueError(f"generate_batch needs prompts of one length, got lengths {sorted(lengths)}")
        for prompt in prompts:
            self.check_prompt(prompt)
        batch, prompt_len = len(prompts), lengths.pop()
        room = self.max_model_len - prompt_len
        max_tokens = [max(1, min(int(s.max_tokens), room)) for s in specs]
        stop_ids = [set(s.stop_token_ids) | (set() if s.ignore_eos else set(self.eos_token_ids)) for s in specs]
        generators = [torch.Generator().manual_seed(int(s.seed)) if s.seed is not None else None for s in specs]
        device = next(self.model.parameters()).device
        ids = torch.tensor([list(p) for p in prompts], dtype=torch.long, device=device)
        seen = [ids[b].clone() for b in range(batch)]
        out_ids: list[list[int]] = [[] for _ in range(batch)]
        out_logp: list[list[float]] = [[] for _ in range(batch)]
        finish = ["length"] * batch
        rows = [list(range(b * prompt_len, (b + 1) * prompt_len)) for b in range(batch)]
        active = [True] * batch
        recorded = batch * prompt_len
        ctx = routing_capture(self.model) if routing_capture is not None else contextlib.nullcontext()
        with ctx as recorder:
            outputs = self.model(input_ids=ids, use_cache=True)
            past = outputs.past_key_values
            logits = outputs.logits[:, -1]
            while True:
                feed = [False] * batch
                for b in range(batch):
                    if not active[b]:
                        continue
                    token, logp = sample_token(logits[b], specs[b], generators[b], seen[b])
                    out_ids[b].append(token)
                    out_logp[b].append(logp)
                    if token in stop_ids[b]:
                        finish[b], active[b] = "stop", False
                    elif len(out_ids[b]) == max_tokens[b]:
                        active[b] = False
                    else:
                        feed[b] = True
                if not any(feed):
                    break
                for b in range(batch):
                    if feed[b]:
                        rows[b].append(recorded + b)
                        seen[b] = torch.cat([seen[b], seen[b].new_tensor([out_ids[b][-1]])])
                step_ids = torch.tensor([[o[-1]] for o in out_ids], dtype=torch.long, device=device)
                outputs = self.model(input_ids=step_ids, past_key_values=past, use_cache=True)
                recorded += batch
                past = outputs.past_key_values
                logits = outputs.logits[:, -1]
        return [
            Generation(out_ids[b], out_logp[b], finish[b], routing=recorder, extra={"routing_rows": rows[b]})
            for b in range(batch)
        ]


@torch.no_grad()
def teacher_forced_logprobs(model: nn.Module, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> torch.Tensor:
    """log p(response_t | prompt, response_<t) from one full forward (no cache), fp32 [len(response)]."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(response_ids)], dtype=torch.long, device=device)
    logits = model(input_ids=ids).logits[0].float()
    n = len(prompt_ids)
    logp = torch.log_softmax(logits[n - 1 : -1], dim=-1)
    return logp.gather(-1, ids[0, n:, None]).squeeze(-1)
