"""The guard's ``replay_coverage`` rule: when it fires, what it ignores, and how it is configured."""

from __future__ import annotations

import math

import pytest

from verl_stable.monitor.guard import DEFAULT_RULES, Guard, GuardTripped, Rule

KEY = "stable/routing/coverage/response_replayed"


def _fired(guard: Guard, value: object, step: int = 1) -> list[tuple[str, str]]:
    return [(v.rule, v.action) for v in guard.observe(step, {KEY: value})]


def test_default_rule_warns_below_099():
    (rule,) = [r for r in DEFAULT_RULES if r.name == "replay_coverage"]
    assert (rule.condition, rule.metrics, rule.threshold, rule.action, rule.optional) == (
        "below",
        (KEY,),
        0.99,
        "warn",
        True,
    )
    guard = Guard()
    assert _fired(guard, 0.75) == [("replay_coverage", "warn")]
    verdict = guard.observe(2, {KEY: 0.98})[0]
    assert verdict.values == {KEY: 0.98} and f"{KEY}=0.98 below 0.99" in verdict.message
    assert _fired(guard, 0.99) == [] and _fired(guard, 1.0) == []
    assert guard.flagged_steps == {1, 2}


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "0.5", None])
def test_a_non_finite_or_non_numeric_coverage_fires(value):
    assert _fired(Guard(), value) == [("replay_coverage", "warn")]


def test_runs_without_replay_are_not_affected():
    guard = Guard()
    assert guard.observe(1, {"actor/pg_loss": 0.1, "stable/train_inf/kl_k3": 1e-3}) == []
    assert "replay_coverage" not in guard.missing  # optional: absent by design when nothing is replayed
    assert guard.metrics([])["stable/guard/replay_coverage"] == 0.0


def test_threshold_and_action_are_configurable():
    guard = Guard.from_config({"rules": {"replay_coverage": {"threshold": 0.5, "action": "stop"}}})
    assert _fired(guard, 0.75) == []
    with pytest.raises(GuardTripped, match=r"\[replay_coverage\].*response_replayed=0.25 below 0.5"):
        guard.check(2, {KEY: 0.25})
    stop_ckpt = Guard.from_config({"rules": {"replay_coverage": {"action": "stop_checkpoint"}}})
    assert _fired(stop_ckpt, 0.9) == [("replay_coverage", "stop_checkpoint")]
    assert _fired(Guard.from_config({"rules": {"replay_coverage": {"threshold": "1e-1"}}}), 0.09) != []


def test_the_rule_can_be_switched_off():
    for spec in (None, {"enabled": False}):
        guard = Guard.from_config({"rules": {"replay_coverage": spec}})
        assert "replay_coverage" not in [r.name for r in guard.rules] and _fired(guard, 0.0) == []


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        ({"action": "explode"}, ValueError, r"rules\.replay_coverage\.action must be one of"),
        ({"threshold": "high"}, ValueError, r"rules\.replay_coverage\.threshold must be a number, got str 'high'"),
        (
            {"threshold": math.nan},
            ValueError,
            r"rules\.replay_coverage\.threshold must be a finite number, got float nan",
        ),
        ({"threshold": [0.9]}, TypeError, r"rules\.replay_coverage\.threshold must be a number, got list"),
        ({"treshold": 0.9}, ValueError, r"rules\.replay_coverage\.treshold: unknown key \(known: action, "),
        ({"optional": "yes"}, TypeError, r"rules\.replay_coverage\.optional must be a bool"),
        ({"enabled": "false"}, TypeError, r"rules\.replay_coverage\.enabled must be a bool"),
        ("warn", TypeError, r"rules\.replay_coverage must be a mapping, got str 'warn'"),
    ],
)
def test_config_errors_name_the_rule(spec, error, match):
    with pytest.raises(error, match=match):
        Guard.from_config({"rules": {"replay_coverage": spec}})


def test_a_custom_rule_can_be_optional_too():
    guard = Guard.from_config(
        {"rules": {"prompt_cov": {"condition": "below", "metric": "stable/x", "threshold": 1, "optional": True}}}
    )
    guard.observe(1, {})
    assert "prompt_cov" not in guard.missing and "entropy_collapse" in guard.missing
    assert Rule("r", "below", "m", threshold=1.0).optional is False
