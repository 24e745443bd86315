"""The recipes of verl-stable: where they are, what regime each one is, and checks that a composed config still is it.

A recipe is a hydra config in ``recipes/<backend>/<regime>.yaml`` that composes on verl 0.9.1's own trainer config
(``ppo_trainer`` for FSDP, ``ppo_megatron_trainer`` for Megatron) through ``hydra.searchpath=[pkg://verl.trainer
.config]`` declared in the recipe itself, so verl's entry point runs it unchanged::

    python -m verl.trainer.main_ppo --config-path=$PWD/recipes/fsdp --config-name=minirl_n2_r2 \\
        actor_rollout_ref.model.path=Qwen/Qwen3-30B-A3B data.train_files=... data.val_files=...

One recipe per regime of the paper (Qwen team, arXiv 2512.01374), with N the staleness: the number of policy updates
(mini-batches) per rollout batch, ``N = data.train_batch_size / actor.ppo_mini_batch_size`` with ``ppo_epochs = 1``.
The paper's mini-batch is 64 prompts x 16 samples = 1024 responses, so a recipe sets ``ppo_mini_batch_size = 64``,
``rollout.n = 16`` and ``train_batch_size = 64 N``::

    regime            N      loss     routing replay                 rollout routing export
    ----------------  -----  -------  -----------------------------  ----------------------
    minirl_onpolicy   1      minirl   disabled (nothing to replay)   off
    minirl_n2_r2      2      minirl   R2 (train-side, pi_old pass)   off
    minirl_n4_r3      >= 4   minirl   R3 (inference-side)            on
    vespo             8      vespo    disabled                       off

Every recipe: advantage ``A = R - mean_group(R)`` (estimator ``minirl``), token IS weight ``w = min(pi_old / mu, 5)``
from verl's decoupled rollout correction, trust region ``eps_low = 0.2``, ``eps_high = 0.27``, aggregation
``seq-mean-token-sum`` (sum over a response's tokens, mean over responses: no per-response length normalisation), no
KL term, entropy computed for the monitor, and the monitored trainer ``stable_sync`` with the ``stable`` block (see
:mod:`verl_stable.integration.trainer`).

This module is the single source of truth for that table: :func:`regime_mismatches` checks a composed config against
it, :func:`verl_configs` converts a config to verl's dataclasses exactly as verl's workers do (unknown keys raise),
:func:`unknown_recipe_keys` finds keys in a recipe file that verl's config does not have, :func:`unknown_override_keys`
the keys that ``+key=value`` overrides add without verl or verl-stable defining them, and :func:`cpu_overrides` turns a
regime into a run of verl's trainer on the CPU runtime with the same N, loss and replay. :func:`main` is the
``verl-stable recipe`` command; it checks names, numbers and overrides (:func:`check_override_syntax`,
:func:`preflight`) before it composes, builds or runs anything, and answers a bad one with exit code 2 and a message.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# ------------------------------------------------------------------------------------------------ the regime table
BACKENDS: dict[str, str] = {"fsdp": "ppo_trainer", "megatron": "ppo_megatron_trainer"}
"""backend -> the verl trainer config its recipes compose on."""

VERL_CONFIG_SEARCHPATH = "pkg://verl.trainer.config"
RECIPES_ENV = "VERL_STABLE_RECIPES"

MINI_BATCH_PROMPTS = 64  # paper: mini-batch of 1024 responses = 64 prompts x 16 samples
GROUP_SIZE = 16
IS_THRESHOLD = 5.0
CLIP_RATIO_LOW = 0.2
CLIP_RATIO_HIGH = 0.27
LOSS_AGG_MODE = "seq-mean-token-sum"
ADV_ESTIMATOR = "minirl"
TRAINER_MODE = "stable_sync"
POLICY_LOSS_CONFIG = "verl_stable.integration.losses.StablePolicyLossConfig"

ROUTER_REPLAY_KEY: dict[str, str] = {
    "fsdp": "actor_rollout_ref.actor.fsdp_config.router_replay.mode",
    "megatron": "actor_rollout_ref.actor.megatron.router_replay.mode",
}
ROLLOUT_ROUTING_KEY = "actor_rollout_ref.rollout.enable_rollout_routing_replay"


@dataclass(frozen=True)
class Regime:
    """One training regime of the paper, as the recipes set it.

    Attributes:
        name: the recipe's file stem (``recipes/<backend>/<name>.yaml``).
        loss_mode: ``actor.policy_loss.loss_mode`` (``minirl`` or ``vespo``).
        staleness: N of the shipped recipe (mini-batches per rollout batch).
        min_staleness: smallest N for which the regime is the paper's recommendation.
        max_staleness: largest such N (``None``: unbounded).
        router_replay: ``router_replay.mode`` of the actor engine (disabled, R2, R3).
        rollout_routing_export: ``rollout.enable_rollout_routing_replay`` (the rollout returns its routed experts).
        summary: one line for listings.
    """

    name: str
    loss_mode: str
    staleness: int
    min_staleness: int
    max_staleness: int | None
    router_replay: str
    rollout_routing_export: bool
    summary: str

    @property
    def train_batch_size(self) -> int:
        """``data.train_batch_size`` of the shipped recipe: ``64 N`` prompts."""
        return MINI_BATCH_PROMPTS * self.staleness

    def accepts_staleness(self, n: float) -> bool:
        """Whether ``n`` lies in the regime's range (an integer number of mini-batches)."""
        if n != int(n):
            return False
        return n >= self.min_staleness and (self.max_staleness is None or n <= self.max_staleness)


