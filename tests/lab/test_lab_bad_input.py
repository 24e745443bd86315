"""The lab refuses bad arguments before any work, and never truncates or deletes results already measured.

Work that a refused sweep must not start (assets, cold start, verl runs) is replaced by functions that fail the test
when called.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from verl_stable.lab import cli, sweep
from verl_stable.lab.coldstart import ColdStartResult
from verl_stable.toy.assets import Assets


def _no_work(*args, **kwargs):
    raise AssertionError("work started although the input should have been refused")


@pytest.fixture
def no_work(monkeypatch):
    """Any asset build, cold start or verl run fails the test."""
    import verl_stable.toy.launch as launch

    monkeypatch.setattr(sweep, "prepare", _no_work)
    monkeypatch.setattr(sweep, "ensure_assets", _no_work)
    monkeypatch.setattr(sweep, "cold_start", _no_work)
    monkeypatch.setattr(sweep, "run_one", _no_work)
    monkeypatch.setattr(launch, "run_main_ppo", _no_work)


def _row(variant: str, n: int, step: int, seed: int = 0, score: float = 0.5) -> dict:
    return {"variant": variant, "staleness": n, "seed": seed, "step": step, "critic/score/mean": score}


def _write_rows(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_text(text)
    return text


def _exit_code(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        cli.main(argv, out=lambda _: None)
    return info.value.code, capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ --only
def test_unknown_only_is_refused_before_any_work_and_keeps_metrics(tmp_path, no_work, capsys, monkeypatch):
    out = tmp_path / "lab"
    before = _write_rows(out / "metrics.jsonl", [_row("minirl", 1, 1), _row("minirl", 1, 2)])
    code, err = _exit_code(["--out", str(out), "--only", "minirl_r9"], capsys)
    assert code == 2
    assert "--only ['minirl_r9'] names no run of preset 'default'" in err
    assert "expected a prefix of one of" in err and "minirl_r3__N4__s0" in err  # names what was expected
    assert (out / "metrics.jsonl").read_text() == before
    # and --report-only still reports what was there
    import verl_stable.lab.report as report

    seen: list[dict] = []
    monkeypatch.setattr(report, "write_report", lambda rows, d, h: seen.extend(rows) or Path(d) / "report.md")
    assert cli.main(["--out", str(out), "--report-only"], out=lambda _: None) == 0
    assert [r["step"] for r in seen] == [1, 2]


def test_only_naming_a_variant_outside_the_preset_is_refused(tmp_path, no_work, capsys):
    # vanilla_grpo is a real variant, but the default preset has no run of it: a typo-like mistake all the same
    code, err = _exit_code(["--out", str(tmp_path), "--only", "minirl__N4", "vanilla_grpo"], capsys)
    assert code == 2 and "--only ['vanilla_grpo'] names no run of preset 'default'" in err


def test_run_sweep_refuses_an_unknown_only_before_preparing(tmp_path, no_work):
    with pytest.raises(ValueError, match=r"--only \['nope'\] names no run of preset 'mini'; expected a prefix of one"):
        sweep.run_sweep(tmp_path, sweep.PRESETS["mini"], only=["nope"], jobs=1)
    assert not (tmp_path / "metrics.jsonl").exists()


# ------------------------------------------------------------------------------------------------ other arguments
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--steps", "0"], "argument --steps: expected an integer >= 1, got 0"),
        (["--steps", "-3"], "argument --steps: expected an integer >= 1, got -3"),
        (["--steps", "two"], "argument --steps: expected an integer >= 1, got 'two'"),
        (["--seeds", "-1"], "argument --seeds: expected an integer in [0, 4294967295], got -1"),
        (["--seeds", "4294967296"], "argument --seeds: expected an integer in [0, 4294967295], got 4294967296"),
        (["--seeds", "0.5"], "argument --seeds: expected an integer in [0, 4294967295], got '0.5'"),
        (["--seeds", "0", "1", "0"], "seeds and (variant, N) runs must be distinct, got seeds=[0, 1, 0]"),
        (["--jobs", "0"], "argument --jobs: expected an integer >= 1, got 0"),
        (["--timeout", "0"], "argument --timeout: expected a number of seconds > 0, got '0'"),
        (["--timeout", "nan"], "argument --timeout: expected a number of seconds > 0, got 'nan'"),
        (["--timeout", "-5"], "argument --timeout: expected a number of seconds > 0, got '-5'"),
        (["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
        (["--precision", "fp9"], "argument --precision: invalid choice: 'fp9'"),
        (["--top-k", "0"], "argument --top-k: expected an integer >= 1, got 0"),
        (["--top-k", "17"], "top_k must be an int in [1, 16] (16 experts), got 17"),
        (["--router-noise", "-0.1"], "argument --router-noise: expected a finite number >= 0, got '-0.1'"),
        (["--router-noise", "inf"], "argument --router-noise: expected a finite number >= 0, got 'inf'"),
        (["--engine", "vllm", "--router-noise", "0.3"], "router_noise is an hf-backend option, engine is 'vllm'"),
        (["--lr", "0"], "argument --lr: expected a finite number > 0, got '0'"),
        (["--lr", "nan"], "argument --lr: expected a finite number > 0, got 'nan'"),
        (["--variants", "ppo"], "argument --variants: invalid choice: 'ppo'"),
        (["--variants", "dppo", "dppo"], "runs must be distinct"),
        (["--staleness", "3"], "argument --staleness: invalid choice: 3"),
        (["--variants", "dppo", "--only", "minirl_r3"], "--only ['minirl_r3'] names no run of preset 'default'"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(tmp_path, no_work, capsys, args, expected):
    code, err = _exit_code(["--out", str(tmp_path / "lab"), *args], capsys)
    assert code == 2
    assert expected in err
    assert not (tmp_path / "lab").exists()


def test_out_that_is_a_file_is_refused(tmp_path, no_work, capsys):
    target = tmp_path / "lab.txt"
    target.write_text("mine")
    code, err = _exit_code(["--out", str(target)], capsys)
    assert code == 2 and f"--out {target} is a file; expected a directory" in err
    assert target.read_text() == "mine"


def test_preset_refuses_negative_and_duplicate_seeds():
    with pytest.raises(ValueError, match=r"seeds must be integers in \[0, 4294967295\], got \[-1\]"):
        sweep.Preset("x", runs=(("minirl", 1),), steps=1, seeds=(0, -1))
    with pytest.raises(ValueError, match="must be distinct"):
        sweep.Preset("x", runs=(("minirl", 1), ("minirl", 1)), steps=1)


@pytest.mark.parametrize(
    ("line", "expected"),
    [("{not json", "line 2 is not JSON"), ("[1, 2]", "line 2 is a list; expected one JSON object per line")],
)
def test_unreadable_metrics_are_refused_not_overwritten(tmp_path, no_work, capsys, line, expected):
    out = tmp_path / "lab"
    out.mkdir()
    text = json.dumps(_row("minirl", 1, 1)) + "\n" + line + "\n"
    (out / "metrics.jsonl").write_text(text)
    assert cli.main(["--out", str(out), "--report-only"], out=lambda _: None) == 1
    assert expected in capsys.readouterr().err
    assert cli.main(["--out", str(out), "--only", "minirl__N4"], out=lambda _: None) == 1  # refused, no run
    assert expected in capsys.readouterr().err
    with pytest.raises(ValueError, match=expected.split(";")[0]):
        sweep.run_sweep(out, sweep.PRESETS["default"], jobs=1)
    assert (out / "metrics.jsonl").read_text() == text


def test_rows_without_a_run_identity_give_a_message_not_a_traceback(tmp_path, capsys):
    out = tmp_path / "lab"
    _write_rows(out / "metrics.jsonl", [{"step": 1}])
    assert cli.main(["--out", str(out), "--report-only"], out=lambda _: None) == 1
    assert "lacks ['variant', 'staleness', 'seed']" in capsys.readouterr().err


def test_report_only_on_an_empty_out_names_the_file(tmp_path, capsys):
    assert cli.main(["--out", str(tmp_path), "--report-only"], out=lambda _: None) == 1
    assert f"no metrics to report: {tmp_path / 'metrics.jsonl'} is missing or empty" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ never truncate
def _fake_prepare(tmp_path: Path, monkeypatch) -> None:
    assets = Assets(*(tmp_path / n for n in ("root", "model", "train.parquet", "val.parquet")))
    cs = ColdStartResult(tmp_path / "model", expected_reward=0.4, initial_expected_reward=0.1, steps=0, cached=True)
    monkeypatch.setattr(sweep, "prepare", lambda out, p: (assets, cs))


def _log_steps(run_dir: Path, steps: range) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "a") as f:
        for s in steps:
            f.write(json.dumps({"step": s, "data": {"critic/score/mean": 0.25}}) + "\n")


def test_a_run_that_raises_midway_keeps_earlier_lines_and_merges_beside_old_ones(tmp_path, monkeypatch):
    """Old rows stay, the finished run's rows are added, the broken run's logged lines stay on disk."""
    out = tmp_path / "lab"
    old = [_row("vespo", 4, 1), _row("vespo", 4, 2)]
    before = _write_rows(out / "metrics.jsonl", old)
    _fake_prepare(tmp_path, monkeypatch)
    preset = sweep.Preset("t", runs=(("minirl", 1), ("minirl_r3", 4)), steps=2)

    def fake_run_one(overrides, run_dir, steps, on_step, timeout_s):
        if run_dir.name.startswith("minirl_r3"):
            _log_steps(run_dir, range(1, 2))
            raise RuntimeError("killed at step 2")
        _log_steps(run_dir, range(1, steps + 1))
        return 0, False

    monkeypatch.setattr(sweep, "run_one", fake_run_one)
    outcomes = sweep.run_sweep(out, preset, jobs=1)
    assert [(o.spec.name, o.returncode, len(o.rows)) for o in outcomes] == [
        ("minirl__N1__s0", 0, 2),
        ("minirl_r3__N4__s0", -1, 1),
    ]
    text = (out / "metrics.jsonl").read_text()
    assert text.startswith(before)  # nothing measured before was lost or rewritten
    rows = sweep.load_rows(out)
    assert [(r["variant"], r["step"]) for r in rows] == [
        ("vespo", 1),
        ("vespo", 2),
        ("minirl", 1),
        ("minirl", 2),
        ("minirl_r3", 1),
    ]
    assert "killed at step 2" in (out / "runs" / "minirl_r3__N4__s0" / "error.txt").read_text()
    assert sweep._count_lines(out / "runs" / "minirl_r3__N4__s0" / "metrics.jsonl") == 1


def test_an_interrupted_sweep_merges_the_runs_that_finished(tmp_path, monkeypatch):
    out = tmp_path / "lab"
    before = _write_rows(out / "metrics.jsonl", [_row("vespo", 4, 1)])
    _fake_prepare(tmp_path, monkeypatch)
    preset = sweep.Preset("t", runs=(("minirl", 1), ("minirl_r3", 4)), steps=1)

    def fake_run_one(overrides, run_dir, steps, on_step, timeout_s):
        if run_dir.name.startswith("minirl_r3"):
            raise KeyboardInterrupt
        _log_steps(run_dir, range(1, 2))
        return 0, False

    monkeypatch.setattr(sweep, "run_one", fake_run_one)
    with pytest.raises(KeyboardInterrupt):
        sweep.run_sweep(out, preset, jobs=1)
    assert (out / "metrics.jsonl").read_text().startswith(before)
    assert [(r["variant"], r["step"]) for r in sweep.load_rows(out)] == [("vespo", 1), ("minirl", 1)]


def test_merge_is_atomic_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    before = _write_rows(path, [_row("vespo", 4, 1)])
    spec = sweep.RunSpec("minirl", 1, 0)
    outcome = sweep.RunOutcome(spec, [_row("minirl", 1, 1)], 0, False, tmp_path / "log")

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sweep.os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        sweep.merge_rows(path, [outcome])
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []  # no temporary file left behind


def test_merge_replaces_a_remeasured_run_and_keeps_the_rest(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write_rows(path, [_row("vespo", 4, 1), _row("minirl", 1, 1, score=0.1), _row("minirl", 1, 2, score=0.1)])
    remeasured = sweep.RunOutcome(
        sweep.RunSpec("minirl", 1, 0), [_row("minirl", 1, 1, score=0.9)], 0, False, tmp_path / "log"
    )
    failed = sweep.RunOutcome(sweep.RunSpec("vespo", 4, 0), [], 1, False, tmp_path / "log")
    merged = sweep.merge_rows(path, [remeasured, failed])
    assert [(r["variant"], r["step"], r["critic/score/mean"]) for r in merged] == [
        ("vespo", 1, 0.5),  # its new attempt logged nothing: the old rows stay
        ("minirl", 1, 0.9),
    ]
    assert sweep.load_rows(tmp_path) == merged
    unchanged = path.read_text()
    sweep.merge_rows(path, [failed])  # nothing new: the file is left as it is
    assert path.read_text() == unchanged


def test_a_run_that_starts_over_sets_its_earlier_attempt_aside(tmp_path, monkeypatch):
    """A finished run of other overrides (e.g. another --steps) is moved to superseded/, never deleted."""
    import verl_stable.toy.launch as launch

    run_dir = tmp_path / "runs" / "minirl__N1__s0"
    _log_steps(run_dir, range(1, 4))
    (run_dir / "done.json").write_text(json.dumps({"digest": sweep.overrides_digest(["a=1"])}))
    old_metrics = (run_dir / "metrics.jsonl").read_text()

    def fake_main_ppo(overrides, workdir, *, timeout_s=None, **kwargs):
        _log_steps(Path(workdir), range(1, 3))
        return subprocess.CompletedProcess(["main_ppo"], 0)

    monkeypatch.setattr(launch, "run_main_ppo", fake_main_ppo)
    assert sweep.run_one(["a=2"], run_dir, 2) == (0, False)
    assert sweep._count_lines(run_dir / "metrics.jsonl") == 2  # the new run's own rows, not appended to the old
    (aside,) = (run_dir / "superseded").iterdir()
    assert (aside / "metrics.jsonl").read_text() == old_metrics
    assert json.loads((aside / "done.json").read_text())["digest"] == sweep.overrides_digest(["a=1"])


def test_cli_reports_every_run_in_out_after_an_only_sweep(tmp_path, monkeypatch):
    out = tmp_path / "lab"
    _write_rows(out / "metrics.jsonl", [_row("vespo", 4, s) for s in (1, 2)])
    _fake_prepare(tmp_path, monkeypatch)

    def fake_run_one(overrides, run_dir, steps, on_step, timeout_s):
        _log_steps(run_dir, range(1, steps + 1))
        return 0, False

    monkeypatch.setattr(sweep, "run_one", fake_run_one)
    import verl_stable.lab.report as report

    seen: list[dict] = []
    monkeypatch.setattr(report, "write_report", lambda rows, d, h: seen.extend(rows) or Path(d) / "report.md")
    argv = ["--out", str(out), "--only", "minirl_r3", "--steps", "2", "--jobs", "1", "--seeds", "0"]
    assert cli.main(argv, out=lambda _: None) == 0
    assert [(r["variant"], r["step"]) for r in seen] == [("vespo", 1), ("vespo", 2), ("minirl_r3", 1), ("minirl_r3", 2)]


# ------------------------------------------------------------------------------------------------ damaged files
@pytest.mark.parametrize(
    ("done", "last_line"),
    [('{"digest": ', None), ("[1]", None), (None, '{"step": 3, "da')],
    ids=["done.json cut short", "done.json a list", "metrics line cut short"],
)
def test_a_damaged_run_is_incomplete_and_starts_over(tmp_path, monkeypatch, done, last_line):
    """A run killed while writing is run again (its files set aside), not a traceback that stops the sweep."""
    import verl_stable.toy.launch as launch

    run_dir = tmp_path / "r"
    _log_steps(run_dir, range(1, 3))
    (run_dir / "done.json").write_text(done or json.dumps({"digest": sweep.overrides_digest(["a=1"])}))
    if last_line is not None:
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.write(last_line)
    assert not sweep.is_complete(run_dir, ["a=1"], 2)
    started = []
    monkeypatch.setattr(
        launch, "run_main_ppo", lambda ov, wd, **kw: started.append(wd) or subprocess.CompletedProcess([], 0)
    )
    assert sweep.run_one(["a=1"], run_dir, 2) == (0, False)
    assert started == [run_dir]
    assert len(list((run_dir / "superseded").iterdir())) == 1


def test_a_damaged_asset_marker_rebuilds_the_assets(tmp_path, monkeypatch):
    from verl_stable.toy import assets as A

    built = []
    monkeypatch.setattr(A, "build_tokenizer", lambda d: built.append("tokenizer"))
    monkeypatch.setattr(A, "build_model", lambda d, spec, tok: built.append("model"))
    monkeypatch.setattr(A, "build_datasets", lambda root, spec: built.append("data"))
    (tmp_path / "train.parquet").write_text("x")
    (tmp_path / A.MARKER).write_text('{"task": "co')  # cut short
    A.ensure_assets(tmp_path, A.AssetSpec())
    assert built == ["tokenizer", "model", "data"]
    assert json.loads((tmp_path / A.MARKER).read_text())["task"] == "copy"


def test_a_damaged_cold_start_cache_entry_is_rebuilt(tmp_path, monkeypatch):
    import transformers

    from verl_stable.lab import coldstart
    from verl_stable.toy.assets import AssetSpec

    spec, config = AssetSpec(), coldstart.ColdStartConfig()
    entry = tmp_path / coldstart.cache_key(spec, config)
    entry.mkdir()
    (entry / coldstart.MARKER).write_text('{"expected_reward": 0.4}')  # lacks the other fields

    def rebuild(*args, **kwargs):
        raise RuntimeError("rebuild started")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", rebuild)
    assets = Assets(*(tmp_path / n for n in ("root", "model", "train.parquet", "val.parquet")))
    with pytest.raises(RuntimeError, match="rebuild started"):
        coldstart.cold_start(assets, spec, tmp_path, config)


# ------------------------------------------------------------------------------------------------ paths and recipes
@pytest.mark.parametrize("name", ["a,b", "a=b", "lab[1]", "résultats"])
def test_an_out_hydra_cannot_carry_is_refused_before_any_work(tmp_path, no_work, capsys, name):
    code, err = _exit_code(["--out", str(tmp_path / name)], capsys)
    assert code == 2
    assert f"--out {str(tmp_path / name)!r} cannot be passed to verl in a hydra override" in err
    assert "expected a path of ASCII letters, digits, spaces and / . _ - + @ :" in err


def test_missing_recipes_are_refused_before_any_work(tmp_path, no_work, capsys, monkeypatch):
    from verl_stable import recipes

    monkeypatch.setenv(recipes.RECIPES_ENV, str(tmp_path / "nowhere"))
    code, err = _exit_code(["--out", str(tmp_path / "lab")], capsys)
    assert code == 2 and f"{recipes.RECIPES_ENV}={tmp_path / 'nowhere'} is not a verl-stable recipes directory" in err


def test_run_sweep_refuses_an_out_hydra_cannot_carry(tmp_path, no_work):
    with pytest.raises(ValueError, match="output directory '.*a,b' cannot be passed to verl in a hydra override"):
        sweep.run_sweep(tmp_path / "a,b", sweep.PRESETS["mini"], jobs=1)


def test_an_out_below_a_file_or_unwritable_is_refused_before_any_work(tmp_path, no_work, capsys, monkeypatch):
    (tmp_path / "f").write_text("mine")
    code, err = _exit_code(["--out", str(tmp_path / "f" / "lab")], capsys)
    assert (
        code == 2
        and f"--out {tmp_path / 'f' / 'lab'} lies below the file {tmp_path / 'f'}; expected a directory" in err
    )
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    code, err = _exit_code(["--out", str(tmp_path / "lab")], capsys)
    assert code == 2 and f"--out {tmp_path / 'lab'} cannot be written: {tmp_path} is not writable by this user" in err


# ------------------------------------------------------------------------------------------------ concurrent sweeps
def _merge_many(path: str, variant: str, runs: int) -> None:
    """One sweep's merges: ``runs`` runs of ``variant``, each merged on its own (as sweeps sharing --out do)."""
    for seed in range(runs):
        rows = [_row(variant, 1, step, seed=seed) for step in range(1, 21)]
        sweep.merge_rows(path, [sweep.RunOutcome(sweep.RunSpec(variant, 1, seed), rows, 0, False, Path("log"))])


