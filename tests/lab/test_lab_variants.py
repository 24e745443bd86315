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
    assert changed == {V.override_key(k) for k in V.VARIANTS[name].switches}
    for key, value in V.VARIANTS[name].switches.items():
        assert mine[V.override_key(key)] == V.format_value(value)


@pytest.mark.parametrize("name", list(V.VARIANTS))
def test_composed_configs_differ_only_by_the_named_switches(composed, name):
    variant = V.VARIANTS[name]
    reference = composed["minirl"]
    mine = composed[name]
    changed = {k for k in reference.keys() | mine.keys() if reference.get(k) != mine.get(k)} - PER_RUN
    if variant.recipe == "minirl_onpolicy":
        assert changed == {V.override_key(k) for k in variant.switches}
        for key, value in variant.switches.items():
            assert mine[V.override_key(key)] == value
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


def _preflight(variant: V.Variant | str, n: int = 2):
    """The project's preflight of a run's overrides on its recipe: syntax, composition, unknown keys, verl-stable's
    option checks, verl's validate_config and its worker dataclasses (what main_ppo would reach after Ray started)."""
    from verl_stable.recipes.validate import preflight

    variant = V.get_variant(variant) if isinstance(variant, str) else variant
    args = V.run_overrides(variant, ASSETS, staleness=n, **GEOMETRY)
    return preflight([a for a in args if not a.startswith("--")], recipe=recipes.recipe_path("fsdp", variant.recipe))


@pytest.mark.parametrize("name", list(V.VARIANTS))
def test_every_variant_passes_the_preflight(name):
    """verl's own validation and dataclass conversion (as its workers do) take every switched config, and so do
    verl-stable's run-time option checks (the trust region the monitor needs, the hf backend's options)."""
    cfg = _preflight(name)
    configs = recipes.verl_configs(cfg, validate=False)
    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    assert dict(configs.actor.fsdp_config.mixed_precision) == fp32


@pytest.mark.parametrize(
    ("switches", "expected"),
    [
        ({"algorithm.rollout_correction.rollout_is_threshhold": 2.0}, "do not compose"),  # a misspelt key
        ({"+algorithm.rollout_correction.rollout_is_threshhold": 2.0}, "unknown config key"),  # ... added with +
        ({V.CLIP_LOW: 1.0}, "trust region"),  # MiniRL's loss cannot measure a lower bound of 0
    ],
)
def test_the_preflight_refuses_a_wrong_switch(switches, expected):
    with pytest.raises(ValueError, match=expected):
        _preflight(V.Variant("wrong", "minirl_onpolicy", switches))


def test_every_variant_names_a_loss_an_estimator_and_an_aggregation_verl_has(composed):
    """The values the preflight does not check: verl looks them up only inside its workers, mid-run."""
    import torch
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, agg_loss, get_adv_estimator_fn

    import verl_stable.integration.advantages  # noqa: F401 - registers minirl's estimator, as the plugin does
    import verl_stable.integration.losses  # noqa: F401 - registers the minirl and vespo losses

    for name, flat in composed.items():
        assert flat[V.LOSS_MODE] in POLICY_LOSS_REGISTRY, name
        assert callable(get_adv_estimator_fn(flat[V.ADV_ESTIMATOR])), name
        loss = agg_loss(torch.ones(2, 3), torch.ones(2, 3), flat[V.LOSS_AGG_MODE])  # raises for an unknown mode
        assert torch.isfinite(loss), name


# ---------------------------------------------------------------------------------------------- verl's baselines
_LOSS_KEYS = ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode", "entropy_coeff")
_LOSS_KEYS += ("use_kl_loss", "ppo_epochs", "policy_loss.loss_mode")


def _verl_defaults() -> dict:
    """verl 0.9.1's own trainer config, flattened: the reference the baselines must reproduce."""
    return _flat(recipes.base_container("fsdp"))


def _algorithm(flat: dict) -> dict:
    """The keys that make up the algorithm: its rollout correction, advantage, and the actor's loss settings."""
    out = {k: v for k, v in flat.items() if k.startswith("algorithm.rollout_correction.")}
    out.update({k: flat[k] for k in ("algorithm.adv_estimator", "algorithm.norm_adv_by_std_in_grpo")})
    out.update({f"actor_rollout_ref.actor.{k}": flat[f"actor_rollout_ref.actor.{k}"] for k in _LOSS_KEYS})
    return out


def test_plain_grpo_is_verls_grpo_with_no_correction(composed):
    """verl's docs/algo/grpo.md: adv_estimator=grpo, everything else verl's default (no rollout correction)."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    expected = {**_algorithm(_verl_defaults()), V.ADV_ESTIMATOR: "grpo"}
    assert _algorithm(composed["vanilla_grpo"]) == expected
    disabled = RolloutCorrectionConfig.disabled()  # verl's "metrics only" preset
    block = {k.rsplit(".", 1)[1]: v for k, v in expected.items() if k.startswith("algorithm.rollout_correction.")}
    assert block == {k: getattr(disabled, k) for k in block}
    assert block["rollout_is"] is None


def test_verl_tis_is_verls_token_tis_preset_on_plain_grpo(composed):
    """verl's token TIS as its presets define it (RolloutCorrectionConfig.decoupled_token_is(), verl's default
    threshold), on plain GRPO: the two differ by rollout_is alone."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    tis = _algorithm(composed["verl_tis"])
    preset = RolloutCorrectionConfig.decoupled_token_is()
    block = {k.rsplit(".", 1)[1]: v for k, v in tis.items() if k.startswith("algorithm.rollout_correction.")}
    assert block == {k: getattr(preset, k) for k in block}
    assert (block["rollout_is"], block["rollout_is_threshold"], block["bypass_mode"]) == ("token", 2.0, False)
    grpo = _algorithm(composed["vanilla_grpo"])
    assert {k for k in tis if tis[k] != grpo[k]} == {V.ROLLOUT_IS}
    # and the MiniRL recipe's own settings (threshold 5, clip-high 0.27, seq-mean-token-sum, minirl advantage) are gone
    assert composed["minirl"][V.ROLLOUT_IS_THRESHOLD] == 5.0 and composed["minirl"][V.CLIP_HIGH] == 0.27