REGIMES: dict[str, Regime] = {
    r.name: r
    for r in (
        Regime("minirl_onpolicy", "minirl", 1, 1, 1, "disabled", False, "on-policy MiniRL with the train-inference IS"),
        Regime("minirl_n2_r2", "minirl", 2, 2, 3, "R2", False, "N = 2: MiniRL + clipping + R2 (train-side replay)"),
        Regime("minirl_n4_r3", "minirl", 4, 4, None, "R3", True, "N >= 4: MiniRL + clipping + R3 (rollout replay)"),
        Regime("vespo", "vespo", 8, 1, None, "disabled", False, "VESPO sequence-level reshaped IS, N = 8"),
    )
}


# ------------------------------------------------------------------------------------------------ locating recipes
def recipes_dir() -> Path:
    """The ``recipes/`` directory: ``$VERL_STABLE_RECIPES`` if set, else the checkout's (next to the package), else
    ``<prefix>/share/verl-stable/recipes``.

    Raises:
        FileNotFoundError: ``$VERL_STABLE_RECIPES`` is set but holds no recipes, or none of the others exists (e.g. a
            wheel install without the recipes); the message says what to set.
    """
    env = os.environ.get(RECIPES_ENV)
    if env:
        if not (Path(env) / "fsdp").is_dir():
            raise FileNotFoundError(f"{RECIPES_ENV}={env} is not a verl-stable recipes directory (no fsdp/ in it)")
        return Path(env)
    candidates = [Path(__file__).resolve().parent.parent / "recipes", Path(sys.prefix) / "share/verl-stable/recipes"]
    for path in candidates:
        if (path / "fsdp").is_dir():
            return path
    raise FileNotFoundError(
        f"no verl-stable recipes directory found (looked in {[str(p) for p in candidates]}); "
        f"set {RECIPES_ENV}=/path/to/verl-stable/recipes"
    )


def _check_backend_regime(backend: str, regime: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known: {sorted(BACKENDS)}")
    if regime not in REGIMES:
        raise ValueError(f"unknown regime {regime!r}; known: {list(REGIMES)}")


def recipe_path(backend: str, regime: str) -> Path:
    """``recipes/<backend>/<regime>.yaml``.

    Raises:
        ValueError: Unknown backend or regime.
        FileNotFoundError: The file is missing.
    """
    _check_backend_regime(backend, regime)
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
    _check_backend_regime(backend, regime)
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
        hydra.errors.ConfigCompositionException / MissingConfigException: The recipe does not compose.
    """
    from hydra import compose, initialize_config_dir

    path = Path(path).resolve()
    with initialize_config_dir(config_dir=str(path.parent), version_base=None):
        return compose(config_name=path.stem, overrides=list(overrides))


def compose_recipe(backend: str, regime: str, overrides: Sequence[str] = ()) -> Any:
    """Compose ``recipes/<backend>/<regime>.yaml`` on verl's config with ``overrides``; see :func:`compose_file`."""
    return compose_file(recipe_path(backend, regime), overrides)


def compose_base(backend: str, overrides: Sequence[str] = ()) -> Any:
    """verl's own trainer config for ``backend`` (what the recipes compose on), without any recipe."""
    if not overrides:
        from omegaconf import OmegaConf

        return OmegaConf.create(_base_container(backend))
    return _compose_base(backend, overrides)


@functools.cache
def _base_container(backend: str) -> dict:
    # verl's installed config files do not change within a process; composing them costs ~1 s
    from omegaconf import OmegaConf

    return OmegaConf.to_container(_compose_base(backend, ()), resolve=False)


def _compose_base(backend: str, overrides: Sequence[str]) -> Any:
    from hydra import compose, initialize_config_module

    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known: {sorted(BACKENDS)}")
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name=BACKENDS[backend], overrides=list(overrides))