def test_two_sweeps_merging_into_one_out_lose_no_row(tmp_path):
    """Two processes read-modify-write ``out/metrics.jsonl`` at once, many times: every row of both stays."""
    import multiprocessing

    path = tmp_path / "metrics.jsonl"
    runs = 40
    ctx = multiprocessing.get_context("fork")  # the child needs only this module's function, already imported
    procs = [ctx.Process(target=_merge_many, args=(str(path), v, runs)) for v in ("minirl", "vespo")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0]
    rows = sweep.load_rows(tmp_path)
    for variant in ("minirl", "vespo"):
        seeds = sorted({r["seed"] for r in rows if r["variant"] == variant})
        assert seeds == list(range(runs)), f"{variant}: runs lost, {runs - len(seeds)} of {runs}"
    assert len(rows) == 2 * runs * 20


# ------------------------------------------------------------------------------------------------ typed rows
@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        ({"seed": "0"}, "key 'seed' must be an integer, got the string '0'"),
        ({"step": "2"}, "key 'step' must be an integer, got the string '2'"),
        ({"staleness": 1.0}, "key 'staleness' must be an integer, got the float 1.0"),
        ({"seed": True}, "key 'seed' must be an integer, got the bool True"),
        ({"variant": 3}, "key 'variant' must be a string, got the int 3"),
        ({"step": None}, "key 'step' must be an integer, got None"),
    ],
)
def test_report_only_refuses_a_row_of_the_wrong_type(tmp_path, no_work, capsys, bad, expected):
    """A seed "0" is not seed 0: it would join that run past the duplicate check and change its reward."""
    out = tmp_path / "lab"
    text = _write_rows(
        out / "metrics.jsonl", [_row("minirl", 1, 1), _row("minirl", 1, 2), {**_row("minirl", 1, 3), **bad}]
    )
    assert cli.main(["--out", str(out), "--report-only"], out=lambda _: None) == 1
    err = capsys.readouterr().err
    assert f"{out / 'metrics.jsonl'} line 3: {expected}" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (out / "report.md").exists() and (out / "metrics.jsonl").read_text() == text
    with pytest.raises(ValueError, match="line 3: key"):
        sweep.check_sweep(out, sweep.PRESETS["default"])  # a sweep would merge into it: refused before any run


