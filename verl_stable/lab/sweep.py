"""The lab's sweep: one run of verl's own trainer (``main_ppo`` on the CPU runtime) per (variant, N, seed).

The sweep only orchestrates: it builds the tiny assets (:mod:`verl_stable.lab.assets`), cold-starts the model
(:mod:`verl_stable.lab.coldstart`, cached), composes each run's overrides (:func:`verl_stable.lab.variants
.run_overrides`), runs :func:`verl_stable.cpu.launch.run_main_ppo` and collects the per-step metrics verl's file
logger wrote. Every loss, estimator, replay and monitor value comes from verl + verl-stable inside that process.

Layout of the output directory::

    assets/                     tokenizer, random tiny Qwen3-MoE, parquet data
    coldstart/<hash>/           cold-started model (cache)
    runs/<variant>__N<n>__s<seed>/{main_ppo.log, metrics.jsonl, done.json}
    runs/<variant>__N<n>__s<seed>/superseded/<time>/   an earlier attempt's files, set aside when the run starts over
    metrics.jsonl               every run's per-step metrics, one JSON object per step (variant, staleness, seed, step)
    report.md, plots/*.png      see :mod:`verl_stable.lab.report`

A run is complete when its ``done.json`` records the same overrides and its metrics hold every step; complete runs are
skipped, so an interrupted sweep resumes where it stopped (an incomplete run starts over).

Nothing measured is ever deleted or truncated: a run that starts over first moves its earlier attempt's files aside
(``superseded/``), and ``out/metrics.jsonl`` is rewritten atomically (a temporary file renamed over it) as the rows it
held merged with the sweep's: a run measured again replaces its own rows, every other run's rows stay. A sweep is
checked before any work starts: an ``only`` prefix that names no run of the preset, or an ``out/metrics.jsonl`` that
cannot be read back, is refused.

Runs are independent processes (each with its own local Ray instance), so ``jobs > 1`` runs several at once. On a small
CPU host a run's wall time is dominated by start-up (each of verl's Ray actors imports torch, tensordict and verl in a
fresh process, mostly on one core), so two concurrent runs use both cores of a 2-core host; per-step numbers are
unaffected (each run is seeded and nothing is shared between runs).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from verl_stable.lab import variants as V
from verl_stable.lab.assets import Assets, AssetSpec, ensure_assets
from verl_stable.lab.coldstart import ColdStartConfig, ColdStartResult, cold_start
from verl_stable.lab.progress import ProgressBar

MAX_SEED = 2**32 - 1  # numpy's seed range; verl seeds its data shuffling with data.seed


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
        bad_seeds = [s for s in self.seeds if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= MAX_SEED]
        if bad_seeds:
            raise ValueError(f"preset {self.name!r}: seeds must be integers in [0, {MAX_SEED}], got {bad_seeds}")
        # two runs of one name would share (and clobber) one run directory
        if len(set(self.seeds)) != len(self.seeds) or len(set(self.runs)) != len(self.runs):
            raise ValueError(
                f"preset {self.name!r}: seeds and (variant, N) runs must be distinct, got seeds={list(self.seeds)} "
                f"runs={list(self.runs)}"
            )
        for variant, n in self.runs:
            V.get_variant(variant)
            if n not in V.STALENESS_CHOICES:
                raise ValueError(f"preset {self.name!r}: N must be one of {V.STALENESS_CHOICES}, got {n}")
        if self.precision not in V.PRECISIONS:
            raise ValueError(f"precision must be one of {V.PRECISIONS}, got {self.precision!r}")

    def run_specs(self) -> list[RunSpec]:
        return [RunSpec(v, n, s) for s in self.seeds for v, n in self.runs]

    def select(self, only: Sequence[str] | None = None) -> list[RunSpec]:
        """The runs whose name starts with one of the ``only`` prefixes (every run when ``only`` is empty or None).

        Raises:
            ValueError: A prefix that names no run of this preset; the message lists the preset's run names.
        """
        specs = self.run_specs()
        if not only:
            return specs
        unmatched = [p for p in only if not any(s.name.startswith(p) for s in specs)]
        if unmatched:
            raise ValueError(
                f"--only {unmatched} names no run of preset {self.name!r}; expected a prefix of one of "
                f"{[s.name for s in specs]}"
            )
        return [s for s in specs if any(s.name.startswith(p) for p in only)]


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
    try:
        record = json.loads(done.read_text())
        if not isinstance(record, dict) or record.get("digest") != overrides_digest(overrides):
            return False
        return len({r["step"] for r in read_metrics(metrics)}) >= steps
    except (ValueError, KeyError, TypeError):  # a line cut short by a killed run: incomplete, run again
        return False


def _set_aside(run_dir: Path) -> Path | None:
    """Move an earlier attempt's files of ``run_dir`` into ``run_dir/superseded/<time>/``; None if there were none.

    verl's file logger appends to ``metrics.jsonl``, so a run that starts over needs it gone; its rows were measured,
    so they are moved, never deleted.
    """
    files = [run_dir / n for n in ("metrics.jsonl", "done.json", "error.txt", "main_ppo.log") if (run_dir / n).exists()]
    if not any(f.name in ("metrics.jsonl", "done.json") for f in files):
        return None
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    dest = run_dir / "superseded" / stamp
    i = 1
    while dest.exists():
        dest = run_dir / "superseded" / f"{stamp}_{i}"
        i += 1
    dest.mkdir(parents=True)
    for f in files:
        f.rename(dest / f.name)
    return dest


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
    _set_aside(run_dir)
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


def check_sweep(
    out: str | Path,
    preset: Preset,
    *,
    only: Sequence[str] | None = None,
    jobs: int | None = None,
    timeout_s: float | None = None,
) -> list[RunSpec]:
    """What :func:`run_sweep` checks before it builds or runs anything; returns the runs it would execute.

    Raises:
        ValueError: ``jobs`` < 1, a ``timeout_s`` that is not a positive number, an ``only`` prefix naming no run of
            the preset, an ``out`` that :func:`verl_stable.recipes.check_output_dir` refuses, or an
            ``out/metrics.jsonl`` that cannot be read (the sweep would have to overwrite it at the end).
        FileNotFoundError: The recipe of one of the runs' variants is missing.
    """
    from verl_stable import recipes

    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if timeout_s is not None and not (0 < timeout_s < float("inf")):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s}")
    specs = preset.select(only)
    out = recipes.check_output_dir(out, "output directory")  # every run's model and data paths lie below it
    for variant in dict.fromkeys(s.variant for s in specs):
        recipes.recipe_path("fsdp", V.get_variant(variant).recipe)
    load_rows(out)
    return specs


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
    # refused here, before the assets and the cold start (tens of seconds) are built
    specs = check_sweep(out, preset, only=only, jobs=jobs, timeout_s=timeout_s)
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    assets, cs = prepare(out, preset)
    (out / "coldstart.json").write_text(json.dumps({**asdict(cs), "model_dir": str(cs.model_dir)}, indent=1))
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
        try:
            rc, skipped = run_one(ov, run_dir, preset.steps, lambda k: tracker.set(spec.name, k, label), timeout_s)
        except Exception as exc:  # noqa: BLE001 - one broken run is reported as failed; the others' results count
            (run_dir / "error.txt").write_text(repr(exc))
            rc, skipped = -1, False
        tracker.set(spec.name, preset.steps, label + (" (cached)" if skipped else f" ({time.monotonic() - t0:.0f}s)"))
        try:
            rows = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
        except (ValueError, KeyError) as exc:  # a line cut short by a killed run: the file stays for inspection
            (run_dir / "error.txt").write_text(f"metrics.jsonl unreadable: {exc!r}")
            rows, rc = [], rc or -1
        return RunOutcome(spec, tag_rows(rows, spec), rc, skipped, run_dir / "main_ppo.log")

    # results keep the preset's order whatever order the runs finish in
    futures: list[Future[RunOutcome]] = []
    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(execute, i, s) for i, s in enumerate(specs)]
            outcomes = [f.result() for f in futures]
    finally:
        # also on an interrupt: the runs that finished are merged, and the rows already on disk stay
        tracker.bar.close()
        finished = [f.result() for f in futures if f.done() and not f.cancelled() and f.exception() is None]
        merge_rows(out / "metrics.jsonl", finished)
    return outcomes


def _run_key(row: Any) -> tuple | None:
    if not isinstance(row, dict):
        return None
    return (row.get("variant"), row.get("staleness"), row.get("seed"))


def merge_rows(path: str | Path, outcomes: Sequence[RunOutcome]) -> list[dict]:
    """Merge the outcomes' rows into the JSON-lines file ``path`` atomically; returns the rows now in it.

    A run with new rows replaces that run's old rows (same variant, N and seed); a run that produced no rows leaves
    its old rows in place, and so do all runs not in ``outcomes``. The merged rows go to a temporary file in the same
    directory that is then renamed over ``path``, so a reader (or a crash) never sees a truncated file.

    Raises:
        ValueError: ``path`` exists but is not JSON lines (it is left untouched).
    """
    path = Path(path)
    old = load_rows(path.parent, path.name)
    fresh = [o for o in outcomes if o.rows]
    replaced = {(o.spec.variant, o.spec.staleness, o.spec.seed) for o in fresh}
    merged = [r for r in old if _run_key(r) not in replaced] + [r for o in fresh for r in o.rows]
    if not fresh and path.exists():
        return merged  # nothing new: the file stays byte for byte as it is
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            for row in merged:
                f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return merged


def load_rows(out: str | Path, name: str = "metrics.jsonl") -> list[dict]:
    """The sweep's rows from ``out/metrics.jsonl`` (empty if absent).

    Raises:
        ValueError: A line that is not a JSON object; the message names the file and the line.
    """
    path = Path(out) / name
    if not path.is_file():
        return []
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} line {i} is not JSON ({exc.msg}); expected one JSON object per line") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path} line {i} is a {type(row).__name__}; expected one JSON object per line")
        rows.append(row)
    return rows


def coldstart_line(out: str | Path) -> str:
    """One line on the cold start recorded under ``out`` (for the report header)."""
    path = Path(out) / "coldstart.json"
    if not path.exists():
        return "unknown"
    try:
        info = json.loads(path.read_text())
        return (
            f"{info['steps']} supervised steps, expected exact-match reward {info['initial_expected_reward']:.3f} -> "
            f"{info['expected_reward']:.3f}" + (" (cached)" if info.get("cached") else "")
        )
    except (ValueError, KeyError, TypeError, AttributeError):  # a hand-edited file must not cost the report
        return f"unknown ({path} is unreadable)"