# Keys a recipe may add beyond verl's YAML: each is checked by a dataclass when the config is converted.
EXTENSION_PREFIXES: tuple[str, ...] = (
    "stable",  # verl_stable.integration.trainer.StableConfig
    "actor_rollout_ref.actor.policy_loss.minirl",  # StablePolicyLossConfig.minirl
    "actor_rollout_ref.actor.policy_loss.vespo",  # StablePolicyLossConfig.vespo
    "actor_rollout_ref.actor.fsdp_config.router_replay",  # verl's EngineConfig.router_replay (absent from fsdp.yaml)
)

# verl-stable's sections that nothing converts as a whole: only these option names exist below them.
HF_OPTIONS_SECTION = "actor_rollout_ref.rollout.engine_kwargs.hf"
ROUTING_OPTIONS_SECTION = "verl_stable.routing"

# Mappings verl hands on whole as keyword arguments (to ``ray.init``, to a model config): any key may go below them.
# Mappings that verl's YAML leaves empty (``override_config: {}``, ``engine_kwargs.vllm: {}`` ...) count as open too.
OPEN_MAPPINGS: tuple[str, ...] = (
    "ray_kwargs.ray_init",
    "actor_rollout_ref.actor.megatron.override_transformer_config",
    "actor_rollout_ref.ref.megatron.override_transformer_config",
    "critic.megatron.override_transformer_config",
)


def _section_fields(section: str) -> frozenset[str]:
    import dataclasses

    if section == HF_OPTIONS_SECTION:
        from verl_stable.cpu.hf_rollout import HFOptions as options
    else:
        from verl_stable.integration.rollout import RolloutRoutingOptions as options
    return frozenset(f.name for f in dataclasses.fields(options))


