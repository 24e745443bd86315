"""Supervised cold start of the lab's tiny MoE, so RL begins from a non-zero, non-perfect reward; cached on disk.

A random tiny model almost never answers a toy task exactly, and an exact-match binary reward then gives GRPO-style
estimators nothing to work with. The cold start is a short supervised fine-tune in plain torch (verl's SFT trainer
needs a torchrun/FSDP launch and its own dataset format: far more machinery than a few hundred CPU steps warrant):

* data: fresh examples of the task (a seed disjoint from the RL data), each the chat prompt exactly as verl renders it
  (``apply_chat_template(..., add_generation_prompt=True)``) followed by the target ``answer <|im_end|>``;
* loss: mean cross-entropy on the target tokens only, ``L = -1/|T| sum_{t in T} log pi(y_t | y_<t)``; AdamW;
* routers frozen (``freeze_routers``, default): the MoE routers keep their initial weights while attention, experts,
  embeddings and head learn the task. Trained routers of a tiny model grow wide margins between the k-th and (k+1)-th
  expert (median 0.025 -> 0.073 in 30 steps), after which fp8 rollouts flip only ~1.3 % of routing decisions instead
  of ~8 % (``benchmarks/bench_precision_flips.py``, ``docs/explanation/benchmarks.md``); keeping them at init keeps the
  routing as fragile as a large MoE's (the R3 paper measures ~10 % on Qwen3-30B-A3B), which is what the lab compares;
* stopping: every ``eval_every`` steps the *expected exact-match reward under sampling at temperature 1* is computed
  on held-out prompts, ``E[r] = mean_x pi(answer | x) * pi(<|im_end|> | x, answer)`` (the only token sequence the
  binary reward accepts), and training stops once it reaches ``target_reward`` (or after ``max_steps``).

The result (model + tokenizer, the directory verl reads) is stored under ``cache_root/<hash>`` where the hash covers
the asset spec, the cold-start config and :data:`COLDSTART_VERSION`; an existing entry is reused as is.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from verl_stable.toy import tasks
from verl_stable.toy.assets import EOS, Assets, AssetSpec

COLDSTART_VERSION = 1
MARKER = "coldstart.json"


@dataclass(frozen=True)
class ColdStartConfig:
    """Cold-start settings. Any change gives a new cache entry."""

    target_reward: float = 0.35
    max_steps: int = 400
    batch_size: int = 32
    lr: float = 3e-3
    eval_every: int = 10
    num_eval: int = 64
    seed: int = 1234
    freeze_routers: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.target_reward < 1.0:
            raise ValueError(f"target_reward must lie in (0, 1), got {self.target_reward}")
        if self.max_steps < 1 or self.batch_size < 1 or self.eval_every < 1 or self.num_eval < 1:
            raise ValueError(f"max_steps, batch_size, eval_every and num_eval must be >= 1: {self}")


@dataclass(frozen=True)
class ColdStartResult:
    """Where the cold-started model is and what it reached."""

    model_dir: Path
    expected_reward: float
    initial_expected_reward: float
    steps: int
    cached: bool


def cache_key(spec: AssetSpec, config: ColdStartConfig) -> str:
    """Content hash of everything the cold-started weights depend on."""
    payload = json.dumps({"assets": asdict(spec), "coldstart": asdict(config), "version": COLDSTART_VERSION})
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def encode_examples(tokenizer, examples: list[tasks.Example]):
    """Token ids of ``prompt + answer + eos`` per example, left-padded, with a mask of the target positions.

    Returns:
        ``(input_ids [B, T], attention_mask [B, T], target_mask [B, T])``; ``target_mask[b, t]`` marks positions whose
        token is a target (predicted from position ``t - 1``).
    """
    import torch

    rows, targets = [], []
    for ex in examples:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": ex.question}], add_generation_prompt=True, tokenize=False
        )
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        t_ids = [tokenizer.convert_tokens_to_ids(ex.answer), tokenizer.convert_tokens_to_ids(EOS)]
        if tokenizer.unk_token_id in p_ids or tokenizer.unk_token_id in t_ids:
            raise ValueError(f"example {ex} does not tokenize without <unk>")
        rows.append(p_ids + t_ids)
        targets.append([0] * len(p_ids) + [1] * len(t_ids))
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    attn = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    tmask = torch.tensor([[0] * (width - len(t)) + t for t in targets], dtype=torch.bool)
    return ids, attn, tmask


def target_logprobs(model, ids, attn, tmask):
    """Per-example sum of ``log pi(target token)`` over the target positions: ``[B]``."""
    import torch

    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (logp * tmask[:, 1:]).sum(-1)


def expected_reward(model, ids, attn, tmask) -> float:
    """Mean probability of sampling exactly ``answer <|im_end|>`` at temperature 1 (the binary reward's mean)."""
    import torch

    with torch.no_grad():
        return float(target_logprobs(model, ids, attn, tmask).exp().mean())


def router_parameters(model) -> list:
    """The MoE routers' parameters, found through the model's routing family (:mod:`verl_stable.routing.families`)."""
    from verl_stable.routing.families import bind_model

    params = []
    for site in bind_model(model).sites:
        # a router site is the router itself; a routing-method site is the MoE block, whose router is its ``gate``
        router = site.module if not hasattr(site.module, "gate") else site.module.gate
        params += list(router.parameters())
    if not params:
        raise ValueError(f"{type(model).__name__}: no router parameters found")
    return params


def trainable_parameters(model, freeze_routers: bool) -> list:
    """Every parameter, or all but the routers' (which then get ``requires_grad = False``)."""
    if not freeze_routers:
        return list(model.parameters())
    frozen = {id(p) for p in router_parameters(model)}
    for p in model.parameters():
        if id(p) in frozen:
            p.requires_grad_(False)
    return [p for p in model.parameters() if id(p) not in frozen]


def cold_start(
    assets: Assets, spec: AssetSpec, cache_root: str | Path, config: ColdStartConfig | None = None
) -> ColdStartResult:
    """Fine-tune ``assets.model_dir`` on ``spec.task`` until the expected exact-match reward reaches the target.

    Reuses ``cache_root/<cache_key>`` if it holds a finished cold start. The cold-started directory holds the model
    and the tokenizer, so it can replace ``assets.model_dir`` in a verl run.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = config or ColdStartConfig()
    out = Path(cache_root) / cache_key(spec, config)
    marker = out / MARKER
    if marker.exists():
        try:
            info = json.loads(marker.read_text())
            return ColdStartResult(out, info["expected_reward"], info["initial_expected_reward"], info["steps"], True)
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache entry is rebuilt, like a missing one
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(assets.model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(assets.model_dir), dtype=torch.float32)
    torch.manual_seed(config.seed)
    train = tasks.make_examples(spec.task, config.max_steps * config.batch_size, config.seed)
    held_out = encode_examples(tokenizer, tasks.make_examples(spec.task, config.num_eval, config.seed + 1))
    params = trainable_parameters(model, config.freeze_routers)
    optim = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    model.eval()
    initial = reached = expected_reward(model, *held_out)
    steps = 0
    while reached < config.target_reward and steps < config.max_steps:
        model.train()
        for _ in range(config.eval_every):
            chunk = train[steps * config.batch_size : (steps + 1) * config.batch_size]
            ids, attn, tmask = encode_examples(tokenizer, chunk)
            loss = -target_logprobs(model, ids, attn, tmask).sum() / tmask.sum()
            optim.zero_grad()
            loss.backward()
            optim.step()
            steps += 1
        model.eval()
        reached = expected_reward(model, *held_out)
    for p in model.parameters():  # the saved model is an ordinary trainable checkpoint
        p.requires_grad_(True)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    info = {"expected_reward": reached, "initial_expected_reward": initial, "steps": steps, "config": asdict(config)}
    (tmp / MARKER).write_text(json.dumps(info, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return ColdStartResult(out, reached, initial, steps, False)
