"""Where the recipes are and how they compose on verl's own trainer config.

A recipe is a hydra config in ``recipes/<backend>/<regime>.yaml`` that composes on verl 0.9.1's own trainer config
(``ppo_trainer`` for FSDP, ``ppo_megatron_trainer`` for Megatron) through ``hydra.searchpath=[pkg://verl.trainer
.config]`` declared in the recipe itself, so verl's entry point runs it unchanged::

    python -m verl.trainer.main_ppo --config-path=$PWD/recipes/fsdp --config-name=minirl_n2_r2 \\
        actor_rollout_ref.model.path=Qwen/Qwen3-30B-A3B data.train_files=... data.val_files=...

This module finds the files (:func:`recipes_dir`, :func:`recipe_path`), composes them exactly as ``main_ppo``'s
``--config-path/--config-name`` would (:func:`compose_file`, :func:`compose_recipe`), composes verl's own base config
(:func:`compose_base`) and lists the keys a config or a recipe file sets (:func:`config_keys`, :func:`recipe_keys`).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from verl_stable import env_vars
from verl_stable.recipes.regimes import BACKENDS, REGIMES, check_backend_regime
from verl_stable.recipes.strict_yaml import read_recipe_file

RECIPES_ENV = env_vars.RECIPES.name


# ------------------------------------------------------------------------------------------------ locating recipes
def recipes_dir() -> Path:
    """The ``recipes/`` directory: ``$VERL_STABLE_RECIPES`` if set, else the checkout's (next to the package), else
    ``<prefix>/share/verl-stable/recipes``.

    Raises:
        FileNotFoundError: ``$VERL_STABLE_RECIPES`` is set but holds no recipes, or none of the others exists (e.g. a
            wheel install without the recipes); the message says what to set.
    """
    try:
        chosen = env_vars.RECIPES.read()
    except env_vars.EnvVarError as exc:
        raise FileNotFoundError(str(exc)) from None
    if chosen is not None:
        return chosen
    # this file is <checkout>/verl_stable/recipes/compose.py
    candidates = [Path(__file__).resolve().parents[2] / "recipes", Path(sys.prefix) / "share/verl-stable/recipes"]
    for path in candidates:
        if (path / "fsdp").is_dir():
            return path
    raise FileNotFoundError(
        f"no verl-stable recipes directory found (looked in {[str(p) for p in candidates]}); "
        f"set {RECIPES_ENV}=/path/to/verl-stable/recipes"
    )


def recipe_path(backend: str, regime: str) -> Path:
    """``recipes/<backend>/<regime>.yaml``.

    Raises:
        ValueError: Unknown backend or regime.
        FileNotFoundError: The file is missing.
    """
    check_backend_regime(backend, regime)
    path = recipes_dir() / backend / f"{regime}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"recipe {backend}/{regime} is missing: {path}")
    return path


def list_recipes() -> list[tuple[str, str, Path]]:
    """Every shipped recipe as ``(backend, regime, path)``, in table order."""
    return [(b, r, recipe_path(b, r)) for b in BACKENDS for r in REGIMES]


def parse_recipe_name(name: str) -> tuple[str, str]:
    """``"fsdp/minirl_n2_r2"`` (or just ``"minirl_n2_r2"``, meaning FSDP) -> ``("fsdp", "minirl_n2_r2")``.

    Raises:
        ValueError: An unknown backend or regime; the message lists the known ones.
    """
    backend, _, regime = name.rpartition("/")
    backend = backend or "fsdp"
    regime = regime.removesuffix(".yaml")
    check_backend_regime(backend, regime)
    return backend, regime


def main_ppo_command(backend: str, regime: str) -> list[str]:
    """The verl command that runs a recipe; append ``key=value`` overrides."""
    path = recipe_path(backend, regime)
    return [
        "python",
        "-m",
        "verl.trainer.main_ppo",
        f"--config-path={path.parent}",
        f"--config-name={path.stem}",
    ]


# ------------------------------------------------------------------------------------------------ composing
def compose_file(path: str | os.PathLike, overrides: Sequence[str] = ()) -> Any:
    """Compose a recipe file with hydra's compose API exactly as ``main_ppo --config-path/--config-name`` would.

    The recipe's own ``hydra.searchpath`` brings in verl's config package. Interpolations are left unresolved (as
    hydra hands them to ``main_ppo``); resolve with ``OmegaConf.resolve`` on a copy if needed.

    Raises:
        RecipeFileError: The file is malformed (:func:`~verl_stable.recipes.strict_yaml.read_recipe_file`: not
            UTF-8, a duplicate key, an alias bomb ...); checked before hydra reads it.
        hydra.errors.ConfigCompositionException / MissingConfigException: The recipe does not compose.
    """
    from hydra import compose, initialize_config_dir

    path = Path(path).resolve()
    read_recipe_file(path)  # hydra's own read would expand an alias bomb and report the rest without the file
    with initialize_config_dir(config_dir=str(path.parent), version_base=None):
        return compose(config_name=path.stem, overrides=list(overrides))


def compose_recipe(backend: str, regime: str, overrides: Sequence[str] = ()) -> Any:
    """Compose ``recipes/<backend>/<regime>.yaml`` on verl's config with ``overrides``; see :func:`compose_file`."""
    return compose_file(recipe_path(backend, regime), overrides)


