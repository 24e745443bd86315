"""A run that fails while starting is retried once, and the report says so; a run that fails for good is named with
its first error line, and every comparison says which seeds it lacks (issue #30).

The runs here are fake runners passed into :func:`verl_stable.lab.sweep.run_sweep` (no verl start): they write what a
real attempt leaves behind (``main_ppo.log``, ``metrics.jsonl``, ``done.json``). The real side-by-side starts of
verl are in ``test_lab_sweep.py::test_mini_preset_end_to_end``.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from verl_stable.lab import attempts, cli, report, sweep
from verl_stable.lab.coldstart import ColdStartResult
from verl_stable.lab.progress import ProgressBar
from verl_stable.toy.assets import Assets

# what a failed start of verl looks like in main_ppo.log (Ray's colour codes and actor prefixes included)
STARTUP_LOG = (
    "ray init kwargs: {'num_cpus': 16}\n"
    "Error executing job with overrides: ['data.seed=3']\n"
    "Traceback (most recent call last):\n"
    '  File "verl/trainer/main_ppo.py", line 74, in run_ppo\n'
    "\x1b[36m(TaskRunnerV1 pid=7)\x1b[0m ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing "
    "this task.\n"
    "RuntimeError: later, caused by the above\n"
)
TRAINING_LOG = (
    "INFO:2026-12-03 02:01:15,812:" + attempts.READY_MARKER + "\n"
    "Traceback (most recent call last):\n"
    "ValueError: loss is nan at step 1\n"
)
CONFIG_LOG = (
    "Could not override 'actor_rollout_ref.actor.nope'.\n"
    "omegaconf.errors.ConfigAttributeError: Key 'nope' is not in struct\n"
)


def _write_rows(run_dir: Path, steps: int, reward: float = 0.5) -> None:
    with open(run_dir / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            f.write(
                json.dumps({"step": s, "data": {"critic/score/mean": reward, "stable/train_inf/kl_k3": 1e-3}}) + "\n"
            )


class Runner:
    """A fake :func:`sweep.run_one`: each attempt of a run takes the next of its scripted results.

    ``script[name]`` is a list of ``("ok", None)``, ``("fail", log_text)`` or ``("partial", log_text)`` (one step
    logged, then the failure); a run not in it succeeds. Like
    ``run_one`` it first sets the earlier attempt's files aside.
    """

    def __init__(self, script: dict[str, list[tuple[str, str | None]]]) -> None:
        self.script = script
        self.calls: list[tuple[str, list[str]]] = []

    def __call__(self, overrides, run_dir, steps, on_step, timeout_s):
        run_dir.mkdir(parents=True, exist_ok=True)
        if sweep.is_complete(run_dir, overrides, steps):
            return 0, True
        sweep.set_aside(run_dir, sweep.RUN_FILES)
        self.calls.append((run_dir.name, list(overrides)))
        kind, log = (self.script.get(run_dir.name) or [("ok", None)]).pop(0)
        (run_dir / "main_ppo.log").write_text(log or "training...\n")
        if kind == "fail":
            return 1, False
        if kind == "partial":  # one step logged, then the failure
            _write_rows(run_dir, 1)
            return 1, False
        _write_rows(run_dir, steps, reward=0.3 + 0.01 * len(self.calls))
        (run_dir / "done.json").write_text(json.dumps({"digest": sweep.overrides_digest(overrides)}))
        on_step(steps)
        return 0, False


@pytest.fixture
def lab(tmp_path, monkeypatch):
    """A default-shaped preset (minirl vs minirl_r3 at N = 4) on three seeds, with the assets and cold start faked."""
    assets = Assets(*(tmp_path / n for n in ("root", "model", "train.parquet", "val.parquet")))
    cs = ColdStartResult(tmp_path / "model", expected_reward=0.4, initial_expected_reward=0.1, steps=0, cached=True)
    monkeypatch.setattr(sweep, "prepare", lambda out, p: (assets, cs))
    preset = sweep.Preset("t", runs=(("minirl", 4), ("minirl_r3", 4)), steps=2, seeds=(0, 1, 2))
    return tmp_path / "out", preset


def _sweep(out, preset, runner, **kw):
    bar = ProgressBar(len(preset.run_specs()) * preset.steps, stream=io.StringIO())
    return sweep.run_sweep(out, preset, jobs=2, progress=bar, runner=runner, **kw)


def test_a_startup_failure_is_retried_once_and_named_in_the_report(lab):
    out, preset = lab
    runner = Runner({"minirl_r3__N4__s1": [("fail", STARTUP_LOG), ("ok", None)]})
    outcomes = {o.spec.name: o for o in _sweep(out, preset, runner)}
    r3 = outcomes["minirl_r3__N4__s1"]
    assert (r3.attempts, r3.returncode, len(r3.rows), r3.error) == (2, 0, 2, None)
    # the first error line, without colour codes or hydra's wrapper line
    assert r3.retried == (
        "(TaskRunnerV1 pid=7) ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task."
    )
    assert [o.attempts for n, o in outcomes.items() if n != r3.spec.name] == [1] * 5
    assert [name for name, _ in runner.calls].count(r3.spec.name) == 2
    # the failed attempt's log is kept (set aside), the run's own files are the second attempt's
    (aside,) = (out / "runs" / r3.spec.name / "superseded").iterdir()
    assert (aside / "main_ppo.log").read_text() == STARTUP_LOG
    record = json.loads((out / "runs" / r3.spec.name / "outcome.json").read_text())
    assert (record["attempts"], record["retried"], record["steps"], record["expected_steps"]) == (2, r3.retried, 2, 2)
    text = report.render_markdown(sweep.load_rows(out), runs=report.run_records(out))
    assert "6 run(s) recorded: 6 finished, 1 retried once after a start-up failure, 0 failed." in text
    assert f"Retried: `minirl_r3__N4__s1` -- the first attempt failed while starting: `{r3.retried}`" in text
    assert "finished on attempt 2" in text and "missing:" not in text  # every seed is there


def test_a_run_that_fails_again_is_reported_with_its_error_and_its_seed_is_missing(lab):
    out, preset = lab
    runner = Runner({"minirl_r3__N4__s1": [("fail", STARTUP_LOG), ("fail", STARTUP_LOG)]})
    outcomes = {o.spec.name: o for o in _sweep(out, preset, runner)}
    r3 = outcomes["minirl_r3__N4__s1"]
    assert (r3.attempts, r3.returncode, r3.rows, r3.failed) == (2, 1, [], True)  # retried once, not twice
    assert r3.error == r3.retried and "ActorDiedError" in r3.error
    text = report.render_markdown(sweep.load_rows(out), runs=report.run_records(out))
    assert "6 run(s) recorded: 5 finished, 1 retried once after a start-up failure, 1 failed." in text
    assert f"Failed: `minirl_r3__N4__s1` (exit 1, 0 of 2 steps, 2 attempt(s)): `{r3.error}`" in text
    # the answer table and every R3 comparison name the missing seed instead of silently using two
    missing = "missing: minirl_r3 seed 1 (no step logged); paired on seeds 0, 2"
    (row,) = [line for line in text.splitlines() if line.startswith("| off-policy N = 4") and "| R3 |" in line]
    assert missing in row
    r3_lines = [line for line in text.splitlines() if line.startswith("- R3, N=4")]
    # step-1 KL, late reward and reward over all steps (no clip logged) judged, the median-step KL shown: each names
    # the missing seed
    assert len(r3_lines) == 4 and all(missing in line for line in r3_lines)


def test_a_failure_inside_training_or_in_the_config_is_not_retried(lab):
    out, preset = lab
    runner = Runner(
        {"minirl__N4__s0": [("fail", TRAINING_LOG), ("ok", None)], "minirl__N4__s2": [("fail", CONFIG_LOG)]}
    )
    outcomes = {o.spec.name: o for o in _sweep(out, preset, runner)}
    trained = outcomes["minirl__N4__s0"]
    assert (trained.attempts, trained.retried, trained.error) == (1, None, "ValueError: loss is nan at step 1")
    config = outcomes["minirl__N4__s2"]
    assert (config.attempts, config.error) == (1, "omegaconf.errors.ConfigAttributeError: Key 'nope' is not in struct")
    text = report.render_markdown(sweep.load_rows(out), runs=report.run_records(out))
    assert "0 retried once" in text and "2 failed" in text
    assert "missing: minirl seeds 0, 2 (no step logged); paired on seed 1" in text


def test_a_run_that_fails_after_a_step_is_not_retried_and_marked_incomplete(lab):
    out, preset = lab
    runner = Runner({"minirl__N4__s1": [("partial", STARTUP_LOG), ("ok", None)]})
    outcomes = {o.spec.name: o for o in _sweep(out, preset, runner)}
    stopped = outcomes["minirl__N4__s1"]
    assert (stopped.attempts, len(stopped.rows), stopped.returncode) == (1, 1, 1)  # a step logged: not a start-up
    assert "ActorDiedError" in stopped.error
    text = report.render_markdown(sweep.load_rows(out), runs=report.run_records(out))
    assert "Failed: `minirl__N4__s1` (exit 1, 1 of 2 steps, 1 attempt(s))" in text
    (row,) = [line for line in text.splitlines() if "| R3 |" in line]
    assert row.endswith("(incomplete: minirl seed 1 (1 of 2 steps)) |") and "missing:" not in row


def test_a_switch_whose_one_side_only_failed_is_said_not_measured(lab):
    out, preset = lab
    runner = Runner({f"minirl_r3__N4__s{s}": [("fail", TRAINING_LOG)] for s in (0, 1, 2)})
    _sweep(out, preset, runner)
    text = report.render_markdown(sweep.load_rows(out), runs=report.run_records(out))
    assert "| off-policy N = 4: mismatch + staleness | R3 | not measured | missing: minirl_r3 seeds 0, 1, 2" in text
    assert "- R3, N=4: not compared; missing: minirl_r3 seeds 0, 1, 2 (no step logged)." in text


def test_forced_start_failure_reaches_only_the_first_attempt(lab, monkeypatch):
    """The test-only switch appends an override that makes Ray's start fail; the retry runs without it."""
    out, preset = lab
    seen: list[list[str]] = []

    def runner(overrides, run_dir, steps, on_step, timeout_s):
        seen.append(list(overrides))
        forced = attempts.FORCED_START_FAILURE in overrides
        return Runner({run_dir.name: [("fail" if forced else "ok", STARTUP_LOG if forced else None)]})(
            overrides, run_dir, steps, on_step, timeout_s
        )

    monkeypatch.setenv(attempts.FORCE_START_FAILURE_ENV, "minirl_r3__N4__s0")
    outcomes = {o.spec.name: o for o in _sweep(out, preset, runner)}
    assert outcomes["minirl_r3__N4__s0"].attempts == 2 and outcomes["minirl_r3__N4__s0"].error is None
    assert sum(attempts.FORCED_START_FAILURE in ov for ov in seen) == 1 and len(seen) == 7
    # a second sweep finds every run complete: nothing forced, nothing started
    seen.clear()
    assert all(o.skipped for o in _sweep(out, preset, runner))
    assert len(seen) == 6 and not any(attempts.FORCED_START_FAILURE in ov for ov in seen)


