"""Which metrics a run logs, known from its configuration before it starts: what a guard rule can watch.

A guard rule fires only on a metric the run logs. Whether a run logs ``stable/train_inf/kl_k3`` or
``stable/routing/coverage/response_replayed`` follows from its settings (the monitored trainer, the monitor switch
and taus, the rollout's log-probs and routing export, the replay mode, the loss, verl's bypass mode), so a rule on
a metric the configuration never logs can be refused before anything starts instead of sitting silent for a whole
run. This module holds that knowledge as data:

* :class:`RunShape`: the settings that decide which metrics exist, read from a composed trainer config
  (:meth:`RunShape.from_config`);
* :data:`FAMILIES`: every metric name verl-stable logs, and the verl names the default rules and the docs use, as
  patterns, each with the condition under which a run logs it and whether it appears in every such run
  (``every_run``) or only at some steps (``stable/entropy/slope`` after its window fills, load metrics every
  ``routing_interval`` steps);
* :func:`known`, :func:`logged_by`: a name's families, and whether a run of a shape can log it (with the reason
  when it cannot).

The catalogue cannot drift from the code unnoticed: the end-to-end tests check, on the metrics real verl runs log,
that every logged ``stable/`` name (and every name of the project's losses) matches a family the run's shape
predicts, and that every ``every_run`` family the shape predicts was logged (``tests/testkit/logged.py``).

verl's own metrics are listed only where a rule or the docs name them: ``actor/entropy``, ``actor/pg_loss``,
``rollout_corr/*``... verl logs many more (timings, throughput, lengths); a rule on a name this catalogue does not
know cannot be checked here and is refused unless the rule says it accepts that (``optional: true``).

Nothing here imports verl or torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from verl_stable.metric_names import COVERAGE_COUNTS, GUARD, SIDE_READ_COUNTS

__all__ = [
    "FAMILIES",
    "GUARD_COUNTERS",
    "GUARD_PREFIX",
    "MONITORED_MODES",
    "Family",
    "RunShape",
    "config_get",
    "known",
    "logged_by",
    "not_logged_reason",
]

MONITORED_MODES: tuple[str, ...] = ("stable_sync", "stable_colocate_async", "stable_separate_async")
"""``trainer.v1.trainer_mode`` values of the monitored trainers (:mod:`verl_stable.integration.trainer`)."""
GUARD_PREFIX = GUARD
"""``stable/guard/``: the guard's per-rule flags and counters."""
GUARD_COUNTERS: tuple[str, ...] = ("rollbacks", "escalations", "skipped_updates")
"""``stable/guard/<name>`` entries the guard fills with its counters, not with a rule's 0 / 1 flag."""
STALENESS = ("ratio_mean", "ratio_min", "ratio_max", "ratio_dev_max", "log_ratio_abs_mean", "kl_k3", "frac_above",
             "frac_below", "frac_outside_trust_region")  # fmt: skip
"""``stable/staleness/<name>`` of the losses (mirrors :data:`verl_stable.monitor.staleness.STALENESS_NAMES`, which
imports torch; a test checks the two are equal)."""
TRAIN_INF_NAMES = ("nonfinite_frac", "kl_k1", "kl_k3", "ratio_mean", "ratio_min", "ratio_max", "log_ratio_abs_mean",
                   "log_ratio_abs_median", "frac_masked")  # fmt: skip
"""``stable/train_inf/<name>`` of the monitor, beside F(tau) and the truncated fraction."""
COMPACT_MANAGER = "CompactRoutingAgentLoopManagerTQ"
"""The agent-loop manager class of the compact routing transport (its ``stable/routing/transport/*`` counters)."""


def config_get(node: Any, dotted: str, default: Any = None) -> Any:
    """The value at a dotted key of a config (a DictConfig or nested mappings); ``default`` where absent or null."""
    for part in dotted.split("."):
        if node is None or not hasattr(node, "get"):
            return default
        node = node.get(part, None)
    return default if node is None else node


