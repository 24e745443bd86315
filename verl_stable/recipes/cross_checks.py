"""Cross-field rules: a setting that cannot take effect in the run it configures is refused before anything starts.

Each key's own type and range is the schema's (:mod:`verl_stable.schema`). What is left is one level up: a value
valid on its own that this run cannot act on, or that verl would refuse only after Ray, the workers and a rollout
have started. One function per class of problem; each returns messages naming the keys (empty: fine):

1. :func:`monitor_problems`: a ``stable`` block on a trainer without the monitor (verl's own ``sync`` mode,
   ``trainer.use_v1=false``): nothing in it would act.
2. :func:`rule_metric_problems`: a guard rule on a metric this configuration never logs (a misspelt name, an F(tau)
   for a tau not in ``stable.monitor.taus``, any ``stable/`` metric with the monitor off, a replay metric without
   R2 / R3). The metrics a configuration logs are known from it (:mod:`verl_stable.monitor.logged`); a rule that
   accepts its metric being absent says so with ``optional: true`` (the default ``replay_coverage`` rule does).
3. :func:`rule_option_problems`: options that do nothing for their rule (``max_skips`` on a rule that does not skip,
   ``window`` or ``slope_tolerance`` on a condition that fits no slope, a ``threshold`` on ``non_finite``), an
   ``escalate_to`` that changes nothing in force, a rule named like one of the guard's counters, an action this
   trainer cannot carry out (roll back in an async mode, or with no checkpoint to go back to).
4. :func:`rollout_correction_problems`: the run's own ``algorithm.rollout_correction``, judged by verl's own code
   on three tokens as at step 1 (a NaN or negative threshold, an unknown rejection-sampling name).
5. :func:`replay_problems`: R3 without the rollout's routing export, R2 in bypass mode, a replay-metrics interval
   where there is no Megatron replay to sample.
6. :mod:`verl_stable.recipes.geometry`: parallel sizes that do not divide the world, layouts the CPU runtime cannot
   run exactly, and batch sizes that do not split over the data-parallel ranks and their micro-batches.

:func:`cross_field_problems` runs them all. The same function serves ``verl-stable recipe check``, the preflight of
``verl-stable run`` / ``recipe run-cpu`` / ``lab`` (through :func:`verl_stable.recipes.validate.option_problems`),
verl's own ``main_ppo`` in the driver before ``ray.init`` (:mod:`verl_stable.integration.driver_checks` extends
verl's ``validate_config``) and the monitored trainer's constructor.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any

from verl_stable.monitor import logged
from verl_stable.monitor.logged import config_get
from verl_stable.recipes import geometry
from verl_stable.schema import to_plain

__all__ = [
    "cross_field_problems",
    "monitor_problems",
    "replay_problems",
    "rollout_correction_problems",
    "rule_metric_problems",
    "rule_option_problems",
]

RULES_KEY = "stable.guard.rules"
CORRECTION_KEY = "algorithm.rollout_correction"
ROLLOUT_ROUTING_KEY = "actor_rollout_ref.rollout.enable_rollout_routing_replay"
REPLAY_METRICS_INTERVAL_KEY = "stable.monitor.replay_metrics_interval"
RULE_OPTIONS_BY_ACTION: dict[str, str] = {"max_skips": "skip_update", "max_rollbacks": "rollback"}
"""Rule options that only one action reads."""
SLOPE_OPTIONS: tuple[str, ...] = ("window", "slope_tolerance")
"""Rule options only ``below_and_falling`` reads (the slope's window and tolerance)."""


def _trainer_name(cfg: Any) -> str:
    if not config_get(cfg, "trainer.use_v1", True):
        return "trainer.use_v1=false (verl's legacy trainer)"
    return f"trainer.v1.trainer_mode={config_get(cfg, 'trainer.v1.trainer_mode', 'sync')}"


def _active_rules(cfg: Any) -> tuple[Any, ...]:
    """The guard's rules after its defaults and the config's changes (empty when the guard is off)."""
    from verl_stable.monitor.guard import Guard
    from verl_stable.monitor.step import StableConfig

    stable = StableConfig.from_trainer_config(cfg)
    return Guard.from_config(stable.guard).rules if stable.guard_enable else ()


def _given_rules(cfg: Any) -> dict[str, dict[str, Any]]:
    """What the config itself writes under ``stable.guard.rules`` (name -> the keys given), not the defaults."""
    stable = to_plain(config_get(cfg, "stable", None))
    if not isinstance(stable, Mapping):
        return {}
    guard = stable.get("guard")
    rules = guard.get("rules") if isinstance(guard, Mapping) else None
    if not isinstance(rules, Mapping):
        return {}
    return {str(k): dict(v) for k, v in rules.items() if isinstance(v, Mapping) and v.get("enabled", True)}


def _shape_and_rules(cfg: Any) -> tuple[logged.RunShape, tuple[Any, ...]]:
    """The run's shape and its guard's active rules (none unless the trainer is monitored), the rules read once."""
    rules = _active_rules(cfg) if logged.RunShape.from_config(cfg).monitored else ()
    return logged.RunShape.from_config(cfg, rules=((r.name, r.action) for r in rules)), rules


def run_shape(cfg: Any) -> logged.RunShape:
    """The :class:`~verl_stable.monitor.logged.RunShape` of a composed config, with its guard's active rules."""
    return _shape_and_rules(cfg)[0]


# ------------------------------------------------------------------------------------------------------ class 1
def monitor_problems(cfg: Any) -> list[str]:
    """A ``stable`` block on a trainer that has no monitor: refused, naming the monitored mode to use.

    A block that only switches things off (``stable: false``, ``stable.guard: false`` ...) is consistent with any
    trainer and passes.
    """
    stable = to_plain(config_get(cfg, "stable", None))
    if _only_switched_off(stable) or logged.RunShape.from_config(cfg).monitored:
        return []
    mode = str(config_get(cfg, "trainer.v1.trainer_mode", "sync"))
    fix = (
        f"trainer.v1.trainer_mode=stable_{mode}"
        if mode in ("sync", "colocate_async", "separate_async")
        else "trainer.v1.trainer_mode=stable_sync"
    )
    if not config_get(cfg, "trainer.use_v1", True):
        fix = "trainer.use_v1=true and " + fix
    return [
        f"stable is set ({_shown(stable)}) but {_trainer_name(cfg)} has no verl-stable monitor: no stable/ metric "
        f"would be logged and no guard rule would act; set {fix} (the monitored trainer) or remove the stable block"
    ]


def _only_switched_off(stable: Any) -> bool:
    """Whether a ``stable`` block asks for nothing: absent, empty, or only ``false`` / ``{enable: false}`` switches
    (consistent with any trainer: there is nothing to turn off)."""

    def off(value: Any) -> bool:
        return value is False or (isinstance(value, Mapping) and dict(value) == {"enable": False})

    if stable is None or stable is False or stable == {}:
        return True
    return isinstance(stable, Mapping) and all(k in ("monitor", "guard") and off(v) for k, v in stable.items())


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ------------------------------------------------------------------------------------------------------ class 2
def rule_metric_problems(cfg: Any) -> list[str]:
    """Guard rules none of whose metrics this configuration logs, and metric names no run logs.

    Every metric name a rule lists must be one some run logs (a misspelt name is refused, with the nearest known
    name); and at least one of them must be logged by this run, unless the rule is ``optional: true``. A name of
    verl's own that the catalogue does not list (verl logs many) needs ``optional: true``: whether verl logs it
    cannot be told from the config.
    """
    shape, rules = _shape_and_rules(cfg)
    problems = []
    for rule in rules:
        where = f"{RULES_KEY}.{rule.name}"
        refused = False
        for name in rule.metrics:
            if logged.known(name) or name.startswith(logged.GUARD_PREFIX):
                continue
            near = difflib.get_close_matches(name.removeprefix("actor/"), logged.examples(), n=1, cutoff=0.6)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            if name.startswith(("stable/", "actor/stable/")):
                problems.append(f"{where}: metric {name!r} is not a metric verl-stable logs{hint}")
            elif not rule.optional:
                problems.append(
                    f"{where}: metric {name!r} is not one verl-stable knows verl to log{hint}; if verl logs it in "
                    f"this run, say so with {where}.optional=true (the rule then stays silent where it is absent)"
                )
            else:
                continue
            refused = True
        if refused or rule.optional or any(logged.logged_by(m, shape) for m in rule.metrics):
            continue
        reasons = "; ".join(f"{m!r}: {logged.not_logged_reason(m, shape)}" for m in rule.metrics)
        problems.append(
            f"{where} (action {rule.action}) can never fire: this run logs none of its metrics ({reasons}); change "
            f"the settings, drop the rule ({where}=null) or mark it {where}.optional=true"
        )
    return problems


# ------------------------------------------------------------------------------------------------------ class 3
def rule_option_problems(cfg: Any) -> list[str]:
    """Rule options that do nothing for their rule, escalations that change nothing, names the counters take, and
    actions this trainer cannot carry out."""
    from verl_stable.integration import escalation

    rules = _shape_and_rules(cfg)[1]
    given = _given_rules(cfg)
    problems = []
    for rule in rules:
        where = f"{RULES_KEY}.{rule.name}"
        keys = given.get(rule.name, {})
        if rule.name in logged.GUARD_COUNTERS:
            problems.append(
                f"{where}: {rule.name!r} is the name of the guard's own counter stable/guard/{rule.name}, which would "
                "overwrite the rule's flag in the logged metrics; rename the rule"
            )
        for option, action in RULE_OPTIONS_BY_ACTION.items():
            if option in keys and rule.action != action:
                problems.append(f"{where}.{option} is read only by action {action!r}, not {rule.action!r}")
        if rule.condition != "below_and_falling":
            for option in SLOPE_OPTIONS:
                if option in keys:
                    problems.append(
                        f"{where}.{option} is read only by condition 'below_and_falling' (the slope), not "
                        f"{rule.condition!r}"
                    )
        if rule.condition == "non_finite" and "threshold" in keys:
            problems.append(f"{where}.threshold is not read by condition 'non_finite' (any NaN or inf fires it)")
        if rule.action == "escalate" and rule.escalate_to:
            before, after = escalation.effective(cfg), escalation.effective(cfg, rule.escalate_to)
            if before == after:
                problems.append(
                    f"{where}.escalate_to {dict(rule.escalate_to)} is what {CORRECTION_KEY} already has in force: "
                    "the rule's one escalation would change nothing; escalate to something stricter"
                )
    mode = str(config_get(cfg, "trainer.v1.trainer_mode", "sync"))
    rolling = [r.name for r in rules if r.action == "rollback"]
    if rolling and mode != "stable_sync":
        problems.append(
            f"{RULES_KEY} {rolling} roll back, which trainer_mode {mode} cannot: its rollout keeps generating with "
            "the abandoned weights; use stable_sync or another action"
        )
    save_freq = config_get(cfg, "trainer.save_freq", -1)
    if rolling and isinstance(save_freq, int) and save_freq <= 0:
        problems.append(
            f"{RULES_KEY} {rolling} roll back to the last good checkpoint, but trainer.save_freq={save_freq} saves "
            "none: set trainer.save_freq > 0 (every step the run may go back to) or use another action"
        )
    return problems


# ------------------------------------------------------------------------------------------------------ class 4
def rollout_correction_problems(cfg: Any) -> list[str]:
    """The run's own ``algorithm.rollout_correction`` as verl's trainer will use it at step 1.

    verl judges these settings only in the driver's first step, and takes a NaN threshold without complaint (every
    IS weight is then NaN). Refused here: a numeric threshold that is not a finite number > 0, an IS level other than
    ``token`` / ``sequence`` / null, and whatever verl's own rollout-correction code raises on, or returns a
    non-finite weight for, on three tokens with ratios on both sides of 1.
    """
    section = to_plain(config_get(cfg, CORRECTION_KEY, None))
    if not isinstance(section, Mapping):
        return []
    problems = []
    level = section.get("rollout_is")
    if level not in (None, "token", "sequence"):
        problems.append(f"{CORRECTION_KEY}.rollout_is must be token, sequence or null, got {level!r}")
    for key in ("rollout_is_threshold", "rollout_rs_threshold"):
        value = section.get(key)
        if isinstance(value, bool) or (isinstance(value, (int, float)) and not (math.isfinite(value) and value > 0)):
            problems.append(
                f"{CORRECTION_KEY}.{key} must be a finite number > 0 (or verl's 'lower_upper'), got {value!r}"
            )
    if problems or section.get("bypass_mode", False):
        return problems  # in bypass mode verl's trainer computes no rollout correction
    import torch
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    from verl_stable.integration import escalation

    settings = escalation.effective(cfg)
    old = torch.zeros(1, 3)
    rollout = torch.tensor([[0.0, -0.5, 0.5]])  # ratios e^0, e^0.5, e^-0.5
    try:
        weights, mask, _ = compute_rollout_correction_and_rejection_mask(old, rollout, torch.ones(1, 3), **settings)
    except Exception as exc:  # noqa: BLE001 - verl raises several types; each is a refusal of the settings
        return [f"{CORRECTION_KEY}: verl's rollout correction refuses {settings}: {type(exc).__name__}: {exc}"]
    if weights is not None:  # a DataProto holding the weights
        weights = weights.batch["rollout_is_weights"]
    if weights is not None and not bool(torch.isfinite(weights).all()):
        problems.append(
            f"{CORRECTION_KEY}: verl's rollout correction gives non-finite IS weights {weights.tolist()} with "
            f"{settings} on ratios 1, e^0.5, e^-0.5"
        )
    return problems


# ------------------------------------------------------------------------------------------------------ class 5
def _replay_key(cfg: Any) -> str:
    from verl_stable.recipes.regimes import ROUTER_REPLAY_KEY

    strategy = config_get(cfg, "actor_rollout_ref.actor.strategy", "fsdp")
    return ROUTER_REPLAY_KEY["megatron" if strategy == "megatron" else "fsdp"]


def replay_problems(cfg: Any) -> list[str]:
    """Routing replay that cannot run (the parallel layout and the batch geometry: :mod:`.geometry`)."""
    key = _replay_key(cfg)
    mode = config_get(cfg, key, "disabled")
    problems = []
    if mode == "R3" and not config_get(cfg, ROLLOUT_ROUTING_KEY, False):
        problems.append(
            f"{key}=R3 replays the rollout's routing, but {ROLLOUT_ROUTING_KEY}=false: the rollout exports none and "
            "the first old-log-prob pass would fail; set it true"
        )
    if mode == "R2" and config_get(cfg, f"{CORRECTION_KEY}.bypass_mode", False):
        problems.append(
            f"{key}=R2 records routing in the pi_old pass, which {CORRECTION_KEY}.bypass_mode=true skips: use R3 or "
            "bypass_mode=false"
        )
    shape = logged.RunShape.from_config(cfg)
    if shape.monitored and shape.replay_metrics_interval != 1:
        given = f"{REPLAY_METRICS_INTERVAL_KEY}={shape.replay_metrics_interval}"
        if shape.backend != "megatron":
            problems.append(
                f"{given} samples the Megatron actor's replay metrics; the {shape.backend} engine measures them as "
                "part of its replay, every pass: remove it"
            )
        elif not shape.replays:
            problems.append(f"{given} samples the replay metrics, but {key}={mode} replays nothing: remove it")
    return problems


# ------------------------------------------------------------------------------------------------------- all
CHECKS = (
    monitor_problems,
    rule_metric_problems,
    rule_option_problems,
    rollout_correction_problems,
    replay_problems,
    geometry.layout_problems,
    geometry.batch_problems,
)
"""The classes, in the order a reader fixes them."""


def cross_field_problems(cfg: Any) -> list[str]:
    """Every cross-field problem of a composed config (empty: every setting can take effect).

    A class that cannot be judged because a section is malformed is left to the schema's own refusal (the
    schema's checks run first in every caller).
    """
    from verl_stable.schema import ConfigError

    problems: list[str] = []
    for check in CHECKS:
        try:
            problems += check(cfg)
        except ConfigError:
            continue  # the schema names it; one message per problem
    return problems
