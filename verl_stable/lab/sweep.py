"""The lab's sweep: one run of verl's own trainer (``main_ppo`` on the CPU runtime) per (variant, N, seed).

The sweep only orchestrates the runs of a preset (:mod:`verl_stable.lab.presets`): it builds the tiny assets (:mod:`verl_stable.toy.assets`), cold-starts the model
(:mod:`verl_stable.lab.coldstart`, cached), composes each run's overrides (:func:`verl_stable.lab.variants
.run_overrides`), runs :func:`verl_stable.toy.launch.run_main_ppo` and collects the per-step metrics verl's file
logger wrote. Every loss, estimator, replay and monitor value comes from verl + verl-stable inside that process.

Layout of the output directory::

    assets/                     tokenizer, random tiny Qwen3-MoE, parquet data
    coldstart/<hash>/           cold-started model (cache)
    runs/<variant>__N<n>__s<seed>/{main_ppo.log, metrics.jsonl, done.json, outcome.json}
    runs/<variant>__N<n>__s<seed>/superseded/<time>/   an earlier attempt's files, set aside when the run starts over
    metrics.jsonl               every run's per-step metrics, one JSON object per step (variant, staleness, seed, step)
    report.md, plots/*.png      see :mod:`verl_stable.lab.report`

A run is complete when its ``done.json`` records the same overrides and its metrics hold every step; complete runs are
skipped, so an interrupted sweep resumes where it stopped (an incomplete run starts over).

Nothing measured is ever deleted or truncated: a run that starts over first moves its earlier attempt's files aside
(``superseded/``, :func:`verl_stable.toy.trainer_process.set_aside`, as ``verl-stable run`` does), and
``out/metrics.jsonl`` is rewritten atomically (a temporary file renamed over it) as the rows it held merged with the
sweep's: a run measured again replaces its own rows, every other run's rows stay (:mod:`verl_stable.lab.results`;
sweeps sharing ``out`` take turns through a file lock). A sweep is checked before any work starts: an ``only`` prefix
that names no run of the preset, an ``out`` in a symlink loop, an ``out/metrics.jsonl`` that cannot be read back (a
malformed row, a directory), or a ``report.md`` that is a directory is refused.

A run whose attempt fails while starting (before its first step, for a reason of the machinery rather than of its
config or of the training code: :func:`startup_failure`) is started once more; its outcome counts the attempts and
keeps the first attempt's error line, a run that fails for good carries the first error line of its log
(:func:`first_error_line`), and both go to ``runs/<name>/outcome.json``, from which the report names them and the
seeds each comparison lacks (docs/explanation/lab.md, "Runs side by side").

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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from verl_stable import env_vars
from verl_stable.argtypes import resolve_path
from verl_stable.lab import variants as V
from verl_stable.lab.attempts import (
    FORCED_START_FAILURE,
    GUARD_STOPPED,
    START_RETRIES,
    first_error_line,
    forced_start_failures,
    guard_stop_reason,
    is_forced,
    startup_failure,
)
from verl_stable.lab.coldstart import ColdStartResult, cold_start
from verl_stable.lab.presets import MAX_SEED, PRESETS, Preset, RunSpec
from verl_stable.lab.progress import ProgressBar
from verl_stable.lab.results import RunOutcome, coldstart_line, load_rows, merge_rows, tag_rows
from verl_stable.recipes.strict_yaml import read_recipe_file
from verl_stable.toy.assets import Assets, ensure_assets
from verl_stable.toy.trainer_process import set_aside

__all__ = [
    "MAX_SEED",
    "PRESETS",
    "Preset",
    "RunOutcome",
    "RunSpec",
    "check_sweep",
    "coldstart_line",
    "default_jobs",
    "is_complete",
    "load_rows",
    "merge_rows",
    "overrides_digest",
    "prepare",
    "run_one",
    "run_sweep",
    "tag_rows",
]


def overrides_digest(overrides: Sequence[str]) -> str:
    """Stable hash of a run's argument list (the resumability key)."""
    return hashlib.sha256("\n".join(overrides).encode()).hexdigest()[:16]


def is_complete(run_dir: Path, overrides: Sequence[str], steps: int) -> bool:
    """Whether ``run_dir`` holds a finished run of exactly these overrides with ``steps`` metric rows."""
    from verl_stable.toy.launch import read_metrics

    done, metrics = run_dir / "done.json", run_dir / "metrics.jsonl"
    if not (done.exists() and metrics.exists()):
        return False
    try:
        record = json.loads(done.read_text())
        if not isinstance(record, dict) or record.get("digest") != overrides_digest(overrides):
            return False
        if isinstance(record.get(GUARD_STOPPED), str):  # the guard ended it early: that is its outcome
            return True
        return len({r["step"] for r in read_metrics(metrics)}) >= steps
    except (ValueError, KeyError, TypeError):  # a line cut short by a killed run: incomplete, run again
        return False