def test_report_only_refuses_a_row_lacking_the_run_identity_naming_the_line(tmp_path, capsys):
    out = tmp_path / "lab"
    _write_rows(out / "metrics.jsonl", [_row("minirl", 1, 1), {"step": 2, "seed": 0}])
    assert cli.main(["--out", str(out), "--report-only"], out=lambda _: None) == 1
    assert f"{out / 'metrics.jsonl'} line 2: lacks ['variant', 'staleness']" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ paths that break
def test_report_only_with_report_md_a_directory_gives_one_line(tmp_path, capsys):
    out = tmp_path / "lab"
    _write_rows(out / "metrics.jsonl", [_row("minirl", 1, 1), _row("minirl", 1, 2)])
    (out / "report.md").mkdir()
    assert cli.main(["--out", str(out), "--report-only"], out=lambda _: None) == 1
    err = capsys.readouterr().err
    assert f"cannot write the report: {out / 'report.md'} is a directory" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_sweep_whose_report_cannot_be_written_is_refused_before_any_run(tmp_path, no_work, capsys):
    out = tmp_path / "lab"
    (out / "report.md").mkdir(parents=True)
    code, err = _exit_code(["--out", str(out)], capsys)
    assert code == 2 and f"{out / 'report.md'} is a directory; expected the report file" in err