def _leaf_paths(node: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(node, Mapping) and node:
        for key, value in node.items():
            yield from _leaf_paths(value, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix


def _target_fields(node: Mapping) -> frozenset[str] | None:
    """Field names of the dataclass a config node converts to (its ``_target_``); None when it has none."""
    import dataclasses
    import importlib

    target = node.get("_target_")
    if not isinstance(target, str) or "." not in target:
        return None
    module, _, cls_name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except (ImportError, AttributeError):
        return None
    return frozenset(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else None


def is_known_key(base: Mapping, key: str) -> bool:
    """Whether a dotted config key is one that verl or verl-stable defines.

    Known: a key of verl's composed config ``base``; a key below an extension section whose dataclass checks it on
    conversion (:data:`EXTENSION_PREFIXES`); an option of verl-stable's ``hf`` backend or rollout-routing options; a
    key below a mapping verl passes on whole (:data:`OPEN_MAPPINGS`, or one its YAML leaves empty or null); a field
    of the dataclass that the nearest node of ``base`` converts to (``_target_``), with anything below it.
    """
    from omegaconf import DictConfig, OmegaConf

    if isinstance(base, DictConfig):
        base = OmegaConf.to_container(base, resolve=False)  # plain values: no interpolation or ``???`` on access
    if any(key == p or key.startswith(p + ".") for p in (*EXTENSION_PREFIXES, *OPEN_MAPPINGS)):
        return True
    for section in (HF_OPTIONS_SECTION, ROUTING_OPTIONS_SECTION):
        if key.startswith(section + "."):
            return key[len(section) + 1 :].split(".", 1)[0] in _section_fields(section)
        if key == section:
            return True
    node: Any = base
    for part in key.split("."):
        if node is None:
            return True  # a null default: the value (mapping or not) is the user's
        if not isinstance(node, Mapping):
            return False  # below a scalar of verl's config
        if part in node:
            node = node[part]
            continue
        if not node:
            return True
        fields = _target_fields(node)
        return fields is not None and part in fields
    return True


def config_keys(cfg: Any) -> set[str]:
    """Every dotted leaf key of a config (an empty mapping counts as a leaf), interpolations unresolved."""
    from omegaconf import DictConfig, OmegaConf

    container = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else cfg
    return set(_leaf_paths(container))


def recipe_keys(path: str | os.PathLike) -> list[str]:
    """Dotted leaf keys a recipe file sets itself (its ``hydra`` and ``defaults`` entries excluded)."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a recipe must be a mapping")
    body = {k: v for k, v in raw.items() if k not in ("hydra", "defaults")}
    return list(_leaf_paths(body))


def recipe_base(path: str | os.PathLike) -> str:
    """The verl trainer config a recipe file lists in its ``defaults``.

    Raises:
        ValueError: The recipe lists neither ``ppo_trainer`` nor ``ppo_megatron_trainer``.
    """
    from omegaconf import OmegaConf

    defaults = OmegaConf.to_container(OmegaConf.load(path)).get("defaults") or []
    bases = [d for d in defaults if isinstance(d, str) and d in BACKENDS.values()]
    if len(bases) != 1:
        raise ValueError(f"{path}: defaults must list exactly one of {sorted(BACKENDS.values())}, got {defaults}")
    return bases[0]


def unknown_recipe_keys(path: str | os.PathLike, base: Any = None) -> list[str]:
    """Keys the recipe file sets that verl's trainer config does not have (and no extension dataclass checks).

    A key absent from verl's YAML still counts as known when it is a field of the dataclass its parent node converts
    to (``_target_``): verl's conversion accepts it.

    Hydra merges a recipe's new keys silently, and sections verl never converts to dataclasses (``trainer``,
    ``data``, ``reward`` ...) would carry a typo to runtime unnoticed; this catches them at composition time.

    Args:
        path: the recipe file.
        base: verl's composed base config (:func:`compose_base`); composed here when ``None``.
    """
    from omegaconf import DictConfig, OmegaConf

    if base is None:
        base = _base_container(next(b for b, name in BACKENDS.items() if name == recipe_base(path)))
    elif isinstance(base, DictConfig):
        # as a plain container, so that keys holding verl's MISSING marker (``rollout.name: ???``) count as present
        base = OmegaConf.to_container(base, resolve=False)
    return [key for key in recipe_keys(path) if not is_known_key(base, key)]


def unknown_override_keys(backend: str, regime: str, overrides: Sequence[str]) -> list[str]:
    """Keys that ``overrides`` add to the composed recipe although neither verl nor verl-stable defines them.

    Hydra's ``+key=value`` adds any key silently, and sections verl reads with ``.get`` (``data``, ``trainer`` ...)
    ignore it: ``+data.train_batchsize=512`` would leave the batch size as it was. Every key the composed config
    gains over the recipe alone must pass :func:`is_known_key`.

    Raises:
        ValueError: An override that is not ``key=value`` (see :func:`check_override_syntax`).
        hydra.errors.HydraException: The overrides do not compose.
    """
    check_override_syntax(overrides)
    return _unknown_gained(compose_recipe(backend, regime), compose_recipe(backend, regime, overrides), backend)


def _unknown_gained(before: Any, after: Any, backend: str) -> list[str]:
    base = _base_container(backend)
    return sorted(k for k in config_keys(after) - config_keys(before) if not is_known_key(base, k))


def option_problems(cfg: Any) -> list[str]:
    """What verl-stable's own option sections of a composed config would reject at run time (empty when fine).

    ``verl_stable.routing`` is read by the rollout-routing manager and ``rollout.engine_kwargs.hf`` by the ``hf``
    backend (when ``rollout.name`` is ``hf``), both long after the run has started.
    """
    from omegaconf import OmegaConf

    from verl_stable.integration.rollout import RolloutRoutingOptions

    problems = []
    try:
        RolloutRoutingOptions.from_config(cfg)
    except (ValueError, TypeError) as exc:
        problems.append(str(exc))
    if _select(cfg, "actor_rollout_ref.rollout.name") == "hf":
        from verl_stable.cpu.hf_rollout import resolve_options

        rollout = OmegaConf.to_container(cfg.actor_rollout_ref.rollout, resolve=True)
        try:
            resolve_options(rollout)
        except (ValueError, TypeError) as exc:
            problems.append(f"hf rollout backend: {exc}")
    return problems


def preflight(overrides: Sequence[str], recipe: str | os.PathLike | None = None, backend: str = "fsdp") -> Any:
    """Check a ``main_ppo`` argument list before a run starts; returns the composed config.

    Checks, in order: every override's syntax (:func:`check_override_syntax`); that the overrides compose on the
    recipe file (or on verl's own ``backend`` trainer config when ``recipe`` is None), as ``main_ppo`` would compose
    them; that every key the result has beyond verl's config is one verl or verl-stable defines
    (:func:`is_known_key`); verl-stable's own options (:func:`option_problems`); verl's own ``validate_config``
    (batch-size arithmetic ...) and the conversion to the dataclasses verl's workers build (:func:`verl_configs`),
    which ``main_ppo`` would otherwise reach only after Ray and its workers have started.

    Raises:
        ValueError: The first check that fails, with a message naming what was expected.
    """
    check_override_syntax(overrides)
    on = f"recipe {recipe}" if recipe is not None else f"verl's {BACKENDS[backend]}"
    try:
        cfg = compose_file(recipe, overrides) if recipe is not None else _compose_base(backend, overrides)
    except Exception as exc:  # noqa: BLE001 - hydra and omegaconf raise many types; each is a refusal here
        raise ValueError(f"the overrides do not compose on {on}: {type(exc).__name__}: {exc}") from None
    unknown = _unknown_gained(_base_container(backend), cfg, backend)
    if unknown:
        raise ValueError(
            f"unknown config key(s) {unknown}: expected keys of verl's {BACKENDS[backend]} or of verl-stable "
            "(a typo behind '+'?)"
        )
    problems = option_problems(cfg)
    if problems:
        raise ValueError("; ".join(problems))
    try:
        # validate_config prints its verdict; stdout stays for what the caller prints (run --print-overrides)
        with contextlib.redirect_stdout(io.StringIO()):
            verl_configs(cfg, validate=True)
    except Exception as exc:  # noqa: BLE001 - whatever verl's checks or conversion raise is the refusal
        raise ValueError(f"verl rejects the config: {type(exc).__name__}: {exc}") from None
    return cfg


def check_output_dir(path: str | os.PathLike, what: str) -> Path:
    """Refuse, before any work, a directory that a run could not create or write, or could not name to verl.

    Returns:
        The resolved path.

    Raises:
        ValueError: ``path`` is a file or lies below one, its nearest existing ancestor is not writable, or hydra
            cannot carry it (:func:`check_override_path`); the message starts with ``what`` (e.g. ``--workdir``).
    """
    path = Path(path).resolve()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {path} is a file; expected a directory (created if missing)")
    nearest = next(p for p in (path, *path.parents) if p.exists())
    if not nearest.is_dir():
        raise ValueError(f"{what} {path} lies below the file {nearest}; expected a directory (created if missing)")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {path} cannot be written: {nearest} is not writable by this user")
    check_override_path(path, what)
    return path


def check_override_path(path: str | os.PathLike, what: str) -> None:
    """Refuse a path that cannot travel to verl inside an unquoted hydra override value (``data.train_files=PATH``).

    Hydra's grammar rejects ``= [ ] { } ( ) ~ ' #``, non-ASCII letters and more in such a value, reads a comma as a
    sweep over several values and ``${`` as an interpolation; verl would fail on it only after the assets were built.

    Raises:
        ValueError: Naming ``what`` (e.g. ``--workdir``), the path and the characters that are safe.
    """
    value = str(path)
    safe = "," not in value and "${" not in value
    if safe:
        try:
            check_override_syntax([f"key={value}"])
        except ValueError:
            safe = False
    if not safe:
        raise ValueError(
            f"{what} {value!r} cannot be passed to verl in a hydra override; expected a path of ASCII letters, "
            "digits, spaces and / . _ - + @ : (hydra refuses , = [ ] { } ( ) ~ ' \" # ! & ; and non-ASCII there)"
        )


def check_override_syntax(overrides: Sequence[str]) -> None:
    """Parse every override with hydra's own grammar, so a malformed one is refused before anything is composed.

    Raises:
        ValueError: An override that is not ``key=value``, ``+key=value``, ``++key=value`` or ``~key[=value]``; the
            message names it and hydra's reason.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    expected = "expected key=value, +key=value, ++key=value or ~key"
    for item in overrides:
        if not isinstance(item, str):
            raise ValueError(f"override {item!r} is a {type(item).__name__}; {expected}")
        try:
            parsed = parser.parse_override(item)
        except HydraException as exc:
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"override {item!r} is malformed ({reason}); {expected}") from None
        if not parsed.key_or_group:
            raise ValueError(f"override {item!r} has no key; {expected}")


# ------------------------------------------------------------------------------------------------ converting
@dataclass
class VerlConfigs:
    """A composed config converted to verl's (and verl-stable's) dataclasses, as the trainer and workers do.

    Attributes:
        actor: ``FSDPActorConfig`` / ``McoreActorConfig`` (its ``policy_loss`` a ``StablePolicyLossConfig``).
        rollout: ``RolloutConfig``.
        algorithm: ``AlgoConfig``.
        rollout_correction: ``RolloutCorrectionConfig`` (verl passes it on as a mapping; typed here to check it).
        stable: the monitor / guard block, ``StableConfig``.
    """

    actor: Any
    rollout: Any
    algorithm: Any
    rollout_correction: Any
    stable: Any


def verl_configs(cfg: Any, validate: bool = True) -> VerlConfigs:
    """Convert ``cfg`` to verl's config dataclasses with verl's own ``omega_conf_to_dataclass``.

    These are the conversions verl's workers make at start-up (actor, rollout, algorithm); the frozen dataclasses
    reject unknown keys. With ``validate``, verl's ``validate_config`` (what ``main_ppo`` runs first) runs too.

    Raises:
        Exception: Whatever verl raises for a bad config (unknown keys: ``TypeError`` from hydra's instantiate or
            ``omegaconf`` errors; bad values: ``ValueError`` / ``AssertionError``).
    """
    from omegaconf import OmegaConf
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.utils.config import omega_conf_to_dataclass

    from verl_stable.integration.trainer import StableConfig

    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))  # resolved copy, as the workers see it
    if validate:
        from verl.trainer.ppo.utils import need_critic, need_reference_policy
        from verl.utils.config import validate_config

        validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    return VerlConfigs(
        actor=omega_conf_to_dataclass(cfg.actor_rollout_ref.actor),
        rollout=omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout),
        algorithm=omega_conf_to_dataclass(cfg.algorithm),
        rollout_correction=omega_conf_to_dataclass(cfg.algorithm.rollout_correction, RolloutCorrectionConfig),
        stable=StableConfig.from_trainer_config(cfg),
    )