# a lab run's files: set aside together when the run starts over (``checkpoints``: verl's ``default_local_dir``, with
# the guard's run summary and any checkpoint, which verl would otherwise resume from)
RUN_FILES = ("metrics.jsonl", "done.json", "error.txt", "main_ppo.log", "outcome.json", "checkpoints")


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
    from verl_stable.toy.launch import run_main_ppo

    run_dir.mkdir(parents=True, exist_ok=True)
    if is_complete(run_dir, overrides, steps):
        on_step(steps)
        return 0, True
    set_aside(run_dir, RUN_FILES)
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
    stopped = guard_stop_reason(run_dir) if rc != 0 else None
    if rc == 0 or stopped is not None:
        done = {"digest": overrides_digest(overrides), "argv": list(overrides)}
        (run_dir / "done.json").write_text(json.dumps({**done, GUARD_STOPPED: stopped} if stopped else done))
    return rc, False


def prepare(out: Path, preset: Preset) -> tuple[Assets, ColdStartResult]:
    """Tiny assets for the preset's task and the cold-started model (both cached under ``out``)."""
    from verl_stable.toy.launch import asset_spec

    spec = replace(asset_spec(preset.engine, preset.task), num_experts_per_tok=preset.top_k)
    # each engine's model has its own shape (vLLM's CPU attention needs head size 32), and each top-k its own routers:
    # their own assets and cold start
    assets = ensure_assets(out / asset_dir_name(preset), spec)
    cs = cold_start(assets, spec, out / "coldstart", preset.coldstart)
    return replace(assets, model_dir=cs.model_dir), cs


