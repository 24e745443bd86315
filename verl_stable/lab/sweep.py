"""The lab's sweep: one run of verl's own trainer (``main_ppo`` on the CPU runtime) per (variant, N, seed).

The sweep only orchestrates: it builds the tiny assets (:mod:`verl_stable.lab.assets`), cold-starts the model
(:mod:`verl_stable.lab.coldstart`, cached), composes each run's overrides (:func:`verl_stable.lab.variants
.run_overrides`), runs :func:`verl_stable.cpu.launch.run_main_ppo` and collects the per-step metrics verl's file
logger wrote. Every loss, estimator, replay and monitor value comes from verl + verl-stable inside that process.

Layout of the output directory::

    assets/                     tokenizer, random tiny Qwen3-MoE, parquet data
    coldstart/<hash>/           cold-started model (cache)
    runs/<variant>__N<n>__s<seed>/{main_ppo.log, metrics.jsonl, done.json}
    metrics.jsonl               every run's per-step metrics, one JSON object per step (variant, staleness, seed, step)
    report.md, plots/*.png      see :mod:`verl_stable.lab.report`

A run is complete when its ``done.json`` records the same overrides and its metrics hold every step; complete runs are
skipped, so an interrupted sweep resumes where it stopped (an incomplete run starts over).

Runs are independent processes (each with its own local Ray instance), so ``jobs > 1`` runs several at once. On a small
CPU host a run's wall time is dominated by start-up (each of verl's Ray actors imports torch, tensordict and verl in a
fresh process, mostly on one core), so two concurrent runs use both cores of a 2-core host; per-step numbers are
unaffected (each run is seeded and nothing is shared between runs).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from verl_stable.lab import variants as V
from verl_stable.lab.assets import Assets, AssetSpec, ensure_assets
from verl_stable.lab.coldstart import ColdStartConfig, ColdStartResult, cold_start
from verl_stable.lab.progress import ProgressBar


@dataclass(frozen=True)
class RunSpec:
    """One training run: a variant at staleness N with a seed."""

    variant: str
    staleness: int
    seed: int = 0

    @property
    def name(self) -> str:
        return f"{self.variant}__N{self.staleness}__s{self.seed}"


@dataclass(frozen=True)
class Preset:
    """A sweep: which runs, how long, at what scale.

    Attributes:
        name: preset id.
        runs: (variant, N) pairs; each is run once per seed.
        steps: RL steps per run (``trainer.total_training_steps``).
        seeds: seeds per (variant, N).
        mini_batch_prompts: prompts per mini-batch; a step has N mini-batches.
        group_size: samples per prompt.
        task: toy task of :mod:`verl_stable.lab.tasks`.
        precision: rollout precision of the ``hf`` backend (the training engine is fp32).
        max_response_length: response token budget (answers are one digit + end of turn).
        coldstart: cold-start settings.
    """

    name: str
    runs: tuple[tuple[str, int], ...]
    steps: int
    seeds: tuple[int, ...] = (0,)
    mini_batch_prompts: int = 4
    group_size: int = 4
    task: str = "max"
    precision: str = "fp8"
    max_response_length: int = 4
    coldstart: ColdStartConfig = field(default_factory=ColdStartConfig)

    def __post_init__(self) -> None:
        if self.steps < 1 or not self.seeds or not self.runs:
            raise ValueError(f"preset {self.name!r} needs steps >= 1, a seed and a run")
        for variant, n in self.runs:
            V.get_variant(variant)
            if n not in V.STALENESS_CHOICES:
                raise ValueError(f"preset {self.name!r}: N must be one of {V.STALENESS_CHOICES}, got {n}")
        if self.precision not in V.PRECISIONS:
            raise ValueError(f"precision must be one of {V.PRECISIONS}, got {self.precision!r}")

    def run_specs(self) -> list[RunSpec]:
        return [RunSpec(v, n, s) for s in self.seeds for v, n in self.runs]


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        # <= 10 min on 2 cores (docs/lab.md): on-policy IS vs no IS; at N = 4 staleness, routing replay R3, VESPO
        Preset(
            "default",
            runs=(
                ("reinforce_no_is", 1),
                ("minirl", 1),
                ("minirl", 4),
                ("minirl_r3", 4),
                ("vespo", 4),
            ),
            steps=8,
        ),
        # R2 vs R3 against MiniRL without replay at two staleness levels (9 min 11 s on 2 cores, cold start cached)
        Preset(
            "replay",
            runs=tuple((v, n) for n in (2, 4) for v in ("minirl", "minirl_r2", "minirl_r3")),
            steps=8,
        ),
        Preset(
            "full",
            runs=tuple((v, n) for n in V.STALENESS_CHOICES for v in V.VARIANTS),
            steps=40,
            seeds=(0, 1),
            mini_batch_prompts=8,
            group_size=8,
        ),
        # the CI smoke test: one R3 run of two steps
        Preset("mini", runs=(("minirl_r3", 2),), steps=2, mini_batch_prompts=2, group_size=4),
    )
}


@dataclass
class RunOutcome:
    """What a run produced."""

    spec: RunSpec
    rows: list[dict]
    returncode: int
    skipped: bool
    log: Path


def overrides_digest(overrides: Sequence[str]) -> str:
    """Stable hash of a run's argument list (the resumability key)."""
    return hashlib.sha256("\n".join(overrides).encode()).hexdigest()[:16]


