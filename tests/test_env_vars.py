"""Every ``VERL_STABLE_*`` variable is read by one typed reader (:mod:`verl_stable.env_vars`), and a bad value is
refused where it is read and by every command that uses it before any work: no asset built, no earlier run set
aside, no verl process started. Each refusal names the variable and the values it accepts.

Work a refused command must not start is replaced by functions that fail the test.
"""

from __future__ import annotations

import math
import socket
import subprocess
import sys

import pytest

from verl_stable import cli, env_vars, recipe_cli
from verl_stable.compat import skip_imports
from verl_stable.cpu import faults, polling
from verl_stable.integration import plugin
from verl_stable.lab import attempts, sweep
from verl_stable.lab import cli as lab_cli
from verl_stable.recipes import compose
from verl_stable.toy import launch, trainer_process

# (variable, bad value, what the refusal says about it)
BAD = [
    ("VERL_STABLE_SKIP_STEPS", "fsdp_routerreplay", "names unknown steps ['fsdp_routerreplay']; known steps: skip_imp"),
    ("VERL_STABLE_SKIP_IMPORTS", "megatorn", "names unknown groups ['megatorn']; known: megatron, vllm"),
    ("VERL_STABLE_FAULT_LR_SPIKE", "3x100", "is not '<optimizer step>:<factor>'"),
    (
        "VERL_STABLE_FAULT_LR_SPIKE",
        "0:100",
        "is out of range: the step must be >= 1 and the factor a finite number > 0",
    ),
    ("VERL_STABLE_POLL_INTERVAL_S", "inf", "is not finite"),
    ("VERL_STABLE_POLL_INTERVAL_S", "nan", "is not finite"),
    ("VERL_STABLE_POLL_INTERVAL_S", "fast", "is not a number"),
    ("VERL_STABLE_POLL_INTERVAL_S", "-0.5", "is not > 0"),
    ("VERL_STABLE_PREFORK", "off", "is neither 0 nor 1"),
    ("VERL_STABLE_PREFORK", "true", "is neither 0 nor 1"),
    ("VERL_STABLE_PREFORK_SOCKET", "/nonexistent/prefork.sock", "cannot be reached"),
    ("VERL_STABLE_RECIPES", "/nonexistent/recipes", "is not a verl-stable recipes directory (no fsdp/ in it)"),
]
IDS = [f"{name.removeprefix('VERL_STABLE_')}={value}" for name, value, _ in BAD]


def _reader(name: str) -> env_vars.EnvVar:
    return next(v for v in env_vars.READERS if v.name == name)


def _fail(*args, **kwargs):
    raise AssertionError("work started although the input should have been refused")


@pytest.fixture
def clean_env(monkeypatch):
    """No ``VERL_STABLE_*`` variable of the test's own environment leaks into the check."""
    import os

    for name in [n for n in os.environ if n.startswith(env_vars.PREFIX)]:
        monkeypatch.delenv(name)


# ------------------------------------------------------------------------------------------------ the readers
@pytest.mark.parametrize(("name", "value", "why"), BAD, ids=IDS)
def test_each_reader_refuses_a_bad_value_naming_it_and_the_accepted_values(name, value, why):
    reader = _reader(name)
    with pytest.raises(env_vars.EnvVarError) as info:
        reader.read({name: value})
    message = str(info.value)
    assert message.startswith(f"{name}={value} ") and why in message
    assert message.endswith(f"; expected {reader.accepted}")
    assert env_vars.check_all({name: value}) == [message]


def test_the_readers_keep_their_values_for_what_they_accept(tmp_path):
    assert env_vars.SKIP_STEPS.read({}) == frozenset()
    assert env_vars.SKIP_STEPS.read({"VERL_STABLE_SKIP_STEPS": " losses, ,losses"}) == {"losses"}
    assert env_vars.SKIP_IMPORTS.read({"VERL_STABLE_SKIP_IMPORTS": "vllm,megatron,"}) == ("vllm", "megatron")
    assert env_vars.FAULT_LR_SPIKE.read({"VERL_STABLE_FAULT_LR_SPIKE": "3:1e3"}) == (3, 1000.0)
    assert env_vars.FAULT_LR_SPIKE.read({"VERL_STABLE_FAULT_LR_SPIKE": ""}) is None
    assert env_vars.POLL_INTERVAL_S.read({"VERL_STABLE_POLL_INTERVAL_S": " 0.25 "}) == 0.25
    assert env_vars.POLL_INTERVAL_S.read({"VERL_STABLE_POLL_INTERVAL_S": ""}) is None
    assert env_vars.PREFORK.read({}) is True and env_vars.PREFORK.read({"VERL_STABLE_PREFORK": "0"}) is False
    assert env_vars.LAB_FORCE_START_FAILURE.read({"VERL_STABLE_LAB_FORCE_START_FAILURE": "a, b,"}) == ("a", "b")
    (tmp_path / "fsdp").mkdir()
    assert env_vars.RECIPES.read({"VERL_STABLE_RECIPES": str(tmp_path)}) == tmp_path
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        assert env_vars.PREFORK_SOCKET.read({"VERL_STABLE_PREFORK_SOCKET": str(path)}) == path
    (tmp_path / "plain").write_text("")
    with pytest.raises(env_vars.EnvVarError, match="is not a unix socket"):
        env_vars.PREFORK_SOCKET.read({"VERL_STABLE_PREFORK_SOCKET": str(tmp_path / "plain")})


