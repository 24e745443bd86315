"""dp=2 step time of the R3 recipe's routing features against verl's plain GRPO, and routing bytes at dp=1 vs dp=2.

Both variants run verl's ``main_ppo`` on the CPU runtime with the same shape: two actor ranks and two ``hf`` rollout
replicas (``trainer.n_gpus_per_node=2``), 4 prompts x 4 samples per step, ``balance_batch`` and dynamic batch sizes
on, every response exactly ``max_response_length`` tokens (``ignore_eos``, so both variants do the same work whatever
they sample):

* ``plain``: verl's GRPO as it comes: no routing export, ``router_replay.mode`` disabled, verl's agent-loop manager,
  verl's ``sync`` trainer (no monitor, no guard).
* ``r3``: what ``recipes/fsdp/minirl_n4_r3.yaml`` adds around the loss: the rollout exports its routed experts, the
  plugin's agent-loop manager validates and compacts them (uint8, ragged, prompt rows once per group; per-sample
  seeds; the trainer sorts each batch into dispatch order), R3 replays them in the old-log-prob pass and in the
  update, and ``stable_sync`` runs the monitor and the guard (the recipe's ``routing_interval``, default 10: routing
  metrics fetched every 10th step). The loss stays verl's GRPO, so only the routing machinery differs.

The routing variants share a group's prompt rows as the recipe does: only where that saves
``share_prompt_rows_min_bytes`` (default 2 MiB; this shape's groups save a few hundred bytes, so they keep their
rows). ``--share-min-bytes 0`` shares every group, which is what the side entries of
:mod:`verl_stable.transport.sharing` cost at this shape; ``--no-share-prompt-rows`` turns sharing off
(``+verl_stable.routing.share_prompt_rows=false``).

``--ladder`` adds the steps in between, each one feature more than the last, all on ``stable_sync`` with its monitor
and guard switched off (verl's own ``sync`` trainer would make the plugin's workers put samples one after another,
see ``transport/seeding.py``): ``export`` (the rollout's routing through the plugin's agent-loop manager;
with ``router_replay.mode`` disabled the engine only observes it: records the routing it used and logs the
disagreement) and ``replay`` (+ R3).

The runs alternate in ABBA order (plain, r3, r3, plain, plain, r3, ...) so that a change in the host's load hits every
variant alike and a steady drift cancels; the figure is verl's own ``timing_s/step`` of every step after the first (the first
holds start-up work): the median per variant and their ratio (target <= 1.05x), and the ratio of the two run medians
of each round with the median of those ratios (a round is one run of each variant, back to back), and the ratio of
the fastest steps: other processes' load only adds time to a step, so on a shared host the fastest steps are the
least disturbed estimate. Next to it the machine's busy CPU seconds per step (Linux: ``/proc/stat``'s user, nice,
system, irq and softirq time, read whenever verl's metrics file gains a step; time the hypervisor gave other machines
is not counted): a step's wall time also holds waits for a core, its CPU time only the work done (on the 2-core host
of docs/explanation/benchmarks.md the two moved together: the same work took more CPU seconds in some runs than in
others). Both come with a 90 % interval of the pooled median ratio, resampling whole rounds. And the CPU seconds per
step of each process role (actor ranks, agent-loop worker, rollout servers, trainer, TransferQueue, Ray, ...; every
process's ``/proc/<pid>/stat`` after step 1 and after the last step): where the features' cost lands, r3 minus plain.
``--report-only`` prints the figures of the runs already in ``--workdir`` (several folders: their rounds pooled).

Routing bytes per step (the transport's counters, ``stable/routing/transport/*``, computed on the driver from every
sample's boundary counters) are read from the r3 runs at dp=2 and from one r3 run at dp=1, with the actors' reads of
the shared prompt rows (``stable/routing/transport/side_*``, counted by each rank's ``SharedRowReader``): TransferQueue
reads in all and per rank, entries fetched and entries served from what a rank already held, bytes fetched.

    python benchmarks/bench_dp_overhead.py [--runs 2] [--steps 4] [--ladder] [--routing-interval 10] [--skip-dp1]
        [--response-length 4] [--hidden-size 64] [--share-min-bytes N | --no-share-prompt-rows]
        [--workdir /tmp/bench_dp ...] [--report-only]

``--response-length`` / ``--hidden-size`` scale the per-token work (generation steps, sequence length) and the
model: a cost per call or per step stays the same while the step grows, a cost per token grows with it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import threading
import time
from pathlib import Path

VARIANTS = ("plain", "export", "replay", "r3")  # each adds one feature to the one before
PHASES = ("gen", "old_log_prob", "update_actor", "update_weights")
TRANSPORT = ("bytes", "verl_bytes", "bytes_ratio", "samples", "prompt_groups_shared", "shared_prompt_rows")
POLL_S = 0.02
"""verl's trainer waits for the rollout by polling TransferQueue (``VERL_STABLE_POLL_INTERVAL_S``; the CPU runs' default
0.1 s): ``gen`` is rounded up to the next poll, so at 0.1 s a few milliseconds more rollout work could show up as a
0.1 s step. 20 ms keeps that rounding well below the differences measured."""
SIDE_READS = ("side_reads", "side_reads_per_rank", "side_read_entries", "side_read_reused", "side_read_bytes")
CPU_FILE = "cpu_steps.json"
CLOCKS = (("timing_s/step", "wall"), ("cpu_s/step", "busy CPU"))
COVERAGE = ("response_rows", "response_replayed_rows", "prompt_rows", "prompt_replayed_rows")


ROLES = (
    ("WorkerDict", "actor ranks"),
    ("AgentLoopWorker", "agent-loop worker"),
    ("RolloutServer", "rollout servers"),
    ("TaskRunner", "trainer"),
    ("TransferQueue", "TransferQueue"),
    ("StorageUnit", "TransferQueue"),
    ("RewardLoop", "reward"),
    ("main_ppo", "driver"),
    ("ray", "Ray (raylet, GCS, idle workers, ...)"),
)
"""Process title (Ray names a worker process ``ray::<Class>.<method>``) -> role; the first match wins, else "other"."""


def process_role(title: str) -> str:
    """The role of a process by its title (:data:`ROLES`)."""
    return next((role for part, role in ROLES if part in title), "other")


def process_cpu() -> dict[int, tuple[float, str]]:
    """``{pid: (user + system CPU seconds, title)}`` of every process (Linux ``/proc``; empty elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            title = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # the process ended while we looked
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; utime, stime are fields 14, 15
        out[int(entry.name)] = ((int(fields[11]) + int(fields[12])) / tick, title)
    return out


class StepCpuClock:
    """The machine's busy CPU seconds between consecutive steps of verl's file logger, and who spent them.

    A thread watches ``metrics_path`` and, whenever it gains lines, reads the first line of ``/proc/stat`` (jiffies
    since boot: user nice system idle iowait irq softirq steal ...). Busy = user + nice + system + irq + softirq; idle,
    iowait and steal (another virtual machine's turn on the core) are not work of this run. The busy seconds of step
    ``k`` are those between the line of step ``k - 1`` and the line of step ``k``; the first step has none. At the
    first and the ``last_line``-th line it also reads every process's CPU time (:func:`process_cpu`): the CPU seconds
    per step of each role (:data:`ROLES`) over steps 2..``last_line``. Off Linux (no ``/proc/stat``) it records nothing.
    """

    STAT = Path("/proc/stat")

    def __init__(self, metrics_path: Path, last_line: int, poll_s: float = 0.01) -> None:
        self.metrics_path = Path(metrics_path)
        self.last_line = last_line
        self.poll_s = poll_s
        self.marks: list[tuple[int, float]] = []  # (lines in the metrics file, busy seconds since boot)
        self.processes: dict[int, dict[int, tuple[float, str]]] = {}  # line -> process_cpu() at that line
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def busy_s(self) -> float:
        user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in self.STAT.read_text().split()[1:8])
        return (user + nice + system + irq + softirq) / self._tick

    def __enter__(self) -> StepCpuClock:
        if self.STAT.exists():
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _watch(self) -> None:
        size, lines = -1, 0
        while not self._stop.wait(self.poll_s):
            try:
                now = self.metrics_path.stat().st_size
            except FileNotFoundError:
                continue
            if now == size:
                continue
            busy = self.busy_s()
            size = now
            count = self.metrics_path.read_bytes().count(b"\n")
            if count > lines:
                lines = count
                self.marks.append((count, busy))
                if count in (1, self.last_line):
                    self.processes[count] = process_cpu()

    def per_line(self) -> dict[int, float]:
        """``{line: busy seconds since the line before}`` (1-based lines; a mark that covers several new lines at
        once, which a 10 ms poll makes unlikely, is left out)."""
        out = {}
        for (prev_lines, prev_busy), (lines, busy) in itertools.pairwise(self.marks):
            if lines == prev_lines + 1:
                out[lines] = round(busy - prev_busy, 3)
        return out

    def per_role(self) -> dict[str, float]:
        """``{role: CPU seconds per step}`` over steps 2..``last_line`` (empty unless both snapshots were taken)."""
        first, last = self.processes.get(1), self.processes.get(self.last_line)
        if first is None or last is None or self.last_line < 2:
            return {}
        roles: dict[str, float] = {}
        for pid, (cpu, title) in last.items():
            before, before_title = first.get(pid, (0.0, title))
            role = process_role(before_title or title)
            roles[role] = roles.get(role, 0.0) + (cpu - before) / (self.last_line - 1)
        return {role: round(cpu, 4) for role, cpu in sorted(roles.items())}

    def record(self) -> dict:
        """What ``cpu_steps.json`` holds: ``{"per_line": ..., "per_role": ...}``."""
        return {"per_line": self.per_line(), "per_role": self.per_role()}


