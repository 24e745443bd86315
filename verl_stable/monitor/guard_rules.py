"""The guard's vocabulary: rules, the verdicts they return, the default rules, and the exception that stops a run.

A :class:`Rule` says which metric to watch, the condition that fires it and the action a firing asks for; a
:class:`Verdict` is one firing at one step. :class:`~verl_stable.monitor.guard.Guard` evaluates the rules on the stream
of step metrics. Malformed rules raise when they are built (``TypeError`` for a wrong type, ``ValueError`` for a wrong
value, each naming the rule). This module does not import verl.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from verl_stable.metric_names import IS_WEIGHTS, ROUTING, TRAIN_INF, TRANSPORT
from verl_stable.monitor.common import check_bool, check_int, check_real, type_name
from verl_stable.schema import ESCALATION_KEYS, MAX_WINDOW, EscalationOptions, parse

Action = Literal["warn", "stop", "stop_checkpoint", "skip_update", "rollback", "escalate"]
Condition = Literal["above", "below", "below_and_falling", "non_finite"]
ACTIONS: tuple[str, ...] = ("warn", "stop", "stop_checkpoint", "skip_update", "rollback", "escalate")
Phase = Literal["before_update", "after_update"]
PRE_UPDATE_PREFIXES: tuple[str, ...] = (
    f"{TRAIN_INF}/",
    f"{IS_WEIGHTS}/",
    TRANSPORT,
    f"{ROUTING}/rollout_vs_train/",
    "rollout_corr/",
)
"""Metrics measured before the actor update (from the rollout's and pi_old's log-probs and routing; verl's own
rollout-correction metrics, computed with the advantages): the only ones a ``skip_update`` rule can watch, since it
decides whether that update is applied."""
DEFAULT_MAX_SKIPS = 3
DEFAULT_MAX_ROLLBACKS = 2
CONDITIONS: tuple[str, ...] = ("above", "below", "below_and_falling", "non_finite")
RollbackData = Literal["replay", "skip"]
ROLLBACK_DATA: tuple[str, ...] = get_args(RollbackData)


@dataclass(frozen=True)
class Rule:
    """One guard rule.

    Attributes:
        name: identifier used in verdicts, metrics (``stable/guard/{name}``) and configuration.
        condition: ``above``: value > threshold; ``below``: value < threshold; ``below_and_falling``: value <
            threshold and the least-squares slope per training step of the last ``window`` observed values of
            that metric is below ``-slope_tolerance`` (evaluated once ``window`` values were observed);
            ``non_finite``: any listed metric is NaN or infinite. Under every condition, a watched value that is
            NaN, infinite or not a number fires the rule.
        metrics: metric names (a str or a sequence of str, stored as a tuple). For threshold conditions the first
            name present in a step's metrics is used (a preference order with fallbacks), each name with its own
            slope window; for ``non_finite`` every present name is checked.
        threshold: the threshold, a finite real number (required except for ``non_finite``, which ignores it).
        window: number of most recent observations the slope is fitted on (an int; >= 2 for
            ``below_and_falling``, ignored by the other conditions).
        action: ``warn``, ``stop``, ``stop_checkpoint`` or ``skip_update``. ``skip_update`` is evaluated before the
            actor update, on metrics measured before it (:data:`PRE_UPDATE_PREFIXES`), and the update is not
            applied when it fires; more than ``max_skips`` consecutive firings escalate to ``stop_checkpoint``.
            ``rollback`` returns the run to the last good checkpoint; its ``max_rollbacks + 1``-th firing in a run
            escalates to ``stop_checkpoint``.
        slope_tolerance: per-step decline the slope must exceed to count as falling (``below_and_falling``);
            raise it for tasks whose healthy entropy is legitimately low and noisy.
        optional: the metrics exist only in some runs (``replay_coverage``: only under routing replay), so a
            rule that never found them is not listed in :attr:`Guard.missing`.
        max_skips: ``skip_update`` only: consecutive skipped updates allowed before the rule escalates to
            ``stop_checkpoint`` (an int >= 1).
        max_rollbacks: ``rollback`` only: rollbacks this rule may ask for in one run before it escalates to
            ``stop_checkpoint`` (an int >= 1): a fault that recurs after every rollback is not transient.
        rollback_data: ``rollback`` only: which batches the redone steps train on. ``replay`` (default): the ones
            after the checkpoint again, as a resume from it would (bit-for-bit where the run is deterministic: a
            transient fault, such as a bad optimizer step, does not come back, but damage the data and sampling
            themselves cause does); ``skip``: the ones the abandoned steps had not reached, so the steps after the
            checkpoint are redone on new data (the restarts of large pre-training runs skip the batches around a
            loss spike the same way).
        marks_checkpoints: whether this rule's firing counts against the checkpoints around its step when a
            rollback or ``stop_checkpoint`` looks for the last good one (:func:`~verl_stable.monitor.guard.
            last_good_checkpoint_step`; default ``True``, warn included). Set ``False`` for an alarm about something
            other than the weights -- ``train_inference_kl`` measures the rollout engine against the trainer, and
            without routing replay on an MoE it fires on most steps, which would leave no checkpoint good.
        escalate_to: ``escalate`` only (and required there): the fields of verl's ``algorithm.rollout_correction``
            the run moves to, as ``(key, value)`` pairs sorted by key (a mapping is accepted), keys from
            :data:`~verl_stable.schema.ESCALATION_KEYS`, values typed by :class:`~verl_stable.schema.EscalationOptions`.
    """

    name: str
    condition: Condition
    metrics: tuple[str, ...]
    threshold: float | None = None
    window: int = 1
    action: Action = "warn"
    slope_tolerance: float = 0.0
    optional: bool = False
    max_skips: int = DEFAULT_MAX_SKIPS
    max_rollbacks: int = DEFAULT_MAX_ROLLBACKS
    rollback_data: RollbackData = "replay"
    escalate_to: tuple[tuple[str, Any], ...] = ()
    marks_checkpoints: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"rule name must be a str, got {type_name(self.name)} {self.name!r}")
        if not self.name or "/" in self.name:
            raise ValueError(f"rule name must be a non-empty path segment without '/', got {self.name!r}")
        where = f"rule {self.name!r}"
        if self.condition not in CONDITIONS:
            raise ValueError(f"{where}: condition must be one of {CONDITIONS}, got {self.condition!r}")
        if self.action not in ACTIONS:
            raise ValueError(f"{where}: action must be one of {ACTIONS}, got {self.action!r}")
        # frozen: normalised values are written through object.__setattr__
        object.__setattr__(self, "metrics", _metric_names(where, self.metrics))
        if self.threshold is not None:
            object.__setattr__(self, "threshold", check_real(f"{where}: threshold", self.threshold))
        if self.condition != "non_finite" and (self.threshold is None or not math.isfinite(self.threshold)):
            raise ValueError(f"{where}: condition {self.condition!r} needs a finite threshold, got {self.threshold}")
        object.__setattr__(self, "window", check_int(f"{where}: window", self.window))
        if self.condition == "below_and_falling" and self.window < 2:
            raise ValueError(f"{where}: below_and_falling needs an integer window >= 2, got {self.window!r}")
        if not 1 <= self.window <= MAX_WINDOW:
            raise ValueError(f"{where}: window must be in [1, {MAX_WINDOW}], got {self.window!r}")
        tolerance = check_real(f"{where}: slope_tolerance", self.slope_tolerance)
        if not (math.isfinite(tolerance) and tolerance >= 0):
            raise ValueError(f"{where}: slope_tolerance must be a finite number >= 0, got {tolerance!r}")
        object.__setattr__(self, "slope_tolerance", tolerance)
        check_bool(f"{where}: optional", self.optional)
        check_bool(f"{where}: marks_checkpoints", self.marks_checkpoints)
        object.__setattr__(self, "max_skips", check_int(f"{where}: max_skips", self.max_skips))
        if not 1 <= self.max_skips <= MAX_WINDOW:
            raise ValueError(f"{where}: max_skips must be in [1, {MAX_WINDOW}], got {self.max_skips!r}")
        object.__setattr__(self, "max_rollbacks", check_int(f"{where}: max_rollbacks", self.max_rollbacks))
        if not 1 <= self.max_rollbacks <= MAX_WINDOW:
            raise ValueError(f"{where}: max_rollbacks must be in [1, {MAX_WINDOW}], got {self.max_rollbacks!r}")
        if self.rollback_data not in ROLLBACK_DATA:
            raise ValueError(f"{where}: rollback_data must be one of {ROLLBACK_DATA}, got {self.rollback_data!r}")
        if self.rollback_data != "replay" and self.action != "rollback":
            raise ValueError(
                f"{where}: rollback_data {self.rollback_data!r} is for action 'rollback', not {self.action!r}"
            )
        object.__setattr__(self, "escalate_to", _escalation(where, self.escalate_to))
        if (self.action == "escalate") != bool(self.escalate_to):
            need = "needs a non-empty escalate_to" if self.action == "escalate" else "has escalate_to but"
            raise ValueError(f"{where}: {need} action {self.action!r} (escalate_to is for action 'escalate' only)")
        if self.action == "skip_update":
            late = [m for m in self.metrics if not m.startswith(PRE_UPDATE_PREFIXES)]
            if late:
                raise ValueError(
                    f"{where}: skip_update decides before the actor update, so it can watch only metrics measured "
                    f"before it ({', '.join(p + '*' for p in PRE_UPDATE_PREFIXES)}), got {late}"
                )


def _escalation(where: str, value: object) -> tuple[tuple[str, Any], ...]:
    """``escalate_to`` as sorted ``(key, value)`` pairs, each key and value checked by the schema's model."""
    if isinstance(value, Mapping):
        value = tuple(value.items())
    if not isinstance(value, (tuple, list)) or not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in value):
        raise TypeError(f"{where}: escalate_to must be a mapping of {ESCALATION_KEYS} to values, got {value!r}")
    given = dict(value)
    if len(given) != len(value):
        raise ValueError(f"{where}: escalate_to names a key twice: {[k for k, _ in value]}")
    checked = parse(EscalationOptions, given, f"{where}: escalate_to")
    return tuple(sorted(checked.model_dump(include=set(given)).items()))


