"""The guard's rollback action: configured per rule, capped per run, escalated; forgetting the abandoned steps."""

from __future__ import annotations

import pytest

from verl_stable.monitor.guard import Guard, Rule, Verdict, last_good_checkpoint_step
from verl_stable.monitor.step import StableConfig, StepMonitor
from verl_stable.schema import ConfigError

NORM = "actor/grad_norm"
ENTROPY = "stable/entropy/mean"


def _rollback_rule(**kw):
    return Rule("norm_spike", "above", (NORM,), threshold=10.0, action="rollback", **kw)


def test_rollbacks_beyond_the_cap_escalate_to_stop_checkpoint_and_are_counted_per_run():
    guard = Guard(rules=(_rollback_rule(max_rollbacks=2),))
    seen = []
    for step in (3, 4, 5):  # three firings, quiet steps in between do not reset a per-run cap
        guard.observe(step - 1, {NORM: 1.0})
        seen.append([(v.action, v.rolls_back, v.stops) for v in guard.observe(step, {NORM: 50.0})])
    assert seen == [
        [("rollback", True, False)],
        [("rollback", True, False)],
        [("stop_checkpoint", False, True)],
    ]
    assert guard.rollbacks == {"norm_spike": 2} and guard.total_rollbacks == 2
    assert guard.metrics([])["stable/guard/rollbacks"] == 2.0


def test_an_impossible_rollback_escalates_and_is_not_counted():
    guard = Guard(rules=(_rollback_rule(),))
    (verdict,) = guard.observe(1, {NORM: 50.0})
    stop = guard.escalate(verdict, "no resumable checkpoint")
    assert (stop.action, stop.step, stop.values) == ("stop_checkpoint", 1, {NORM: 50.0})
    assert "rollback impossible (no resumable checkpoint): escalated to stop_checkpoint" in stop.message
    assert guard.total_rollbacks == 0


def test_rolled_back_forgets_the_flags_and_window_observations_of_the_abandoned_steps():
    falling = Rule("collapse", "below_and_falling", (ENTROPY,), threshold=1.0, window=3, action="rollback")
    guard = Guard(rules=(falling,))
    for step, value in ((1, 0.9), (2, 0.8), (3, 0.5)):
        verdicts = guard.observe(step, {ENTROPY: value})
    assert [v.rule for v in verdicts] == ["collapse"] and guard.flagged_steps == {3}
    guard.rolled_back(1)
    assert guard.flagged_steps == set()
    # the window holds only step 1 again: a healthy redone step 2 cannot fire on the abandoned steps' slope
    assert guard.observe(2, {ENTROPY: 0.92}) == []
    assert guard.observe(3, {ENTROPY: 0.95}) == []  # 0.9, 0.92, 0.95: rising, quiet


def test_the_rollback_target_is_the_last_checkpoint_the_fault_cannot_have_touched():
    # a spike in the update of step 3 is first seen at step 4: checkpoint 3 holds it, 2 is good
    assert last_good_checkpoint_step([1, 2, 3], trip_step=4, flagged_steps={4}) == 2


def test_rollback_is_a_configurable_action_with_a_strict_cap():
    config = StableConfig.from_trainer_config(
        {
            "stable": {
                "guard": {
                    "rules": {
                        "norm": {
                            "condition": "above",
                            "metric": NORM,
                            "threshold": 5.0,
                            "action": "rollback",
                            "max_rollbacks": 1,
                        }
                    }
                }
            }
        }
    )
    monitor = StepMonitor(config)
    rule = next(r for r in monitor.guard.rules if r.name == "norm")
    assert (rule.action, rule.max_rollbacks) == ("rollback", 1)
    for bad in ("1", 0, True):
        with pytest.raises(ConfigError, match="max_rollbacks"):
            StableConfig.from_trainer_config(
                {"stable": {"guard": {"rules": {"train_inference_kl": {"action": "rollback", "max_rollbacks": bad}}}}}
            )