def attach_cpu(rows: list[dict], cpu_path: Path) -> list[dict]:
    """``rows`` (one per metrics line) with ``cpu_s/step`` from ``cpu_path`` (the run's :class:`StepCpuClock` record),
    and on the last row ``cpu_role_s/<role>`` (the run's CPU seconds per step of each role)."""
    if not cpu_path.exists():
        return rows
    record = json.loads(cpu_path.read_text())
    if "per_line" not in record:  # written before the roles were recorded: the per-line figures alone
        record = {"per_line": record, "per_role": {}}
    per_line = {int(k): v for k, v in record["per_line"].items()}
    rows = [{**row, "cpu_s/step": per_line[i]} if i in per_line else row for i, row in enumerate(rows, start=1)]
    if rows and record["per_role"]:
        rows[-1] = {**rows[-1], **{f"cpu_role_s/{role}": cpu for role, cpu in record["per_role"].items()}}
    return rows


def overrides(
    variant: str,
    assets,
    workdir: Path,
    *,
    steps: int,
    dp: int,
    routing_interval: int,
    response_length: int = 4,
    share_prompt_rows: bool = True,
    share_min_bytes: int | None = None,
) -> list[str]:
    """The hydra overrides of one run of ``variant`` at ``dp`` actor ranks (and as many rollout replicas)."""
    from verl_stable.toy import launch
    from verl_stable.transport.options import MANAGER_FQN

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    level = VARIANTS.index(variant)
    ov = launch.cpu_overrides(
        assets,
        steps=steps,
        max_response_length=response_length,
        routing_capture=level >= 1,
        metrics_logger=("file",),
    )
    ov += [
        f"trainer.default_local_dir={workdir / 'ckpt'}",
        f"trainer.n_gpus_per_node={dp}",
        f"ray_kwargs.ray_init.num_gpus={dp}",  # one fake GPU per actor rank and rollout replica
        "trainer.balance_batch=True",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=256",
        "actor_rollout_ref.rollout.ignore_eos=True",  # the same number of tokens in both variants
    ]
    if level >= 1:
        ov += [f"+actor_rollout_ref.rollout.agent.agent_loop_manager_class={MANAGER_FQN}"]
        ov += ["trainer.v1.trainer_mode=stable_sync"]
        if not share_prompt_rows:
            ov.append("+verl_stable.routing.share_prompt_rows=false")
        elif share_min_bytes is not None:
            ov.append(f"+verl_stable.routing.share_prompt_rows_min_bytes={share_min_bytes}")
    if level >= 2:
        ov.append("+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3")
    if level >= 3:
        ov.append(f"+stable.monitor.routing_interval={routing_interval}")
    elif level >= 1:
        ov += ["+stable.monitor.enable=false", "+stable.guard.enable=false"]
    return ov