def _metric_names(where: str, metrics: object) -> tuple[str, ...]:
    """``metrics`` as a non-empty tuple of non-empty names; a mapping or set (no order of preference) raises."""
    if isinstance(metrics, str):
        metrics = (metrics,)
    if not isinstance(metrics, Sequence) or isinstance(metrics, bytes):
        raise TypeError(f"{where}: metrics must be a metric name or a list of names, got {type_name(metrics)}")
    bad = [m for m in metrics if not isinstance(m, str)]
    if bad:
        raise TypeError(f"{where}: metrics must be metric names (str), got {type_name(bad[0])} {bad[0]!r}")
    if not metrics or not all(metrics):
        raise ValueError(f"{where}: metrics must be a non-empty sequence of non-empty names, got {list(metrics)!r}")
    return tuple(metrics)


@dataclass(frozen=True)
class Verdict:
    """A rule that fired at a step: which rule, the values it saw, what it asks for, and why.

    Attributes:
        rule: the rule's name.
        action: the rule's action.
        step: the training step (verl's ``global_steps``) of the metrics that fired it.
        values: the metric values the rule saw (and ``slope`` for ``below_and_falling``).
        message: a one-line human-readable reason.
        last_good_checkpoint: filled by the integration for ``stop_checkpoint`` and ``rollback`` (a path: where the
            run may resume, or goes back to), else ``None``.
    """

    rule: str
    action: Action
    step: int
    values: dict[str, float]
    message: str
    last_good_checkpoint: str | None = None

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"verdict of rule {self.rule!r}: action must be one of {ACTIONS}, got {self.action!r}")

    @property
    def stops(self) -> bool:
        """Whether the verdict asks to stop the run."""
        return self.action in ("stop", "stop_checkpoint")

    @property
    def skips(self) -> bool:
        """Whether the verdict asks not to apply this step's actor update."""
        return self.action == "skip_update"

    @property
    def rolls_back(self) -> bool:
        """Whether the verdict asks to return to the last good checkpoint and continue."""
        return self.action == "rollback"

    @property
    def escalates(self) -> bool:
        """Whether the verdict asks to move the run to its rule's stricter rollout correction."""
        return self.action == "escalate"

    def describe(self) -> str:
        """The message, plus the checkpoint to resume from for ``stop_checkpoint``.

        Without one the text says that no checkpoint before the trip is both resumable and unflagged, not that none
        was saved: verl's rotation leaves older ``global_step_<n>/`` folders without their weights, and a checkpoint
        a rule flagged is not good (see :func:`last_good_checkpoint_step`).
        """
        if self.action == "rollback":
            return f"{self.message}; rolling back to {self.last_good_checkpoint}"
        if self.action != "stop_checkpoint":
            return self.message
        where = self.last_good_checkpoint or "none (no resumable checkpoint before the trip that no rule flagged)"
        return f"{self.message}; last good checkpoint: {where}"