@dataclass(frozen=True)
class RunShape:
    """The settings of a run that decide which metrics it logs.

    Attributes:
        monitored: verl's V1 trainer in a monitored mode (``trainer.use_v1`` and a ``trainer_mode`` of
            :data:`MONITORED_MODES`): only then does anything log ``stable/`` metrics or run the guard.
        monitor: ``monitored`` and ``stable.monitor.enable``.
        taus: ``stable.monitor.taus``.
        routing_interval: ``stable.monitor.routing_interval`` (0: routing never fetched).
        replay_metrics_interval: ``stable.monitor.replay_metrics_interval`` (0: the Megatron actor never measures its
            replay metrics; otherwise step 1 and every N-th after it, so every run logs them at step 1).
        train_routing_field: ``stable.monitor.train_routing_field``.
        per_update: ``stable.monitor.per_update``.
        rules: the guard's active rules ``(name, action)``; empty when the guard is off or the run unmonitored.
        rollout_log_probs: ``rollout.calculate_log_probs`` (mu exists).
        bypass: ``algorithm.rollout_correction.bypass_mode`` (pi_old := mu, never recomputed).
        rollout_correction: verl's ``algorithm.rollout_correction`` section is present (verl computes
            ``rollout_corr/*`` from it).
        rollout_is: ``algorithm.rollout_correction.rollout_is`` (None, ``token``, ``sequence``).
        rollout_routing: ``rollout.enable_rollout_routing_replay`` (the rollout exports its routed experts).
        compact_transport: the agent loop is verl-stable's compact-routing manager.
        backend: ``actor.strategy`` (``fsdp``, ``fsdp2``, ``megatron``).
        replay: the actor's ``router_replay.mode`` (``disabled``, ``R2``, ``R3``).
        loss_mode: ``actor.policy_loss.loss_mode``.
    """

    monitored: bool = True
    monitor: bool = True
    taus: tuple[float, ...] = (2.0, 5.0)
    routing_interval: int = 1
    replay_metrics_interval: int = 1
    train_routing_field: str | None = None
    per_update: bool = True
    rules: tuple[tuple[str, str], ...] = ()
    rollout_log_probs: bool = True
    bypass: bool = False
    rollout_correction: bool = True
    rollout_is: str | None = None
    rollout_routing: bool = False
    compact_transport: bool = False
    backend: str = "fsdp"
    replay: str = "disabled"
    loss_mode: str = "vanilla"

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | Any, rules: Iterable[tuple[str, str]] = ()) -> RunShape:
        """Read the shape from a composed trainer config (a DictConfig or nested mappings).

        The ``stable`` block is read with the schema's reader by the caller, who passes the guard's active rules
        (they need the guard's defaults); this reads the monitor's switch, taus and intervals directly, as plain
        values, so that a shape can be built from a config whose guard section is being checked.
        """
        use_v1 = config_get(cfg, "trainer.use_v1", True)
        mode = config_get(cfg, "trainer.v1.trainer_mode", "sync")
        monitored = bool(use_v1) and mode in MONITORED_MODES
        stable = config_get(cfg, "stable", None)
        monitor_block = config_get(stable, "monitor", None) if stable not in (True, False) else None
        enable = stable is not False and monitor_block is not False and bool(config_get(monitor_block, "enable", True))
        strategy = str(config_get(cfg, "actor_rollout_ref.actor.strategy", "fsdp"))
        replay_key = (
            "actor_rollout_ref.actor.megatron.router_replay.mode"
            if strategy == "megatron"
            else "actor_rollout_ref.actor.fsdp_config.router_replay.mode"
        )
        correction = config_get(cfg, "algorithm.rollout_correction", None)
        manager = str(config_get(cfg, "actor_rollout_ref.rollout.agent.agent_loop_manager_class", "") or "")
        return cls(
            monitored=monitored,
            monitor=monitored and enable,
            taus=tuple(float(t) for t in config_get(monitor_block, "taus", (2.0, 5.0))),
            routing_interval=int(config_get(monitor_block, "routing_interval", 1)),
            replay_metrics_interval=int(config_get(monitor_block, "replay_metrics_interval", 1)),
            train_routing_field=config_get(monitor_block, "train_routing_field", None),
            per_update=bool(config_get(monitor_block, "per_update", True)),
            rules=tuple(rules) if monitored else (),
            rollout_log_probs=bool(config_get(cfg, "actor_rollout_ref.rollout.calculate_log_probs", False)),
            bypass=bool(config_get(correction, "bypass_mode", False)),
            rollout_correction=correction is not None,
            rollout_is=config_get(correction, "rollout_is", None),
            rollout_routing=bool(config_get(cfg, "actor_rollout_ref.rollout.enable_rollout_routing_replay", False)),
            compact_transport=manager.rsplit(".", 1)[-1] == COMPACT_MANAGER,
            backend=strategy,
            replay=str(config_get(cfg, replay_key, "disabled") or "disabled"),
            loss_mode=str(config_get(cfg, "actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla")),
        )

    @property
    def replays(self) -> bool:
        """R2 or R3 is on."""
        return self.replay in ("R2", "R3")

    @property
    def replay_measured(self) -> bool:
        """R2 or R3 is on and the actor measures it (the Megatron actor not with ``replay_metrics_interval`` 0)."""
        return self.replays and (self.backend != "megatron" or self.replay_metrics_interval > 0)

    @property
    def train_inference(self) -> bool:
        """The monitor measures KL(mu || pi_old): it runs, and pi_old is the training engine's against the rollout's mu."""
        return self.monitor and self.pi_old_from_training

    @property
    def pi_old_from_training(self) -> bool:
        """pi_old is recomputed by the training engine and mu exists: the train-inference metrics have a value."""
        return self.rollout_log_probs and not self.bypass


