"""The guard's skip_update action: judged before the actor update, capped, escalated; and through the step monitor."""

from __future__ import annotations

import pytest

from verl_stable.monitor.guard import Guard, Rule
from verl_stable.monitor.step import StableConfig, StepMonitor
from verl_stable.schema import ConfigError

KL = "stable/train_inf/kl_k3"


def _skip_rule(**kw):
    return Rule("kl_skip", "above", (KL,), threshold=0.1, action="skip_update", **kw)


def test_skip_rules_are_judged_only_before_the_update_and_the_others_only_after():
    guard = Guard(rules=(_skip_rule(), Rule("kl_warn", "above", (KL,), threshold=0.1, action="warn")))
    metrics = {KL: 0.5}
    before = guard.observe(1, metrics, phase="before_update")
    after = guard.observe(1, metrics)
    assert [(v.rule, v.action, v.skips, v.stops) for v in before] == [("kl_skip", "skip_update", True, False)]
    assert [(v.rule, v.action) for v in after] == [("kl_warn", "warn")]
    assert guard.skips_updates and not Guard(rules=(Rule("w", "above", (KL,), threshold=1.0),)).skips_updates


def test_consecutive_skips_beyond_the_cap_escalate_and_a_quiet_step_resets_the_count():
    guard = Guard(rules=(_skip_rule(max_skips=2),))
    kl = {1: 0.5, 2: 0.5, 3: 0.0, 4: 0.5, 5: 0.5, 6: 0.5}
    actions = {}
    for step, value in kl.items():
        verdicts = guard.observe(step, {KL: value}, phase="before_update")
        actions[step] = [v.action for v in verdicts]
    assert actions == {
        1: ["skip_update"],
        2: ["skip_update"],
        3: [],  # reset
        4: ["skip_update"],
        5: ["skip_update"],
        6: ["stop_checkpoint"],  # the third in a row, cap 2
    }
    (escalated,) = guard.observe(7, {KL: 0.5}, phase="before_update")
    assert (
        escalated.stops and "escalated to stop_checkpoint" in escalated.message and "max_skips 2" in escalated.message
    )


def test_a_skip_rule_must_watch_metrics_known_before_the_update():
    with pytest.raises(ValueError, match="skip_update decides before the actor update.*actor/grad_norm"):
        Rule("late", "non_finite", ("actor/grad_norm",), action="skip_update")
    Rule("ok", "above", ("rollout_corr/k3_kl", "stable/routing/rollout_vs_train/layer_max"), 0.1, action="skip_update")
    with pytest.raises(ValueError, match="max_skips"):
        _skip_rule(max_skips=0)
    with pytest.raises(TypeError, match="max_skips"):
        _skip_rule(max_skips=1.5)


def test_config_reads_skip_update_and_max_skips_strictly():
    rules = {"train_inference_kl": {"action": "skip_update", "max_skips": 4}}
    guard = Guard.from_config({"rules": rules})
    (rule,) = [r for r in guard.rules if r.name == "train_inference_kl"]
    assert (rule.action, rule.max_skips) == ("skip_update", 4)
    with pytest.raises(ConfigError, match="max_skips"):
        Guard.from_config({"rules": {"train_inference_kl": {"action": "skip_update", "max_skips": "4"}}})
    with pytest.raises(ConfigError, match=r"stable.guard.rules.non_finite.*skip_update decides before"):
        Guard.from_config({"rules": {"non_finite": {"action": "skip_update"}}})


def test_step_monitor_logs_the_skips_of_the_step_with_its_other_verdicts():
    config = StableConfig.from_dict(
        {
            "monitor": False,
            "guard": {
                "use_defaults": False,
                "rules": {
                    "kl_skip": {"condition": "above", "metric": KL, "threshold": 0.1, "action": "skip_update"},
                    "kl_warn": {"condition": "above", "metric": KL, "threshold": 0.1, "action": "warn"},
                },
            },
        }
    )
    monitor = StepMonitor(config)
    assert monitor.skips_updates
    assert [v.action for v in monitor.before_update(1, None, {KL: 0.5})] == ["skip_update"]
    metrics = {KL: 0.5}
    verdicts = monitor.step(1, None, metrics)
    assert sorted(v.rule for v in verdicts) == ["kl_skip", "kl_warn"]
    assert metrics["stable/guard/skipped_updates"] == 1.0
    assert metrics["stable/guard/kl_skip"] == 1.0 and metrics["stable/guard/kl_warn"] == 1.0
    # the next step: nothing pending, nothing skipped
    assert monitor.before_update(2, None, {KL: 0.0}) == []
    metrics = {KL: 0.0}
    assert monitor.step(2, None, metrics) == []
    assert metrics["stable/guard/skipped_updates"] == 0.0 and metrics["stable/guard/kl_skip"] == 0.0


def test_without_skip_rules_nothing_is_judged_before_the_update():
    monitor = StepMonitor(StableConfig.from_dict({}))
    assert not monitor.skips_updates
    assert monitor.before_update(1, None, {KL: 99.0}) == []
    metrics = {KL: 0.0}
    monitor.step(1, None, metrics)
    assert "stable/guard/skipped_updates" not in metrics
