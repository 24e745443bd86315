"""Where the R3 features' extra CPU lands, process role by process role: py-spy samples of a plain run beside an r3 run.

``bench_dp_overhead.py`` says how much CPU each role (actor ranks, agent-loop worker, trainer, rollout servers,
TransferQueue storage) spends per step with and without the R3 recipe's routing features; this script says in which
functions. It runs one round of ``bench_dp_overhead.py --runs 1 --steps N --skip-dp1`` (a plain run, then an r3 run)
and, once each run's agent-loop worker is up and a warm-up has passed, records every process of each role with
``py-spy record --nonblocking --format raw`` for ``--seconds`` at ``--rate`` Hz. Printed per role: the samples of
each run, and how many of them fall in stacks that hold each of :data:`FRAMES` (inclusive counts: a sample counts once
per frame name it holds). Two runs' windows see different mixes of phases, so a difference is a place to look, not a
cost.

Needs py-spy (``pip install py-spy``; not a dependency of the project) and permission to read other processes
(ptrace), as on the CI host.

    python benchmarks/profile_dp_roles.py [--steps 40] [--seconds 25] [--rate 100] [--warmup 12]
        [--workdir /tmp/profile_dp_roles] [--ladder]
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).with_name("bench_dp_overhead.py")
# the agent-loop worker's process title in each variant: its appearance says the run has reached its steps
MARKERS = {
    "plain": "AgentLoopWorkerTQ",
    "export": "CompactRoutingAgentLoopWorkerTQ",
    "replay": "CompactRoutingAgentLoopWorkerTQ",
    "r3": "CompactRoutingAgentLoopWorkerTQ",
}
LADDER = ("plain", "export", "replay", "r3")  # bench_dp_overhead --ladder's variants, in its first round's order
# role -> the Ray actor class names whose processes it holds
ROLES = {
    "actor ranks": ("WorkerDict",),
    "agent-loop worker": ("AgentLoopWorkerTQ", "CompactRoutingAgentLoopWorkerTQ"),
    "trainer": ("TaskRunnerV1",),
    "rollout servers": ("HFRolloutServer",),
    "TransferQueue storage": ("SimpleStorageUnit",),
}
FRAMES = (
    "train_batch",
    "infer_batch",
    "update_weights",
    "verl_stable/routing/",
    "verl_stable/transport/",
    "verl_stable/integration/fsdp_replay.py",
    "verl_stable/monitor/",
    "compact_agent_loop_output",
    "kv_batch_get",
    "kv_put",
    "kv_list",
    "_generate_batch",
)


def py_spy() -> str:
    """The py-spy executable: beside this interpreter, or on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.is_file() else shutil.which("py-spy")
    if found is None:
        raise SystemExit("py-spy is not installed: pip install py-spy")
    return found


def processes(name: str) -> list[int]:
    """PIDs whose command line is Ray's process title ``ray::<name>`` (optionally ``.<method>``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if title == f"ray::{name}" or title.startswith(f"ray::{name}."):
            found.append(int(entry.name))
    return found


def finished(log: Path, variant: str) -> bool:
    """Whether the bench has printed ``variant``'s end-of-run line (its processes are going or gone)."""
    return log.exists() and f"  {variant:5s} dp=" in log.read_text()


def record(variant: str, out: Path, args: argparse.Namespace, after: tuple[Path, str] | None = None) -> None:
    """Wait for ``variant``'s run (with ``after = (bench log, variant)``: first for that earlier run to end, whose
    agent-loop worker may carry the same title), then sample every role's processes at once for ``args.seconds``."""
    deadline = time.monotonic() + 600
    while after is not None and not finished(*after):
        if time.monotonic() > deadline:
            raise SystemExit(f"the {after[1]} run never ended")
        time.sleep(1)
    if after is not None:
        time.sleep(5)  # its Ray processes exit after the line
    while not processes(MARKERS[variant]):
        if time.monotonic() > deadline:
            raise SystemExit(f"the {variant} run's agent-loop worker never started")
        time.sleep(1)
    time.sleep(args.warmup)  # past the first step, which holds start-up work
    spies = []
    for role, names in ROLES.items():
        for pid in (pid for name in names for pid in processes(name)):
            path = out / f"{variant}.{role.replace(' ', '_')}.{pid}.txt"
            cmd = [py_spy(), "record", "--pid", str(pid), "--duration", str(args.seconds), "--rate", str(args.rate)]
            cmd += ["--nonblocking", "--format", "raw", "-o", str(path)]
            spies.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for spy in spies:
        spy.wait()


def counts(out: Path, variant: str, role: str) -> tuple[int, collections.Counter]:
    """Samples of ``role`` in ``variant``'s profiles, and per frame name the samples whose stack holds it."""
    total, held = 0, collections.Counter()
    for path in out.glob(f"{variant}.{role.replace(' ', '_')}.*.txt"):
        for line in path.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            if not stack or not n.isdigit():
                continue
            total += int(n)
            held.update({frame: int(n) for frame in FRAMES if frame in stack})
    return total, held


def main() -> None:
    """Run the round, record both runs, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="steps per run (long enough to outlast the sampling)")
    parser.add_argument("--seconds", type=int, default=25, help="sampling window per run")
    parser.add_argument("--rate", type=int, default=100, help="samples per second")
    parser.add_argument("--warmup", type=float, default=12.0, help="seconds after the agent-loop worker starts")
    parser.add_argument("--workdir", default="/tmp/profile_dp_roles")
    parser.add_argument(
        "--ladder",
        action="store_true",
        help="all four of bench_dp_overhead's --ladder variants (export: routing export and the compact transport, "
        "the engine observing; replay: + R3; r3: + monitor and guard), not only plain and r3",
    )
    args = parser.parse_args()
    py_spy()
    workdir = Path(args.workdir)
    out = workdir / "profiles"
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} holds earlier profiles: give another --workdir")
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(BENCH), "--runs", "1", "--steps", str(args.steps), "--skip-dp1"]
    cmd += ["--workdir", str(workdir / "runs")] + ["--ladder"] * args.ladder
    variants = LADDER if args.ladder else ("plain", "r3")
    log_path = workdir / "bench.log"
    with open(log_path, "w") as log:
        bench = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ)
        try:
            for i, variant in enumerate(variants):  # bench_dp_overhead's first ABBA round runs them in this order
                record(variant, out, args, after=(log_path, variants[i - 1]) if i else None)
        finally:
            if bench.wait() != 0:
                raise SystemExit(f"bench_dp_overhead failed: {log_path}")
    shown = " / ".join(variants)
    print(f"py-spy samples per role ({args.seconds} s at {args.rate} Hz, every process of the role), {shown}")
    for role in ROLES:
        per = [counts(out, v, role) for v in variants]
        print(f"== {role}: {' / '.join(str(total) for total, _ in per)} samples")
        for frame in FRAMES:
            if any(held[frame] for _, held in per):
                print(f"   {frame:<40} {' / '.join(f'{held[frame]:6d}' for _, held in per)}")


if __name__ == "__main__":
    main()
