"""The guard's escalate action (configured per rule, once per run, then a warning), its run state across restarts,
and the run summary's records and text."""

from __future__ import annotations

import pytest

from verl_stable.monitor import run_summary as rs
from verl_stable.monitor.guard import Guard, Rule
from verl_stable.schema import ESCALATION_KEYS, ConfigError

KL = "stable/train_inf/kl_k3"
STRICTER = {"rollout_rs": "token_k3", "rollout_rs_threshold": 0.01}


def _guard(**kw) -> Guard:
    return Guard(
        rules=(Rule("kl_high", "above", (KL,), threshold=0.01, action="escalate", escalate_to=STRICTER, **kw),)
    )


def test_the_rule_escalates_once_and_later_firings_only_warn():
    guard = _guard()
    assert guard.rules[0].escalate_to == (("rollout_rs", "token_k3"), ("rollout_rs_threshold", 0.01))
    assert guard.observe(1, {KL: 0.001}) == []
    (first,) = guard.observe(2, {KL: 0.5})
    assert (first.action, first.escalates, first.stops) == ("escalate", True, False)
    assert guard.escalations == {"kl_high": 2}
    (again,) = guard.observe(3, {KL: 0.7})
    assert (again.action, again.escalates) == ("warn", False)
    assert again.message.endswith("the run already escalated at step 2")
    assert guard.metrics([again]) == {"stable/guard/kl_high": 1.0, "stable/guard/escalations": 1.0}
    guard.rolled_back(1)  # the stricter regime holds for the redone steps too
    assert guard.escalations == {"kl_high": 2}


def test_escalate_needs_escalate_to_and_nothing_else_takes_it():
    with pytest.raises(ValueError, match="needs a non-empty escalate_to action 'escalate'"):
        Rule("r", "above", (KL,), threshold=1.0, action="escalate")
    with pytest.raises(ValueError, match="has escalate_to but action 'warn'"):
        Rule("r", "above", (KL,), threshold=1.0, action="warn", escalate_to=STRICTER)


@pytest.mark.parametrize(
    ("escalate_to", "match"),
    [
        ({"rollout_is_threshold": -1.0}, "must be > 0"),
        ({"rollout_is_batch_normalize": "true"}, "rollout_is_batch_normalize"),  # a string is never a bool
        ({"rollout_is": "tokens"}, "rollout_is"),
        ({"clip_ratio": 0.1}, "clip_ratio"),  # not a rollout-correction key: unknown
        ([("rollout_rs", "token_k3"), ("rollout_rs", "token_k2")], "names a key twice"),
    ],
)
def test_escalate_to_is_read_by_the_schema_strictly(escalate_to, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Rule("r", "above", (KL,), threshold=1.0, action="escalate", escalate_to=escalate_to)


def test_the_yaml_form_builds_the_same_rule():
    config = {"rules": {"kl_high": {"condition": "above", "metric": KL, "threshold": 0.01, "action": "escalate",
                                    "escalate_to": {"rollout_rs": "token_k3", "rollout_rs_threshold": 0.01}}}}  # fmt: skip
    rule = next(r for r in Guard.from_config(config).rules if r.name == "kl_high")
    assert rule == _guard().rules[0]
    assert set(ESCALATION_KEYS) == {
        "rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold",
    }  # fmt: skip
    bad = {"rules": {"kl_high": {**config["rules"]["kl_high"], "escalate_to": {"rollout_rs": 3}}}}
    with pytest.raises(ConfigError, match=r"stable\.guard\.rules\.kl_high\.escalate_to\.rollout_rs"):
        Guard.from_config(bad)


def test_the_run_state_survives_a_restart_and_ignores_rules_the_config_dropped():
    guard = Guard(
        rules=(
            *_guard().rules,
            Rule("norm", "above", ("actor/grad_norm",), threshold=10.0, action="rollback", max_rollbacks=2),
        )
    )
    guard.observe(2, {KL: 0.5, "actor/grad_norm": 50.0})
    state = guard.state_dict()
    assert state == {"rollbacks": {"norm": 1}, "escalations": {"kl_high": 2}}
    restarted = Guard(rules=guard.rules)
    restarted.load_state_dict({**state, "rollbacks": {**state["rollbacks"], "gone": 5}})
    assert restarted.state_dict() == state
    restarted.observe(5, {KL: 0.001, "actor/grad_norm": 50.0})
    (capped,) = restarted.observe(6, {KL: 0.001, "actor/grad_norm": 50.0})
    assert capped.action == "stop_checkpoint"  # max_rollbacks counts the rollback before the restart
    with pytest.raises(TypeError, match="must be a mapping"):
        restarted.load_state_dict({"rollbacks": [1]})
    with pytest.raises(TypeError):
        restarted.load_state_dict({"rollbacks": {"norm": "1"}})


def test_the_summary_counts_the_actions_and_shows_them_in_step_order():
    records = [
        rs.action_record(2, "kl_high", "escalate", "KL 0.5 > 0.01", "algorithm.rollout_correction: rollout_rs: None -> 'token_k3'"),
        rs.action_record(3, "kl_high", "warn", "KL 0.7 > 0.01; the run already escalated at step 2"),
        rs.action_record(3, "norm", "rollback", "norm 50 > 10", "to /ckpt/global_step_1"),
    ]  # fmt: skip
    report = rs.summary(records, last_step=6, stopped=None)
    assert report["actions"] == {"escalate": 1, "rollback": 1, "warn": 1}
    assert report["ended"] == "completed" and report["stop_reason"] is None
    text = rs.summary_text(report).splitlines()
    assert text[0] == "verl-stable run summary: completed at step 6"
    assert text[1] == "  guard actions: 1 escalate, 1 rollback, 1 warn"
    assert text[2].startswith("  step 2: [kl_high -> escalate] KL 0.5 > 0.01 (algorithm.rollout_correction:")
    assert rs.check_records(report["records"]) == records
    quiet = rs.summary_text(rs.summary([], 4, "[kl] stopped"))
    assert quiet.splitlines() == [
        "verl-stable run summary: stopped by the guard at step 4",
        "  stop: [kl] stopped",
        "  the guard took no action",
    ]
    many = rs.summary([rs.action_record(s, "w", "warn", "m") for s in range(25)], 25, None)
    assert rs.summary_text(many).splitlines()[-1] == f"  ... 5 more in {rs.SUMMARY_FILE}"
    with pytest.raises(TypeError, match="needs the keys"):
        rs.check_records([{"step": 1}])