def test_a_metrics_file_that_is_a_directory_is_refused_before_any_run(tmp_path, no_work, capsys):
    out = tmp_path / "lab"
    (out / "metrics.jsonl").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"metrics.jsonl is a directory; expected a JSON-lines file"):
        sweep.check_sweep(out, sweep.PRESETS["default"])
    assert cli.main(["--out", str(out)], out=lambda _: None) == 1
    err = capsys.readouterr().err
    assert f"{out / 'metrics.jsonl'} is a directory; expected a JSON-lines file" in err and "Traceback" not in err
    assert cli.main(["--out", str(out), "--report-only"], out=lambda _: None) == 1
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("report_only", [False, True])
def test_an_out_in_a_symlink_loop_is_refused(tmp_path, no_work, capsys, report_only):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    code, err = _exit_code(["--out", str(tmp_path / "a" / "lab"), *(["--report-only"] if report_only else [])], capsys)
    assert code == 2 and f"--out {tmp_path / 'a' / 'lab'} cannot be resolved" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="cannot be resolved"):
        sweep.check_sweep(tmp_path / "a", sweep.PRESETS["default"])


def test_an_attempt_that_logged_no_step_is_set_aside_too(tmp_path, monkeypatch):
    """A run that failed before its first step left only its log and error: both are kept when it starts over."""
    import verl_stable.toy.launch as launch

    run_dir = tmp_path / "runs" / "minirl__N1__s0"
    run_dir.mkdir(parents=True)
    (run_dir / "main_ppo.log").write_text("ray failed to start\n")
    (run_dir / "error.txt").write_text("RuntimeError('ray')")

    def fake_main_ppo(overrides, workdir, *, timeout_s=None, **kwargs):
        (Path(workdir) / "main_ppo.log").write_text("second attempt\n")
        _log_steps(Path(workdir), range(1, 3))
        return subprocess.CompletedProcess(["main_ppo"], 0)

    monkeypatch.setattr(launch, "run_main_ppo", fake_main_ppo)
    assert sweep.run_one(["a=1"], run_dir, 2) == (0, False)
    (aside,) = (run_dir / "superseded").iterdir()
    assert (aside / "main_ppo.log").read_text() == "ray failed to start\n"
    assert (aside / "error.txt").read_text() == "RuntimeError('ray')"
    assert not (run_dir / "error.txt").exists()
