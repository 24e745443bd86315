"""Where an R3 pass of verl's FSDP engine spends the time a plain pass does not: timed A/B, then a profile diff.

In one process (gloo, world size 1, the CPU runtime, one torch thread), three engines built through verl's
``EngineRegistry`` on the toy assets' tiny Qwen3-MoE exactly as the FSDP device check builds them
(``tests/gpu/check_fsdp_replay.py``'s ``build_engine``, imported so the two cannot drift): ``disabled`` (verl's
engine, no replay), ``R2`` (only to record the model's own routing once) and ``R3`` (the project's replay engine).
A batch of ``--samples`` sequences of ``--min-len`` to ``--min-len + 4`` tokens (the dp-overhead benchmark's scale)
in micro-batches of ``--micro-batch`` is run through ``infer_batch`` (the old-log-prob pass) and
``forward_backward_batch`` with a backward (the update), three variants interleaved ``--rounds`` times: ``plain``
(no routing in the batch), ``observe`` (the disabled engine given the routing: it records what it used and logs the
disagreement, as the dp benchmark's ``export`` variant does) and ``R3``; thread CPU medians and their ratio to
plain. R3 replays the recorded routing, so the expert work is the same; the difference is the routing field verl
splits into micro-batches and the replay itself (aligning targets, the router hooks, the metrics). Then each variant's ``infer_batch`` runs ``--profiled``
times under ``cProfile`` and the functions whose cumulative time differs most are printed, ms per pass (the
profiler inflates Python-heavy code roughly twofold: read the list as where, the timed ratio as how much).

    python benchmarks/profile_fsdp_pass.py [--rounds 20] [--profiled 10] [--samples 16] [--micro-batch 2] [--top 30]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
import check_fsdp_replay as device_check  # noqa: E402 -- the device check's engine builder and passes


def profile_rows(run: Any, passes: int) -> dict[str, tuple[float, int]]:
    """``function -> (cumulative seconds, calls)`` over ``passes`` calls of ``run``."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(passes):
        run()
    profiler.disable()
    rows = {}
    for (path, line, name), (_, calls, _, cumulative, _) in pstats.Stats(profiler).stats.items():
        rows[f"{path.split('site-packages/')[-1].split(os.getcwd() + '/')[-1]}:{line}({name})"] = (cumulative, calls)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--profiled", type=int, default=10)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    os.environ.setdefault("VERL_PLATFORM", "cpu")
    torch.set_num_threads(1)
    from verl.utils import tensordict_utils as tu

    from verl_stable.cpu import runtime
    from verl_stable.integration import fsdp_engine
    from verl_stable.toy.assets import AssetSpec, ensure_assets

    runtime.register()
    device_check.init_distributed("cpu")
    fsdp_engine.register_engine()
    assets = ensure_assets(Path(tempfile.mkdtemp(prefix="profile_fsdp_pass_")) / "assets", AssetSpec(task="copy"))
    engines = {mode: device_check.build_engine(assets.model_dir, mode) for mode in ("disabled", "R2", "R3")}
    vocab = int(engines["R3"].module.config.vocab_size)
    lengths = [args.min_len + i % 5 for i in range(args.samples)]
    recorded, _ = device_check.infer(engines["R2"], device_check.make_batch(lengths, vocab))
    routes = recorded["routed_experts"].values().cpu()

    def batch(routed: bool, replay: bool | None) -> Any:
        data = device_check.make_batch(lengths, vocab, routed=routes if routed else None)
        tu.assign_non_tensor(data, micro_batch_size_per_gpu=args.micro_batch)
        if replay is not None:
            tu.assign_non_tensor(data, enable_routing_replay=replay)
        return data

    variants = {
        "plain": (engines["disabled"], False, False),
        "observe": (engines["disabled"], True, None),
        "R3": (engines["R3"], True, True),
    }
    times: dict[tuple[str, str], list[float]] = {(v, p): [] for v in variants for p in ("infer", "update")}
    for _ in range(args.rounds):
        for name, (engine, routed, replay) in variants.items():
            for phase, run in (("infer", device_check.infer), ("update", device_check.train)):
                data = batch(routed, replay)
                start = time.thread_time()
                run(engine, data)
                times[(name, phase)].append(time.thread_time() - start)
    print(
        f"verl FSDP engine on CPU, tiny Qwen3-MoE, {args.samples} sequences of {min(lengths)}-{max(lengths)} tokens, "
        f"micro-batches of {args.micro_batch}, {args.rounds} interleaved rounds, one thread (thread CPU medians)"
    )
    for phase in ("infer", "update"):
        base = statistics.median(times[("plain", phase)])
        shown = "  ".join(
            f"{v} {statistics.median(times[(v, phase)]) * 1e3:7.1f} ms ({statistics.median(times[(v, phase)]) / base:.3f}x)"
            for v in variants
        )
        print(f"  {phase:<6} {shown}")
    rows = {name: profile_rows(lambda e=engine, o=routed, r=replay: device_check.infer(e, batch(o, r)), args.profiled)
            for name, (engine, routed, replay) in variants.items() if name != "observe"}  # fmt: skip
    plain, r3 = rows["plain"], rows["R3"]
    diffs = sorted(((r3.get(k, (0, 0))[0] - plain.get(k, (0, 0))[0], k) for k in set(plain) | set(r3)), reverse=True)
    print(f"  infer_batch under cProfile, {args.profiled} passes each: cumulative ms per pass, plain / R3 (calls)")
    for diff, key in diffs[: args.top]:
        (p, pc), (r, rc) = plain.get(key, (0.0, 0)), r3.get(key, (0.0, 0))
        per = args.profiled
        print(
            f"    +{diff * 1e3 / per:6.2f}  {p * 1e3 / per:7.2f} / {r * 1e3 / per:7.2f}  ({pc // per}/{rc // per})  {key}"
        )


if __name__ == "__main__":
    main()