def compose_base(backend: str, overrides: Sequence[str] = ()) -> Any:
    """verl's own trainer config for ``backend`` (what the recipes compose on), without any recipe.

    Raises:
        ValueError: An unknown backend.
        hydra.errors.HydraException: The overrides do not compose.
    """
    if not overrides:
        from omegaconf import OmegaConf

        return OmegaConf.create(base_container(backend))
    return _compose_base(backend, overrides)


@functools.cache
def base_container(backend: str) -> dict:
    """verl's own trainer config for ``backend`` as a plain container, interpolations unresolved (cached).

    verl's installed config files do not change within a process, and composing them costs about a second.
    """
    from omegaconf import OmegaConf

    return OmegaConf.to_container(_compose_base(backend, ()), resolve=False)


def _compose_base(backend: str, overrides: Sequence[str]) -> Any:
    from hydra import compose, initialize_config_module

    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known: {sorted(BACKENDS)}")
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name=BACKENDS[backend], overrides=list(overrides))


# ------------------------------------------------------------------------------------------------ keys
def leaf_paths(node: Any, prefix: str = "") -> Iterator[str]:
    """Dotted paths of every leaf below ``node`` (a plain container; an empty mapping counts as a leaf)."""
    if isinstance(node, Mapping) and node:
        for key, value in node.items():
            yield from leaf_paths(value, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix


def config_keys(cfg: Any) -> set[str]:
    """Every dotted leaf key of a config (an empty mapping counts as a leaf), interpolations unresolved."""
    from omegaconf import DictConfig, OmegaConf

    container = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else cfg
    return set(leaf_paths(container))


def recipe_keys(path: str | os.PathLike) -> list[str]:
    """Dotted leaf keys a recipe file sets itself (its ``hydra`` and ``defaults`` entries excluded).

    Raises:
        RecipeFileError: The file is malformed (:func:`~verl_stable.recipes.strict_yaml.read_recipe_file`).
        ValueError: The file is not a mapping.
    """
    raw = read_recipe_file(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a recipe must be a mapping")
    body = {k: v for k, v in raw.items() if k not in ("hydra", "defaults")}
    return list(leaf_paths(body))


def recipe_base(path: str | os.PathLike) -> str:
    """The verl trainer config a recipe file lists in its ``defaults``.

    Raises:
        RecipeFileError: The file is malformed (:func:`~verl_stable.recipes.strict_yaml.read_recipe_file`).
        ValueError: The file is not a mapping, or lists neither ``ppo_trainer`` nor ``ppo_megatron_trainer``.
    """
    raw = read_recipe_file(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a recipe must be a mapping")
    defaults = raw.get("defaults") or []
    bases = [d for d in defaults if isinstance(d, str) and d in BACKENDS.values()]
    if len(bases) != 1:
        raise ValueError(f"{path}: defaults must list exactly one of {sorted(BACKENDS.values())}, got {defaults}")
    return bases[0]