def _select(cfg: Any, key: str) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key, default=None)


def staleness(cfg: Any) -> float:
    """N = ``data.train_batch_size / actor.ppo_mini_batch_size`` times ``ppo_epochs`` (updates per rollout batch)."""
    train = _select(cfg, "data.train_batch_size")
    mini = _select(cfg, "actor_rollout_ref.actor.ppo_mini_batch_size")
    epochs = _select(cfg, "actor_rollout_ref.actor.ppo_epochs") or 1
    if not train or not mini:
        raise ValueError(f"data.train_batch_size={train} and actor.ppo_mini_batch_size={mini} must be positive")
    return train / mini * epochs


def backend_of(cfg: Any) -> str:
    """``megatron`` when the actor strategy is Megatron, else ``fsdp``."""
    return "megatron" if _select(cfg, "actor_rollout_ref.actor.strategy") == "megatron" else "fsdp"


def regime_mismatches(cfg: Any, regime: str | Regime, *, paper_geometry: bool = True) -> list[str]:
    """What in a composed config differs from ``regime``; empty when the config is the regime.

    Args:
        cfg: a composed config (a recipe with any overrides).
        regime: the regime (or its name).
        paper_geometry: also require the paper's mini-batch (64 prompts x 16 samples).

    Returns:
        One line per mismatch, ``"<key> = <found>, regime needs <wanted>"``.
    """
    regime = REGIMES[regime] if isinstance(regime, str) else regime
    backend = backend_of(cfg)
    wanted: dict[str, Any] = {
        "algorithm.adv_estimator": ADV_ESTIMATOR,
        "algorithm.use_kl_in_reward": False,
        "algorithm.rollout_correction.rollout_is": "token",
        "algorithm.rollout_correction.rollout_is_threshold": IS_THRESHOLD,
        "algorithm.rollout_correction.rollout_rs": None,
        "algorithm.rollout_correction.bypass_mode": False,
        "actor_rollout_ref.rollout.calculate_log_probs": True,
        "actor_rollout_ref.actor.policy_loss.loss_mode": regime.loss_mode,
        "actor_rollout_ref.actor.policy_loss._target_": POLICY_LOSS_CONFIG,
        "actor_rollout_ref.actor.clip_ratio_low": CLIP_RATIO_LOW,
        "actor_rollout_ref.actor.clip_ratio_high": CLIP_RATIO_HIGH,
        "actor_rollout_ref.actor.loss_agg_mode": LOSS_AGG_MODE,
        "actor_rollout_ref.actor.use_kl_loss": False,
        "actor_rollout_ref.actor.entropy_coeff": 0,
        "actor_rollout_ref.actor.calculate_entropy": True,
        "actor_rollout_ref.actor.ppo_epochs": 1,
        ROUTER_REPLAY_KEY[backend]: regime.router_replay,
        ROLLOUT_ROUTING_KEY: regime.rollout_routing_export,
        "trainer.v1.trainer_mode": TRAINER_MODE,
    }
    if regime.loss_mode == "minirl":
        wanted["actor_rollout_ref.actor.policy_loss.minirl.allow_missing_rollout_is_weights"] = False
    if paper_geometry:
        wanted["actor_rollout_ref.actor.ppo_mini_batch_size"] = MINI_BATCH_PROMPTS
        wanted["actor_rollout_ref.rollout.n"] = GROUP_SIZE
    problems = []
    for key, want in wanted.items():
        found = _select(cfg, key)
        same = found == want if not isinstance(want, float) else found is not None and abs(float(found) - want) < 1e-9
        if not same or isinstance(found, bool) != isinstance(want, bool):
            problems.append(f"{key} = {found!r}, regime {regime.name} needs {want!r}")
    try:
        n = staleness(cfg)
    except ValueError as exc:
        problems.append(str(exc))
    else:
        if not regime.accepts_staleness(n):
            upper = "inf" if regime.max_staleness is None else regime.max_staleness
            problems.append(
                f"staleness N = train_batch_size / ppo_mini_batch_size * ppo_epochs = {n:g}, regime {regime.name} "
                f"needs an integer N in [{regime.min_staleness}, {upper}]"
            )
    return problems