@dataclass(frozen=True)
class Family:
    """Metric names that one piece of code logs under one condition.

    Attributes:
        pattern: a regular expression a name must match whole.
        needs: the condition on a :class:`RunShape` under which a run logs the family.
        why_not: what to change when ``needs`` fails (names the settings), for the refusal message.
        every_run: every run whose shape meets ``needs`` logs at least one name of it (otherwise only some steps
            or some batches do).
        example: one name of the family, for "did you mean" suggestions.
    """

    pattern: str
    needs: Callable[[RunShape], bool]
    why_not: str
    every_run: bool = True
    example: str = ""

    def matches(self, name: str) -> bool:
        """Whether ``name`` is one of this family's names (for a ``{taus}`` family: under any taus)."""
        return re.fullmatch(self.pattern.replace("{taus}", r"[0-9.e+-]+"), name) is not None

    def matches_in(self, name: str, shape: RunShape) -> bool:
        """Whether ``name`` is one of this family's names in a run of ``shape`` (its own taus)."""
        taus = "|".join(re.escape(f"{t:g}") for t in shape.taus) or "(?!)"
        return re.fullmatch(self.pattern.replace("{taus}", f"(?:{taus})"), name) is not None


def _alt(names: Iterable[str]) -> str:
    return "(?:" + "|".join(re.escape(n) for n in names) + ")"


