"""Cross-request batching in the ``hf`` rollout server: one batch of B requests vs the same B requests one at a time.

The lab's rollout shape: the lab's tiny Qwen3-MoE (4 layers, 16 experts, top-4, hidden 64) with fp8 weights, prompts of
12 tokens, up to 4 sampled tokens, routing export on. Each round samples the same B seeded requests both ways, in ABBA
order across rounds, and the ratio serial / batched of this thread's CPU time and of wall time is taken per round
(the thread clock ignores time the process was descheduled, the main noise on a shared host). Prints the median and
IQR of the per-round ratios per batch size.

    python benchmarks/bench_generation_batching.py --rounds 20
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def bench(batch_sizes: list[int], rounds: int, max_tokens: int, precision: str) -> dict[int, dict[str, tuple]]:
    from transformers import AutoModelForCausalLM

    from verl_stable.backends.hf.generation import KVCachedSampler, SamplingSpec
    from verl_stable.backends.hf.precision import apply_precision_
    from verl_stable.backends.hf.rollout import routing_exporter
    from verl_stable.toy.assets import AssetSpec, ensure_assets

    assets = ensure_assets(Path("/tmp/bench_cpu_gen_assets"), AssetSpec(max_position_embeddings=512))
    model = AutoModelForCausalLM.from_pretrained(assets.model_dir, dtype=torch.float32).eval()
    model = apply_precision_(model, precision).eval()
    sampler = KVCachedSampler(model, max_model_len=64)
    exporter = routing_exporter(model)
    prompt = list(range(3, 15))

    def serial(specs: list) -> None:
        for spec in specs:
            gen = sampler.generate(prompt, spec, routing_capture=exporter.capture)
            exporter.to_array(gen.routing, gen.extra["routing_rows"])

    def batched(specs: list) -> None:
        gens = sampler.generate_batch([prompt] * len(specs), specs, routing_capture=exporter.capture)
        for gen in gens:
            exporter.to_array(gen.routing, gen.extra["routing_rows"])

    def timed(fn, specs) -> tuple[float, float]:
        w0, c0 = time.perf_counter(), time.thread_time()
        fn(specs)
        return time.perf_counter() - w0, time.thread_time() - c0

    out = {}
    for size in batch_sizes:
        specs = [SamplingSpec(max_tokens=max_tokens, seed=i, ignore_eos=True) for i in range(size)]
        timed(serial, specs), timed(batched, specs)  # warm-up
        wall, cpu, batched_ms = [], [], []
        for r in range(rounds):
            order = (serial, batched) if r % 2 == 0 else (batched, serial)
            t = {fn.__name__: timed(fn, specs) for fn in order}
            wall.append(t["serial"][0] / t["batched"][0])
            cpu.append(t["serial"][1] / t["batched"][1])
            batched_ms.append(1e3 * t["batched"][0])
        out[size] = {"cpu": _quartiles(cpu), "wall": _quartiles(wall), "batched_ms": _quartiles(batched_ms)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--precision", default="fp8")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    res = bench(args.batch_sizes, args.rounds, args.max_tokens, args.precision)
    print(f"serial / batched, median (IQR) of {args.rounds} interleaved rounds, {args.threads} thread(s)")
    print("| requests | thread CPU time | wall time | batch wall ms |")
    print("|---|---|---|---|")
    for size, r in res.items():
        cells = [f"{r[k][1]:.2f}x ({r[k][0]:.2f} - {r[k][2]:.2f}x)" for k in ("cpu", "wall")]
        print(f"| {size} | {cells[0]} | {cells[1]} | {r['batched_ms'][1]:.1f} |")


if __name__ == "__main__":
    main()