def test_the_monitor_forgets_the_abandoned_entropy_window_on_rollback():
    monitor = StepMonitor(StableConfig.from_trainer_config({"stable": {"monitor": {"entropy_window": 3}}}))
    monitor._entropy.extend([(1, 1.0), (2, 0.9), (3, 0.1)])
    monitor.rolled_back(1)
    assert list(monitor._entropy) == [(1, 1.0)]


def test_rollback_verdicts_describe_where_they_go():
    verdict = Verdict("norm_spike", "rollback", 4, {NORM: 50.0}, "step 4: spike", "/ckpt/global_step_2")
    assert verdict.describe() == "step 4: spike; rolling back to /ckpt/global_step_2"


def test_in_verls_bypass_mode_no_train_inference_metric_pretends_there_is_no_mismatch():
    """Bypass mode copies the rollout's log-probs into old_log_probs: KL(mu || pi_old) would be 0 by construction."""
    import torch

    from verl_stable.monitor.step import MonitorBatch

    logp = torch.log(torch.tensor([[0.5, 0.25, 0.125]]))
    tokens = {"old_log_probs": logp, "rollout_log_probs": logp.clone(), "response_mask": torch.ones(1, 3)}
    config = StableConfig.from_trainer_config({})
    measured = StepMonitor(config).batch_metrics(MonitorBatch(tokens))
    assert measured["stable/train_inf/kl_k3"] == 0.0  # decoupled mode: a real measurement that happens to be 0
    bypass = StepMonitor(config, pi_old_is_rollout=True)
    metrics = bypass.batch_metrics(MonitorBatch(tokens))
    assert not [k for k in metrics if k.startswith("stable/train_inf/")], sorted(metrics)
    assert "bypass" in bypass._warned


@pytest.mark.parametrize(("marks", "good"), [(True, None), (False, 1)])
def test_an_alarm_that_does_not_mark_checkpoints_leaves_the_one_before_it_good(marks, good):
    """The lab's stability runs, seed 2: the train-inference alarm (warn) at step 2, the entropy blow-up at step 3.

    Checkpoint 1 (update 1, its rollout measured at step 2) is good only if the alarm at step 2 is not about the
    weights; checkpoint 2 is never good (its rollout is the one that tripped)."""
    kl = Rule("train_inference_kl", "above", ("stable/train_inf/kl_k3",), threshold=0.01, marks_checkpoints=marks)
    blowup = Rule("entropy_blowup", "above", (ENTROPY,), threshold=4.0, action="rollback")
    guard = Guard(rules=(kl, blowup))
    assert guard.observe(1, {"stable/train_inf/kl_k3": 0.001, ENTROPY: 1.6}) == []
    assert [v.rule for v in guard.observe(2, {"stable/train_inf/kl_k3": 0.05, ENTROPY: 3.2})] == ["train_inference_kl"]
    assert [v.rule for v in guard.observe(3, {"stable/train_inf/kl_k3": 0.02, ENTROPY: 6.9})] == [
        "train_inference_kl",
        "entropy_blowup",
    ]
    assert guard.flagged_steps == ({2, 3} if marks else {3})
    assert last_good_checkpoint_step([1, 2, 3], trip_step=3, flagged_steps=guard.flagged_steps) == good


def test_marks_checkpoints_is_read_as_a_strict_bool():
    guard = Guard.from_config({"rules": {"train_inference_kl": {"marks_checkpoints": False}}})
    rule = next(r for r in guard.rules if r.name == "train_inference_kl")
    assert rule.marks_checkpoints is False and rule.action == "stop"  # only the key given changes
    assert all(r.marks_checkpoints for r in guard.rules if r.name != "train_inference_kl")
    with pytest.raises(ConfigError, match="marks_checkpoints"):
        Guard.from_config({"rules": {"train_inference_kl": {"marks_checkpoints": "false"}}})
    with pytest.raises(TypeError, match="marks_checkpoints"):
        Rule("x", "above", ("m",), threshold=1.0, marks_checkpoints=1)