# ------------------------------------------------------------------------------------------------ CPU runs
CPU_MINI_BATCH_PROMPTS = 2
CPU_GROUP_SIZE = 4


def cpu_overrides(
    regime: str | Regime,
    assets: Any,
    *,
    steps: int = 2,
    mini_batch_prompts: int = CPU_MINI_BATCH_PROMPTS,
    group_size: int = CPU_GROUP_SIZE,
    backend: str = "fsdp",
) -> list[str]:
    """Overrides that run a regime's recipe on the CPU runtime with the tiny assets, keeping its N, loss and replay.

    The runtime overrides come from :func:`verl_stable.cpu.launch.cpu_overrides`; every key the recipe file sets
    itself is dropped from them (the recipe defines the regime), then the CPU geometry is appended: a mini-batch of
    ``mini_batch_prompts x group_size`` responses, ``N`` of them per step, one micro-batch per mini-batch.

    Args:
        regime: the regime (or its name).
        assets: :class:`verl_stable.lab.assets.Assets` (tiny MoE, tokenizer, parquet data).
        steps: ``trainer.total_training_steps``.
        mini_batch_prompts: prompts per mini-batch (the paper's 64, scaled down).
        group_size: samples per prompt (the paper's 16, scaled down).
        backend: only ``fsdp`` runs on CPU.

    Raises:
        ValueError: A backend other than ``fsdp``.
    """
    from verl_stable.cpu import launch

    if backend != "fsdp":
        raise ValueError(f"only the fsdp recipes run on the CPU runtime, got backend {backend!r}")
    regime = REGIMES[regime] if isinstance(regime, str) else regime
    own = set(recipe_keys(recipe_path(backend, regime.name)))
    train = mini_batch_prompts * regime.staleness
    runtime = launch.cpu_overrides(
        assets,
        steps=steps,
        batch_size=train,
        group_size=group_size,
        rollout_is="token",
        routing_capture=regime.rollout_routing_export,
    )
    geometry = {
        "data.train_batch_size": train,
        "actor_rollout_ref.actor.ppo_mini_batch_size": mini_batch_prompts,
        "actor_rollout_ref.rollout.n": group_size,
        "actor_rollout_ref.actor.use_dynamic_bsz": False,
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": False,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": mini_batch_prompts * group_size,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": mini_batch_prompts * group_size,
        "actor_rollout_ref.rollout.name": "hf",
    }
    kept = []
    for item in runtime:
        key = item.split("=", 1)[0].lstrip("+~")
        if key not in own and key not in geometry:
            kept.append(item)
    return kept + [f"{k}={v}" for k, v in geometry.items()]


