"""Routing capture / replay overhead and the bf16-vs-fp32 routing mismatch that replay removes (CPU).

Part 1: forward+backward of a small Qwen3-MoE in training mode on a padded batch, plain vs ``capture`` vs ``replay``
(of the model's own captured routing, so the expert work is identical), interleaved in shuffled order in one run.
Prints median times and the ratios to plain (target: capture and replay each <= 1.03x).

Part 2: a bf16 copy and the fp32 original of a tiny Qwen3-MoE (4 layers, top-4 of 16 experts) on 16 x 64 random
tokens: routing disagreement and KL(bf16 || fp32) of the next-token distributions, before and after replaying the
bf16 routing in the fp32 model.

Usage: .venv/bin/python benchmarks/bench_routing.py [--rounds 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import importlib
import random
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from verl_stable.routing import capture, replay, routing_disagreement

# the package re-exports the function ``replay`` under the submodule's name
replay_module = importlib.import_module("verl_stable.routing.replay")


def qwen3_moe(hidden: int, layers: int, experts: int, top_k: int, seed: int = 0, init: float = 0.02):
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        initializer_range=init,
        max_position_embeddings=1024,
    )
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg)


def batch(b: int, s: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 512, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    for i in range(b):  # left padding of varied length
        mask[i, : (i * s) // (2 * b)] = 0
    return ids, mask


def overhead(rounds: int) -> None:
    model = qwen3_moe(hidden=128, layers=4, experts=16, top_k=4).train()
    ids, mask = batch(4, 128)
    with torch.no_grad(), capture(model) as rec:
        model(ids, attention_mask=mask)
    own = rec.trace

    def step(mode: str) -> float:
        model.zero_grad(set_to_none=True)
        start = time.thread_time()
        if mode == "plain":
            model(ids, attention_mask=mask).logits.float().logsumexp(-1).mean().backward()
        elif mode == "capture":
            with capture(model) as rec:
                model(ids, attention_mask=mask).logits.float().logsumexp(-1).mean().backward()
            _ = rec.trace
        else:
            with replay(model, own):
                model(ids, attention_mask=mask).logits.float().logsumexp(-1).mean().backward()
        return time.thread_time() - start

    modes = ["plain", "capture", "replay"]
    for mode in modes * 2:  # warm-up
        step(mode)
    times: dict[str, list[float]] = {m: [] for m in modes}
    rng = random.Random(0)
    for _ in range(rounds):
        order = modes[:]
        rng.shuffle(order)
        for mode in order:
            times[mode].append(step(mode))
    med = {m: statistics.median(t) for m, t in times.items()}
    best = {m: min(t) for m, t in times.items()}
    # per-round ratios pair each mode with the plain step run next to it, which cancels slow drifts in machine load
    ratios = {m: [x / p for x, p in zip(times[m], times["plain"], strict=True)] for m in modes}
    paired = {m: statistics.median(r) for m, r in ratios.items()}
    iqr = {m: statistics.quantiles(r, n=4, method="inclusive") for m, r in ratios.items()}
    tokens = int(mask.sum())
    print(
        f"[overhead] Qwen3-MoE 4 layers, top-4 of 16 experts, hidden 128, {tokens} tokens, fwd+bwd, {rounds} rounds, "
        "CPU time of the (single) compute thread"
    )
    for m in modes:
        print(
            f"  {m:8s} median {med[m] * 1e3:8.2f} ms  ratio {med[m] / med['plain']:.3f}x   "
            f"best {best[m] * 1e3:8.2f} ms  ratio {best[m] / best['plain']:.3f}x   "
            f"paired median ratio {paired[m]:.3f}x (IQR {iqr[m][0]:.3f}-{iqr[m][2]:.3f}x)"
        )
    print(
        f"  trace: {own.nbytes} bytes for {own.num_tokens} tokens ({own.ids.dtype}, {own.nbytes // own.num_tokens} B/token)"
    )


def hook_cost(steps: int) -> None:
    """CPU time spent inside the routing hooks and context set-up, measured by instrumenting them.

    Wall-clock ratios on a shared CPU are noisy at the percent level; this counts the added work directly (it
    excludes the autograd backward of the recomputed gate weights in replay, a softmax + gather per MoE layer).
    """
    model = qwen3_moe(hidden=128, layers=4, experts=16, top_k=4).train()
    ids, mask = batch(4, 128)
    with torch.no_grad(), capture(model) as rec:
        model(ids, attention_mask=mask)
    own = rec.trace
    spent = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.thread_time() - start

        return wrapper

    names = ("_on_site", "_pre_forward", "_post_forward")
    originals = {name: getattr(replay_module._RoutingSession, name) for name in names}
    for name in names:
        setattr(replay_module._RoutingSession, name, timed(originals[name]))
    try:
        result = {}
        for mode in ("capture", "replay"):
            spent[0], plain = 0.0, 0.0
            for _ in range(steps):
                model.zero_grad(set_to_none=True)
                start = time.thread_time()
                model(ids, attention_mask=mask).logits.float().logsumexp(-1).mean().backward()
                plain += time.thread_time() - start
                start = time.thread_time()
                ctx = capture(model) if mode == "capture" else replay(model, own)
                with ctx as session:
                    spent[0] += time.thread_time() - start
                    model.zero_grad(set_to_none=True)
                    model(ids, attention_mask=mask).logits.float().logsumexp(-1).mean().backward()
                    start = time.thread_time()
                    if mode == "capture":
                        _ = session.trace
                spent[0] += time.thread_time() - start
            result[mode] = (spent[0] / steps, plain / steps)
    finally:
        for name in names:
            setattr(replay_module._RoutingSession, name, originals[name])
    print(f"[hook cost] CPU time inside routing hooks + context entry/exit (+ trace assembly), {steps} steps")
    for mode, (cost, plain) in result.items():
        print(
            f"  {mode:8s} {cost * 1e3:7.3f} ms per step = {cost / plain:.2%} of a plain fwd+bwd ({plain * 1e3:.1f} ms)"
        )


def mismatch() -> None:
    fp32 = qwen3_moe(hidden=64, layers=4, experts=16, top_k=4, init=0.1).eval()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    ids, mask = torch.randint(3, 512, (16, 64), generator=torch.Generator().manual_seed(1)), torch.ones(16, 64)
    with torch.no_grad():
        with capture(fp32) as r32:
            lp32 = fp32(ids, attention_mask=mask).logits.float().log_softmax(-1)
        with capture(bf16) as r16:
            lp16 = bf16(ids, attention_mask=mask).logits.float().log_softmax(-1)
        with replay(fp32, r16.trace), capture(fp32) as rr:
            lpr = fp32(ids, attention_mask=mask).logits.float().log_softmax(-1)

    def kl(p: torch.Tensor, q: torch.Tensor) -> float:
        return float((p.exp() * (p - q)).sum(-1).mean())

    before, after = routing_disagreement(r16.trace, r32.trace), routing_disagreement(r16.trace, rr.trace)
    print("[mismatch] tiny Qwen3-MoE (4 layers, top-4 of 16), bf16 copy vs fp32, 16 x 64 random tokens")
    print(
        f"  routing disagreement: {before['overall']:.2%} of (token, layer), {before['token_any_layer']:.1%} of tokens"
        f" -> {after['overall']:.2%} / {after['token_any_layer']:.1%} with the bf16 routing replayed in fp32"
    )
    print(f"  KL(bf16 || fp32) per token: {kl(lp16, lp32):.3e} -> {kl(lp16, lpr):.3e} with replay")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    overhead(args.rounds)
    hook_cost(steps=10)
    mismatch()


if __name__ == "__main__":
    main()
