"""The stability guard: rules evaluated on the stream of step metrics, turning them into verdicts.

A :class:`Guard` consumes one flat ``{name: float}`` dict per training step (verl's logged metrics: keys such as
``actor/entropy``, ``actor/grad_norm``, ``rollout_corr/k3_kl`` and ours under ``stable/``) and returns the
:class:`Verdict` of every rule that fired. What a verdict asks for is its rule's action:

* ``warn``: report and continue;
* ``stop``: stop the run with the verdict as the reason;
* ``stop_checkpoint``: stop and name the last good checkpoint (see :func:`last_good_checkpoint_step`).

Default rules (the seed's checklist): token entropy below 0.25 and still falling over a window of steps;
KL(mu || pi_old) above 0.01; a non-finite loss or gradient norm. Each is configurable from a plain dict, as it
comes from the recipe YAML (:meth:`Guard.from_config`). This module does not import verl.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from verl_stable.monitor.metrics import window_slope

Action = Literal["warn", "stop", "stop_checkpoint"]
Condition = Literal["above", "below", "below_and_falling", "non_finite"]
ACTIONS: tuple[str, ...] = ("warn", "stop", "stop_checkpoint")
CONDITIONS: tuple[str, ...] = ("above", "below", "below_and_falling", "non_finite")


@dataclass(frozen=True)
class Rule:
    """One guard rule.

    Attributes:
        name: identifier used in verdicts, metrics (``stable/guard/{name}``) and configuration.
        condition: ``above``: value > threshold; ``below``: value < threshold; ``below_and_falling``: value <
            threshold and the least-squares slope of the last ``window`` observed values is below
            ``-slope_tolerance`` (evaluated once ``window`` values were observed); ``non_finite``: any listed
            metric is NaN or infinite.
        metrics: metric names. For threshold conditions the first name present in a step's metrics is used
            (a preference order with fallbacks); for ``non_finite`` every present name is checked.
        threshold: the threshold (required except for ``non_finite``).
        window: number of most recent observations the slope is fitted on (``below_and_falling``; >= 2).
        action: ``warn``, ``stop`` or ``stop_checkpoint``.
        slope_tolerance: per-step decline the slope must exceed to count as falling (``below_and_falling``);
            raise it for tasks whose healthy entropy is legitimately low and noisy.
    """

    name: str
    condition: Condition
    metrics: tuple[str, ...]
    threshold: float | None = None
    window: int = 1
    action: Action = "warn"
    slope_tolerance: float = 0.0

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"rule name must be a non-empty path segment without '/', got {self.name!r}")
        if self.condition not in CONDITIONS:
            raise ValueError(f"rule {self.name!r}: condition must be one of {CONDITIONS}, got {self.condition!r}")
        if self.action not in ACTIONS:
            raise ValueError(f"rule {self.name!r}: action must be one of {ACTIONS}, got {self.action!r}")
        if isinstance(self.metrics, str) or not self.metrics or not all(isinstance(m, str) for m in self.metrics):
            raise ValueError(f"rule {self.name!r}: metrics must be a non-empty sequence of names, got {self.metrics!r}")
        if self.condition != "non_finite":
            if self.threshold is None or not math.isfinite(float(self.threshold)):
                raise ValueError(f"rule {self.name!r}: condition {self.condition!r} needs a finite threshold")
        if self.condition == "below_and_falling" and (not isinstance(self.window, int) or self.window < 2):
            raise ValueError(f"rule {self.name!r}: below_and_falling needs an integer window >= 2, got {self.window!r}")
        if not (math.isfinite(float(self.slope_tolerance)) and self.slope_tolerance >= 0):
            raise ValueError(f"rule {self.name!r}: slope_tolerance must be >= 0, got {self.slope_tolerance!r}")


@dataclass(frozen=True)
class Verdict:
    """A rule that fired at a step: which rule, the values it saw, what it asks for, and why.

    Attributes:
        rule: the rule's name.
        action: the rule's action.
        step: the training step (verl's ``global_steps``) of the metrics that fired it.
        values: the metric values the rule saw (and ``slope`` for ``below_and_falling``).
        message: a one-line human-readable reason.
        last_good_checkpoint: filled by the integration for ``stop_checkpoint`` (a path), else ``None``.
    """

    rule: str
    action: Action
    step: int
    values: dict[str, float]
    message: str
    last_good_checkpoint: str | None = None

    @property
    def stops(self) -> bool:
        """Whether the verdict asks to stop the run."""
        return self.action != "warn"

    def describe(self) -> str:
        """The message, plus the checkpoint to resume from for ``stop_checkpoint``."""
        if self.action != "stop_checkpoint":
            return self.message
        where = self.last_good_checkpoint or "none saved before the trip"
        return f"{self.message}; last good checkpoint: {where}"


class GuardTripped(RuntimeError):
    """Raised to stop a run; carries the stopping verdicts (picklable, so it crosses Ray process boundaries)."""

    def __init__(self, verdicts: Sequence[Verdict]):
        self.verdicts = tuple(verdicts)
        if not self.verdicts:
            raise ValueError("GuardTripped needs at least one verdict")
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
)

_RULE_KEYS = {"condition", "metrics", "metric", "threshold", "window", "action", "enabled", "slope_tolerance"}


def _as_float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


@dataclass
class Guard:
    """Evaluates rules on a stream of step metric dicts.

    Attributes:
        rules: the active rules.
        flagged_steps: steps at which any rule fired (warn included).
        missing: rule name -> metric names it looked for but never found (a silent rule is visible here).
    """

    rules: tuple[Rule, ...] = DEFAULT_RULES
    flagged_steps: set[int] = field(default_factory=set)
    missing: dict[str, tuple[str, ...]] = field(default_factory=dict)
    _history: dict[str, deque] = field(default_factory=dict, repr=False)
    _seen: set[str] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        self.rules = tuple(self.rules)
        names = [r.name for r in self.rules]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate rule names: {duplicates}")
        for rule in self.rules:
            self._history[rule.name] = deque(maxlen=max(rule.window, 1))

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> Guard:
        """Build a guard from a plain dict (YAML), starting from :data:`DEFAULT_RULES`.

        Shape::

            rules:
              entropy_collapse: {threshold: 0.2, window: 8, action: warn}   # override fields of a default
              train_inference_kl: {enabled: false}                           # or null: drop a default rule
              f5: {condition: above, metric: stable/train_inf/extreme_frac_tau5, threshold: 0.01}  # a new rule
            use_defaults: true    # false starts from no rule

        ``metric`` (one name) and ``metrics`` (a list) are synonyms. Unknown keys raise ``ValueError``.
        """
        config = dict(config or {})
        unknown = set(config) - {"rules", "use_defaults", "enable"}
        if unknown:
            raise ValueError(f"unknown guard config keys: {sorted(unknown)}")
        rules = {r.name: r for r in DEFAULT_RULES} if config.get("use_defaults", True) else {}
        for name, spec in dict(config.get("rules") or {}).items():
            if spec is None:
                rules.pop(name, None)
                continue
            if not isinstance(spec, Mapping):
                raise ValueError(f"guard rule {name!r} must be a mapping or null, got {spec!r}")
            spec = dict(spec)
            bad = set(spec) - _RULE_KEYS
            if bad:
                raise ValueError(f"guard rule {name!r}: unknown keys {sorted(bad)} (allowed: {sorted(_RULE_KEYS)})")
            if not spec.pop("enabled", True):
                rules.pop(name, None)
                continue
            if "metric" in spec:
                if "metrics" in spec:
                    raise ValueError(f"guard rule {name!r}: give either 'metric' or 'metrics', not both")
                spec["metrics"] = [spec.pop("metric")]
            if "metrics" in spec:
                metrics = spec["metrics"]
                spec["metrics"] = (metrics,) if isinstance(metrics, str) else tuple(metrics)
            if "threshold" in spec and spec["threshold"] is not None:
                spec["threshold"] = float(spec["threshold"])
            if name in rules:
                rules[name] = replace(rules[name], **spec)
            else:
                if "condition" not in spec or "metrics" not in spec:
                    raise ValueError(f"new guard rule {name!r} needs 'condition' and 'metric(s)'")
                rules[name] = Rule(name=name, **spec)
        return cls(rules=tuple(rules.values()))

    def observe(self, step: int, metrics: Mapping[str, Any]) -> list[Verdict]:
        """Evaluate every rule on one step's metrics and return the verdicts of the rules that fired."""
        verdicts = []
        for rule in self.rules:
            verdict = self._evaluate(rule, step, metrics)
            if verdict is not None:
                verdicts.append(verdict)
        if verdicts:
            self.flagged_steps.add(step)
        return verdicts

    def check(self, step: int, metrics: Mapping[str, Any]) -> list[Verdict]:
        """:meth:`observe`, then raise :class:`GuardTripped` with the stopping verdicts if there are any."""
        verdicts = self.observe(step, metrics)
        stopping = [v for v in verdicts if v.stops]
        if stopping:
            raise GuardTripped(stopping)
        return verdicts

    def metrics(self, verdicts: Iterable[Verdict]) -> dict[str, float]:
        """``stable/guard/{rule}`` = 1.0 for each rule that fired this step, 0.0 for the others."""
        fired = {v.rule for v in verdicts}
        return {f"stable/guard/{rule.name}": float(rule.name in fired) for rule in self.rules}

    def _evaluate(self, rule: Rule, step: int, metrics: Mapping[str, Any]) -> Verdict | None:
        present = [m for m in rule.metrics if m in metrics]
        if not present:
            if rule.name not in self._seen:
                self.missing[rule.name] = rule.metrics
            return None
        self._seen.add(rule.name)
        self.missing.pop(rule.name, None)

        if rule.condition == "non_finite":
            values = {m: _as_float(metrics[m]) for m in present}
            bad = {m: v for m, v in values.items() if v is None or not math.isfinite(v)}
            if not bad:
                return None
            names = ", ".join(f"{m}={v}" for m, v in bad.items())
            return Verdict(rule.name, rule.action, step, bad, f"step {step}: non-finite {names}")

        key = present[0]
        value = _as_float(metrics[key])
        if value is None or not math.isfinite(value):
            return None  # a non-finite value is the non_finite rule's business, not a threshold's
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

        history = self._history[rule.name]
        history.append(value)
        if len(history) < rule.window:
            return None
        slope = window_slope(list(history))
        # the floor keeps a numerically flat window (slope ~ -1e-18) from counting as falling
        if value < rule.threshold and slope is not None and slope < -max(rule.slope_tolerance, 1e-12):
            msg = (
                f"step {step}: {key}={value:.6g} below {rule.threshold:g} and falling "
                f"(slope {slope:.3g}/step over the last {len(history)} steps)"
            )
            return Verdict(rule.name, rule.action, step, {key: value, "slope": slope}, msg)
        return None


def last_good_checkpoint_step(saved_steps: Iterable[int], trip_step: int, flagged_steps: Iterable[int]) -> int | None:
    """The latest saved step whose weights the guard has evidence are healthy.

    A checkpoint saved at step ``c`` holds the weights after update ``c``. Update ``c``'s own metrics (loss,
    gradient norm) are logged at step ``c``, and the rollout those weights generate is measured at step
    ``c + 1``. So ``c`` is good when ``c + 1 < trip_step`` and neither step ``c`` nor ``c + 1`` was flagged by any
    rule (warn included). Steps before this guard started (a resumed run) count as unflagged.

    Returns:
        The largest good saved step, or ``None``.
    """
    flagged = set(flagged_steps)
    good = [c for c in saved_steps if c + 1 < trip_step and c not in flagged and c + 1 not in flagged]
    return max(good) if good else None
