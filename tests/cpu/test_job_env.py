"""The CPU run's environment reaches every node: overrides that put it into the Ray job's runtime_env.

A worker on a node the driver did not start (a cluster joined with ``ray_kwargs.ray_init.address``) gets its
environment from that node's ``ray start``, not from the driver; verl passes ``ray_kwargs.ray_init.runtime_env`` to
``ray.init``, whose ``env_vars`` Ray sets in every process of the job on every node.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_stable.toy.trainer_process import JOB_ENV_KEY, cpu_env, hydra_quote, job_env, job_env_overrides

TRICKY = ["cpu", "0.1", "true", "null", "1e3", "", "/tmp/a b/metrics.jsonl", "it's", "a\\b", "end\\", "\\'", "x${y}"]


@pytest.mark.parametrize("value", TRICKY)
def test_quoted_value_composes_back_to_the_same_string(value):
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    parsed = OverridesParser.create().parse_override(f"++k={hydra_quote(value)}").value()
    assert OmegaConf.create({"k": parsed}).k == value


def test_job_env_forwards_verl_variables_the_caller_did_not_set(tmp_path):
    env = cpu_env(tmp_path / "metrics.jsonl", 0.1, base={"PATH": "/bin", "VERL_STABLE_SKIP_STEPS": "losses"})
    given = [f"++{JOB_ENV_KEY}.VERL_PLATFORM='cpu'"]
    forwarded = {item.split("=", 1)[0].removeprefix(f"++{JOB_ENV_KEY}.") for item in job_env(env, given)}
    assert forwarded == {
        "VERL_FILE_LOGGER_PATH",
        "VERL_STABLE_POLL_INTERVAL_S",
        "VERL_STABLE_SKIP_STEPS",
        "TOKENIZERS_PARALLELISM",
    }
    with pytest.raises(ValueError, match="cannot be a config key"):
        job_env_overrides({"A-B": "1"})


def test_cpu_run_overrides_put_the_platform_and_run_variables_into_the_job_runtime_env(tmp_path):
    import verl.trainer.config as verl_config
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from verl_stable.toy.assets import asset_paths
    from verl_stable.toy.launch import cpu_overrides

    overrides = cpu_overrides(asset_paths(tmp_path / "assets"))
    overrides += job_env(cpu_env(tmp_path / "metrics.jsonl", 0.1, base={}), overrides)
    with initialize_config_dir(config_dir=str(Path(verl_config.__file__).parent), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    env_vars = OmegaConf.to_container(cfg.ray_kwargs.ray_init.runtime_env.env_vars)
    assert env_vars == {
        "VERL_PLATFORM": "cpu",
        "VERL_FILE_LOGGER_PATH": str(tmp_path / "metrics.jsonl"),
        "VERL_STABLE_POLL_INTERVAL_S": "0.1",  # a string: Ray refuses other env_vars values
        "TOKENIZERS_PARALLELISM": "false",
    }


def test_run_main_ppo_passes_its_variables_in_the_job_runtime_env(tmp_path, monkeypatch):
    import subprocess

    from verl_stable.toy import trainer_process

    seen: list[list[str]] = []

    def fake_run(cmd, cwd, env, stdout, stderr, timeout):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(trainer_process.subprocess, "run", fake_run)
    trainer_process.run_main_ppo([f"++{JOB_ENV_KEY}.VERL_PLATFORM='cpu'", "x=1"], tmp_path / "run")
    forwarded = [arg for arg in seen[0] if arg.startswith(f"++{JOB_ENV_KEY}.")]
    assert f"++{JOB_ENV_KEY}.VERL_FILE_LOGGER_PATH='{tmp_path / 'run' / 'metrics.jsonl'}'" in forwarded
    assert sum(".VERL_PLATFORM=" in arg for arg in forwarded) == 1  # the caller's own is not repeated