# ------------------------------------------------------------------------------------------------ command line
def _cmd_list(out) -> int:
    for backend, name, path in list_recipes():
        r = REGIMES[name]
        out(f"{backend + '/' + name:<26} N={r.staleness:<2} replay={r.router_replay:<8} {r.summary}  ({path})")
    return 0


def _cmd_check(name: str, overrides: Sequence[str], out) -> int:
    backend, regime = parse_recipe_name(name)
    path = recipe_path(backend, regime)
    try:
        problems = [f"unknown key {k} (not in verl's {BACKENDS[backend]})" for k in unknown_recipe_keys(path)]
    except Exception as exc:  # noqa: BLE001 - a recipe from $VERL_STABLE_RECIPES may be any file
        problems = [f"cannot read the recipe {path}: {type(exc).__name__}: {exc}"]
    try:
        cfg = compose_recipe(backend, regime, overrides)
    except Exception as exc:  # noqa: BLE001 - hydra's refusal (a key not in verl's config ...) is the answer
        cfg = None
        problems.append(f"the overrides do not compose on the recipe: {type(exc).__name__}: {exc}")
    if cfg is not None:
        problems += [
            f"unknown key {k} (added by an override; expected a key of verl's {BACKENDS[backend]} or of verl-stable)"
            for k in _unknown_gained(compose_recipe(backend, regime), cfg, backend)
        ]
        problems += regime_mismatches(cfg, regime)
        problems += option_problems(cfg)
        try:
            verl_configs(cfg, validate=True)
        except Exception as exc:  # noqa: BLE001 - any failure of verl's conversion is the answer
            problems.append(f"verl rejects the config: {type(exc).__name__}: {exc}")
    for p in problems:
        out(f"  - {p}")
    out(f"{backend}/{regime}: " + ("OK" if not problems else f"{len(problems)} problem(s)"))
    return 1 if problems else 0


