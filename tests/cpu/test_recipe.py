"""The CPU recipe YAML composes on verl's ppo_trainer and agrees with the launcher's overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

RECIPE_DIR = Path(__file__).resolve().parents[2] / "recipes" / "cpu"


def _compose(config_dir, name, overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name=name, overrides=overrides)


def test_recipe_matches_launcher(cpu_assets):
    import verl.trainer.config as verl_config

    from verl_stable.toy.launch import cpu_overrides

    paths = [
        f"data.train_files={cpu_assets.train_file}",
        f"data.val_files={cpu_assets.val_file}",
        f"actor_rollout_ref.model.path={cpu_assets.model_dir}",
    ]
    recipe = _compose(RECIPE_DIR, "grpo_tiny_moe", paths)
    launcher = _compose(Path(verl_config.__file__).parent, "ppo_trainer", cpu_overrides(cpu_assets))
    keys = [
        "trainer.device",
        "ray_kwargs.ray_init.runtime_env.env_vars.VERL_PLATFORM",
        "ray_kwargs.ray_init.num_gpus",
        "ray_kwargs.ray_init.num_cpus",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units",
        "actor_rollout_ref.rollout.name",
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        "actor_rollout_ref.actor.strategy",
        "actor_rollout_ref.model.use_remove_padding",
        "actor_rollout_ref.model.override_config.attn_implementation",
        "actor_rollout_ref.rollout.n",
        "data.train_batch_size",
        "algorithm.adv_estimator",
        "algorithm.rollout_correction.rollout_is",
        "reward.custom_reward_function.name",
    ]
    from omegaconf import OmegaConf

    for key in keys:
        assert OmegaConf.select(recipe, key) == OmegaConf.select(launcher, key), key
    assert recipe.trainer.device == "cpu" and recipe.actor_rollout_ref.rollout.name == "hf"
    assert recipe.ray_kwargs.ray_init.runtime_env.env_vars.VERL_PLATFORM == "cpu"


def test_kl_loss_overrides_pass_verls_config_validation(cpu_assets):
    # verl refuses a reference policy without a log-prob micro-batch size; cpu_overrides(kl_loss_coef=...) sets it.
    import verl.trainer.config as verl_config
    from verl.utils.config import validate_config

    from verl_stable.toy.launch import cpu_overrides

    config_dir = Path(verl_config.__file__).parent
    cfg = _compose(config_dir, "ppo_trainer", cpu_overrides(cpu_assets, kl_loss_coef=0.05))
    actor = cfg.actor_rollout_ref.actor
    assert actor.use_kl_loss is True and actor.kl_loss_coef == 0.05 and actor.kl_loss_type == "low_var_kl"
    validate_config(cfg, use_reference_policy=True, use_critic=False)
    bare = _compose(config_dir, "ppo_trainer", cpu_overrides(cpu_assets))
    assert bare.actor_rollout_ref.actor.use_kl_loss is False
    bare.actor_rollout_ref.actor.use_kl_loss = True
    with pytest.raises(ValueError, match="actor_rollout_ref.ref"):
        validate_config(bare, use_reference_policy=True, use_critic=False)