def run(
    variant: str,
    assets,
    workdir: Path,
    *,
    steps: int,
    dp: int,
    routing_interval: int,
    response_length: int = 4,
    poll_s: float = POLL_S,
    share_prompt_rows: bool = True,
    share_min_bytes: int | None = None,
) -> list[dict]:
    from verl_stable.toy import launch
    from verl_stable.toy.trainer_process import set_aside

    ov = overrides(
        variant,
        assets,
        workdir,
        steps=steps,
        dp=dp,
        routing_interval=routing_interval,
        response_length=response_length,
        share_prompt_rows=share_prompt_rows,
        share_min_bytes=share_min_bytes,
    )
    t0 = time.perf_counter()
    metrics = workdir / "metrics.jsonl"
    # the clock counts this run's lines only: an earlier run's metrics and CPU record are moved aside, not deleted
    set_aside(workdir, (metrics.name, CPU_FILE))
    with StepCpuClock(metrics, last_line=steps) as clock:
        proc = launch.run_main_ppo(ov, workdir, timeout_s=3600, poll_interval_s=poll_s)
    if proc.returncode != 0:
        raise SystemExit(f"main_ppo ({variant}, dp={dp}) failed, see {workdir / 'main_ppo.log'}")
    (workdir / CPU_FILE).write_text(json.dumps(clock.record()))
    rows = attach_cpu(launch.read_metrics(metrics), workdir / CPU_FILE)
    print(f"  {variant:5s} dp={dp}: {len(rows)} steps, run wall {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in rows)


def pooled_ratio_interval(
    base: list[list[dict]], mine: list[list[dict]], key: str, *, draws: int = 2000, level: float = 0.90, seed: int = 0
) -> tuple[float, float]:
    """A percentile-bootstrap interval of ``median(mine) / median(base)`` over the pooled steps of all runs.

    Rounds (run ``i`` of each variant, measured back to back) are resampled with replacement as a whole, so the
    interval holds the spread between runs (start-up placement, the host's load of the moment), not only between
    the steps of one run.
    """
    rng = random.Random(seed)
    rounds = [(b, m) for b, m in zip(base, mine, strict=True) if b and m]
    ratios = []
    for _ in range(draws):
        picked = [rounds[rng.randrange(len(rounds))] for _ in rounds]
        ratios.append(_median([r for _, m in picked for r in m], key) / _median([r for b, _ in picked for r in b], key))
    ratios.sort()
    tail = (1.0 - level) / 2
    return ratios[int(tail * (draws - 1))], ratios[int((1.0 - tail) * (draws - 1))]


def report_timing(runs: dict[str, list[list[dict]]]) -> None:
    """Print step times of ``{variant: [rows of run 0, rows of run 1, ...]}`` (rounds pair run i of each variant)."""
    names = list(runs)
    steady = {v: [[r for r in rows if r["step"] >= 2] for rows in runs[v]] for v in names}
    flat = {v: [r for rows in steady[v] for r in rows] for v in names}
    last = max(r["step"] for r in flat["plain"])
    for key, label in CLOCKS:
        timed = {v: [[r for r in rows if key in r] for rows in steady[v]] for v in names}
        pooled = {v: [r for rows in timed[v] for r in rows] for v in names}
        if not all(pooled.values()):
            print(f"\n({label} seconds per step: not recorded)")
            continue
        print(f"\n{label} seconds per step ({key}), steps 2..{last}, {len(runs['plain'])} runs per variant:")
        step = {v: _median(pooled[v], key) for v in names}
        fastest = {v: min(r[key] for r in pooled[v]) for v in names}
        for v in names:
            phases = (
                "; medians: " + ", ".join(f"{p} {_median(pooled[v], f'timing_s/{p}'):.3f}" for p in PHASES)
                if key == "timing_s/step"
                else ""
            )
            print(f"  {v:6s}: median {step[v]:.3f} s, fastest {fastest[v]:.3f} s ({len(pooled[v])} steps{phases})")
        for v in names[1:]:
            ratios = [
                _median(mine, key) / _median(base, key)
                for base, mine in zip(timed["plain"], timed[v], strict=True)
                if base and mine
            ]
            low, high = pooled_ratio_interval(timed["plain"], timed[v], key)
            # another process's load only ever adds time to a step: the fastest steps are the least disturbed
            print(
                f"  {v} / plain: medians {step[v] / step['plain']:.3f}x (90 % interval over rounds {low:.3f}x-"
                f"{high:.3f}x), fastest steps {fastest[v] / fastest['plain']:.3f}x, per round (run medians) "
                + ", ".join(f"{r:.3f}x" for r in ratios)
                + (" (target <= 1.05x)" if v == "r3" else "")
            )
    print(
        "  fastest phase times, s: "
        + "; ".join(
            p + " " + "/".join(f"{min(r.get(f'timing_s/{p}', 0.0) for r in flat[v]):.3f}" for v in names)
            for p in PHASES
        )
        + f" ({'/'.join(names)})"
    )
    report_roles(runs)


def report_roles(runs: dict[str, list[list[dict]]]) -> None:
    """Print each role's CPU seconds per step (median over a variant's runs) and each variant's difference to plain."""
    names = list(runs)
    per_run = {
        v: [rows[-1] for rows in runs[v] if rows and any(k.startswith("cpu_role_s/") for k in rows[-1])] for v in names
    }
    if not all(per_run.values()):
        return
    roles = sorted({k for v in names for row in per_run[v] for k in row if k.startswith("cpu_role_s/")})
    print(f"\nCPU seconds per step by process role (steps 2..N; median over runs), {' / '.join(names)}:")
    for key in roles:
        med = {v: statistics.median(row.get(key, 0.0) for row in per_run[v]) for v in names}
        diffs = ", ".join(f"{v} {1e3 * (med[v] - med['plain']):+.0f} ms" for v in names[1:])
        print(f"  {key.removeprefix('cpu_role_s/'):36s} " + " / ".join(f"{med[v]:.3f}" for v in names) + f"  ({diffs})")


def report_routing(per_dp: dict[int, list[dict]]) -> None:
    """Print the routing bytes, coverage rows and prompt-row side reads per step of r3 runs at several dp sizes."""
    print("\nrouting per step (r3 runs; stable/routing/transport/* and replay coverage row counts):")
    steps = sorted(set.intersection(*({r["step"] for r in rows} for rows in per_dp.values())))
    for s in steps:
        for dp, rows in sorted(per_dp.items()):
            row = next(r for r in rows if r["step"] == s)
            transport = ", ".join(f"{k} {row.get(f'stable/routing/transport/{k}', float('nan')):g}" for k in TRANSPORT)
            coverage = ", ".join(f"{k} {row.get(f'stable/routing/coverage/{k}', float('nan')):g}" for k in COVERAGE)
            side = ", ".join(f"{k} {row.get(f'stable/routing/transport/{k}', float('nan')):g}" for k in SIDE_READS)
            print(
                f"  step {s}, dp={dp}: {transport}\n                coverage rows: {coverage}\n                {side}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="runs per variant, interleaved")
    parser.add_argument("--steps", type=int, default=4, help="steps per run (the first is not timed)")
    parser.add_argument("--ladder", action="store_true", help="also the variants between plain and r3")
    parser.add_argument("--dp", type=int, default=2, help="actor ranks of the timed runs")
    parser.add_argument("--routing-interval", type=int, default=10, help="stable.monitor.routing_interval (recipe: 10)")
    parser.add_argument("--skip-dp1", action="store_true", help="no dp=1 run for the routing bytes")
    parser.add_argument("--response-length", type=int, default=4, help="tokens per response (ignore_eos)")
    parser.add_argument("--hidden-size", type=int, default=64, help="the tiny Qwen3-MoE's hidden size")
    parser.add_argument(
        "--no-share-prompt-rows",
        action="store_true",
        help="the routing variants keep every sample's prompt rows (+verl_stable.routing.share_prompt_rows=false)",
    )
    parser.add_argument(
        "--share-min-bytes",
        type=int,
        default=None,
        help="+verl_stable.routing.share_prompt_rows_min_bytes of the routing variants (default: the recipe's, 2 MiB)",
    )
    parser.add_argument("--report-only", action="store_true", help="print the figures of the runs in --workdir")
    parser.add_argument(
        "--workdir",
        nargs="+",
        default=["/tmp/bench_dp"],
        help="where the runs go; with --report-only, several folders pool their rounds (each with --runs rounds)",
    )
    args = parser.parse_args()
    if args.steps < 2 or args.runs < 1:
        parser.error("need --steps >= 2 (the first step is not timed) and --runs >= 1")

    from verl_stable.toy import launch
    from verl_stable.toy.assets import AssetSpec, ensure_assets

    if len(args.workdir) > 1 and not args.report_only:
        parser.error("several --workdir folders only with --report-only (their rounds are pooled)")
    workdir = Path(args.workdir[0])
    kw = {
        "steps": args.steps,
        "dp": args.dp,
        "routing_interval": args.routing_interval,
        "response_length": args.response_length,
        "share_prompt_rows": not args.no_share_prompt_rows,
        "share_min_bytes": args.share_min_bytes,
    }
    names = VARIANTS if args.ladder else ("plain", "r3")
    runs: dict[str, list[list[dict]]] = {v: [] for v in names}
    if args.report_only:
        for folder in map(Path, args.workdir):
            for v in names:
                for i in range(args.runs):
                    run_dir = folder / f"{v}_{i}"
                    runs[v].append(attach_cpu(launch.read_metrics(run_dir / "metrics.jsonl"), run_dir / CPU_FILE))
    else:
        assets = ensure_assets(workdir / "assets", AssetSpec(task="copy", hidden_size=args.hidden_size))
        print(f"{args.runs} rounds of {names} in ABBA order at dp={args.dp}, {args.steps} steps each")
        for i in range(args.runs):
            for variant in names if i % 2 == 0 else names[::-1]:
                runs[variant].append(run(variant, assets, workdir / f"{variant}_{i}", **kw))
    report_timing(runs)

    per_dp = {args.dp: runs["r3"][0]}
    dp1 = workdir / "r3_dp1" / "metrics.jsonl"
    if args.report_only and dp1.exists():
        per_dp[1] = launch.read_metrics(dp1)
    elif not args.report_only and not args.skip_dp1 and args.dp != 1:
        per_dp[1] = run("r3", assets, workdir / "r3_dp1", **{**kw, "dp": 1, "steps": min(args.steps, 2)})
    report_routing(per_dp)


if __name__ == "__main__":
    main()