def run_on_cpu(
    regime: str, workdir: str | os.PathLike, overrides: Sequence[str] = (), *, steps: int = 2, task: str = "copy"
) -> int:
    """Run ``recipes/fsdp/<regime>.yaml`` with verl's ``main_ppo`` on the CPU runtime (tiny MoE, toy task).

    The arguments are checked first (:func:`preflight`); then the tiny assets are built under ``workdir/assets`` if
    missing; the log is ``workdir/run/main_ppo.log`` and the per-step metrics ``workdir/run/metrics.jsonl``. Returns
    ``main_ppo``'s exit code.

    Raises:
        ValueError: An unknown regime or task, ``steps`` below 1, a ``workdir`` that :func:`check_output_dir`
            refuses, or overrides that :func:`preflight` refuses; raised before anything is built or started.
    """
    from verl_stable.cpu import launch
    from verl_stable.lab import tasks
    from verl_stable.lab.assets import AssetSpec, asset_paths, ensure_assets

    _check_backend_regime("fsdp", regime)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if task not in tasks.TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {tasks.TASKS}")
    workdir = check_output_dir(workdir, "workdir")
    path = recipe_path("fsdp", regime)
    ov = cpu_overrides(regime, asset_paths(workdir / "assets"), steps=steps)
    ov += [f"trainer.default_local_dir={workdir / 'checkpoints'}", *overrides]
    preflight(ov, recipe=path)
    ensure_assets(workdir / "assets", AssetSpec(task=task))
    args = [f"--config-path={path.parent}", f"--config-name={path.stem}", *ov]
    proc = launch.run_main_ppo(args, workdir / "run")
    return proc.returncode


def main(argv: Sequence[str] | None = None, out: Callable[[str], None] = print) -> int:
    """``verl-stable recipe list | path | command | show | check | run-cpu``.

    NAME is ``<backend>/<regime>`` (``fsdp/minirl_n2_r2``) or a bare regime (FSDP). ``check`` returns 1 when it finds
    a problem (one line each).

    Raises:
        SystemExit: code 2 for an unknown name, a malformed override, a bad ``--steps`` or ``--workdir``, or (``show``,
            ``run-cpu``) overrides that do not compose or that :func:`preflight` refuses; before anything is built.
    """
    parser = argparse.ArgumentParser(prog="verl-stable recipe", description="the verl-stable recipes")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="every recipe with its regime")
    for action, text in (
        ("path", "the recipe file"),
        ("command", "the main_ppo command that runs it"),
        ("show", "the composed config (YAML), with overrides"),
        ("check", "compose, convert to verl's dataclasses, check the regime; exit 1 on any problem"),
    ):
        p = sub.add_parser(action, help=text)
        p.add_argument("name")
        if action in ("show", "check"):
            p.add_argument("overrides", nargs="*")
    p = sub.add_parser("run-cpu", help="run an fsdp recipe with verl's trainer on the CPU runtime (tiny MoE)")
    p.add_argument("name")
    p.add_argument("--workdir", default="./verl_stable_recipe_run")
    p.add_argument("--steps", type=_positive_int, default=2)
    p.add_argument("overrides", nargs="*")
    # overrides may follow options (``run-cpu NAME --steps 3 key=value``): argparse leaves those to parse_known_args
    args, extra = parser.parse_known_args(argv)
    unknown_options = [a for a in extra if a.startswith("-")]
    if unknown_options or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        if args.action == "list":
            return _cmd_list(out)
        backend, regime = parse_recipe_name(args.name)
        path = recipe_path(backend, regime)
        check_override_syntax(getattr(args, "overrides", ()))
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    if args.action == "path":
        out(str(path))
        return 0
    if args.action == "command":
        out(" ".join(main_ppo_command(backend, regime)))
        return 0
    if args.action == "run-cpu":
        if backend != "fsdp":
            parser.error(f"run-cpu runs the fsdp recipes only, got {backend}/{regime}")
        try:
            rc = run_on_cpu(regime, args.workdir, args.overrides, steps=args.steps)
        except ValueError as exc:  # refused by the checks made before anything is built
            parser.error(str(exc))
        run = Path(args.workdir).resolve() / "run"
        out(f"main_ppo exited {rc}; log: {run / 'main_ppo.log'}; metrics: {run / 'metrics.jsonl'}")
        return rc
    if args.action == "show":
        from omegaconf import OmegaConf

        try:
            cfg = compose_recipe(backend, regime, args.overrides)
        except Exception as exc:  # noqa: BLE001 - hydra's refusal is reported, not raised
            parser.error(f"the overrides do not compose on {backend}/{regime}: {type(exc).__name__}: {exc}")
        out(OmegaConf.to_yaml(cfg))
        return 0
    return _cmd_check(args.name, args.overrides, out)


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


if __name__ == "__main__":
    raise SystemExit(main())
