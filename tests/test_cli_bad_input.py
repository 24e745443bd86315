"""``verl-stable run`` and ``verl-stable doctor``: bad input is refused before anything starts, with a message.

``run`` must refuse a bad argument (exit code 2) before it builds assets or starts verl: both are replaced here by
functions that fail the test. ``doctor --model`` must give a verdict for any checkpoint, never a traceback. Each run
of verl gets a Ray temporary directory of its own, short enough for Ray's unix sockets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_stable import cli
from verl_stable.toy import launch, trainer_process


def _fail(*args, **kwargs):
    raise AssertionError("work started although the input should have been refused")


@pytest.fixture
def no_work(monkeypatch):
    monkeypatch.setattr(launch, "ensure_assets", _fail)
    monkeypatch.setattr(launch, "run_main_ppo", _fail)
    monkeypatch.setattr(trainer_process.subprocess, "run", _fail)


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ run
@pytest.mark.parametrize("extra", [[], ["--print-overrides"]])
def test_run_refuses_an_unknown_precision(tmp_path, no_work, capsys, extra):
    err = _refused(["run", "--workdir", str(tmp_path / "w"), "--precision", "fp9", *extra], capsys)
    assert "argument --precision: invalid choice: 'fp9' (choose from" in err
    assert all(p in err for p in ("'fp8'", "'bf16'", "'fp16'", "'fp32'"))
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--steps", "0"], "argument --steps: expected an integer >= 1, got 0"),
        (["--steps", "three"], "argument --steps: expected an integer >= 1, got 'three'"),
        (["--poll-interval", "0"], "argument --poll-interval: expected a number of seconds > 0, got '0'"),
        (["--poll-interval", "inf"], "argument --poll-interval: expected a number of seconds > 0, got 'inf'"),
        (["--task", "sort"], "argument --task: invalid choice: 'sort'"),
        (["data.train_batch_size"], "override 'data.train_batch_size' is malformed (missing EQUAL"),
        (["=4"], "override '=4' has no key; expected key=value, +key=value, ++key=value or ~key"),
        (["data.train_batchsize=4"], "the overrides do not compose on verl's ppo_trainer"),
        (
            ["+data.train_batchsize=4"],
            "unknown config key(s) ['data.train_batchsize']: expected keys of verl's ppo_trainer or of verl-stable",
        ),
        (
            ["+actor_rollout_ref.rollout.engine_kwargs.hf.precision=fp9"],
            "hf rollout backend: unknown rollout precision 'fp9'; expected one of",
        ),
        (
            ["data.train_batch_size=3"],
            "verl rejects the config: ValueError: train_batch_size (3) must be >= actor.ppo_mini_batch_size (4)",
        ),
    ],
)
def test_run_refuses_bad_arguments_before_anything_starts(tmp_path, no_work, capsys, args, expected):
    err = _refused(["run", "--workdir", str(tmp_path / "w"), *args], capsys)
    assert expected in err
    assert not (tmp_path / "w").exists()


def test_run_refuses_a_file_as_workdir(tmp_path, no_work, capsys):
    target = tmp_path / "w"
    target.write_text("mine")
    err = _refused(["run", "--workdir", str(target)], capsys)
    assert f"--workdir {target} is a file; expected a directory" in err
    assert target.read_text() == "mine"


def test_print_overrides_checks_and_builds_nothing(tmp_path, no_work, capsys):
    argv = ["run", "--workdir", str(tmp_path / "w"), "trainer.val_before_train=True", "--precision", "bf16"]
    assert cli.main([*argv, "--print-overrides"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "trainer.device=cpu"  # only the overrides: the checks print nothing to stdout
    assert "+actor_rollout_ref.rollout.engine_kwargs.hf.precision=bf16" in lines
    assert lines[-1] == "trainer.val_before_train=True"  # an override before the options still comes last and wins
    assert not (tmp_path / "w").exists()


def test_run_with_the_megatron_actor_composes_on_verls_megatron_trainer(tmp_path, monkeypatch, capsys):
    argv = ["run", "--workdir", str(tmp_path / "w"), "--actor", "megatron", "--engine", "vllm", "--steps", "1"]
    monkeypatch.setattr(launch, "ensure_assets", _fail)
    assert cli.main([*argv, "--print-overrides"]) == 0  # preflight composed them on ppo_megatron_trainer
    lines = capsys.readouterr().out.splitlines()
    assert "actor_rollout_ref.actor.megatron.vanilla_mbridge=True" in lines  # the Megatron CPU runtime's settings
    assert "actor_rollout_ref.model.use_remove_padding=True" in lines  # Megatron trains packed sequences
    assert not [
        x
        for x in lines
        if x.startswith(("actor_rollout_ref.actor.strategy=", "actor_rollout_ref.model.use_remove_padding=False"))
    ]
    assert "actor_rollout_ref.rollout.name=vllm" in lines
    # the run itself: verl's main_ppo on its Megatron trainer config
    started: list[list[str]] = []
    monkeypatch.setattr(launch, "ensure_assets", lambda *a, **k: None)
    monkeypatch.setattr(
        launch, "run_main_ppo", lambda ov, *a, **k: started.append(ov) or subprocess.CompletedProcess(ov, 0)
    )
    assert cli.main(argv) == 0
    assert started[0][0] == "--config-name=ppo_megatron_trainer" and started[0][1:] == lines


def test_run_refuses_the_fsdp_attention_for_the_megatron_actor(tmp_path, no_work, capsys):
    err = _refused(["run", "--workdir", str(tmp_path / "w"), "--actor", "megatron", "--attention", "varlen"], capsys)
    assert "--attention is the FSDP actor's; the Megatron actor runs its own packed attention on CPU" in err
    err = _refused(["run", "--workdir", str(tmp_path / "w"), "--actor", "tpu"], capsys)
    assert "argument --actor: invalid choice: 'tpu' (choose from 'fsdp', 'megatron')" in err
    # a key of the FSDP trainer that verl's Megatron trainer does not have is refused on it
    err = _refused(
        [
            "run",
            "--workdir",
            str(tmp_path / "w"),
            "--actor",
            "megatron",
            "actor_rollout_ref.actor.fsdp_config.param_offload=True",
        ],
        capsys,
    )
    assert "the overrides do not compose on verl's ppo_megatron_trainer" in err
    assert not (tmp_path / "w").exists()


# ------------------------------------------------------------------------------------------------ Ray temp dir
def test_each_run_gets_its_own_ray_tmpdir(tmp_path, monkeypatch):
    seen: list[dict] = []

    def fake_run(cmd, cwd, env, stdout, stderr, timeout):
        seen.append(env)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(trainer_process.subprocess, "run", fake_run)
    monkeypatch.setenv("RAY_TMPDIR", "/tmp")  # a shared value inherited from the shell does not leak into runs
    a, b = Path("/tmp") / f"vs_{os.getpid()}_a", tmp_path / "b"
    try:
        launch.run_main_ppo(["x=1"], a)
        launch.run_main_ppo(["x=1"], b)
        dirs = [Path(env["RAY_TMPDIR"]) for env in seen]
        assert dirs[0] == a / launch.RAY_TMPDIR_NAME
        assert dirs[0] != dirs[1] and all(d.is_dir() for d in dirs)
    finally:
        import shutil

        shutil.rmtree(a, ignore_errors=True)
        for env in seen[1:]:
            if not Path(env["RAY_TMPDIR"]).is_relative_to(tmp_path):  # b's short private dir in the system temp dir
                shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)


def test_a_deep_workdir_gets_a_short_private_ray_tmpdir(tmp_path):
    deep = tmp_path / ("d" * 60) / "run"
    short = launch.ray_tmpdir(deep)
    assert len(str(short).encode()) + len(trainer_process._RAY_SOCKET_TAIL) <= trainer_process._SOCKET_PATH_MAX
    assert (deep / launch.RAY_TMPDIR_NAME).resolve() == short.resolve()  # found from the workdir
    assert short.stat().st_mode & 0o077 == 0 and short.stat().st_uid == os.getuid()
    assert launch.ray_tmpdir(deep) == short  # stable for one workdir
    other = launch.ray_tmpdir(tmp_path / ("e" * 60) / "run")
    assert other != short
    for d in (short, other):
        d.rmdir()


def test_a_short_ray_tmpdir_of_another_user_is_refused(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 60)
    short = launch.ray_tmpdir(deep)
    real_uid = os.getuid()
    monkeypatch.setattr(trainer_process.os, "getuid", lambda: real_uid + 1)
    name = f"vs-ray-{real_uid + 1}-" + short.name.rsplit("-", 1)[1]
    (short.parent / name).mkdir(mode=0o700)  # "pre-created" by someone else: owned by real_uid, not by real_uid + 1
    try:
        with pytest.raises(PermissionError, match=f"is not a directory owned by user {real_uid + 1}; expected one"):
            launch.ray_tmpdir(deep)
    finally:
        (short.parent / name).rmdir()
        short.rmdir()


# ------------------------------------------------------------------------------------------------ doctor --model
@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ("[1, 2]", "holds a JSON list; expected a JSON object with a model_type"),
        ("{not json", "is not JSON (Expecting property name enclosed in double quotes, line 1)"),
        ('{"num_hidden_layers": 4}', "model_type must be a string, got None"),
        ('{"model_type": ["qwen3_moe"]}', "model_type must be a string, got ['qwen3_moe']"),
        (
            '{"model_type": "qwen3_moe", "num_hidden_layers": "four", "num_experts": 8, "num_experts_per_tok": 2}',
            "num_hidden_layers must be an integer >= 0, got 'four'",
        ),
        ('{"model_type": "qwen3_moe", "num_hidden_layers": 4.5}', "num_hidden_layers must be an integer >= 0, got 4.5"),
        ('{"model_type": "qwen3_moe", "num_experts": true}', "num_experts must be an integer >= 0, got True"),
        ('{"model_type": "mixtral", "num_local_experts": -8}', "num_local_experts must be an integer >= 0, got -8"),
        ('{"model_type": "qwen3_moe", "mlp_only_layers": "0,1"}', "mlp_only_layers must be a list of layer indices"),
        ('{"model_type": "x", "text_config": [1]}', "text_config must be a JSON object, got list"),
        (
            '{"model_type": "qwen3_5_moe", "text_config": {"num_hidden_layers": "4"}}',
            "text_config.num_hidden_layers must be an integer >= 0, got '4'",
        ),
    ],
)
def test_doctor_model_with_a_malformed_config_gets_a_verdict(tmp_path, config, expected):
    (tmp_path / "config.json").write_text(config)
    lines: list[str] = []
    problems = cli._check_model(str(tmp_path), lines.append)
    assert len(problems) == 1 and problems[0].startswith(f"routing of {tmp_path} cannot be checked: ")
    assert expected in problems[0]
    assert lines[-1].startswith("    routing replay: cannot be checked (") and expected in lines[-1]


def test_doctor_model_verdict_when_transformers_itself_refuses(tmp_path, monkeypatch):
    import verl_stable.routing.describe as describe

    def broken(model):
        raise TypeError("something\nmulti-line")

    monkeypatch.setattr(describe, "describe_model_routing", broken)
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe"}')
    lines: list[str] = []
    assert cli._check_model(str(tmp_path), lines.append) == [
        f"routing of {tmp_path} cannot be checked: TypeError: something multi-line"
    ]


def test_doctor_model_still_reports_a_sound_checkpoint(tmp_path):
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(hidden_size=32, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2).save_pretrained(tmp_path)
    lines: list[str] = []
    assert cli._check_model(str(tmp_path), lines.append) == []
    assert any("routing replay: supported (family qwen3_moe" in line for line in lines)


def test_doctor_end_to_end_prints_a_verdict_and_exits_1(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_check_cpu_runtime", lambda out: [])  # its own tests live in tests/cpu
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    assert cli.main(["doctor", "--model", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"routing of {tmp_path} cannot be checked: {tmp_path / 'config.json'} holds a JSON list" in out
    assert "Traceback" not in out


@pytest.mark.parametrize(("make", "why"), [("missing", "no such file or directory"), ("empty", "no config.json in it")])
def test_doctor_refuses_a_model_that_is_not_a_checkpoint(tmp_path, capsys, monkeypatch, make, why):
    monkeypatch.setattr(cli, "doctor", _fail)
    path = tmp_path / make
    if make == "empty":
        path.mkdir()
    err = _refused(["doctor", "--model", str(path)], capsys)
    expected = "argument --model: expected a Hugging Face checkpoint directory with a config.json (or the file)"
    assert f"{expected}, got {str(path)!r} ({why})" in err


def test_an_unknown_command_is_refused(capsys):
    err = _refused(["trian"], capsys)
    assert "invalid choice: 'trian'" in err


@pytest.mark.parametrize("name", ["w,1", "w=1", "w[1]", "wörk", "w#1"])
def test_run_refuses_a_workdir_hydra_cannot_carry(tmp_path, no_work, capsys, name):
    err = _refused(["run", "--workdir", str(tmp_path / name)], capsys)
    assert f"--workdir {str(tmp_path / name)!r} cannot be passed to verl in a hydra override; expected a path" in err
    assert not (tmp_path / name).exists()


def test_run_accepts_a_workdir_with_spaces(tmp_path, no_work, capsys):
    assert cli.main(["run", "--workdir", str(tmp_path / "my run"), "--print-overrides"]) == 0
    assert f"trainer.default_local_dir={tmp_path / 'my run' / 'checkpoints'}" in capsys.readouterr().out


def test_run_refuses_a_workdir_below_a_file_or_unwritable(tmp_path, no_work, capsys, monkeypatch):
    (tmp_path / "f").write_text("mine")
    err = _refused(["run", "--workdir", str(tmp_path / "f" / "w")], capsys)
    assert f"--workdir {tmp_path / 'f' / 'w'} lies below the file {tmp_path / 'f'}; expected a directory" in err
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    err = _refused(["run", "--workdir", str(tmp_path / "w")], capsys)
    assert f"--workdir {tmp_path / 'w'} cannot be written: {tmp_path} is not writable by this user" in err


# ------------------------------------------------------------------------------------------------ never truncate
def _verl_like_main_ppo(monkeypatch, calls: list[int]):
    """Stands in for the ``main_ppo`` subprocess, writing the run's files as it does: verl's own file logger opens
    the metrics file named by ``VERL_FILE_LOGGER_PATH`` (mode "wb"), and the process's output goes to the log."""
    from verl.utils.tracking import FileLogger

    def fake_run(cmd, cwd, env, stdout, stderr, timeout):
        calls.append(len(calls) + 1)
        monkeypatch.setenv("VERL_FILE_LOGGER_PATH", env["VERL_FILE_LOGGER_PATH"])
        logger = FileLogger("p", "e")
        logger.log({"critic/score/mean": calls[-1] / 10}, step=1)
        logger.finish()
        stdout.write(f"run {calls[-1]}\n")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(trainer_process.subprocess, "run", fake_run)