def test_startup_failure_rule(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "main_ppo.log").write_text(STARTUP_LOG)
    assert "ActorDiedError" in attempts.startup_failure(1, [], run)
    assert attempts.startup_failure(0, [], run) is None  # succeeded
    assert attempts.startup_failure(1, [{"step": 1}], run) is None  # failed after a step: inside training
    (run / "main_ppo.log").write_text(TRAINING_LOG)
    assert attempts.startup_failure(1, [], run) is None  # the training loop had started, the error is the code's
    # ... unless the error after the marker is the machinery's (a worker killed, a lost connection)
    (run / "main_ppo.log").write_text(TRAINING_LOG.replace("ValueError: loss is nan", "ray.exceptions.ActorDiedError:"))
    assert "ActorDiedError" in attempts.startup_failure(1, [], run)
    (run / "main_ppo.log").write_text(CONFIG_LOG)
    assert attempts.startup_failure(1, [], run) is None
    (run / "main_ppo.log").write_text("")
    assert attempts.startup_failure(-9, [], run) == "exit -9 before verl's training loop started"
    (run / "error.txt").write_text("TimeoutExpired(cmd=['python'], timeout=900)")
    assert attempts.startup_failure(-1, [], run) is None  # the sweep's own time limit: not retried


def test_cli_names_the_retry_and_the_failure(lab, monkeypatch, capsys):
    out, preset = lab
    runner = Runner(
        {"minirl__N4__s0": [("fail", STARTUP_LOG), ("ok", None)], "minirl__N4__s1": [("fail", TRAINING_LOG)]}
    )
    real = sweep.run_sweep
    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **kw: real(*a, **kw, runner=runner))
    monkeypatch.setitem(sweep.PRESETS, "t", preset)
    monkeypatch.setattr(report, "plot_regimes", lambda rows, d: [])
    assert cli.main(["--preset", "t", "--out", str(out)], out=lambda _: None) == 1
    err = capsys.readouterr().err
    assert "run minirl__N4__s0: the first attempt failed while starting" in err and "retried, finished" in err
    assert "run minirl__N4__s1 failed (exit 1, 0 steps, 1 attempt(s)): ValueError: loss is nan at step 1" in err
    text = (out / "report.md").read_text()
    assert "1 retried once after a start-up failure, 1 failed" in text