def is_complete(run_dir: Path, overrides: Sequence[str], steps: int) -> bool:
    """Whether ``run_dir`` holds a finished run of exactly these overrides with ``steps`` metric rows."""
    from verl_stable.cpu.launch import read_metrics

    done, metrics = run_dir / "done.json", run_dir / "metrics.jsonl"
    if not (done.exists() and metrics.exists()):
        return False
    if json.loads(done.read_text()).get("digest") != overrides_digest(overrides):
        return False
    return len({r["step"] for r in read_metrics(metrics)}) >= steps


def _count_lines(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except FileNotFoundError:
        return 0


def run_one(
    overrides: Sequence[str],
    run_dir: Path,
    steps: int,
    on_step: Callable[[int], None] = lambda _: None,
    timeout_s: float | None = None,
) -> tuple[int, bool]:
    """Run ``main_ppo`` unless the run is complete; calls ``on_step(steps_logged)`` while it runs.

    Returns:
        ``(returncode, skipped)``.
    """
    from verl_stable.cpu.launch import run_main_ppo

    run_dir.mkdir(parents=True, exist_ok=True)
    if is_complete(run_dir, overrides, steps):
        on_step(steps)
        return 0, True
    for stale in ("metrics.jsonl", "done.json"):
        (run_dir / stale).unlink(missing_ok=True)  # verl's file logger appends
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["proc"] = run_main_ppo(overrides, run_dir, timeout_s=timeout_s)
        except Exception as exc:  # noqa: BLE001 - reported as a failed run, the sweep goes on
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(timeout=1.0)
        on_step(_count_lines(run_dir / "metrics.jsonl"))
    on_step(_count_lines(run_dir / "metrics.jsonl"))
    if "error" in result:
        (run_dir / "error.txt").write_text(repr(result["error"]))
        return -1, False
    rc = result["proc"].returncode
    if rc == 0:
        (run_dir / "done.json").write_text(json.dumps({"digest": overrides_digest(overrides), "argv": list(overrides)}))
    return rc, False


def prepare(out: Path, preset: Preset) -> tuple[Assets, ColdStartResult]:
    """Tiny assets for the preset's task and the cold-started model (both cached under ``out``)."""
    spec = AssetSpec(task=preset.task)
    assets = ensure_assets(out / "assets", spec)
    cs = cold_start(assets, spec, out / "coldstart", preset.coldstart)
    return replace(assets, model_dir=cs.model_dir), cs


def tag_rows(rows: list[dict], spec: RunSpec) -> list[dict]:
    """verl's per-step rows with the run's identity in front."""
    return [{"variant": spec.variant, "staleness": spec.staleness, "seed": spec.seed, **r} for r in rows]


def default_jobs() -> int:
    """Concurrent runs by default: 2 when the host has at least 2 cores and 12 GiB of memory, else 1."""
    cores = os.cpu_count() or 1
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem_gib = 0.0
    return 2 if cores >= 2 and mem_gib >= 12 else 1


class _SweepProgress:
    """Sums the steps logged by concurrently running runs into one bar (thread-safe)."""

    def __init__(self, bar: ProgressBar, steps_per_run: int) -> None:
        self.bar = bar
        self.steps_per_run = steps_per_run
        self.done: dict[str, int] = {}
        self.labels: dict[str, str] = {}
        self.lock = threading.Lock()

    def set(self, name: str, steps: int, label: str) -> None:
        with self.lock:
            self.done[name] = min(steps, self.steps_per_run)
            self.labels[name] = label
            running = [lb for n, lb in self.labels.items() if self.done.get(n, 0) < self.steps_per_run]
            self.bar.update(sum(self.done.values()), " + ".join(running) if running else label)


def run_sweep(
    out: str | Path,
    preset: Preset,
    *,
    progress: ProgressBar | None = None,
    timeout_s: float | None = None,
    only: Sequence[str] | None = None,
    jobs: int | None = None,
) -> list[RunOutcome]:
    """Run every (variant, N, seed) of ``preset`` under ``out``; write ``out/metrics.jsonl`` with all rows.

    Args:
        out: output directory (created).
        preset: the sweep.
        progress: a bar over all runs' steps (None: one is drawn on stderr).
        timeout_s: per-run wall-clock limit.
        only: restrict to runs whose name (``<variant>__N<n>__s<seed>``) starts with one of these.
        jobs: runs executed concurrently (None: :func:`default_jobs`).
    """
    from verl_stable.cpu.launch import read_metrics

    jobs = default_jobs() if jobs is None else jobs
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    assets, cs = prepare(out, preset)
    (out / "coldstart.json").write_text(json.dumps({**asdict(cs), "model_dir": str(cs.model_dir)}, indent=1))
    specs = [s for s in preset.run_specs() if not only or any(s.name.startswith(p) for p in only)]
    tracker = _SweepProgress(progress or ProgressBar(total=len(specs) * preset.steps), preset.steps)

    def execute(i: int, spec: RunSpec) -> RunOutcome:
        run_dir = out / "runs" / spec.name
        ov = V.run_overrides(
            spec.variant,
            assets,
            staleness=spec.staleness,
            steps=preset.steps,
            mini_batch_prompts=preset.mini_batch_prompts,
            group_size=preset.group_size,
            precision=preset.precision,
            seed=spec.seed,
            max_response_length=preset.max_response_length,
            workdir=run_dir,
        )
        label = f"run {i + 1}/{len(specs)} {spec.variant} N={spec.staleness} seed={spec.seed}"
        t0 = time.monotonic()
        rc, skipped = run_one(ov, run_dir, preset.steps, lambda k: tracker.set(spec.name, k, label), timeout_s)
        tracker.set(spec.name, preset.steps, label + (" (cached)" if skipped else f" ({time.monotonic() - t0:.0f}s)"))
        rows = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
        return RunOutcome(spec, tag_rows(rows, spec), rc, skipped, run_dir / "main_ppo.log")

    # results keep the preset's order whatever order the runs finish in
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        outcomes = list(pool.map(execute, range(len(specs)), specs))
    tracker.bar.close()
    with open(out / "metrics.jsonl", "w") as f:
        for o in outcomes:
            for row in o.rows:
                f.write(json.dumps(row) + "\n")
    return outcomes


def load_rows(out: str | Path) -> list[dict]:
    """The sweep's rows from ``out/metrics.jsonl`` (empty if absent)."""
    path = Path(out) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def coldstart_line(out: str | Path) -> str:
    """One line on the cold start recorded under ``out`` (for the report header)."""
    path = Path(out) / "coldstart.json"
    if not path.exists():
        return "unknown"
    info = json.loads(path.read_text())
    return (
        f"{info['steps']} supervised steps, expected exact-match reward {info['initial_expected_reward']:.3f} -> "
        f"{info['expected_reward']:.3f}" + (" (cached)" if info.get("cached") else "")
    )
