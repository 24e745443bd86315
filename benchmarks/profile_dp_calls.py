"""Where the R3 features' step cost goes inside real dp=2 runs: per-call time of the functions on each role's path.

``bench_dp_overhead.py`` times whole steps and each process role's CPU; this script opens them up. It runs the same
two variants (``plain`` and ``r3``, the same shape and overrides, ABBA order) with a probe in every process of the run:
a ``sitecustomize`` module written to the run's ``probe`` folder and put on ``PYTHONPATH`` (the driver, the prefork
server and every Ray worker forked from it load it) that wraps a fixed list of functions (:data:`TARGETS`: verl's actor calls and its
TransferQueue bridge, the FSDP engine's passes, the plugin's replay and transport steps, the rollout server's batch,
the agent loop's compaction, the trainer's monitor hooks, TransferQueue's ``kv_*`` calls) as their modules are
imported, and records each call's wall time and the calling thread's CPU time. Every process appends one line per
call to its own file in the run's ``calls`` folder (an earlier run's is moved to ``superseded/``).

For each role and function it prints the calls per step and the median per call (the first tenth of a process's
calls are start-up and are left out), plain next to r3, and r3 - plain in milliseconds per step (per rank for the
actor ranks and the rollout servers). Thread CPU is the work a call did whatever else ran on the two cores; wall adds
the waits. For an ``async`` function both include the other coroutines that ran on its thread while it awaited: read
those as an upper bound. verl's own step phases (``timing_s/*``) are printed too. The probe adds a few microseconds
per wrapped call to both variants; the step ratio of these runs is not the benchmark's figure (that is
``bench_dp_overhead.py``'s).

    python benchmarks/profile_dp_calls.py [--runs 2] [--steps 20] [--workdir /tmp/profile_dp_calls]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_dp_overhead as bench  # noqa: E402 -- the benchmark's variants, runs and process roles

TARGETS: dict[str, list[tuple[str, str]]] = {
    "verl.utils.transferqueue_utils": [("", "_meta_to_realdata"), ("", "_update_meta_with_output")],
    "verl.workers.engine_workers": [
        ("ActorRolloutRefWorker", "compute_log_prob"),
        ("ActorRolloutRefWorker", "update_actor"),
        ("ActorRolloutRefWorker", "update_weights"),
        ("TrainingWorker", "train_mini_batch"),
        ("TrainingWorker", "infer_batch"),
        ("TrainingWorker", "train_batch"),
        ("TrainingWorker", "_postprocess_output"),
    ],
    "verl.workers.engine.fsdp.transformer_impl": [
        ("FSDPEngineWithLMHead", "forward_step"),
        ("FSDPEngine", "optimizer_step"),
    ],
    "verl_stable.integration.fsdp_replay": [
        ("RouterReplayMixin", "forward_backward_batch"),
        ("", "attach_moe_routing"),
        ("RouterReplayMixin", "_align_targets"),
        ("RouterReplayMixin", "_agreement_metrics"),
    ],
    "verl_stable.backends.hf.server": [("HFRolloutServer", "_generate_batch")],
    "verl_stable.integration.rollout.agent_loop": [("", "compact_agent_loop_output")],
    "verl.experimental.agent_loop.agent_loop": [("AgentLoopWorker", "_run_agent_loop")],
    "verl.trainer.ppo.v1.trainer_base": [("PPOTrainer", "_compute_metrics"), ("PPOTrainer", "_compute_old_log_prob")],
    "verl_stable.integration.trainer": [("StabilityMonitorMixin", "_stable_fetch")],
    "transfer_queue": [("", "kv_batch_get"), ("", "kv_batch_put"), ("", "async_kv_batch_put")],
}
"""``module -> [(class or "", function)]``: what the probe wraps, where the module defines it."""

PROBE = r"""
import functools, importlib.abc, inspect, json, os, sys, time  # noqa: E401

