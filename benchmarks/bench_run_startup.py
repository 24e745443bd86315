"""Where a verl run's start-up goes: the CPU of each of its processes, and what the prefork server and skipping
unused imports save.

Runs the toy's GRPO through ``python -m verl.trainer.main_ppo`` on the CPU runtime (``--steps`` steps, ``hf``
rollout) several times, rotating through the conditions (``--conditions``; each repeat reverses the previous order,
so no condition always runs first):

* ``default``: the launcher's default: every process forked from the prefork server
  (:mod:`verl_stable.cpu.prefork`) and ``VERL_STABLE_SKIP_IMPORTS`` chosen by
  :func:`verl_stable.toy.trainer_process.skip_groups` (``megatron,vllm`` for this run);
* ``skip``: the same imports skipped, no prefork server (``VERL_STABLE_PREFORK=0``): the launcher before session 21;
* ``megatron``: no server, the variable set to ``megatron`` alone (vLLM imported), which separates the two groups'
  savings;
* ``none``: no server, the variable set empty, which the launcher leaves alone (verl then imports megatron-core and
  vLLM in each process wherever they are installed).

While a run goes, a thread samples every process below this one (the driver, Ray's daemons, every Ray worker) each
``--interval`` seconds with psutil: its role (the Ray actor class a worker becomes, else the program), when it was
first seen, and its CPU time (user + system). Printed per condition: the run's wall time, verl's own step time (the
sum of ``timing_s/step``), start-up and shutdown (the rest), the CPU of every process, the wall time the run would
need if its processes never waited on one another (their CPU spread over the host's cores, a floor no ordering of
verl's start-up can beat), and each condition's ratios to ``none``. Run it on an otherwise idle host; every number
comes from one invocation.

    python benchmarks/bench_run_startup.py [--steps 2] [--repeats 2] [--conditions default,skip,megatron,none]
        [--workdir /tmp/bench_startup]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from pathlib import Path

import psutil

from verl_stable.compat.skip_imports import ENV_SKIP_IMPORTS
from verl_stable.cpu import prefork


def _role(proc: psutil.Process) -> str | None:
    """What a process is: the Ray actor class (or task) a worker runs, else its program; ``None`` if unknown yet.

    A forked child keeps the server's command line until Ray renames it (``ray::...``): the server's own process is
    the one started by this benchmark, a child that Ray never renames is the driver.
    """
    cmd = proc.cmdline()
    if not cmd:
        return None  # exiting: keep what it was seen as
    head = cmd[0]
    if any("verl_stable.cpu.prefork_server import main" in part for part in cmd):
        return "prefork server" if proc.ppid() == os.getpid() else "main_ppo (driver, forked)"
    if any(part.endswith("prefork_client.py") for part in cmd):
        return "prefork client"
    if head.startswith("ray::"):
        name = head.split(":")[2] if head.count(":") >= 2 else head[len("ray::") :]
        return name.split(".")[0] or None  # "ray::TaskRunnerV1.run" -> "TaskRunnerV1"
    if "verl.trainer.main_ppo" in cmd:
        return "main_ppo (driver)"
    args = [a for a in cmd[1:] if not a.startswith("-")] if Path(head).name.startswith("python") else [head]
    return Path(args[0]).name if args else Path(head).name


class Sampler:
    """Samples the CPU time of every descendant of this process until stopped."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.procs: dict[int, dict] = {}
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            now = time.perf_counter() - self.t0
            for proc in me.children(recursive=True):
                try:
                    with proc.oneshot():
                        cpu = proc.cpu_times()
                        role = _role(proc)
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
                entry = self.procs.setdefault(proc.pid, {"first_s": now, "role": role or "?", "cpu_s": 0.0})
                entry["cpu_s"] = max(entry["cpu_s"], cpu.user + cpu.system)
                if role and role != "IDLE" and not role.startswith(("setup_worker", "default_worker")):
                    entry["role"] = role  # a Ray worker is named for what it runs once it runs something
            self._stop.wait(self.interval_s)


# condition -> (the value VERL_STABLE_SKIP_IMPORTS gets (None: unset, so the launcher chooses), VERL_STABLE_PREFORK)
CONDITIONS: dict[str, tuple[str | None, str]] = {
    "default": (None, "1"),
    "skip": (None, "0"),
    "megatron": ("megatron", "0"),
    "none": ("", "0"),
}