_MONITOR = "the monitor is off (stable.monitor.enable=false, or the trainer is not trainer.v1.trainer_mode=stable_*)"
_TRAIN_INF = (
    "KL(mu||pi_old) needs the monitor, the rollout's log-probs (actor_rollout_ref.rollout.calculate_log_probs=true) "
    "and pi_old recomputed by the trainer (algorithm.rollout_correction.bypass_mode=false)"
)
_IS = "IS weights exist only with verl's IS correction (algorithm.rollout_correction.rollout_is=token|sequence)"
_ROUTING_FETCH = (
    "routing load metrics need the monitor, the rollout's routing export "
    "(actor_rollout_ref.rollout.enable_rollout_routing_replay=true) and stable.monitor.routing_interval > 0"
)
_ENGINE = (
    "the actor's routing metrics need routing replay (router_replay.mode=R2|R3) or, on the FSDP engine, the "
    "rollout's routing export (actor_rollout_ref.rollout.enable_rollout_routing_replay=true)"
)
_REPLAY = (
    "replay metrics need router_replay.mode=R2 or R3 (on Megatron also stable.monitor.replay_metrics_interval > 0)"
)
_STALENESS = "staleness is measured by the minirl and vespo losses (actor.policy_loss.loss_mode=minirl|vespo)"
_PER_UPDATE = "per-update metrics need stable.monitor.per_update=true"


def _engine_routing(s: RunShape) -> bool:
    return s.monitored and (s.replay_measured or (s.backend != "megatron" and s.rollout_routing))


