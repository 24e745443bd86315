"""``VERL_STABLE_SKIP_IMPORTS``: packages a run will not use are refused, verl takes that as "engine not available",
and the CPU launcher asks for megatron-core only in runs that never mention Megatron, for vLLM only in ``hf`` rollouts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from verl_stable.compat import skip_imports as si
from verl_stable.toy import trainer_process as tp

FAKE = "vs_skip_fake_pkg"


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """A throwaway top-level package with a submodule, importable from ``tmp_path``, under a test-only group."""
    pkg = tmp_path / FAKE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("VALUE = 1\n")
    (pkg / "sub.py").write_text("VALUE = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(si.GROUPS, "fake", (FAKE,))
    yield FAKE
    for name in [m for m in sys.modules if m.partition(".")[0] == FAKE]:
        del sys.modules[name]


def test_a_skipped_package_and_its_submodules_are_refused_and_restored_after(fake_package):
    before = list(sys.meta_path)
    with si.skipped(["fake"]):
        assert si.active_groups() == ("fake",) and si.is_skipped(fake_package)
        with pytest.raises(ImportError, match=r"VERL_STABLE_SKIP_IMPORTS=fake"):
            __import__(fake_package)
        with pytest.raises(si.SkippedImportError):
            __import__(f"{fake_package}.sub")
        assert fake_package not in sys.modules
        assert __import__("json") is json  # everything else imports as before
    assert sys.meta_path == before and not si.is_skipped(fake_package)
    assert __import__(f"{fake_package}.sub").sub.VALUE == 2


def test_install_is_idempotent_and_refuses_a_package_already_imported(fake_package):
    with si.skipped([]):
        assert si.install(["fake", "fake"]) == [f"skip-import:{fake_package}"]
        assert si.install(["fake"]) == []  # already active: nothing added
        assert sum(isinstance(f, si._SkipFinder) for f in sys.meta_path) == 1
        si.uninstall()
        assert si.active_groups() == ()
    __import__(fake_package)
    with pytest.raises(ValueError, match=rf"already imported in this process \({fake_package}\)"):
        si.install(["fake"])


def test_the_variable_is_parsed_strictly():
    assert si.requested({}) == ()
    assert si.requested({si.ENV_SKIP_IMPORTS: " megatron , megatron,"}) == ("megatron",)
    assert si.requested({si.ENV_SKIP_IMPORTS: "vllm,megatron"}) == ("vllm", "megatron")
    with pytest.raises(ValueError, match=r"unknown groups \['megatorn'\]; known: megatron, vllm"):
        si.requested({si.ENV_SKIP_IMPORTS: "megatorn"})
    with pytest.raises(ValueError, match="unknown skip groups"):
        si.install(["nope"])


_VERL_PROCESS = textwrap.dedent(
    """
    import json, sys
    import verl  # loads the plugin, whose first step installs the finder
    import verl.workers.engine as engines
    import verl.experimental.agent_loop  # imports verl's checkpoint engines, one of which imports vllm.distributed
    from verl.checkpoint_engine import base as ckpt_base
    from verl.workers.engine.base import EngineRegistry
    from verl_stable.integration import plugin
    from verl_stable.cpu import engines as cpu_engines
    try:
        import megatron.core
        refused = None
    except ImportError as exc:
        refused = str(exc)
    print(json.dumps({
        "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("megatron", "mbridge", "vllm")),
        "hccl_error": str(ckpt_base.CheckpointEngineRegistry._import_errors.get("hccl_checkpoint_engine")),
        "verl_megatron": getattr(engines, "MegatronEngineWithLMHead", None) is not None,
        "fsdp": "fsdp" in EngineRegistry._engines["language_model"],
        "steps": {k: [s.ok, s.registered[:1]] for k, s in plugin.STATUS.items()},
        "installed": cpu_engines.megatron_installed(),
        "refused": refused,
    }))
    """
)


def test_a_verl_process_with_the_variable_never_imports_megatron_or_vllm_and_builds_fsdp_engines():
    env = {**os.environ, "VERL_PLATFORM": "cpu", si.ENV_SKIP_IMPORTS: "megatron,vllm"}
    proc = subprocess.run(
        [sys.executable, "-c", _VERL_PROCESS], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["loaded"] == [] and not out["verl_megatron"] and not out["installed"]
    assert out["fsdp"]
    assert all(ok for ok, _ in out["steps"].values()), out["steps"]
    assert out["steps"]["skip_imports"][1] == ["skip-import:megatron"]  # the first of the three refused packages
    # verl takes the refused vllm as "checkpoint engine not available", with the variable named in its record
    assert out["hccl_error"].startswith("vllm not imported: VERL_STABLE_SKIP_IMPORTS=megatron,vllm")
    assert out["steps"]["megatron_replay_metrics"][1][0].startswith("skipped: verl's Megatron engine is not importable")
    assert "VERL_STABLE_SKIP_IMPORTS=megatron,vllm (verl-stable) keeps it out" in out["refused"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["actor_rollout_ref.actor.strategy=fsdp2", "trainer.device=cpu"], False),
        (["actor_rollout_ref.actor.strategy=megatron"], True),
        (["--config-name=ppo_megatron_trainer"], True),
        (["model_engine=Megatron"], True),
    ],
)
def test_megatron_is_recognised_in_overrides(overrides, expected):
    assert tp.mentions_megatron(overrides) is expected


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["actor_rollout_ref.rollout.name=hf", "trainer.device=cpu"], False),
        (["trainer.device=cpu"], True),  # verl's default rollout is vLLM
        (["actor_rollout_ref.rollout.name=vllm"], True),
        (["actor_rollout_ref.rollout.name=hf", "+actor_rollout_ref.rollout.engine_kwargs.vllm.x=1"], True),
        (["actor_rollout_ref.rollout.name=hf", "reward.reward_model.enable=True"], True),
        (["actor_rollout_ref.rollout.name=hf", "reward.reward_model.enable=False"], False),
        (["actor_rollout_ref.rollout.name=hf", "+distillation.teacher_models.t0.enable=true"], True),
    ],
)
def test_vllm_stays_importable_unless_the_rollout_is_hf_and_nothing_else_may_serve_with_vllm(overrides, expected):
    assert tp.rollout_needs_vllm(overrides) is expected


def test_vllm_stays_importable_when_the_named_config_file_may_serve_a_reward_model_or_teacher(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("cfg")
    (tmp_path / "rm.yaml").write_text("reward:\n  reward_model:\n    enable: true\n")
    (tmp_path / "plain.yaml").write_text("actor_rollout_ref:\n  rollout:\n    name: vllm\n")
    hf = "actor_rollout_ref.rollout.name=hf"
    assert tp.rollout_needs_vllm([f"--config-path={tmp_path}", "--config-name=rm", hf])
    assert not tp.rollout_needs_vllm([f"--config-path={tmp_path}", "--config-name=plain", hf])  # the override wins
    assert not tp.rollout_needs_vllm([f"--config-path={tmp_path}", "--config-name=absent", hf])


def test_the_skip_groups_are_the_packages_a_run_does_not_need():
    assert tp.skip_groups(["actor_rollout_ref.rollout.name=hf"]) == ("megatron", "vllm")
    assert tp.skip_groups(["actor_rollout_ref.rollout.name=vllm"]) == ("megatron",)
    assert tp.skip_groups(["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.actor.strategy=megatron"]) == (
        "vllm",
    )
    assert tp.skip_groups(["actor_rollout_ref.actor.strategy=megatron"]) == ()
    assert all(g in si.GROUPS for g in tp.skip_groups(["actor_rollout_ref.rollout.name=hf"]))


def test_megatron_is_recognised_in_the_named_config_file(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("cfg")  # this test's own tmp_path would carry "megatron" in its name
    (tmp_path / "mine.yaml").write_text("defaults:\n  - ppo_megatron_trainer\n  - _self_\n")
    (tmp_path / "other.yaml").write_text("defaults:\n  - ppo_trainer\n")
    assert tp.mentions_megatron([f"--config-path={tmp_path}", "--config-name=mine"])
    assert not tp.mentions_megatron([f"--config-path={tmp_path}", "--config-name=other.yaml"])
    assert not tp.mentions_megatron([f"--config-path={tmp_path}", "--config-name=absent"])


def _launched_env(monkeypatch, tmp_path, overrides, environ=None):
    seen = {}

    def fake_run(cmd, cwd, env, stdout, stderr, timeout):
        seen.update(env=env, cmd=cmd)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(tp.subprocess, "run", fake_run)
    for name, value in (environ or {}).items():
        monkeypatch.setenv(name, value)
    tp.run_main_ppo(overrides, tmp_path / "run")
    return seen


def test_the_launcher_skips_megatron_only_for_runs_that_never_mention_it(monkeypatch, tmp_path):
    monkeypatch.delenv(si.ENV_SKIP_IMPORTS, raising=False)
    fsdp = _launched_env(monkeypatch, tmp_path, ["trainer.total_training_steps=1"])
    assert fsdp["env"][si.ENV_SKIP_IMPORTS] == "megatron"
    # it travels to every node with the job's environment, like the platform choice
    assert f"++{tp.JOB_ENV_KEY}.{si.ENV_SKIP_IMPORTS}='megatron'" in fsdp["cmd"]
    megatron = _launched_env(monkeypatch, tmp_path, ["actor_rollout_ref.actor.strategy=megatron"])
    assert si.ENV_SKIP_IMPORTS not in megatron["env"]
    hf = _launched_env(monkeypatch, tmp_path, ["actor_rollout_ref.rollout.name=hf"])
    assert hf["env"][si.ENV_SKIP_IMPORTS] == "megatron,vllm"
    assert f"++{tp.JOB_ENV_KEY}.{si.ENV_SKIP_IMPORTS}='megatron,vllm'" in hf["cmd"]
    chosen = _launched_env(monkeypatch, tmp_path, ["trainer.total_training_steps=1"], {si.ENV_SKIP_IMPORTS: ""})
    assert chosen["env"][si.ENV_SKIP_IMPORTS] == ""  # the caller's choice, even empty, wins
