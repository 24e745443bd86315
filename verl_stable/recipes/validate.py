"""Checks of a composed config and of ``main_ppo`` arguments before a run starts: keys, options, paths, verl's verdict.

Hydra merges a recipe's new keys and a ``+key=value`` override silently, and verl reads most sections with ``.get``,
so a typo would reach runtime unnoticed; verl's own checks (``validate_config``, the dataclass conversions its workers
make) run only after Ray and its workers have started. Everything here runs before that:

* :func:`is_known_key`, :func:`unknown_recipe_keys`, :func:`unknown_override_keys`: keys that neither verl nor
  verl-stable defines;
* :func:`option_problems`: verl-stable's own option sections (rollout routing, the ``hf`` backend);
* :func:`check_override_syntax`, :func:`check_override_path`, :func:`check_output_dir`: arguments that hydra would
  refuse or a run could not write;
* :func:`verl_configs`: the conversion to verl's dataclasses exactly as verl's workers make it;
* :func:`preflight`: all of them, in order, on a ``main_ppo`` argument list.

Each refusal is a ``ValueError`` whose message names what was expected. The option schemas are imported from the
modules that read them (:mod:`verl_stable.integration.rollout`, :mod:`verl_stable.backends.hf.options`) only when a check
needs them.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_stable.recipes.compose import (
    base_container,
    compose_base,
    compose_file,
    compose_recipe,
    config_keys,
    recipe_base,
    recipe_keys,
)
from verl_stable.recipes.regimes import BACKENDS, config_value

# Keys a recipe may add beyond verl's YAML: each is checked by a dataclass when the config is converted.
EXTENSION_PREFIXES: tuple[str, ...] = (
    "stable",  # verl_stable.monitor.step.StableConfig
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

    # imported when asked: the option schemas live with the code that reads them (hf_options is a leaf module)
    if section == HF_OPTIONS_SECTION:
        from verl_stable.backends.hf.options import HFOptions as options
    else:
        from verl_stable.transport.options import RolloutRoutingOptions as options
    return frozenset(f.name for f in dataclasses.fields(options))


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
        if key == section or section.startswith(key + "."):  # the section itself or a node above it
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
        base = base_container(next(b for b, name in BACKENDS.items() if name == recipe_base(path)))
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
    return unknown_gained_keys(compose_recipe(backend, regime), compose_recipe(backend, regime, overrides), backend)


def unknown_gained_keys(before: Any, after: Any, backend: str) -> list[str]:
    """Keys that ``after`` has beyond ``before`` although neither verl's ``backend`` config nor verl-stable defines
    them (:func:`is_known_key`), sorted."""
    base = base_container(backend)
    return sorted(k for k in config_keys(after) - config_keys(before) if not is_known_key(base, k))


ULYSSES_KEYS = (
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
    "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size",
)
"""Where verl reads the Ulysses degree. verl's Ulysses attention wraps flash-attention's varlen entry, which does not
run on CPU; under ``sdpa`` (or ``eager``) verl does not refuse sp > 1, and each rank would attend only within its own
slice of the sequence: wrong log-probs, no error. So the CPU runtime refuses sp > 1 before a run starts unless the run
trains packed with verl-stable's pure-torch varlen kernel (:data:`ULYSSES_CPU_ATTENTION`), which runs under verl's
all-to-all."""

ULYSSES_CPU_ATTENTION = {
    "actor_rollout_ref.model.use_remove_padding": True,
    "actor_rollout_ref.model.override_config.attn_implementation": "verl_stable_varlen",
}
"""What a CPU run with Ulysses sp > 1 must set: ``verl_stable.cpu.attention.OVERRIDES`` (checked equal in the tests;
not imported here, so that composing a config does not import the CPU runtime)."""


def option_problems(cfg: Any) -> list[str]:
    """What verl-stable's own option sections of a composed config would reject at run time (empty when fine).

    ``verl_stable.routing`` is read by the rollout-routing manager, ``rollout.engine_kwargs.hf`` by the ``hf``
    backend (when ``rollout.name`` is ``hf``) and the fault-injection period ``rollout.engine_kwargs.vllm
    .corrupt_routing_every`` by the vLLM servers (when it is ``vllm``), all long after the run has started; the trust region
    ``actor.clip_ratio_low/high`` by verl-stable's losses and staleness monitor at the first update; an ``escalate``
    rule's settings by verl's rollout correction at the step it fires (:func:`verl_stable.integration.escalation.check`);
    Ulysses sequence
    parallelism on the CPU runtime (``trainer.device=cpu``) without the varlen kernel, which would be silently wrong
    there (see :data:`ULYSSES_KEYS`); and the cross-field rules of :mod:`verl_stable.recipes.cross_checks` (a guard
    that could not act, settings verl judges only at step 1, replay without its data, parallel sizes that do not
    divide the world).
    """
    from omegaconf import OmegaConf

    from verl_stable.integration.losses import MiniRLLossConfig, VespoLossConfig, section_from_mapping
    from verl_stable.monitor.step import StableConfig
    from verl_stable.transport.options import RolloutRoutingOptions

    problems = []
    # the schema's readers, exactly as the runtime calls them (verl_configs converts them again, inside verl's
    # dataclasses, where a refusal would read as verl's)
    try:
        RolloutRoutingOptions.from_config(cfg)
    except (ValueError, TypeError) as exc:
        problems.append(str(exc))
    try:
        stable = StableConfig.from_trainer_config(cfg)
    except (ValueError, TypeError) as exc:
        problems.append(str(exc))
    else:
        from verl_stable.integration import escalation
        from verl_stable.monitor.guard import Guard

        for rule in Guard.from_config(stable.guard).rules if stable.guard_enable else ():
            if rule.action == "escalate":  # verl's own rollout-correction code judges the escalated settings
                try:
                    escalation.check(cfg, rule.escalate_to, f"stable.guard.rules.{rule.name}")
                except ValueError as exc:
                    problems.append(str(exc))
    for name, cls in (("minirl", MiniRLLossConfig), ("vespo", VespoLossConfig)):
        try:
            section_from_mapping(cls, config_value(cfg, f"actor_rollout_ref.actor.policy_loss.{name}"), name)
        except (ValueError, TypeError) as exc:
            problems.append(str(exc))
    if str(config_value(cfg, "trainer.device") or "").lower() == "cpu":
        ulysses = {k: config_value(cfg, k) for k in ULYSSES_KEYS}
        bad = {k: v for k, v in ulysses.items() if isinstance(v, int) and not isinstance(v, bool) and v > 1}
        attention = {k: config_value(cfg, k) for k in ULYSSES_CPU_ATTENTION}
        if bad and attention != ULYSSES_CPU_ATTENTION:
            fix = " ".join(f"{'+' if 'override_config' in k else ''}{k}={v}" for k, v in ULYSSES_CPU_ATTENTION.items())
            problems.append(
                f"Ulysses sequence parallelism {bad} on the CPU runtime with {attention}: verl's Ulysses attention "
                "needs flash-attention's varlen kernel, which does not run on CPU, and with sdpa or eager each rank "
                "would attend only within its own slice of the sequence (wrong log-probs, no error); use verl-stable's "
                f"varlen kernel ({fix}; `verl-stable run --attention varlen`) or sequence parallel size 1 on CPU"
            )
    if config_value(cfg, "actor_rollout_ref.actor.policy_loss.loss_mode") in ("minirl", "vespo"):
        from verl_stable.monitor.staleness import check_trust_region

        # verl's reading: each bound falls back to clip_ratio
        ratio = config_value(cfg, "actor_rollout_ref.actor.clip_ratio")
        low = config_value(cfg, "actor_rollout_ref.actor.clip_ratio_low")
        high = config_value(cfg, "actor_rollout_ref.actor.clip_ratio_high")
        low, high = (ratio if low is None else low), (ratio if high is None else high)
        try:
            check_trust_region(low, high)
        except (ValueError, TypeError) as exc:
            problems.append(f"actor.clip_ratio_low / clip_ratio_high (the trust region): {exc}")
    if config_value(cfg, "actor_rollout_ref.rollout.name") == "hf":
        from verl_stable.backends.hf.options import resolve_options

        rollout = OmegaConf.to_container(cfg.actor_rollout_ref.rollout, resolve=True)
        try:
            resolve_options(rollout)
        except (ValueError, TypeError) as exc:
            problems.append(f"hf rollout backend: {exc}")
    if config_value(cfg, "actor_rollout_ref.rollout.name") == "vllm":
        from verl_stable.backends.vllm_cpu.rollout import VllmCpuError, routing_fault_every

        try:
            routing_fault_every(OmegaConf.to_container(cfg.actor_rollout_ref.rollout, resolve=True))
        except VllmCpuError as exc:
            problems.append(f"vllm rollout: {exc}")
    from verl_stable.recipes.cross_checks import cross_field_problems

    # settings valid on their own that cannot take effect in this run (the monitored trainer's constructor and verl's
    # validate_config in the driver run the same checks)
    problems += [p for p in cross_field_problems(cfg) if p not in problems]
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
        cfg = compose_file(recipe, overrides) if recipe is not None else compose_base(backend, overrides)
    except Exception as exc:  # noqa: BLE001 - hydra and omegaconf raise many types; each is a refusal here
        raise ValueError(f"the overrides do not compose on {on}: {type(exc).__name__}: {exc}") from None
    unknown = unknown_gained_keys(base_container(backend), cfg, backend)
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

    from verl_stable.monitor.step import StableConfig

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