def test_dppo_is_verls_dppo_example(composed):
    """verl's examples/dppo_trainer/run_qwen30b_dppo.sh with its default LOSS_MODE (dppo_tv); everything it does not
    set stays verl's default."""
    expected = {
        **_algorithm(_verl_defaults()),
        # the example's values, as its script sets them
        V.LOSS_MODE: "dppo_tv",
        V.CLIP_RATIO: 0.15,
        V.CLIP_LOW: 0.15,
        V.CLIP_HIGH: 0.15,
        V.CLIP_RATIO_C: 10000.0,
        V.ADV_ESTIMATOR: "grpo",
        V.NORM_ADV_BY_STD: False,
        V.LOSS_AGG_MODE: "seq-mean-token-sum-norm",
        V.BYPASS_MODE: True,
    }
    assert _algorithm(composed["dppo"]) == expected


def test_dppo_masks_by_total_variation_and_does_not_truncate(composed):
    """verl's DPPO loss with the variant's actor config: a token leaves the trust region when its probability moves
    more than 0.15 in the direction its advantage pushes; the stop-gradient ratio is not truncated (with verl's
    default clip_ratio_c = 3 the 100x ratio below would be)."""
    import torch
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    cfg = _preflight("dppo")
    actor = recipes.verl_configs(cfg, validate=False).actor
    # (mu = pi_old in bypass mode, pi_theta, advantage): +0.10 kept, +0.20 out, 0.001 -> 0.1 kept (ratio 100),
    # -0.20 with A < 0 out, -0.20 with A > 0 kept (the mask bounds only the pushed direction)
    old = torch.tensor([[0.5, 0.5, 0.001, 0.5, 0.5]]).log()
    new = torch.tensor([[0.6, 0.7, 0.1, 0.3, 0.3]]).log()
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, 1.0]])
    loss_fn = get_policy_loss_fn(actor.policy_loss.loss_mode)
    _, metrics = loss_fn(old, new, adv, torch.ones_like(adv), actor.loss_agg_mode, actor)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 5)  # the TV mask: two of five tokens
    assert metrics["actor/pg_clipfrac_lower"] == 0.0  # no ratio above clip_ratio_c = 10000
    # the same variant without the example's clip_ratio_c: verl's default (3.0) truncates the 100x ratio
    unset = V.Variant("dppo_c", "minirl_onpolicy", {k: v for k, v in V.DPPO.items() if k != V.CLIP_RATIO_C})
    actor = recipes.verl_configs(_preflight(unset), validate=False).actor
    assert actor.clip_ratio_c == _verl_defaults()[V.CLIP_RATIO_C] == 3.0
    _, metrics = loss_fn(old, new, adv, torch.ones_like(adv), actor.loss_agg_mode, actor)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 5)


def test_verl_tis_weights_tokens_by_the_truncated_ratio_and_grpo_by_nothing(composed):
    """verl's rollout correction with each baseline's block: w = min(pi_old / mu, 2) per token; none for GRPO."""
    import torch
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

    ratios = torch.tensor([[0.5, 1.5, 3.0, 10.0]])
    rollout = torch.full_like(ratios, 0.2).log()
    batch = {"old_log_probs": rollout + ratios.log(), "rollout_log_probs": rollout}
    for name, expected in (("verl_tis", [[0.5, 1.5, 2.0, 2.0]]), ("vanilla_grpo", None)):
        block = OmegaConf.create(_preflight(name).algorithm.rollout_correction)
        data = DataProto.from_dict({**batch, "response_mask": torch.ones_like(ratios)})
        data, _ = compute_rollout_correction_and_add_to_batch(data, block)
        if expected is None:
            assert "rollout_is_weights" not in data.batch.keys(), name
        else:
            assert data.batch["rollout_is_weights"] == pytest.approx(torch.tensor(expected)), name


def test_only_dppo_takes_pi_old_from_the_rollout_and_the_report_knows(composed):
    from verl_stable.lab.summaries import PI_OLD_IS_ROLLOUT

    bypass = {name for name, flat in composed.items() if flat[V.BYPASS_MODE] is True}
    assert bypass == {name for name in V.VARIANTS if V.pi_old_is_rollout(name)} == {"dppo"}
    assert PI_OLD_IS_ROLLOUT == bypass  # the report reads their KL(mu||pi_old) and F(2) as not logged


def test_precision_and_seed_are_plumbed():
    d = V.as_dict(_ov("minirl", 1, precision="bf16", seed=7))
    assert d["actor_rollout_ref.rollout.engine_kwargs.hf.precision"] == "bf16"
    assert d["data.seed"] == "7" and d["actor_rollout_ref.actor.data_loader_seed"] == "7"
    assert V.as_dict(_ov("minirl", 1, lr=0.02))[V.LR] == "0.02"
    assert V.as_dict(_ov("minirl", 1))[V.LR] == "1e-3"  # the CPU runtime's
    assert [o for o in _ov("minirl", 1, lr=0.02) if o.startswith(V.LR + "=")] == [f"{V.LR}=0.02"]  # replaced, not added


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