FAMILIES: tuple[Family, ...] = (
    # the monitor, on the step's batch (verl_stable.monitor.step.StepMonitor.batch_metrics)
    Family(r"stable/valid_tokens", lambda s: s.monitor, _MONITOR, example="stable/valid_tokens"),
    Family(
        r"stable/train_inf/" + _alt(TRAIN_INF_NAMES),
        lambda s: s.train_inference,
        _TRAIN_INF,
        example="stable/train_inf/kl_k3",
    ),
    Family(
        r"stable/train_inf/extreme_frac_tau{taus}",
        lambda s: s.train_inference,
        _TRAIN_INF + "; F(tau) is logged for the taus of stable.monitor.taus only",
        example="stable/train_inf/extreme_frac_tau2",
    ),
    Family(
        r"stable/train_inf/frac_truncated",
        lambda s: s.train_inference and s.rollout_is == "token",
        _TRAIN_INF + "; the truncated fraction needs token-level IS (algorithm.rollout_correction.rollout_is=token)",
        example="stable/train_inf/frac_truncated",
    ),
    Family(
        r"stable/is/" + _alt(("nonfinite_frac", "ess", "weight_mean", "weight_max")),
        lambda s: s.train_inference and s.rollout_correction and s.rollout_is is not None,
        _IS,
        example="stable/is/ess",
    ),
    Family(
        r"stable/entropy/(?:mean|nonfinite_frac)",
        lambda s: s.monitor and not s.bypass,
        _MONITOR + "; the token entropy comes with pi_old, which bypass mode does not compute",
        example="stable/entropy/mean",
    ),
    Family(
        r"stable/entropy/slope",
        lambda s: s.monitor and not s.bypass,
        _MONITOR + "; the token entropy comes with pi_old, which bypass mode does not compute",
        every_run=False,  # once stable.monitor.entropy_window steps were seen
        example="stable/entropy/slope",
    ),
    Family(
        r"stable/routing/load/(?:layer_\d+/)?(?:max_over_mean|cv)",
        lambda s: s.monitor and s.rollout_routing and s.routing_interval > 0,
        _ROUTING_FETCH,
        every_run=False,  # at steps that are multiples of routing_interval
        example="stable/routing/load/max_over_mean",
    ),
    Family(
        r"stable/routing/rollout_vs_train/[A-Za-z0-9_]+(?:/\d+)?",
        lambda s: s.monitor and s.rollout_routing and s.routing_interval > 0 and bool(s.train_routing_field),
        _ROUTING_FETCH + " and a training-side routing field (stable.monitor.train_routing_field)",
        every_run=False,
        example="stable/routing/rollout_vs_train/disagreement",
    ),
    # the actor's replay engine (FSDP: integration.fsdp_replay; Megatron: integration.megatron_replay), moved from
    # actor/stable/ to stable/ by the monitored trainers
    Family(
        r"stable/routing/(?:router_disagreement|compared_rows|disagreement|disagreement/layer_(?:\d+|max))",
        _engine_routing,
        _ENGINE,
        example="stable/routing/router_disagreement",
    ),
    Family(
        r"stable/routing/(?:missing_rows|padding_rows|disagreement/token_any_layer)",
        lambda s: _engine_routing(s) and s.backend != "megatron",
        _ENGINE + " (these counts: the FSDP engine)",
        example="stable/routing/missing_rows",
    ),
    Family(r"stable/routing/replayed_rows", lambda s: s.monitored and s.replay_measured, _REPLAY, example=""),
    Family(
        r"stable/routing/r2_drift(?:/layer_\d+)?",
        lambda s: s.monitored and s.replay_measured and s.replay == "R2",
        "R2 drift needs router_replay.mode=R2 (on Megatron also stable.monitor.replay_metrics_interval > 0)",
        example="stable/routing/r2_drift",
    ),
    Family(
        r"stable/routing/recorded_rows",
        lambda s: s.monitored and s.replay_measured and s.replay == "R2",
        "recorded rows need router_replay.mode=R2 (on Megatron also stable.monitor.replay_metrics_interval > 0)",
        every_run=False,  # counted in the pi_old pass, whose metrics verl does not always log
    ),
    Family(
        r"stable/routing/coverage/"
        + _alt(
            (
                *COVERAGE_COUNTS,
                "response_replayed",
                "response_fallback",
                "prompt_replayed",
                "prompt_fallback",
                "not_needed",
                "padding",
            )
        ),
        lambda s: s.monitored and s.replay_measured,
        _REPLAY,
        example="stable/routing/coverage/response_replayed",
    ),
    Family(
        r"stable/routing/transport/(?:[a-z_]+|error/[A-Za-z]+)",
        lambda s: s.rollout_routing and s.compact_transport,
        "transport counters need the compact routing transport (rollout.agent.agent_loop_manager_class="
        f"verl_stable.integration.rollout.{COMPACT_MANAGER}) and the rollout's routing export",
        example="stable/routing/transport/skipped_samples",
    ),
    Family(
        r"stable/routing/transport/" + _alt((*SIDE_READ_COUNTS, "side_reads_per_rank")),
        lambda s: s.rollout_routing and s.compact_transport,
        "shared-row reads need the compact routing transport",
        every_run=False,
    ),
    # the losses (integration.losses): staleness inside the update, the losses' own names under actor/
    Family(
        r"stable/staleness/" + _alt((*STALENESS, "nonfinite_frac")),
        lambda s: s.monitored and s.loss_mode in ("minirl", "vespo"),
        _STALENESS,
        example="stable/staleness/kl_k3",
    ),
    Family(
        r"stable/staleness/update_\d+/" + _alt((*STALENESS, "nonfinite_frac")),
        lambda s: s.monitor and s.per_update and s.loss_mode in ("minirl", "vespo"),
        _STALENESS + "; " + _PER_UPDATE,
        example="stable/staleness/update_1/kl_k3",
    ),
    Family(
        r"stable/routing/update_\d+/(?:disagreement|router_disagreement)",
        lambda s: s.monitor and s.per_update and _engine_routing(s),
        _ENGINE + "; " + _PER_UPDATE,
        every_run=False,  # the FSDP engine's observe passes log per update; Megatron's only under replay
        example="stable/routing/update_1/router_disagreement",
    ),
    Family(
        r"stable/routing/update_\d+/r2_drift",
        lambda s: s.monitor and s.per_update and s.replay_measured and s.replay == "R2",
        "R2 drift needs router_replay.mode=R2 (on Megatron also stable.monitor.replay_metrics_interval > 0); "
        + _PER_UPDATE,
    ),
    Family(r"actor/MiniRL/[A-Za-z0-9_]+", lambda s: s.loss_mode == "minirl", "the minirl loss", example=""),
    Family(r"actor/vespo/[A-Za-z0-9_]+", lambda s: s.loss_mode == "vespo", "the vespo loss", example=""),
    # the guard (StepMonitor.step / Guard.metrics)
    Family(
        r"stable/guard/[^/]+",
        lambda s: bool(s.rules),
        "guard flags need the guard on (stable.guard.enable=true) in a monitored trainer",
        example="stable/guard/train_inference_kl",
    ),
    # verl's own names that rules and docs use (verl logs many more; see the module docstring)
    Family(r"actor/entropy", lambda s: True, "", example="actor/entropy"),
    Family(r"actor/(?:pg_loss|loss|grad_norm|pg_clipfrac|ppo_kl|lr)", lambda s: True, "", example="actor/pg_loss"),
    Family(
        r"critic/(?:score|rewards|advantages|returns)/(?:mean|max|min)", lambda s: True, "", example="critic/score/mean"
    ),
    Family(
        r"rollout_corr/[a-z0-9_]+",
        lambda s: s.rollout_correction and s.pi_old_from_training,
        "verl computes rollout_corr/* from algorithm.rollout_correction with the rollout's log-probs "
        "(actor_rollout_ref.rollout.calculate_log_probs=true) outside bypass mode",
        example="rollout_corr/k3_kl",
    ),
    Family(
        r"training/rollout_(?:probs_diff_(?:valid|max|mean|std)|actor_probs_pearson_corr)",
        lambda s: s.pi_old_from_training,
        "verl compares the rollout's and the actor's probabilities only with actor_rollout_ref.rollout."
        "calculate_log_probs=true outside bypass mode",
        example="training/rollout_probs_diff_mean",
    ),
)
"""Every metric family, in the order the docs list them (docs/reference/metrics.md)."""

