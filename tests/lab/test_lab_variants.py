"""The lab's variants: each is a recipe plus exactly the switches it names (checked on hydra-composed configs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_stable import recipes
from verl_stable.lab import variants as V
from verl_stable.toy.assets import Assets

ASSETS = Assets(Path("/lab/assets"), Path("/lab/model"), Path("/lab/train.parquet"), Path("/lab/val.parquet"))
GEOMETRY = dict(steps=3, mini_batch_prompts=2, group_size=4)
PER_RUN = {"trainer.experiment_name"}


def _ov(name: str, n: int = 4, **kw) -> list[str]:
    return V.run_overrides(name, ASSETS, staleness=n, **{**GEOMETRY, **kw})


def _flat(node, prefix=""):
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: node}


def _composed(name: str, n: int = 4) -> dict:
    from omegaconf import OmegaConf

    args = _ov(name, n)
    config_name = next(a for a in args if a.startswith("--config-name=")).split("=", 1)[1]
    cfg = recipes.compose_recipe("fsdp", config_name, [a for a in args if not a.startswith("--")])
    return _flat(OmegaConf.to_container(cfg, resolve=False))


@pytest.fixture(scope="module")
def composed() -> dict[str, dict]:
    return {name: _composed(name) for name in V.VARIANTS}


@pytest.mark.parametrize("name", [n for n, v in V.VARIANTS.items() if v.recipe == "minirl_onpolicy"])
def test_override_lists_differ_only_by_the_named_switches(name):
    base, mine = V.as_dict(_ov("minirl")), V.as_dict(_ov(name))
    changed = {k for k in base.keys() | mine.keys() if base.get(k) != mine.get(k)} - PER_RUN
    assert changed == set(V.VARIANTS[name].switches)
    for key, value in V.VARIANTS[name].switches.items():
        assert mine[key] == V.format_value(value)


@pytest.mark.parametrize("name", list(V.VARIANTS))
def test_composed_configs_differ_only_by_the_named_switches(composed, name):
    variant = V.VARIANTS[name]
    reference = composed["minirl"]
    mine = composed[name]
    changed = {k for k in reference.keys() | mine.keys() if reference.get(k) != mine.get(k)} - PER_RUN
    if variant.recipe == "minirl_onpolicy":
        assert changed == set(variant.switches)
        for key, value in variant.switches.items():
            assert mine[key] == value
    else:  # vespo: its recipe differs from MiniRL's in the loss block only
        assert changed and all(k.startswith("actor_rollout_ref.actor.policy_loss.") for k in changed), changed
        assert mine[V.LOSS_MODE] == "vespo"


@pytest.mark.parametrize("n", [1, 4])
def test_lab_sets_staleness_and_keeps_the_recipe(n):
    from omegaconf import OmegaConf

    args = _ov("minirl_r3", n)
    cfg = recipes.compose_recipe("fsdp", "minirl_onpolicy", [a for a in args if not a.startswith("--")])
    assert recipes.staleness(cfg) == n
    assert cfg.actor_rollout_ref.actor.fsdp_config.router_replay.mode == "R3"
    assert cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay is True
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.hf.precision == "fp8"
    assert cfg.reward.custom_reward_function.path.endswith("verl_stable/lab/reward.py")
    assert OmegaConf.select(cfg, "stable.guard.rules.train_inference_kl.action") == "warn"
    if n >= 4:  # the lab's R3 run at N >= 4 is the shipped R3 regime, up to the CPU geometry
        assert recipes.regime_mismatches(cfg, "minirl_n4_r3", paper_geometry=False) == []


def test_every_run_gets_the_common_switches_and_fp32_training(composed):
    for name, flat in composed.items():
        assert flat[V.ROLLOUT_ROUTING] is True, name
        for part in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            assert flat[f"actor_rollout_ref.actor.fsdp_config.mixed_precision.{part}"] == "fp32", name
        assert flat["data.train_batch_size"] == 4 * GEOMETRY["mini_batch_prompts"], name
    assert composed["reinforce_no_is"][V.ROLLOUT_IS] is None
    assert composed["minirl"][V.ROLLOUT_IS] == "token"


@pytest.mark.parametrize("name", ["minirl_r3", "vanilla_grpo", "vespo", "minirl_noclip"])
def test_verl_accepts_the_lab_configs(name):
    """verl's own validation and dataclass conversion (as its workers do) take every switched config, and so do
    verl-stable's run-time option checks (the trust region the monitor needs, the hf backend's options)."""
    from verl_stable.recipes.validate import option_problems

    args = _ov(name, 2)
    config_name = next(a for a in args if a.startswith("--config-name=")).split("=", 1)[1]
    cfg = recipes.compose_recipe("fsdp", config_name, [a for a in args if not a.startswith("--")])
    assert option_problems(cfg) == []
    configs = recipes.verl_configs(cfg, validate=True)
    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    assert dict(configs.actor.fsdp_config.mixed_precision) == fp32


def test_precision_and_seed_are_plumbed():
    d = V.as_dict(_ov("minirl", 1, precision="bf16", seed=7))
    assert d["actor_rollout_ref.rollout.engine_kwargs.hf.precision"] == "bf16"
    assert d["data.seed"] == "7" and d["actor_rollout_ref.actor.data_loader_seed"] == "7"


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="unknown variant"):
        _ov("ppo")
    with pytest.raises(ValueError, match="staleness N"):
        _ov("minirl", 3)
    with pytest.raises(ValueError, match="precision"):
        _ov("minirl", precision="int3")
    with pytest.raises(ValueError, match="not key=value"):
        V.as_dict(["a.b"])
    assert V.format_value(None) == "null" and V.format_value(True) == "true" and V.format_value(0.5) == "0.5"