_OUT = os.environ.get("PROFILE_DP_CALLS_OUT")
_TARGETS = json.loads(os.environ.get("PROFILE_DP_CALLS_TARGETS", "{}"))
_state = {"pid": None, "fd": None}


def _record(name, wall, cpu):
    if _state["pid"] != os.getpid():  # a forked child starts its own file
        _state["pid"] = os.getpid()
        title = open(f"/proc/{os.getpid()}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        with open(os.path.join(_OUT, f"{os.getpid()}.title"), "w") as f:
            f.write(title[:200])
        _state["fd"] = os.open(os.path.join(_OUT, f"{os.getpid()}.tsv"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    # one unbuffered append per call: nothing is lost when Ray kills the process at the end of the run
    os.write(_state["fd"], f"{name}\t{wall * 1e3:.3f}\t{cpu * 1e3:.3f}\n".encode())


def _wrap(name, fn):
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def timed_async(*a, **k):
            w, c = time.perf_counter(), time.thread_time()
            try:
                return await fn(*a, **k)
            finally:
                _record(name + " (async)", time.perf_counter() - w, time.thread_time() - c)
        return timed_async

    @functools.wraps(fn)
    def timed(*a, **k):
        w, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            _record(name, time.perf_counter() - w, time.thread_time() - c)
    return timed


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                run = spec.loader.exec_module

                def exec_module(module, _run=run):
                    _run(module)
                    for owner_name, attr in _TARGETS[module.__name__]:
                        owner = getattr(module, owner_name) if owner_name else module
                        if attr in vars(owner):
                            setattr(owner, attr, _wrap(f"{owner_name}.{attr}".lstrip("."), vars(owner)[attr]))

                spec.loader.exec_module = exec_module
                return spec
        return None


if _OUT:
    sys.meta_path.insert(0, _Finder())
"""


def run_probed(variant: str, assets, workdir: Path, steps: int) -> list[dict]:
    """One run of ``variant`` (bench_dp_overhead's overrides) with the probe in every process."""
    from verl_stable.toy.trainer_process import set_aside

    probe_dir = workdir / "probe"
    probe_dir.mkdir(parents=True, exist_ok=True)
    (probe_dir / "sitecustomize.py").write_text(PROBE)
    set_aside(workdir, ("calls",))  # an earlier run's records are moved aside, not deleted
    out = workdir / "calls"
    out.mkdir()
    probed = {
        "PYTHONPATH": os.pathsep.join(p for p in (str(probe_dir), os.environ.get("PYTHONPATH")) if p),
        "PROFILE_DP_CALLS_OUT": str(out),
        "PROFILE_DP_CALLS_TARGETS": json.dumps(TARGETS),
    }
    with mock.patch.dict(os.environ, probed):  # the run's processes inherit the driver's environment
        return bench.run(variant, assets, workdir, steps=steps, dp=2, routing_interval=10)


def role_calls(workdir: Path) -> dict[str, dict[str, list[list[tuple[float, float]]]]]:
    """``{role: {function: [calls of process 1, calls of process 2, ...]}}`` of one run."""
    out: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for path in sorted((workdir / "calls").glob("*.tsv")):
        role = bench.process_role(path.with_suffix(".title").read_text())
        calls: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for line in path.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) == 3:  # a line cut short by the process's end is skipped
                calls[parts[0]].append((float(parts[1]), float(parts[2])))
        for name, per_call in calls.items():
            out[role][name].append(per_call)
    return out


def summarise(runs: list[Path], steps: int) -> dict[tuple[str, str], tuple[float, float, float]]:
    """``(role, function) -> (calls per step and process, median wall ms, median thread-CPU ms)``."""
    pooled: dict[tuple[str, str], list] = defaultdict(list)
    for workdir in runs:
        for role, functions in role_calls(workdir).items():
            for name, per_process in functions.items():
                pooled[(role, name)].extend(per_process)
    summary = {}
    for key, per_process in pooled.items():
        steady = [calls[len(calls) // 10 :] for calls in per_process]
        flat = [c for calls in steady for c in calls]
        if not flat:
            continue
        per_step = sum(len(calls) for calls in per_process) / len(per_process) / steps
        summary[key] = (per_step, statistics.median(c[0] for c in flat), statistics.median(c[1] for c in flat))
    return summary


def phase_medians(runs: list[list[dict]]) -> dict[str, float]:
    """verl's ``timing_s/*`` medians over steps 2.. of all runs, ms."""
    values: dict[str, list[float]] = defaultdict(list)
    for rows in runs:
        for row in rows:
            if row.get("step", 0) >= 2:
                for key, value in row.items():
                    if key.startswith("timing_s/") and isinstance(value, (int, float)):
                        values[key].append(value * 1e3)
    return {key: statistics.median(v) for key, v in values.items()}


def report(dirs: dict[str, list[Path]], rows: dict[str, list[list[dict]]], steps: int) -> None:
    plain, r3 = summarise(dirs["plain"], steps), summarise(dirs["r3"], steps)
    print("\nverl's step phases, median ms (steps 2..): plain / r3 / r3 - plain")
    phases = phase_medians(rows["plain"]), phase_medians(rows["r3"])
    for key in sorted(set(phases[0]) | set(phases[1])):
        a, b = phases[0].get(key, 0.0), phases[1].get(key, 0.0)
        print(f"  {key:32s} {a:8.1f} {b:8.1f} {b - a:+8.1f}")
    print(
        "\nper call, median (first tenth of each process's calls left out); per step: calls/step x median, per process"
        "\n  role / function                          plain: calls/step  wall ms  cpu ms |  r3: calls/step  wall ms"
        "  cpu ms | r3 - plain per step: wall ms  cpu ms"
    )
    for role in sorted({role for role, _ in plain} | {role for role, _ in r3}):
        print(f"  {role}")
        for name in sorted({n for r, n in plain if r == role} | {n for r, n in r3 if r == role}):
            a = plain.get((role, name), (0.0, 0.0, 0.0))
            b = r3.get((role, name), (0.0, 0.0, 0.0))
            wall = b[0] * b[1] - a[0] * a[1]
            cpu = b[0] * b[2] - a[0] * a[2]
            print(
                f"    {name:38s} {a[0]:7.2f} {a[1]:8.2f} {a[2]:7.2f} | {b[0]:7.2f} {b[1]:8.2f} {b[2]:7.2f} |"
                f" {wall:+8.2f} {cpu:+7.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="runs per variant, ABBA order")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workdir", default="/tmp/profile_dp_calls")
    parser.add_argument("--report-only", action="store_true", help="print the figures of the runs in --workdir")
    args = parser.parse_args()
    if args.steps < 2 or args.runs < 1:
        parser.error("need --steps >= 2 and --runs >= 1")
    from verl_stable.toy import launch
    from verl_stable.toy.assets import AssetSpec, ensure_assets

    workdir = Path(args.workdir)
    dirs = {v: [workdir / f"{v}_{i}" for i in range(args.runs)] for v in ("plain", "r3")}
    rows: dict[str, list[list[dict]]] = {"plain": [], "r3": []}
    if args.report_only:
        for variant, paths in dirs.items():
            rows[variant] = [launch.read_metrics(p / "metrics.jsonl") for p in paths]
    else:
        assets = ensure_assets(workdir / "assets", AssetSpec(task="copy"))
        print(
            f"{args.runs} rounds of plain / r3 in ABBA order at dp=2, {args.steps} steps each, probe in every process"
        )
        for i in range(args.runs):
            for variant in ("plain", "r3") if i % 2 == 0 else ("r3", "plain"):
                rows[variant].append(run_probed(variant, assets, dirs[variant][i], args.steps))
    report(dirs, rows, args.steps)


if __name__ == "__main__":
    main()