def test_a_run_the_guard_stopped_is_finished_not_failed_and_not_run_again(lab, monkeypatch, capsys):
    """Through the real run_one (verl's launcher replaced): a guarded run that rolled back once and was then stopped
    by its guard exits 1 and writes the run summary; the sweep counts it finished, keeps every row, does not start it
    again, and the CLI exits 0."""
    from dataclasses import replace
    from types import SimpleNamespace

    from verl_stable.monitor.run_summary import SUMMARY_FILE
    from verl_stable.toy import launch

    out, preset = lab
    preset = replace(preset, steps=3)  # the guard stops the run after 2 of its 3 steps
    stopped_run = "minirl_r3__N4__s1"
    reason = "[entropy_blowup] actor/entropy = 6.8 above 4 (no rollback left)"
    calls: list[str] = []

    def fake_main_ppo(overrides, run_dir, timeout_s=None):
        calls.append(run_dir.name)
        run_dir = Path(run_dir)
        if run_dir.name != stopped_run:
            _write_rows(run_dir, preset.steps)
            return SimpleNamespace(returncode=0)
        # steps 1, 2; the guard fires at 2 and rolls back to checkpoint 1; step 2 again, it fires again and stops
        with open(run_dir / "metrics.jsonl", "w") as f:
            for step, reward in [(1, 0.5), (2, 0.0), (2, 0.1)]:
                f.write(json.dumps({"step": step, "data": {"critic/score/mean": reward}}) + "\n")
        (run_dir / "checkpoints").mkdir()
        summary = {"last_step": 2, "ended": "stopped by the guard", "stop_reason": reason, "actions": {}, "records": []}
        (run_dir / "checkpoints" / SUMMARY_FILE).write_text(json.dumps(summary))
        return SimpleNamespace(returncode=1)

    monkeypatch.setattr(launch, "run_main_ppo", fake_main_ppo)
    monkeypatch.setitem(sweep.PRESETS, "t", preset)
    monkeypatch.setattr(report, "plot_regimes", lambda rows, d: [])
    assert cli.main(["--preset", "t", "--out", str(out)], out=lambda _: None) == 0
    assert f"run {stopped_run}: stopped by the guard ({reason})" in capsys.readouterr().err
    record = json.loads((out / "runs" / stopped_run / "outcome.json").read_text())
    assert (record["returncode"], record["steps"], record["error"], record["guard_stopped"]) == (1, 2, None, reason)
    rows = [r for r in sweep.load_rows(out) if r["variant"] == "minirl_r3" and r["seed"] == 1]
    assert [(r["step"], r.get("superseded", False)) for r in rows] == [(1, False), (2, True), (2, False)]
    text = (out / "report.md").read_text()
    assert "6 run(s) recorded: 6 finished (1 of them stopped early by the acting guard)" in text
    assert f"Stopped by the guard: `{stopped_run}` after 2 of 3 steps: {reason}." in text
    # a second sweep finds every run complete, the stopped one too: nothing is started again, and the stopped run,
    # read back from disk, is still stopped by the guard rather than short of its steps
    assert cli.main(["--preset", "t", "--out", str(out)], out=lambda _: None) == 0
    assert len(calls) == 6
    assert f"run {stopped_run}: stopped by the guard ({reason})" in capsys.readouterr().err
    # the same run killed before its summary was written is incomplete and starts over, its files set aside
    (out / "runs" / stopped_run / "done.json").unlink()
    assert cli.main(["--preset", "t", "--out", str(out)], out=lambda _: None) == 0
    assert calls[6:] == [stopped_run]
    (aside,) = (out / "runs" / stopped_run / "superseded").iterdir()
    assert (aside / "checkpoints" / SUMMARY_FILE).exists() and (aside / "metrics.jsonl").exists()
