"""Forward + backward time of the ``minirl`` and ``vespo`` policy losses against verl's ``vanilla``.

All three run through verl's registry on the same tensors (default 64 x 8192 tokens, ragged mask, rollout IS
weights present, ``seq-mean-token-sum`` with verl's global batch info), interleaved in one run so that machine
noise hits them alike. Prints the median time of each and its ratio to ``vanilla`` (target: <= 1.3x).

    python benchmarks/bench_losses.py [--batch 64] [--length 8192] [--reps 15] [--device cpu|cuda] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import verl  # noqa: F401  (loads the verl.plugins entry point, which registers minirl / vespo)
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.config import ActorConfig

from verl_stable.integration.losses import StablePolicyLossConfig

LOSSES = ("vanilla", "minirl", "vespo")


def make_inputs(batch: int, length: int, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random log-probs with a ragged right-padded mask, sequence-constant advantages and IS weights."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=g)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    log_prob = -torch.rand(batch, length, generator=g) * 3
    old = log_prob + 0.05 * torch.randn(batch, length, generator=g)
    adv = torch.randn(batch, 1, generator=g).expand(batch, length).contiguous()
    weights = torch.rand(batch, length, generator=g).clamp(max=5.0) * 2
    tensors = {"log_prob": log_prob, "old_log_prob": old, "advantages": adv, "response_mask": mask}
    tensors["rollout_is_weights"] = weights
    return {k: v.to(device) for k, v in tensors.items()}


def make_config(loss_mode: str, batch: int, tokens: int) -> ActorConfig:
    config = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=batch,
        clip_ratio_low=0.2,
        clip_ratio_high=0.27,
        loss_agg_mode="seq-mean-token-sum",
        policy_loss=StablePolicyLossConfig(loss_mode=loss_mode),
    )
    # As verl's ppo_loss sets it before calling the loss.
    config.global_batch_info.update(dp_size=1, batch_num_tokens=tokens, global_batch_size=batch, loss_scale_factor=None)
    return config


def run_once(loss_mode: str, config: ActorConfig, inputs: dict[str, torch.Tensor], device: torch.device) -> float:
    leaf = inputs["log_prob"].clone().requires_grad_(True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss, _ = get_policy_loss_fn(loss_mode)(
        old_log_prob=inputs["old_log_prob"],
        log_prob=leaf,
        advantages=inputs["advantages"],
        response_mask=inputs["response_mask"],
        loss_agg_mode=config.loss_agg_mode,
        config=config,
        rollout_is_weights=inputs["rollout_is_weights"],
    )
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is the most stable)")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    inputs = make_inputs(args.batch, args.length, device)
    tokens = int(inputs["response_mask"].sum())
    configs = {name: make_config(name, args.batch, tokens) for name in LOSSES}
    times: dict[str, list[float]] = {name: [] for name in LOSSES}
    for rep in range(args.warmup + args.reps):
        order = LOSSES if rep % 2 == 0 else LOSSES[::-1]  # alternate order so neither goes first every time
        for name in order:
            elapsed = run_once(name, configs[name], inputs, device)
            if rep >= args.warmup:
                times[name].append(elapsed)

    medians = {name: statistics.median(values) for name, values in times.items()}
    print(
        f"policy loss forward+backward, {args.batch} x {args.length} tokens ({tokens} valid), device {device}, "
        f"{args.reps} interleaved reps, median"
    )
    for name in LOSSES:
        ratio = medians[name] / medians["vanilla"]
        print(f"  {name:8s} {medians[name] * 1e3:9.2f} ms   ratio to vanilla {ratio:5.2f}x")
    worst = max(medians[n] / medians["vanilla"] for n in ("minirl", "vespo"))
    print(f"target <= 1.30x: {'met' if worst <= 1.3 else 'NOT met'} (worst {worst:.2f}x)")
    return {name: medians[name] / medians["vanilla"] for name in LOSSES}


if __name__ == "__main__":
    main()
