"""The stability guard: rules evaluated on the stream of step metrics, turning them into verdicts.

A :class:`Guard` consumes one flat ``{name: float}`` dict per training step (verl's logged metrics: keys such as
``actor/entropy``, ``actor/grad_norm``, ``rollout_corr/k3_kl`` and ours under ``stable/``) and returns the
:class:`Verdict` of every rule that fired. What a verdict asks for is its rule's action:

* ``warn``: report and continue;
* ``stop``: stop the run with the verdict as the reason;
* ``stop_checkpoint``: stop and name the last good checkpoint (see :func:`last_good_checkpoint_step`);
* ``skip_update`` (judged before the actor update): the step's update is not applied;
* ``rollback``: the run goes back to the last good checkpoint (weights, optimizer, data position) and continues from
  there, at most ``max_rollbacks`` times per rule; the trainer restores it (:mod:`verl_stable.integration.trainer`);
* ``escalate``: the run moves to a stricter rollout correction (the rule's ``escalate_to``: a lower IS threshold,
  rejection sampling on, ...) for the rest of the run, once per rule; later firings of that rule only warn. The
  trainer applies it (:mod:`verl_stable.integration.escalation`).

Default rules (the seed's checklist): token entropy below 0.25 and still falling over a window of steps;
KL(mu || pi_old) above 0.01; a non-finite loss or gradient norm; and, under routing replay (R2 / R3), a replay
coverage of trained response tokens below 0.99 (``replay_coverage``: routing that silently went missing, so
training fell back to the model's own routing on those tokens). Each is configurable from a plain dict, as it
comes from the recipe YAML (:meth:`Guard.from_config`).

A watched metric that is NaN, infinite or not a number at all fires its rule, whatever the condition: an
overflowing KL or a NaN entropy is the collapse the guard exists for, not a value to skip. Malformed rules and
configuration raise when the guard is built (``TypeError`` for a wrong type, ``ValueError`` for a wrong value, each
naming the rule), never at the first trip. This module does not import verl.
"""

from __future__ import annotations

import math
import numbers
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from verl_stable.metric_names import GUARD
from verl_stable.monitor.common import check_int, type_name
from verl_stable.monitor.guard_rules import (
    ACTIONS,
    DEFAULT_RULES,
    Action,
    Condition,
    GuardTripped,
    Phase,
    Rule,
    Verdict,
)
from verl_stable.monitor.metrics import window_slope
from verl_stable.schema import ConfigError, GuardOptions, parse

__all__ = [
    "ACTIONS",
    "DEFAULT_RULES",
    "Action",
    "Condition",
    "Guard",
    "GuardTripped",
    "Phase",
    "Rule",
    "Verdict",
    "last_good_checkpoint_step",
]


def _as_float(value: Any) -> float | None:
    """A logged metric value as a float, ``+-inf`` for an int beyond float range, ``None`` if it is no number.

    Strings are not numbers here even when they parse as one: verl logs numbers, so a string is a broken value.
    """
    if isinstance(value, (str, bytes)):
        return None
    try:
        return float(value)
    except OverflowError:  # a Python int beyond float64
        if isinstance(value, numbers.Integral):
            return math.inf if value > 0 else -math.inf
        return None
    except (TypeError, ValueError, RuntimeError):  # None, containers, tensors of several elements
        return None