def test_a_second_run_in_a_workdir_sets_the_first_aside(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launch, "ensure_assets", lambda *args, **kwargs: None)
    calls: list[int] = []
    _verl_like_main_ppo(monkeypatch, calls)
    workdir = tmp_path / "w"
    assert cli.main(["run", "--workdir", str(workdir), "--steps", "1"]) == 0
    first = {n: (workdir / n).read_text() for n in ("main_ppo.log", "metrics.jsonl")}
    assert json.loads(first["metrics.jsonl"])["data"]["critic/score/mean"] == 0.1
    capsys.readouterr()
    assert cli.main(["run", "--workdir", str(workdir), "--steps", "1"]) == 0
    (aside,) = (workdir / "superseded").iterdir()
    assert {n: (aside / n).read_text() for n in first} == first  # the first run's files, whole
    assert json.loads((workdir / "metrics.jsonl").read_text())["data"]["critic/score/mean"] == 0.2
    assert (workdir / "main_ppo.log").read_text() == "run 2\n"
    captured = capsys.readouterr()
    assert f"moved to {aside}" in captured.err  # says where the first run went


def test_run_refuses_a_workdir_in_a_symlink_loop(tmp_path, no_work, capsys):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    for workdir in (tmp_path / "a", tmp_path / "a" / "run"):
        err = _refused(["run", "--workdir", str(workdir)], capsys)
        assert f"--workdir {workdir} cannot be resolved" in err and "symlink loop" in err.lower()
        assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("verl-stable run: error: --workdir")


def test_doctor_keeps_third_party_messages_out_of_its_verdict(tmp_path):
    """In a terminal (real file descriptors, as a user runs it): the verdict on stdout, verl's and vLLM's warnings
    appended to --log, nothing on stderr, and an existing log is not truncated."""
    log = tmp_path / "doctor.log"
    log.write_text("an earlier line\n")
    done = subprocess.run(
        [sys.executable, "-m", "verl_stable.cli", "doctor", "--log", str(log)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == ""
    assert done.stdout.startswith("verl-stable doctor\n") and "all checks passed" in done.stdout
    assert "UserWarning" not in done.stdout and "WARNING" not in done.stdout
    text = log.read_text()
    assert text.startswith("an earlier line\n") and "engine is not available" in text
    assert f"(third-party messages of the check: {log}; --verbose prints them here)" in done.stdout
