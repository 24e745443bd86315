"""The recipes of verl-stable: what regime each one is, how it composes on verl's config, and checks that it still is.

A recipe is a hydra config in ``recipes/<backend>/<regime>.yaml`` that composes on verl 0.9.1's own trainer config, so
verl's entry point runs it unchanged (``python -m verl.trainer.main_ppo --config-path=... --config-name=...``). The
package has three parts, each importable on its own:

* :mod:`~verl_stable.recipes.regimes` -- the regime table (:data:`REGIMES`: N, loss, routing replay, routing export)
  and its checks (:func:`regime_mismatches`, :func:`staleness`);
* :mod:`~verl_stable.recipes.compose` -- where the recipe files are and how they compose on verl's config;
* :mod:`~verl_stable.recipes.validate` -- checks of a composed config and of ``main_ppo`` arguments before a run
  (unknown keys, verl-stable's option sections, paths hydra cannot carry, verl's own conversion; :func:`preflight`).

Every public name of the three is importable from here. What sits above this package uses it: the CPU launcher runs a
regime on the CPU runtime (:func:`verl_stable.toy.launch.regime_overrides`, :func:`verl_stable.toy.launch.run_recipe`)
and the ``verl-stable recipe`` command is :mod:`verl_stable.recipe_cli` (``python -m verl_stable.recipes`` runs it).
"""

from __future__ import annotations

from verl_stable.recipes.compose import (
    RECIPES_ENV,
    base_container,
    compose_base,
    compose_file,
    compose_recipe,
    config_keys,
    leaf_paths,
    list_recipes,
    main_ppo_command,
    parse_recipe_name,
    recipe_base,
    recipe_keys,
    recipe_path,
    recipes_dir,
)
from verl_stable.recipes.regimes import (
    ADV_ESTIMATOR,
    BACKENDS,
    CLIP_RATIO_HIGH,
    CLIP_RATIO_LOW,
    GROUP_SIZE,
    IS_THRESHOLD,
    LOSS_AGG_MODE,
    MINI_BATCH_PROMPTS,
    POLICY_LOSS_CONFIG,
    REGIMES,
    ROLLOUT_ROUTING_KEY,
    ROUTER_REPLAY_KEY,
    TRAINER_MODE,
    VERL_CONFIG_SEARCHPATH,
    Regime,
    backend_of,
    check_backend_regime,
    config_value,
    regime_mismatches,
    staleness,
)
from verl_stable.recipes.validate import (
    EXTENSION_PREFIXES,
    HF_OPTIONS_SECTION,
    OPEN_MAPPINGS,
    ROUTING_OPTIONS_SECTION,
    VerlConfigs,
    check_output_dir,
    check_override_path,
    check_override_syntax,
    is_known_key,
    option_problems,
    preflight,
    unknown_gained_keys,
    unknown_override_keys,
    unknown_recipe_keys,
    verl_configs,
)

__all__ = [
    "ADV_ESTIMATOR",
    "BACKENDS",
    "CLIP_RATIO_HIGH",
    "CLIP_RATIO_LOW",
    "EXTENSION_PREFIXES",
    "GROUP_SIZE",
    "HF_OPTIONS_SECTION",
    "IS_THRESHOLD",
    "LOSS_AGG_MODE",
    "MINI_BATCH_PROMPTS",
    "OPEN_MAPPINGS",
    "POLICY_LOSS_CONFIG",
    "RECIPES_ENV",
    "REGIMES",
    "ROLLOUT_ROUTING_KEY",
    "ROUTER_REPLAY_KEY",
    "ROUTING_OPTIONS_SECTION",
    "TRAINER_MODE",
    "VERL_CONFIG_SEARCHPATH",
    "Regime",
    "VerlConfigs",
    "backend_of",
    "base_container",
    "check_backend_regime",
    "check_output_dir",
    "check_override_path",
    "check_override_syntax",
    "compose_base",
    "compose_file",
    "compose_recipe",
    "config_keys",
    "config_value",
    "is_known_key",
    "leaf_paths",
    "list_recipes",
    "main_ppo_command",
    "option_problems",
    "parse_recipe_name",
    "preflight",
    "recipe_base",
    "recipe_keys",
    "recipe_path",
    "recipes_dir",
    "regime_mismatches",
    "staleness",
    "unknown_gained_keys",
    "unknown_override_keys",
    "unknown_recipe_keys",
    "verl_configs",
]