class GuardTripped(RuntimeError):
    """Raised to stop a run; carries the stopping verdicts (picklable, so it crosses Ray process boundaries)."""

    def __init__(self, verdicts: Sequence[Verdict]):
        self.verdicts = tuple(verdicts)
        if not self.verdicts:
            raise ValueError("GuardTripped needs at least one verdict")
        for verdict in self.verdicts:
            if not isinstance(verdict, Verdict):
                raise TypeError(f"GuardTripped needs Verdict instances, got {type_name(verdict)}")
        step = self.verdicts[0].step
        reasons = "; ".join(f"[{v.rule}] {v.describe()}" for v in self.verdicts)
        super().__init__(f"verl-stable guard stopped the run at step {step}: {reasons}")

    def __reduce__(self):
        return (type(self), (self.verdicts,))


DEFAULT_RULES: tuple[Rule, ...] = (
    Rule(
        "entropy_collapse",
        "below_and_falling",
        ("stable/entropy/mean", "actor/entropy"),
        threshold=0.25,
        window=5,
        action="stop_checkpoint",
    ),
    Rule(
        "train_inference_kl",
        "above",
        ("stable/train_inf/kl_k3", "rollout_corr/k3_kl"),
        threshold=0.01,
        action="stop",
    ),
    Rule(
        "non_finite",
        "non_finite",
        ("actor/pg_loss", "actor/loss", "actor/grad_norm"),
        action="stop_checkpoint",
    ),
    # logged only when the replay engine replays (R2 updates, every R3 pass): other runs never see the metric
    Rule(
        "replay_coverage",
        "below",
        ("stable/routing/coverage/response_replayed",),
        threshold=0.99,
        action="warn",
        optional=True,
    ),
)
