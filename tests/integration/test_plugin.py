"""The entry point: plain `import verl` registers verl-stable everywhere; `doctor` makes failures visible."""

import os
import subprocess
import sys

import pytest

from verl_stable import cli
from verl_stable.integration import plugin


def test_import_verl_alone_registers_everything():
    # A fresh interpreter that never imports verl_stable: only verl's entry-point discovery can register us.
    code = (
        "import sys, verl\n"
        "from verl.trainer.ppo import core_algos as ca\n"
        "assert 'verl_stable.integration.plugin' in sys.modules, 'entry point not loaded'\n"
        "print(sorted(set(ca.POLICY_LOSS_REGISTRY) & {'minirl', 'vespo'}), 'minirl' in ca.ADV_ESTIMATOR_REGISTRY)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "['minirl', 'vespo'] True"


def test_plugin_can_be_disabled_by_verl_policy():
    code = "import sys, verl; print('verl_stable.integration.plugin' in sys.modules)"
    env = {"VERL_USE_EXTERNAL_PLUGINS": "none", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.strip() == "False"


def test_skip_steps_env_leaves_a_step_out_of_every_verl_process():
    code = (
        "import sys, verl\n"
        "from verl_stable.integration import plugin\n"
        "from verl.trainer.ppo import core_algos as ca\n"
        "st = plugin.STATUS['fsdp_router_replay']\n"
        "print(st.ok, st.registered, 'verl_stable.integration.fsdp_engine' in sys.modules, 'minirl' in ca.POLICY_LOSS_REGISTRY)\n"
    )
    env = {**os.environ, plugin.ENV_SKIP_STEPS: "fsdp_router_replay"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.strip().splitlines()[-1] == "True ['skipped (VERL_STABLE_SKIP_STEPS)'] False True"


def test_skip_steps_env_with_a_typo_fails_doctor(monkeypatch):
    monkeypatch.setenv(plugin.ENV_SKIP_STEPS, "fsdp_routerreplay")
    monkeypatch.setattr(plugin, "STATUS", {})
    with pytest.raises(
        ValueError, match="unknown steps \\['fsdp_routerreplay'\\]; known steps: skip_imports, cpu_runtime"
    ):
        plugin.skipped_steps()
    lines: list[str] = []
    assert cli.doctor(out=lines.append) == 1
    assert "[FAIL] skip_steps" in "\n".join(lines)


def test_doctor_passes_on_this_install():
    lines: list[str] = []
    assert cli.doctor(out=lines.append) == 0, "\n".join(lines)
    text = "\n".join(lines)
    assert "verl         0.9.1" in text
    assert "[ok ] losses" in text and "minirl" in text


def test_doctor_fails_loudly_when_a_step_fails(monkeypatch):
    monkeypatch.setattr(plugin, "REGISTRATION_STEPS", (*plugin.REGISTRATION_STEPS, ("broken", "verl_stable.no_such")))
    monkeypatch.setattr(plugin, "STATUS", {})
    lines: list[str] = []
    assert cli.doctor(out=lines.append) == 1
    text = "\n".join(lines)
    assert "[FAIL] broken" in text
    assert "No module named 'verl_stable.no_such'" in text


def test_cli_rejects_unknown_arguments():
    with pytest.raises(SystemExit):
        cli.main(["doctor", "--bogus"])


def test_doctor_model_reports_replayable_checkpoint(tmp_path):
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
    ).save_pretrained(tmp_path)
    lines: list[str] = []
    assert cli.doctor(model=str(tmp_path), out=lines.append) == 0, "\n".join(lines)
    text = "\n".join(lines)
    assert "routing replay: supported (family qwen3_moe" in text
    assert "MoE layers: 2 of 3 decoder layers (dense: [1])" in text


def test_doctor_model_fails_for_dense_or_unknown_model(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    ).save_pretrained(tmp_path)
    lines: list[str] = []
    assert cli.doctor(model=str(tmp_path), out=lines.append) == 1
    text = "\n".join(lines)
    assert "routing replay: NOT supported" in text and "llama" in text


def test_cli_delegates_recipe_subcommand(capsys):
    assert cli.main(["recipe", "list"]) == 0
    out = capsys.readouterr().out
    assert "fsdp/minirl_n4_r3" in out and "replay=R3" in out