def one_run(workdir: Path, assets, steps: int, condition: str, interval_s: float) -> dict:  # noqa: ANN001
    from verl_stable.toy.launch import cpu_overrides, read_metrics, run_main_ppo

    ov = cpu_overrides(assets, steps=steps, metrics_logger=("file",))
    ov.append(f"trainer.default_local_dir={workdir / 'ckpt'}")
    before = os.environ.get(ENV_SKIP_IMPORTS), os.environ.get(prefork.ENV_SWITCH)
    skip, use_prefork = CONDITIONS[condition]
    if skip is None:
        os.environ.pop(ENV_SKIP_IMPORTS, None)  # the launcher chooses
    else:
        os.environ[ENV_SKIP_IMPORTS] = skip
    os.environ[prefork.ENV_SWITCH] = use_prefork
    try:
        with Sampler(interval_s) as sampler:
            t0 = time.perf_counter()
            proc = run_main_ppo(ov, workdir, timeout_s=1800)
            wall = time.perf_counter() - t0
    finally:
        for name, value in zip((ENV_SKIP_IMPORTS, prefork.ENV_SWITCH), before, strict=True):
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    if proc.returncode != 0:
        raise SystemExit(f"main_ppo failed, see {workdir / 'main_ppo.log'}")
    steps_s = sum(m["timing_s/step"] for m in read_metrics(workdir / "metrics.jsonl"))
    return {"wall_s": wall, "steps_s": steps_s, "procs": list(sampler.procs.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="runs per condition (order reversed each repeat)")
    parser.add_argument(
        "--conditions",
        default="default,skip,none",
        help=f"comma-separated, from {', '.join(CONDITIONS)}; 'none' is required",
    )
    parser.add_argument("--interval", type=float, default=0.5, help="sampling interval, seconds")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench_startup"))
    args = parser.parse_args()

    from verl_stable.toy.assets import ensure_assets

    conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
    unknown = [c for c in conditions if c not in CONDITIONS]
    if unknown or "none" not in conditions or len(set(conditions)) != len(conditions):
        parser.error(f"--conditions: distinct names from {', '.join(CONDITIONS)}, 'none' among them; got {conditions}")
    cores = len(os.sched_getaffinity(0))
    assets = ensure_assets(args.workdir / "assets")
    order = [c for i in range(args.repeats) for c in (conditions if i % 2 == 0 else conditions[::-1])]
    results: dict[str, list[dict]] = {c: [] for c in conditions}
    for i, condition in enumerate(order):
        res = one_run(args.workdir / f"run{i}_{condition}", assets, args.steps, condition, args.interval)
        results[condition].append(res)
        cpu = sum(p["cpu_s"] for p in res["procs"])
        print(
            f"run {i + 1}/{len(order)} {condition}: wall {res['wall_s']:.1f} s, verl's steps {res['steps_s']:.1f} s, "
            f"CPU of its processes {cpu:.1f} s",
            flush=True,
        )

    summary = {}
    for condition, runs in results.items():
        wall = statistics.median(r["wall_s"] for r in runs)
        steps = statistics.median(r["steps_s"] for r in runs)
        cpu = statistics.median(sum(p["cpu_s"] for p in r["procs"]) for r in runs)
        summary[condition] = (wall, steps, cpu)
        skip, use_prefork = CONDITIONS[condition]
        setting = " as the launcher chooses" if skip is None else f"={skip!r}"
        print(
            f"\n{condition} ({ENV_SKIP_IMPORTS}{setting}, {prefork.ENV_SWITCH}={use_prefork}), "
            f"median of {len(runs)}: wall {wall:.1f} s, verl's steps {steps:.1f} s, start-up and shutdown "
            f"{wall - steps:.1f} s = {(wall - steps) / wall:.0%}; CPU of all processes {cpu:.1f} s, "
            f"spread over {cores} cores {cpu / cores:.1f} s"
        )
        last = runs[-1]
        for p in sorted(last["procs"], key=lambda p: p["first_s"]):
            if p["cpu_s"] >= 0.5:
                print(f"  from {p['first_s']:5.1f} s  CPU {p['cpu_s']:5.1f} s  {p['role']}")
    wn, sn, cn = summary["none"]
    for condition in conditions:
        if condition == "none":
            continue
        w, s, c = summary[condition]
        print(
            f"ratios {condition} / none: wall {w / wn:.3f}, start-up and shutdown {(w - s) / (wn - sn):.3f}, "
            f"CPU {c / cn:.3f}"
        )


if __name__ == "__main__":
    main()
