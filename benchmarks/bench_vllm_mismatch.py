"""Train-inference mismatch between vLLM's CPU build and verl's FSDP actor, measured inside verl's own trainer.

For each (vLLM dtype, actor precision) pair, one 2-step GRPO run of the tiny Qwen3-MoE (``rollout.name=vllm``, R3
through the compact transport, one update per step) and, from each step, what the paper calls the training-inference
discrepancy:

* ``flip``: fraction of (token, MoE layer) rows whose top-k expert *set* from the actor's own router differs from
  vLLM's (``stable/routing/update_0/router_disagreement``: measured before the step's update, so staleness is 0);
* ``k3``: verl's ``rollout_corr/k3_kl``, KL(mu || pi_old) per token, k3 estimator;
* ``dp_max`` / ``dp_mean``: verl's ``training/rollout_probs_diff_max`` / ``_mean`` (|p_rollout - p_actor| per token).

    .venv/bin/python benchmarks/bench_vllm_mismatch.py [--steps 2] [--workdir /tmp/bench_vllm]

Needs vLLM's CPU build (the default install). ~90 s per configuration on 2 cores.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

FP32 = "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
CONFIGS = (
    ("fp32", "fp32", [FP32]),
    ("bf16", "fp32", [FP32]),
    ("bf16", "bf16 autocast (verl's default)", []),
)


def main(argv: list[str] | None = None) -> int:
    from verl_stable.toy import launch
    from verl_stable.toy.assets import ensure_assets
    from verl_stable.transport.options import MANAGER_FQN

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--workdir", default="/tmp/bench_vllm_mismatch")
    args = parser.parse_args(argv)
    root = Path(args.workdir)
    assets = ensure_assets(root / "assets", launch.asset_spec("vllm"))
    print(f"{'vLLM':>5} {'actor':>31} {'step':>4} {'flip':>8} {'k3':>10} {'dp_max':>9} {'dp_mean':>9} {'wall_s':>7}")
    for dtype, actor, extra in CONFIGS:
        name = f"{dtype}_{actor.split()[0]}"
        overrides = launch.cpu_overrides(
            assets, steps=args.steps, precision=dtype, routing_capture=True, metrics_logger=("file",), engine="vllm"
        )
        overrides += [
            *extra,
            f"trainer.default_local_dir={root / name / 'checkpoints'}",
            "+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3",
            f"+actor_rollout_ref.rollout.agent.agent_loop_manager_class={MANAGER_FQN}",
            "trainer.v1.trainer_mode=stable_sync",
        ]
        start = time.perf_counter()
        proc = launch.run_main_ppo(overrides, root / name, timeout_s=1200)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            print(f"{dtype:>5} {actor:>31} failed (rc {proc.returncode}); log: {root / name / 'main_ppo.log'}")
            continue
        for row in launch.read_metrics(root / name / "metrics.jsonl"):
            print(
                f"{dtype:>5} {actor:>31} {row['step']:>4} {row['stable/routing/update_0/router_disagreement']:>8.4f} "
                f"{row['rollout_corr/k3_kl']:>10.2e} {row['training/rollout_probs_diff_max']:>9.2e} "
                f"{row['training/rollout_probs_diff_mean']:>9.2e} {wall:>7.0f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