def asset_dir_name(preset: Preset) -> str:
    """``assets`` for the hf engine at top-4; ``assets_vllm``, ``assets_top2``, ``assets_vllm_top2`` otherwise."""
    name = "assets" if preset.engine == "hf" else f"assets_{preset.engine}"
    return name if preset.top_k == 4 else f"{name}_top{preset.top_k}"


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
            the preset, a malformed recipe file (:func:`verl_stable.recipes.strict_yaml.read_recipe_file`), a
            ``VERL_STABLE_*`` variable :func:`verl_stable.env_vars.check_all` refuses (or a forced
            start-up failure naming no run of the sweep), an ``out`` that cannot be resolved (a symlink loop) or that
            :func:`verl_stable.recipes.check_output_dir` refuses, an ``out/metrics.jsonl`` that cannot be read (the
            sweep merges into it at the end; a directory there included), or a ``report.md`` / ``plots`` in the way of
            the report (:func:`verl_stable.lab.report.output_problem`).
        FileNotFoundError: The recipe of one of the runs' variants is missing.
    """
    from verl_stable import recipes
    from verl_stable.lab.report import output_problem

    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if timeout_s is not None and not (0 < timeout_s < float("inf")):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s}")
    specs = preset.select(only)
    # the runs' processes read them (the launcher moves a run's earlier files aside first): refused before any work
    env_vars.check()
    unmatched = [p for p in forced_start_failures() if not any(s.name.startswith(p) for s in specs)]
    if unmatched:
        raise ValueError(
            f"{env_vars.LAB_FORCE_START_FAILURE.name} names {unmatched}, a prefix of no run of this sweep; expected "
            f"{env_vars.LAB_FORCE_START_FAILURE.accepted}, of {[s.name for s in specs]}"
        )
    # every run's model and data paths lie below it
    out = recipes.check_output_dir(resolve_path(out, "output directory"), "output directory")
    for variant in dict.fromkeys(s.variant for s in specs):
        # each run composes on it: a malformed file is refused here, naming it, not once per run after the assets
        read_recipe_file(recipes.recipe_path("fsdp", V.get_variant(variant).recipe))
    load_rows(out)
    problem = output_problem(out)
    if problem is not None:
        raise ValueError(problem)
    return specs


def run_sweep(
    out: str | Path,
    preset: Preset,
    *,
    progress: ProgressBar | None = None,
    timeout_s: float | None = None,
    only: Sequence[str] | None = None,
    jobs: int | None = None,
    runner: Callable[..., tuple[int, bool]] | None = None,
    force_start_failure: Sequence[str] | None = None,
    announce: Callable[[Sequence[RunSpec]], None] | None = None,
) -> list[RunOutcome]:
    """Run every (variant, N, seed) of ``preset`` under ``out``; write ``out/metrics.jsonl`` with all rows.

    A run whose attempt fails while starting (:func:`startup_failure`) is started once more (:data:`START_RETRIES`;
    the failed attempt's files go to ``superseded/``); its outcome counts the attempts and keeps the first attempt's
    error line. A run that fails again, or fails otherwise, carries the first error line of its log
    (:func:`first_error_line`). Each outcome is also written to ``runs/<name>/outcome.json`` for the report.

    Args:
        out: output directory (created).
        preset: the sweep.
        progress: a bar over all runs' steps (None: one is drawn on stderr).
        timeout_s: per-run wall-clock limit.
        only: restrict to runs whose name (``<variant>__N<n>__s<seed>``) starts with one of these.
        jobs: runs executed concurrently (None: :func:`default_jobs`).
        runner: what runs one attempt, called like :func:`run_one` (None: :func:`run_one`); tests pass their own.
        force_start_failure: test-only, run-name prefixes whose first attempt is made to fail in Ray's start-up
            (:data:`FORCED_START_FAILURE`); None reads :data:`FORCE_START_FAILURE_ENV`.
        announce: called once the assets and the cold start are ready, before any run starts, with the runs still to
            do (those not complete in ``out``, :func:`is_complete`): what a resumed sweep will actually run.
    """
    from verl_stable.toy.launch import read_metrics

    jobs = default_jobs() if jobs is None else jobs
    # refused here, before the assets and the cold start (tens of seconds) are built
    specs = check_sweep(out, preset, only=only, jobs=jobs, timeout_s=timeout_s)
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    assets, cs = prepare(out, preset)
    (out / "coldstart.json").write_text(json.dumps({**asdict(cs), "model_dir": str(cs.model_dir)}, indent=1))
    tracker = _SweepProgress(progress or ProgressBar(total=len(specs) * preset.steps), preset.steps)
    prefixes = forced_start_failures() if force_start_failure is None else tuple(force_start_failure)

    def overrides_of(spec: RunSpec) -> list[str]:
        return V.run_overrides(
            spec.variant,
            assets,
            staleness=spec.staleness,
            steps=preset.steps,
            mini_batch_prompts=preset.mini_batch_prompts,
            group_size=preset.group_size,
            precision=preset.precision,
            engine=preset.engine,
            router_noise=preset.router_noise,
            lr=preset.lr,
            seed=spec.seed,
            max_response_length=preset.max_response_length,
            workdir=out / "runs" / spec.name,
        )

    if announce is not None:
        announce([s for s in specs if not is_complete(out / "runs" / s.name, overrides_of(s), preset.steps)])

    def execute(i: int, spec: RunSpec) -> RunOutcome:
        run_dir = out / "runs" / spec.name
        ov = overrides_of(spec)
        label = f"run {i + 1}/{len(specs)} {spec.variant} N={spec.staleness} seed={spec.seed}"
        t0, started = time.monotonic(), time.time()
        run = runner or run_one  # looked up per call: tests replace the module's run_one
        # a forced start-up failure (test-only) is never applied to a run that is complete on disk
        forced = is_forced(spec.name, prefixes) and not is_complete(run_dir, ov, preset.steps)
        retried: str | None = None
        for attempt in range(1 + START_RETRIES):
            argv = [*ov, FORCED_START_FAILURE] if forced and attempt == 0 else ov
            try:
                rc, skipped = run(argv, run_dir, preset.steps, lambda k: tracker.set(spec.name, k, label), timeout_s)
            except Exception as exc:  # noqa: BLE001 - one broken run is reported as failed; the others' results count
                (run_dir / "error.txt").write_text(repr(exc))
                rc, skipped = -1, False
            try:
                rows = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
            except (ValueError, KeyError) as exc:  # a line cut short by a killed run: the file stays for inspection
                (run_dir / "error.txt").write_text(f"metrics.jsonl unreadable: {exc!r}")
                rows, rc = [], rc or -1
            reason = None if attempt == START_RETRIES else startup_failure(rc, rows, run_dir)
            if reason is None:
                break
            retried = reason  # the next attempt sets this one's files aside (superseded/), log included
            tracker.set(spec.name, 0, f"{label} (start-up failed: retrying)")
        tracker.set(spec.name, preset.steps, label + (" (cached)" if skipped else f" ({time.monotonic() - t0:.0f}s)"))
        error = None
        # a run the guard stopped exits non-zero, and one found complete on disk may be such a run (its fewer steps
        # are its outcome, not a shortfall)
        stopped = guard_stop_reason(run_dir) if rc != 0 or skipped else None
        if stopped is not None:
            pass  # the acting guard ended the run: its outcome, not an error
        elif rc != 0:
            error = first_error_line(run_dir) or f"exit {rc}, no error line in {run_dir / 'main_ppo.log'}"
        elif len({r["step"] for r in rows}) < preset.steps:
            error = f"exited 0 after {len({r['step'] for r in rows})} of {preset.steps} steps"
        outcome = RunOutcome(
            spec, tag_rows(rows, spec), rc, skipped, run_dir / "main_ppo.log", attempt + 1, retried, error, stopped
        )
        if not skipped:  # a complete run keeps the record of the sweep that measured it
            # wall-clock start and end (epoch seconds): which runs overlapped, how long each took with its retry
            record = {**outcome.record(), "expected_steps": preset.steps, "started": started, "finished": time.time()}
            (run_dir / "outcome.json").write_text(json.dumps(record, indent=1))
        return outcome

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