def test_a_misspelt_variable_name_is_refused_with_the_closest_known_one():
    (problem,) = env_vars.check_all({"VERL_STABLE_SKIP_STEP": "losses", "VERL_STABLE_NO_VLLM": "1", "PATH": "/bin"})
    assert problem.startswith(
        "VERL_STABLE_SKIP_STEP is not a variable verl-stable reads (did you mean VERL_STABLE_SKIP_STEPS?); known: "
    )


def test_every_variable_the_package_reads_has_a_reader():
    """A ``VERL_STABLE_`` name in the package's source is one of the readers' (or a script's): the one place."""
    import re
    from pathlib import Path

    import verl_stable

    root = Path(verl_stable.__file__).parent
    used = {m for p in root.rglob("*.py") for m in re.findall(r"VERL_STABLE_[A-Z0-9_]+", p.read_text())}
    assert used - {"VERL_STABLE_"} <= set(env_vars.known_names())


def test_the_modules_name_the_variables_their_readers_read():
    from verl_stable.cpu import prefork, prefork_client
    from verl_stable.lab import attempts as lab_attempts

    assert skip_imports.ENV_SKIP_IMPORTS == env_vars.SKIP_IMPORTS.name
    assert plugin.ENV_SKIP_STEPS == env_vars.SKIP_STEPS.name
    assert faults.LR_SPIKE_ENV == env_vars.FAULT_LR_SPIKE.name
    assert polling.ENV_POLL_INTERVAL == env_vars.POLL_INTERVAL_S.name
    assert prefork.ENV_SWITCH == env_vars.PREFORK.name
    assert prefork_client.ENV_SOCKET == env_vars.PREFORK_SOCKET.name
    assert compose.RECIPES_ENV == env_vars.RECIPES.name
    assert lab_attempts.FORCE_START_FAILURE_ENV == env_vars.LAB_FORCE_START_FAILURE.name
    # the prefork switch is read by the prefork module too: it accepts exactly what the reader accepts
    for value in ("0", "1", "off", "", " 1"):
        try:
            expected = env_vars.PREFORK.read({prefork.ENV_SWITCH: value})
        except ValueError:
            with pytest.raises(ValueError, match=prefork.ENV_SWITCH):
                prefork.enabled({prefork.ENV_SWITCH: value})
        else:
            assert prefork.enabled({prefork.ENV_SWITCH: value}) is (expected and sys.platform.startswith("linux"))


def test_the_places_that_read_a_variable_use_its_reader(monkeypatch):
    """Where each variable takes effect, the same refusal as the preflight's (these raised nothing, or another
    message, or read ``inf`` as an interval, before)."""
    monkeypatch.setenv("VERL_STABLE_POLL_INTERVAL_S", "inf")
    with pytest.raises(ValueError, match=r"VERL_STABLE_POLL_INTERVAL_S=inf is not finite"):
        polling.register()
    monkeypatch.setenv("VERL_STABLE_SKIP_STEPS", "losses,lossses")
    with pytest.raises(ValueError, match=r"names unknown steps \['lossses'\]"):
        plugin.skipped_steps()
    with pytest.raises(ValueError, match=r"VERL_STABLE_SKIP_IMPORTS=megatorn names unknown groups"):
        skip_imports.requested({"VERL_STABLE_SKIP_IMPORTS": "megatorn"})
    with pytest.raises(ValueError, match=r"VERL_STABLE_FAULT_LR_SPIKE=3:inf is out of range"):
        faults.register({"VERL_PLATFORM": "cpu", "VERL_STABLE_FAULT_LR_SPIKE": "3:inf"})
    monkeypatch.setenv("VERL_STABLE_RECIPES", "/nonexistent")
    with pytest.raises(FileNotFoundError, match="VERL_STABLE_RECIPES=/nonexistent is not a verl-stable recipes"):
        compose.recipes_dir()
    monkeypatch.setenv("VERL_STABLE_LAB_FORCE_START_FAILURE", "x,y")
    assert attempts.forced_start_failures() == ("x", "y")
    with pytest.raises(ValueError, match="poll interval must be a finite number of seconds > 0, got inf"):
        with polling.poll_interval(math.inf):
            pass


