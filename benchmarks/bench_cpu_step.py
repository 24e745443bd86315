"""CPU runtime benchmark: verl step time and phase shares, and generation throughput with routing capture.

1. End to end (``--steps`` GRPO steps of the tiny MoE through ``main_ppo``), once with verl's fixed 2 s replay-buffer
   poll and once with the plugin's ``VERL_STABLE_POLL_INTERVAL_S`` (default 0.1 s): steady-state seconds per step
   (median over steps >= 2) and the share of each phase from verl's ``timing_s/*`` metrics; "idle/other" is the rest
   of the step (mostly the replay buffer's polling sleep).
2. Generation tokens/s of the ``hf`` sampler with and without routing capture, interleaved in one process over many
   rounds; the median and IQR of the per-round cost ratios, in thread CPU time and in wall time (target: capture
   costs at most 1.03x).

    python benchmarks/bench_cpu_step.py [--skip-e2e] [--steps 6] [--rounds 60] [--workdir /tmp/bench_cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch

PHASES = ("gen", "old_log_prob", "adv", "update_actor", "update_weights")


def bench_e2e(workdir: Path, steps: int, poll: float | None) -> dict[str, float]:
    from verl_stable.toy.assets import ensure_assets
    from verl_stable.toy.launch import cpu_overrides, read_metrics, run_main_ppo

    assets = ensure_assets(workdir / "assets")
    name = f"poll_{poll if poll is not None else 'verl'}"
    ov = cpu_overrides(assets, steps=steps, metrics_logger=("file",))
    ov.append(f"trainer.default_local_dir={workdir / name / 'ckpt'}")
    t0 = time.perf_counter()
    proc = run_main_ppo(ov, workdir / name, poll_interval_s=poll, timeout_s=1800)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"main_ppo failed, see {workdir / name / 'main_ppo.log'}")
    rows = [m for m in read_metrics(workdir / name / "metrics.jsonl") if m["step"] >= 2]
    step = statistics.median(m["timing_s/step"] for m in rows)
    out = {"wall_s": wall, "step_s": step}
    for phase in PHASES:
        out[phase] = statistics.median(m.get(f"timing_s/{phase}", 0.0) for m in rows)
    out["idle/other"] = max(0.0, step - sum(out[p] for p in PHASES))
    return out


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, med, q3


def bench_generation(rounds: int, max_tokens: int) -> dict[str, tuple[float, float, float]]:
    """Generation with and without routing capture, interleaved: per-round cost ratios (capture / plain).

    Each round runs both variants back to back, in ABBA order across rounds (neither always runs second), on the
    same prompt and seed. Per round, the ratio capture/plain is taken of two clocks: wall time, and the CPU time of
    this (single compute) thread, which does not count time the thread was descheduled for other processes -- the
    dominant noise on a shared host. Returns ``{name: (q1, median, q3)}`` of the per-round ratios and of plain
    tokens/s; capture includes building verl's ``routed_experts`` array.
    """
    from transformers import AutoModelForCausalLM

    from verl_stable.backends.hf.generation import KVCachedSampler, SamplingSpec
    from verl_stable.backends.hf.rollout import routing_exporter
    from verl_stable.toy.assets import AssetSpec, ensure_assets

    assets = ensure_assets(Path("/tmp/bench_cpu_gen_assets"), AssetSpec(max_position_embeddings=512))
    model = AutoModelForCausalLM.from_pretrained(assets.model_dir, dtype=torch.float32).eval()
    sampler = KVCachedSampler(model, max_model_len=512)
    capture, to_array, _ = routing_exporter(model)
    spec = SamplingSpec(max_tokens=max_tokens, ignore_eos=True, seed=0)
    prompt = list(range(3, 19))

    def run(with_capture: bool) -> tuple[float, float]:
        w0, c0 = time.perf_counter(), time.thread_time()
        gen = sampler.generate(prompt, spec, routing_capture=capture if with_capture else None)
        if with_capture:
            to_array(gen.routing)
        return time.perf_counter() - w0, time.thread_time() - c0

    for _ in range(3):  # warm-up
        run(False), run(True)
    wall, cpu, tps = [], [], []
    for i in range(rounds):
        order = (False, True) if i % 2 == 0 else (True, False)
        t = {flag: run(flag) for flag in order}
        wall.append(t[True][0] / t[False][0])
        cpu.append(t[True][1] / t[False][1])
        tps.append(max_tokens / t[False][0])
    return {
        "wall": _quantiles(wall),
        "cpu": _quantiles(cpu),
        "tokens_per_s": _quantiles(tps),
        "hook_share": _quantiles(
            _capture_work_share(sampler, prompt, spec, capture, to_array, rounds=max(10, rounds // 3))
        ),
    }


def _capture_work_share(sampler, prompt, spec, capture, to_array, rounds: int) -> list[float]:
    """Per round: thread CPU time inside the capture code (router hooks, set-up/tear-down, export array) divided by a
    plain generation's. Counting the added work directly is immune to the load of other processes; it leaves out
    torch's own hook dispatch (a few microseconds per router call)."""
    from verl_stable.backends.hf.rollout import RouterIdsRecorder

    spent = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.thread_time() - start

        return wrapper

    @contextlib.contextmanager
    def timed_capture(model):
        start = time.thread_time()
        context = capture(model)
        recorder = context.__enter__()
        spent[0] += time.thread_time() - start
        try:
            yield recorder
        finally:
            start = time.thread_time()
            context.__exit__(None, None, None)
            spent[0] += time.thread_time() - start

    original = RouterIdsRecorder.make_hook
    RouterIdsRecorder.make_hook = staticmethod(lambda rows: timed(original(rows)))
    try:
        shares = []
        for _ in range(rounds):
            start = time.thread_time()
            sampler.generate(prompt, spec)
            plain = time.thread_time() - start
            spent[0] = 0.0
            gen = sampler.generate(prompt, spec, routing_capture=timed_capture)
            start = time.thread_time()
            to_array(gen.routing)
            spent[0] += time.thread_time() - start
            shares.append(spent[0] / plain)
    finally:
        RouterIdsRecorder.make_hook = original
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--workdir", default="/tmp/bench_cpu")
    parser.add_argument("--rounds", type=int, default=60, help="interleaved generation rounds")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)

    gen = bench_generation(args.rounds, args.max_tokens)
    q1, med, q3 = gen["tokens_per_s"]
    print(f"generation: {med:.0f} tok/s plain (IQR {q1:.0f}-{q3:.0f}), {args.max_tokens} tokens x {args.rounds} rounds")
    for clock in ("cpu", "wall"):
        q1, med, q3 = gen[clock]
        print(
            f"  routing capture / plain, {clock + ' time':9s}: median {med:.3f}x, IQR {q1:.3f}-{q3:.3f}x "
            "(target <= 1.03x)"
        )
    q1, med, q3 = gen["hook_share"]
    print(f"  CPU time inside the capture code: median {med:.2%} of a plain generation (IQR {q1:.2%}-{q3:.2%})")

    if args.skip_e2e:
        return
    workdir = Path(args.workdir)
    for poll in (None, 0.1):
        r = bench_e2e(workdir, args.steps, poll)
        label = "verl default 2 s poll" if poll is None else f"VERL_STABLE_POLL_INTERVAL_S={poll}"
        shares = ", ".join(f"{k} {r[k] / r['step_s']:.0%}" for k in (*PHASES, "idle/other"))
        print(f"e2e [{label}]: {r['step_s']:.2f} s/step steady state (run wall {r['wall_s']:.0f} s); {shares}")


if __name__ == "__main__":
    main()