_VERL_OWN = ("actor/entropy", "actor/", "critic/", "rollout_corr/", "training/")


def known(name: str) -> list[Family]:
    """The families ``name`` belongs to in some run (empty: no run logs it, as far as this catalogue knows)."""
    return [f for f in FAMILIES if f.matches(name)]


def logged_by(name: str, shape: RunShape) -> bool:
    """Whether a run of ``shape`` can log ``name`` (at some step). A guard flag is logged for an active rule only."""
    if name.startswith(GUARD):
        leaf = name[len(GUARD) :]
        actions = {action for _, action in shape.rules}
        counters = {"rollbacks": "rollback", "escalations": "escalate", "skipped_updates": "skip_update"}
        if leaf in counters:
            return counters[leaf] in actions
        return leaf in {rule for rule, _ in shape.rules}
    return any(f.needs(shape) and f.matches_in(name, shape) for f in FAMILIES)


def not_logged_reason(name: str, shape: RunShape) -> str:
    """Why a run of ``shape`` does not log ``name`` (the settings to change), for a refusal message."""
    families = known(name)
    if not families:
        return "no run logs it"
    if name.startswith(GUARD):
        return "it is not the flag of an active guard rule or counter of this run"
    for family in families:
        if family.needs(shape) and not family.matches_in(name, shape):
            return f"this run's stable.monitor.taus are {list(shape.taus)}"
    reasons = [f.why_not for f in families if not f.needs(shape) and f.why_not]
    if not shape.monitored and name.startswith("stable/"):
        reasons.insert(0, _MONITOR)
    return "; ".join(dict.fromkeys(reasons)) or "this run does not log it"


def is_verl_name(name: str) -> bool:
    """Whether ``name`` lies under a prefix of verl's own metrics (not verl-stable's)."""
    return name.startswith(_VERL_OWN) and not name.startswith(("actor/MiniRL", "actor/vespo", "actor/stable/"))


def examples() -> list[str]:
    """One name per family (for "did you mean" suggestions)."""
    return [f.example for f in FAMILIES if f.example]