# ------------------------------------------------------------------------------------------------ the commands
@pytest.mark.parametrize(("name", "value", "why"), BAD, ids=IDS)
def test_run_refuses_a_bad_variable_before_any_work(tmp_path, clean_env, monkeypatch, capsys, name, value, why):
    monkeypatch.setattr(launch, "ensure_assets", _fail)
    monkeypatch.setattr(launch, "run_main_ppo", _fail)
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--workdir", str(tmp_path / "w")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"{name}={value} {why}" in err and f"expected {_reader(name).accepted}" in err
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize(("name", "value", "why"), BAD, ids=IDS)
def test_recipe_run_cpu_refuses_a_bad_variable_before_any_work(
    tmp_path, clean_env, monkeypatch, capsys, name, value, why
):
    monkeypatch.setattr(launch, "ensure_assets", _fail)
    monkeypatch.setattr(launch, "run_main_ppo", _fail)
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as info:
        recipe_cli.main(["run-cpu", "vespo", "--workdir", str(tmp_path / "w")], out=lambda _: None)
    assert info.value.code == 2
    assert f"{name}={value} {why}" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize(("name", "value", "why"), BAD, ids=IDS)
def test_lab_refuses_a_bad_variable_before_any_work(tmp_path, clean_env, monkeypatch, capsys, name, value, why):
    for work in ("prepare", "ensure_assets", "cold_start", "run_one"):
        monkeypatch.setattr(sweep, work, _fail)
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as info:
        lab_cli.main(["--out", str(tmp_path / "lab")], out=lambda _: None)
    assert info.value.code == 2
    assert f"{name}={value} {why}" in capsys.readouterr().err
    assert not (tmp_path / "lab").exists()


def test_lab_refuses_a_forced_start_failure_that_names_no_run(tmp_path, clean_env, monkeypatch, capsys):
    for work in ("prepare", "ensure_assets", "cold_start", "run_one"):
        monkeypatch.setattr(sweep, work, _fail)
    monkeypatch.setenv("VERL_STABLE_LAB_FORCE_START_FAILURE", "minirl_r3__N2")  # the default preset runs N = 4
    with pytest.raises(SystemExit) as info:
        lab_cli.main(["--out", str(tmp_path / "lab")], out=lambda _: None)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "VERL_STABLE_LAB_FORCE_START_FAILURE names ['minirl_r3__N2'], a prefix of no run of this sweep" in err


def test_run_main_ppo_refuses_before_setting_the_earlier_run_aside(tmp_path, clean_env, monkeypatch):
    monkeypatch.setattr(trainer_process.subprocess, "run", _fail)
    (tmp_path / "main_ppo.log").write_text("the earlier run\n")
    monkeypatch.setenv("VERL_STABLE_PREFORK", "off")
    with pytest.raises(ValueError, match=r"VERL_STABLE_PREFORK=off is neither 0 nor 1; expected 0 \(off\) or 1"):
        trainer_process.run_main_ppo(["x=1"], tmp_path)
    assert (tmp_path / "main_ppo.log").read_text() == "the earlier run\n"
    assert not (tmp_path / trainer_process.SUPERSEDED).exists()


def test_a_poll_interval_set_in_the_environment_takes_effect(tmp_path, clean_env, monkeypatch):
    """The launcher used to overwrite it with its own 0.1 s; now an explicit argument wins, then the variable."""
    seen: list[dict] = []

    def fake_run(cmd, cwd, env, stdout, stderr, timeout):
        seen.append(env)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(trainer_process.subprocess, "run", fake_run)
    monkeypatch.setenv("VERL_STABLE_PREFORK", "0")
    trainer_process.run_main_ppo(["x=1"], tmp_path / "a")
    monkeypatch.setenv("VERL_STABLE_POLL_INTERVAL_S", "0.5")
    trainer_process.run_main_ppo(["x=1"], tmp_path / "b")
    trainer_process.run_main_ppo(["x=1"], tmp_path / "c", poll_interval_s=0.2)
    assert [env["VERL_STABLE_POLL_INTERVAL_S"] for env in seen] == ["0.1", "0.5", "0.2"]