@dataclass
class Guard:
    """Evaluates rules on a stream of step metric dicts.

    Attributes:
        rules: the active rules.
        flagged_steps: steps at which a rule fired (warn included) whose ``marks_checkpoints`` is set.
        missing: rule name -> metric names it looked for but never found (a silent rule is visible here; an
            ``optional`` rule is not listed).
    """

    rules: tuple[Rule, ...] = DEFAULT_RULES
    flagged_steps: set[int] = field(default_factory=set)
    missing: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # rule name -> metric name -> recent (step, value): a fallback metric (verl's actor/entropy) has its own scale
    _history: dict[str, dict[str, deque]] = field(default_factory=dict, repr=False)
    _seen: set[str] = field(default_factory=set, repr=False)
    _skips: dict[str, int] = field(default_factory=dict, repr=False)  # rule -> consecutive skip_update firings
    rollbacks: dict[str, int] = field(default_factory=dict)  # rule -> rollbacks it asked for in this run
    escalations: dict[str, int] = field(default_factory=dict)  # rule -> step at which it escalated the run

    def __post_init__(self) -> None:
        self.rules = tuple(self.rules)
        for rule in self.rules:
            if not isinstance(rule, Rule):
                raise TypeError(f"guard rules must be Rule instances, got {type_name(rule)} {rule!r}")
        names = [r.name for r in self.rules]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate rule names: {duplicates}")
        for rule in self.rules:
            self._history[rule.name] = {}

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None, key: str = "stable.guard") -> Guard:
        """Build a guard from a plain dict (YAML), starting from :data:`DEFAULT_RULES`.

        Shape::

            enable: true          # false: a guard with no rule (the rest is still validated)
            rules:
              entropy_collapse: {threshold: 0.2, window: 8, action: warn}   # override fields of a default
              train_inference_kl: {enabled: false}                           # or null: drop a default rule
              f5: {condition: above, metric: stable/train_inf/extreme_frac_tau5, threshold: 0.01}  # a new rule
            use_defaults: true    # false starts from no rule

        ``metric`` (one name) and ``metrics`` (a list) are synonyms. The shape is the schema's
        :class:`verl_stable.schema.GuardOptions` (strict: ``enable``, ``use_defaults`` and ``enabled`` must be
        booleans, the string ``"false"`` raises rather than reading as true; a numeric string threshold such as
        ``"1e-2"``, PyYAML's reading of ``1e-2``, is converted); ``false`` alone means ``{enable: false}``.

        Args:
            config: the guard's section (mapping, OmegaConf node, bool or None).
            key: the section's full name, used in messages.

        Raises:
            verl_stable.schema.ConfigError: (a ``ValueError`` and ``TypeError``) naming the key of the first
                problem: unknown keys, values of the wrong type or out of range, a new rule without condition or
                metric.
        """
        options = parse(GuardOptions, config, key)
        rules = {r.name: r for r in DEFAULT_RULES} if options.use_defaults else {}
        for name, spec in options.rules.items():
            where = f"{key}.rules.{name}"
            if spec is None or not spec.enabled:
                rules.pop(name, None)
                continue
            given = spec.model_dump(exclude_unset=True, exclude={"enabled"})
            if "metric" in given:
                if "metrics" in given:
                    raise ConfigError(f"{where}: give either 'metric' or 'metrics', not both")
                given["metrics"] = given.pop("metric")
            try:
                if name in rules:
                    rules[name] = replace(rules[name], **given)
                else:
                    if "condition" not in given or "metrics" not in given:
                        raise ValueError(f"new {where} needs 'condition' and 'metric(s)'")
                    rules[name] = Rule(name=name, **given)
            except (ValueError, TypeError) as exc:  # what depends on several fields (Rule's own checks)
                raise ConfigError(f"{where}: {exc}") from None
        return cls(rules=tuple(rules.values()) if options.enable else ())

    @property
    def skips_updates(self) -> bool:
        """Whether a rule decides before the actor update (``skip_update``)."""
        return any(rule.action == "skip_update" for rule in self.rules)

    def observe(self, step: int, metrics: Mapping[str, Any], phase: Phase = "after_update") -> list[Verdict]:
        """Evaluate the rules of ``phase`` on one step's metrics and return the verdicts of the rules that fired.

        ``before_update`` evaluates the ``skip_update`` rules (on what is known before the actor update),
        ``after_update`` every other rule, so no rule sees a step twice. A ``skip_update`` rule that fires more than
        its ``max_skips`` times in a row returns a ``stop_checkpoint`` verdict instead (escalated); a step where it
        does not fire resets its count.

        Args:
            step: the training step (an int) the metrics belong to.
            metrics: metric name -> value, as logged for that step.
            phase: ``before_update`` or ``after_update``.
        """
        if phase not in ("before_update", "after_update"):
            raise ValueError(f"phase must be 'before_update' or 'after_update', got {phase!r}")
        step = check_int("step", step)
        if not isinstance(metrics, Mapping):
            raise TypeError(f"metrics must be a mapping of name to value, got {type_name(metrics)}")
        verdicts = []
        for rule in self.rules:
            if (rule.action == "skip_update") != (phase == "before_update"):
                continue
            verdict = self._evaluate(rule, step, metrics)
            if rule.action == "skip_update":
                verdict = self._count_skip(rule, verdict)
            elif rule.action == "rollback" and verdict is not None:
                verdict = self._count_rollback(rule, verdict)
            elif rule.action == "escalate" and verdict is not None:
                verdict = self._count_escalation(rule, verdict)
            if verdict is not None:
                verdicts.append(verdict)
                if rule.marks_checkpoints:
                    self.flagged_steps.add(step)
        return verdicts

    def _count_skip(self, rule: Rule, verdict: Verdict | None) -> Verdict | None:
        if verdict is None:
            self._skips[rule.name] = 0
            return None
        count = self._skips[rule.name] = self._skips.get(rule.name, 0) + 1
        if count <= rule.max_skips:
            return verdict
        message = (
            f"{verdict.message}; {count} consecutive updates would be skipped (max_skips {rule.max_skips}): "
            "escalated to stop_checkpoint"
        )
        return Verdict(rule.name, "stop_checkpoint", verdict.step, verdict.values, message)

    def _count_rollback(self, rule: Rule, verdict: Verdict) -> Verdict:
        count = self.rollbacks[rule.name] = self.rollbacks.get(rule.name, 0) + 1
        if count <= rule.max_rollbacks:
            return verdict
        self.rollbacks[rule.name] = rule.max_rollbacks  # the escalated firing rolled nothing back
        message = (
            f"{verdict.message}; rollback {count} of max_rollbacks {rule.max_rollbacks}: escalated to stop_checkpoint"
        )
        return Verdict(rule.name, "stop_checkpoint", verdict.step, verdict.values, message)

    def _count_escalation(self, rule: Rule, verdict: Verdict) -> Verdict:
        if rule.name not in self.escalations:
            self.escalations[rule.name] = verdict.step
            return verdict
        message = f"{verdict.message}; the run already escalated at step {self.escalations[rule.name]}"
        return Verdict(rule.name, "warn", verdict.step, verdict.values, message)

    def escalate(self, verdict: Verdict, reason: str) -> Verdict:
        """``verdict`` as ``stop_checkpoint`` because its action cannot be carried out (``reason`` says why); a
        ``rollback`` that did not happen is not counted against its rule."""
        if verdict.rolls_back:
            self.rollbacks[verdict.rule] = max(0, self.rollbacks.get(verdict.rule, 0) - 1)
        message = f"{verdict.message}; {verdict.action} impossible ({reason}): escalated to stop_checkpoint"
        return Verdict(verdict.rule, "stop_checkpoint", verdict.step, verdict.values, message)

    def rolled_back(self, to_step: int) -> None:
        """Forget what the abandoned steps after ``to_step`` taught the rules: their flags, the slope windows'
        observations and the consecutive-skip counts. The steps are redone from the checkpoint of ``to_step``; a
        window that still held the fault would fire again on the first healthy step. Escalations are kept: the
        stricter regime holds for the rest of the run, redone steps included."""
        to_step = check_int("to_step", to_step)
        self.flagged_steps = {s for s in self.flagged_steps if s <= to_step}
        for windows in self._history.values():
            for history in windows.values():
                kept = [(s, v) for s, v in history if s <= to_step]
                history.clear()
                history.extend(kept)
        self._skips.clear()

    @property
    def total_rollbacks(self) -> int:
        """Rollbacks asked for in this run, all rules together."""
        return sum(self.rollbacks.values())

    def check(self, step: int, metrics: Mapping[str, Any]) -> list[Verdict]:
        """:meth:`observe`, then raise :class:`GuardTripped` with the stopping verdicts if there are any."""
        verdicts = self.observe(step, metrics)
        stopping = [v for v in verdicts if v.stops]
        if stopping:
            raise GuardTripped(stopping)
        return verdicts

    def metrics(self, verdicts: Iterable[Verdict]) -> dict[str, float]:
        """``stable/guard/{rule}`` = 1.0 for each rule that fired this step, 0.0 for the others; with a ``rollback``
        rule also ``stable/guard/rollbacks``, the run's rollbacks so far (a redone step's rows differ from the
        abandoned ones by it)."""
        fired = {v.rule for v in verdicts}
        out = {f"{GUARD}{rule.name}": float(rule.name in fired) for rule in self.rules}
        if any(rule.action == "rollback" for rule in self.rules):
            out[f"{GUARD}rollbacks"] = float(self.total_rollbacks)
        if any(rule.action == "escalate" for rule in self.rules):
            out[f"{GUARD}escalations"] = float(len(self.escalations))
        return out

    def state_dict(self) -> dict[str, dict[str, int]]:
        """What the guard must remember across a restart of the run (saved with each checkpoint): the rollbacks each
        rule asked for (so ``max_rollbacks`` holds per run, not per process) and the escalations (the stricter
        regime is re-applied on resume)."""
        return {"rollbacks": dict(self.rollbacks), "escalations": dict(self.escalations)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; a rule this guard does not have is ignored (the config changed)."""
        names = {rule.name for rule in self.rules}
        for key in ("rollbacks", "escalations"):
            entries = state.get(key, {})
            if not isinstance(entries, Mapping):
                raise TypeError(f"guard state {key!r} must be a mapping of rule to int, got {type_name(entries)}")
            kept = {str(k): check_int(f"guard state {key}[{k!r}]", v) for k, v in entries.items() if k in names}
            setattr(self, key, kept)

    def _evaluate(self, rule: Rule, step: int, metrics: Mapping[str, Any]) -> Verdict | None:
        present = [m for m in rule.metrics if m in metrics]
        if not present:
            if rule.name not in self._seen and not rule.optional:
                self.missing[rule.name] = rule.metrics
            return None
        self._seen.add(rule.name)
        self.missing.pop(rule.name, None)

        if rule.condition == "non_finite":
            values = {m: _as_float(metrics[m]) for m in present}
            bad = {m: math.nan if v is None else v for m, v in values.items() if v is None or not math.isfinite(v)}
            if not bad:
                return None
            names = ", ".join(f"{m}={metrics[m]!r}" if values[m] is None else f"{m}={values[m]}" for m in bad)
            return Verdict(rule.name, rule.action, step, bad, f"step {step}: non-finite {names}")

        key = present[0]
        value = _as_float(metrics[key])
        if value is None or not math.isfinite(value):
            # an overflowed KL or a NaN entropy is the failure itself: it fires whatever the condition
            shown = metrics[key] if value is None else value
            msg = f"step {step}: {key}={shown!r} is not a finite number"
            return Verdict(rule.name, rule.action, step, {key: math.nan if value is None else value}, msg)
        if rule.condition == "above":
            if value > rule.threshold:
                msg = f"step {step}: {key}={value:.6g} above {rule.threshold:g}"
                return Verdict(rule.name, rule.action, step, {key: value}, msg)
            return None
        if rule.condition == "below":
            if value < rule.threshold:
                msg = f"step {step}: {key}={value:.6g} below {rule.threshold:g}"
                return Verdict(rule.name, rule.action, step, {key: value}, msg)
            return None

        history = self._history[rule.name].setdefault(key, deque(maxlen=rule.window))
        history.append((step, value))
        if len(history) < rule.window:
            return None
        steps, values = zip(*history, strict=True)
        slope = window_slope(values, steps=steps)
        # the floor keeps a numerically flat window (slope ~ -1e-18) from counting as falling
        if value < rule.threshold and slope is not None and slope < -max(rule.slope_tolerance, 1e-12):
            msg = (
                f"step {step}: {key}={value:.6g} below {rule.threshold:g} and falling "
                f"(slope {slope:.3g}/step over the last {len(history)} observations, steps {steps[0]}-{steps[-1]})"
            )
            return Verdict(rule.name, rule.action, step, {key: value, "slope": slope}, msg)
        return None


def last_good_checkpoint_step(saved_steps: Iterable[int], trip_step: int, flagged_steps: Iterable[int]) -> int | None:
    """The latest saved step whose weights the guard has evidence are healthy.

    A checkpoint saved at step ``c`` holds the weights after update ``c``. Update ``c``'s own metrics (loss,
    gradient norm) are logged at step ``c``, and the rollout those weights generate is measured at step
    ``c + 1``. So ``c`` is good when ``c + 1 < trip_step`` and neither step ``c`` nor ``c + 1`` was flagged by any
    rule (warn included) that marks checkpoints (``Rule.marks_checkpoints``, the default). Steps before this guard
    started (a resumed run) count as unflagged.

    Args:
        saved_steps: steps of the checkpoints that can be resumed from; the trainer passes only those
            (:func:`verl_stable.monitor.checkpoints.resumable_checkpoint_steps`), since verl's rotation leaves an older
            ``global_step_<n>/`` without its weights.
        trip_step: the step whose verdict stops the run.
        flagged_steps: steps any rule flagged.

    Returns:
        The largest good saved step, or ``None``.
    """
    saved = list(saved_steps)
    for c in saved:
        if isinstance(c, bool) or not isinstance(c, numbers.Integral):
            raise TypeError(f"saved_steps must hold ints, got {type_name(c)} {c!r}")
    trip_step = check_int("trip_step", trip_step)
    flagged = set(flagged_steps)
    good = [c for c in saved if c + 1 < trip_step and c not in flagged and c + 1 not in flagged]
    return max(good) if good else None
