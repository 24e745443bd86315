"""The probe from start to end: check the inputs, render the prompts, sample, score without replay and with R3 (on the
training engine ``--train-engine`` names: verl's FSDP actor or its Megatron actor), measure, advise.

:func:`run_probe` takes :class:`ProbeOptions` and returns a :class:`ProbeResult` (what :mod:`.report` writes). Every
check runs before a model is loaded; a bad input raises :class:`~verl_stable.probe.checks.ProbeInputError`. The
rollout model is released before the training model is loaded (the two never share memory), and on the ``vllm``
engine vLLM's process has ended by then.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from verl_stable.monitor.train_inference import DEFAULT_TAUS
from verl_stable.probe import advice, checks, inference, prompts
from verl_stable.probe.metrics import flip_metrics, mismatch_metrics

__all__ = ["ProbeOptions", "ProbeResult", "measure", "run_probe"]


@dataclass(frozen=True)
class ProbeOptions:
    """What to probe (the command line's options, docs/probe.md "Options")."""

    model: Path
    engine: str = "hf"
    rollout_precision: str = "bf16"
    train_dtype: str = "bf16"
    train_engine: str = "fsdp"
    data: Path | None = None
    prompt_key: str = "prompt"
    samples: int = 32
    per_prompt: int = 1
    max_tokens: int = 64
    seed: int = 0
    device: str = "cpu"
    taus: tuple[float, ...] = tuple(DEFAULT_TAUS)


@dataclass
class ProbeResult:
    """A probe's measurements.

    Attributes:
        options: the options, as plain values.
        model_kind: ``moe`` or ``dense``; ``model_type`` and ``routing`` (describe_model_routing's report) beside.
        training: what scored the samples (the training engine's forward, in words: :func:`training_forward`).
        metrics: ``{"none": {...}, "r3": {...}}`` keyed as verl logs them (``r3`` absent for a dense model).
        advice: :func:`verl_stable.probe.advice.advise`'s lines.
        notes: what the reader should know about the inputs (prompts the tokenizer does not know ...).
        samples: counts of what was sampled (``samples``, ``prompts``, ``response_tokens``, ``stopped``).
        seconds: wall time per stage.
        token_gaps: per pass, ``|log mu - log pi|`` of every sampled token (the figure's histogram; not in the JSON).
    """

    options: dict[str, Any]
    model_kind: str
    model_type: str
    routing: dict[str, Any]
    training: str
    metrics: dict[str, dict[str, float]]
    advice: dict[str, str]
    notes: list[str] = field(default_factory=list)
    samples: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    token_gaps: dict[str, list[float]] = field(default_factory=dict)


def _check_counts(options: ProbeOptions) -> None:
    for name in ("samples", "per_prompt", "max_tokens"):
        value = getattr(options, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise checks.ProbeInputError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
    if options.train_dtype not in ("fp32", "bf16"):
        raise checks.ProbeInputError(f"--train-dtype {options.train_dtype!r}: expected fp32 or bf16")


def _unknown_share(tokenizer: Any, ids: list[list[int]]) -> float:
    unk = getattr(tokenizer, "unk_token_id", None)
    total = sum(len(i) for i in ids)
    return 0.0 if unk is None or total == 0 else sum(t == unk for i in ids for t in i) / total


def _check_lengths(model_dir: Path, longest: int, max_tokens: int) -> None:
    from transformers import AutoConfig

    limit = getattr(AutoConfig.from_pretrained(str(model_dir)).get_text_config(), "max_position_embeddings", None)
    if isinstance(limit, int) and longest + max_tokens > limit:
        raise checks.ProbeInputError(
            f"the longest prompt ({longest} tokens) + --max-tokens {max_tokens} exceed the model's "
            f"max_position_embeddings {limit}; lower --max-tokens or use shorter prompts"
        )


def run_probe(options: ProbeOptions, progress: Callable[[int, int, str], None] | None = None) -> ProbeResult:
    """Run the probe (module docstring).

    Args:
        options: what to probe.
        progress: called with ``(units done, units in all, stage)`` as samples are sampled and scored (a unit: one
            sample through the rollout, the training forward, or, for a MoE, the forward with R3).

    Raises:
        ProbeInputError: a bad input (before anything is loaded; a checkpoint transformers cannot load, when loaded).
        verl_stable.probe.vllm_engine.ProbeEngineError: vLLM failed.
    """
    _check_counts(options)
    verdict = checks.classify_model(options.model)
    checks.check_engine(options.engine, options.rollout_precision, needs_routing=verdict.is_moe)
    checks.check_train_engine(options.train_engine, verdict.model_type)
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    tokenizer = prompts.load_tokenizer(options.model)
    chats = prompts.read_chats(options.data, options.prompt_key) if options.data else prompts.builtin_chats()
    of_sample = prompts.sample_prompts(len(chats), options.samples, options.per_prompt)
    rendered = prompts.prompt_set(tokenizer, chats, of_sample, verdict.model_type)
    _check_lengths(options.model, max(len(p) for p in rendered.values()), options.max_tokens)
    notes = []
    unknown = _unknown_share(tokenizer, list(rendered.values()))
    if unknown > 0.2:
        notes.append(
            f"{100 * unknown:.0f} % of the prompt tokens are the tokenizer's unknown token: these prompts do not fit "
            "this tokenizer (pass your data with --data)"
        )
    layout = None
    if verdict.is_moe:
        from transformers import AutoConfig

        from verl_stable.routing import layout_from_config

        layout = layout_from_config(AutoConfig.from_pretrained(str(options.model)))
    eos = inference.eos_token_ids(options.model, tokenizer)
    seconds["prompts"] = time.perf_counter() - start

    done, total = [0], options.samples * (3 if verdict.is_moe else 2)

    def step(stage: str) -> Callable[[int], None]:
        def advance(n: int) -> None:
            done[0] += n
            if progress is not None:
                progress(done[0], total, stage)

        return advance

    start = time.perf_counter()
    stage = f"rollout: {options.engine} {options.rollout_precision}"
    kwargs = dict(
        precision=options.rollout_precision, max_tokens=options.max_tokens, seed=options.seed, eos_ids=eos,
        layout=layout, progress=step(stage),
    )  # fmt: skip
    if options.engine == "vllm":
        from verl_stable.probe.vllm_engine import sample_vllm

        rollouts = sample_vllm(options.model, rendered, of_sample, **kwargs)
    else:
        rollouts = inference.sample_hf(options.model, rendered, of_sample, device=options.device, **kwargs)
    seconds["rollout"] = time.perf_counter() - start

    start = time.perf_counter()
    stage = f"training: {options.train_engine} {options.train_dtype}"
    with training_forward(options, verdict.model_type, layout) as (train, training):
        plain = [train.score(r) for r in _tracked(rollouts, step(stage))]
        replayed = []
        if verdict.is_moe:
            replayed = [train.score(r, replay=True) for r in _tracked(rollouts, step(f"{stage} + R3"))]
    seconds["training"] = time.perf_counter() - start
    del train  # the model goes before the metrics are computed
    if options.train_engine == "megatron" and options.device != "cpu":
        notes.append(f"the Megatron forward ran on the host (the Megatron CPU runtime), not on {options.device}")

    metrics, gaps = measure(rollouts, plain, replayed, layout, options.taus)
    options_dict = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(options).items()}
    return ProbeResult(
        options=options_dict,
        model_kind=verdict.kind,
        model_type=verdict.model_type,
        routing=verdict.routing,
        training=training,
        metrics=metrics,
        advice=advice.advise(metrics, verdict.is_moe),
        notes=notes,
        samples={
            "samples": len(rollouts),
            "prompts": len(rendered),
            "response_tokens": sum(len(r.response_ids) for r in rollouts),
            "stopped": sum(r.finish_reason == "stop" for r in rollouts),
        },
        seconds={k: round(v, 2) for k, v in seconds.items()},
        token_gaps=gaps,
    )


@contextlib.contextmanager
def training_forward(options: ProbeOptions, model_type: str, layout: Any | None) -> Iterator[tuple[Any, str]]:
    """The training side ``options.train_engine`` names, loaded for the block, and what it is in words.

    ``fsdp``: :class:`~verl_stable.probe.training.TrainingForward` (the HF model, verl's FSDP actor);
    ``megatron``: :class:`~verl_stable.probe.megatron_forward.MegatronForward` (verl's Megatron model). Each scores a
    rollout as :class:`~verl_stable.probe.training.Scored`; the model is released when the block ends.
    """
    if options.train_engine == "megatron":
        from verl_stable.probe.megatron_forward import MEGATRON_DTYPES, MegatronForward

        what = (
            f"verl's Megatron actor: mbridge local spec, megatron-core at `actor.megatron.dtype="
            f"{MEGATRON_DTYPES[options.train_dtype]}`, world size 1, on cpu (the Megatron CPU runtime)"
        )
        with MegatronForward(options.model, options.train_dtype, model_type, layout, seed=options.seed) as forward:
            yield forward, what
        return
    from verl_stable.probe.training import TrainingForward

    what = (
        f"verl's FSDP actor: the HF model at `mixed_precision.param_dtype={options.train_dtype}`, on {options.device}"
    )
    yield TrainingForward(options.model, options.train_dtype, options.device, moe=layout is not None), what


def measure(
    rollouts: list[inference.Rollout], plain: list[Any], replayed: list[Any], layout: Any | None, taus: Any
) -> tuple[dict[str, dict[str, float]], dict[str, list[float]]]:
    """The metrics of both passes (``none``; ``r3`` for a MoE) and the per-token gaps ``|log mu - log pi|``.

    Args:
        rollouts: the samples, with ``log mu`` and the engine's routing.
        plain: their :class:`~verl_stable.probe.training.Scored` forwards without replay.
        replayed: the same with R3 (empty for a dense model).
        layout: the model's routing layout (None: dense).
        taus: thresholds of F(tau).
    """
    mu = [torch.tensor(r.logp, dtype=torch.float64) for r in rollouts]
    metrics = {"none": mismatch_metrics(mu, [s.logp for s in plain], taus)}
    gaps = {"none": _gaps(mu, [s.logp for s in plain])}
    if layout is None:
        return metrics, gaps
    reference = [torch.from_numpy(r.routing) for r in rollouts]
    p_len = [len(r.prompt_ids) for r in rollouts]
    experts, moe_layers = layout.num_experts, layout.moe_layers
    metrics["none"].update(flip_metrics(reference, [s.used for s in plain], p_len, experts, moe_layers))
    metrics["r3"] = mismatch_metrics(mu, [s.logp for s in replayed], taus)
    metrics["r3"].update(flip_metrics(reference, [s.used for s in replayed], p_len, experts, moe_layers))
    natural = [s.natural for s in replayed]
    metrics["r3"].update(flip_metrics(reference, natural, p_len, experts, moe_layers, "router_disagreement"))
    gaps["r3"] = _gaps(mu, [s.logp for s in replayed])
    return metrics, gaps


def _tracked(rollouts: list[inference.Rollout], advance: Callable[[int], None]) -> Any:
    for r in rollouts:
        yield r
        advance(1)


def _gaps(mu: list[torch.Tensor], pi: list[torch.Tensor]) -> list[float]:
    values = torch.cat([(a - b.double()).abs() for a, b in zip(mu, pi, strict=True)])
    return [v for v in values.tolist() if math.isfinite(v)]
