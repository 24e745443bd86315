"""The guard on broken metric values and malformed configuration: it must fire or refuse, never look away."""

import math

import pytest
import torch

from verl_stable.monitor import metrics as M
from verl_stable.monitor.guard import DEFAULT_RULES, Guard, GuardTripped, Rule, Verdict, last_good_checkpoint_step

KL = "stable/train_inf/kl_k3"
ENT = "stable/entropy/mean"


@pytest.mark.parametrize("value", [math.inf, math.nan, -math.inf])
def test_non_finite_train_inference_kl_stops_the_run(value):
    with pytest.raises(GuardTripped, match=r"train_inference_kl.*kl_k3=.* not a finite number"):
        Guard().check(4, {KL: value})


def test_an_overflowing_kl_from_finite_log_probs_stops_the_run():
    # the case: logp_mu = -800, logp_old = 0 gives k3 = inf from finite inputs
    metrics = M.train_inference_metrics(torch.tensor([[-800.0]]), torch.tensor([[0.0]]), torch.ones(1, 1))
    with pytest.raises(GuardTripped) as info:
        Guard().check(3, metrics)
    (verdict,) = info.value.verdicts
    assert (verdict.rule, verdict.action, verdict.values) == ("train_inference_kl", "stop", {KL: math.inf})


def test_a_kl_too_large_for_a_float_fires_instead_of_crashing():
    (verdict,) = Guard().observe(2, {KL: 10**400})
    assert verdict.rule == "train_inference_kl" and verdict.values == {KL: math.inf}


@pytest.mark.parametrize("value", [math.nan, -math.inf, math.inf])
def test_non_finite_entropy_fires_entropy_collapse_at_once(value):
    # before the window is full and whatever the slope: a broken entropy must not disable the rule
    (verdict,) = Guard().observe(1, {ENT: value})
    assert verdict.rule == "entropy_collapse" and verdict.action == "stop_checkpoint"
    assert "not a finite number" in verdict.message


@pytest.mark.parametrize("value", ["0.3", None, [0.1, 0.2], object()])
def test_a_value_that_is_not_a_number_fires_the_rule_that_watches_it(value):
    (verdict,) = Guard().observe(1, {KL: value})
    assert verdict.rule == "train_inference_kl" and math.isnan(verdict.values[KL])
    assert "not a finite number" in verdict.message


def test_a_non_finite_value_does_not_enter_the_slope_window():
    guard = Guard()
    for step in range(1, 5):
        assert guard.observe(step, {ENT: 0.2}) == []
    assert [v.rule for v in guard.observe(5, {ENT: math.nan})] == ["entropy_collapse"]
    assert guard.observe(6, {ENT: 0.2}) == []  # the window holds 0.2 five times: flat


def test_entropy_window_is_kept_per_metric_name():
    # steps 1-4 log the monitor's entropy (token mean); step 5 only verl's actor/entropy, on another scale.
    # One window across both would read 0.2 -> 0.1 as a fall; each name has its own window.
    guard = Guard()
    for step in range(1, 5):
        assert guard.observe(step, {ENT: 0.2}) == []
    assert guard.observe(5, {"actor/entropy": 0.1}) == []


def test_entropy_slope_is_per_training_step_across_gaps():
    # 0.24 at step 1 and 0.14 at step 11: 0.01 per step, within a tolerance of 0.05 per step
    guard = Guard.from_config({"rules": {"entropy_collapse": {"window": 2, "slope_tolerance": 0.05}}})
    assert guard.observe(1, {ENT: 0.24}) == []
    assert guard.observe(11, {ENT: 0.14}) == []
    assert [v.rule for v in guard.observe(12, {ENT: 0.04})] == ["entropy_collapse"]


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (
            {"rules": {"train_inference_kl": {"enabled": "false"}}},
            r"rules\.train_inference_kl\.enabled must be a bool.*str",
        ),
        ({"use_defaults": "false"}, r"use_defaults must be a bool \(true/false\), got str 'false'"),
        ({"enable": 0}, r"enable must be a bool \(true/false\), got int 0"),
        (
            {"rules": {"f5": {"condition": "above", "metrics": {"a": 1}, "threshold": 1}}},
            r"rules\.f5\.metrics must be a list, got dict",
        ),
        (
            {"rules": {"f5": {"condition": "above", "metrics": ["a", 1], "threshold": 1}}},
            r"rules\.f5\.metrics\.1 must be a string, got int 1",
        ),
        (
            {"rules": {"train_inference_kl": {"threshold": True}}},
            r"rules\.train_inference_kl\.threshold must be a number, got bool",
        ),
        (
            {"rules": {"train_inference_kl": {"threshold": [0.1]}}},
            r"rules\.train_inference_kl\.threshold must be a number, got list",
        ),
        ({"rules": {"entropy_collapse": {"window": "5"}}}, r"rules\.entropy_collapse\.window must be an int, got str"),
        (
            {"rules": {"entropy_collapse": {"slope_tolerance": "x"}}},
            r"rules\.entropy_collapse\.slope_tolerance must be a number, got str",
        ),
        (["rules"], r"stable\.guard must be a mapping of options \(or true / false\), got list"),
        ({"rules": ["entropy_collapse"]}, r"stable\.guard\.rules must be a mapping, got list"),
        (
            {"rules": {3: {"condition": "above", "metric": "x", "threshold": 1}}},
            r"stable\.guard\.rules: a key must be a name, got 3",
        ),
    ],
)
def test_config_of_the_wrong_type_raises_type_error_naming_the_rule(config, match):
    with pytest.raises(TypeError, match=match):
        Guard.from_config(config)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (
            {"rules": {"train_inference_kl": {"threshold": "abc"}}},
            r"rules\.train_inference_kl\.threshold must be a number, got str 'abc'",
        ),
        (
            {"rules": {"train_inference_kl": {"threshold": "nan"}}},
            r"rules\.train_inference_kl\.threshold must be a finite number, got float nan",
        ),
        (
            {"rules": {"f5": {"condition": "above", "metrics": [], "threshold": 1}}},
            r"rules\.f5\.metrics must not be empty",
        ),
        (
            {"rules": {"f5": {"condition": "above", "metric": "", "threshold": 1}}},
            r"rules\.f5\.metric must not be empty",
        ),
        (
            {"rules": {"entropy_collapse": {"slope_tolerance": math.inf}}},
            r"rules\.entropy_collapse\.slope_tolerance must be a finite number",
        ),
    ],
)
def test_config_with_a_bad_value_raises_value_error_naming_the_rule(config, match):
    with pytest.raises(ValueError, match=match):
        Guard.from_config(config)


def test_numeric_strings_from_plain_yaml_are_read_as_numbers():
    # PyYAML reads `threshold: 1e-2` as the string "1e-2"
    guard = Guard.from_config({"rules": {"train_inference_kl": {"threshold": "1e-2"}}})
    assert {r.name: r.threshold for r in guard.rules}["train_inference_kl"] == 0.01


def test_disabled_guard_config_has_no_rules_and_still_validates():
    assert Guard.from_config({"enable": False}).rules == ()
    assert Guard.from_config({"enable": True}).rules == DEFAULT_RULES
    with pytest.raises(ValueError, match="action must be one of"):
        Guard.from_config({"enable": False, "rules": {"non_finite": {"action": "explode"}}})


def test_rule_built_directly_rejects_a_string_threshold_it_could_not_compare():
    with pytest.raises(TypeError, match=r"rule 'x': threshold must be a real number, got str '0.1'"):
        Rule("x", "above", ("m",), threshold="0.1")
    with pytest.raises(TypeError, match=r"rule name must be a str, got int"):
        Rule(1, "above", ("m",), threshold=0.1)
    assert Rule("x", "above", ["m"], threshold=1).metrics == ("m",)  # a list is stored as a tuple


def test_guard_and_observe_reject_malformed_arguments():
    with pytest.raises(TypeError, match=r"rules must be Rule instances, got dict"):
        Guard(rules=({"name": "x"},))
    with pytest.raises(TypeError, match=r"metrics must be a mapping of name to value, got list"):
        Guard().observe(1, [(KL, 0.1)])
    with pytest.raises(TypeError, match=r"step must be an int, got str"):
        Guard().observe("1", {KL: 0.1})
    with pytest.raises(TypeError, match=r"GuardTripped needs Verdict instances, got str"):
        GuardTripped(["boom"])
    with pytest.raises(ValueError, match=r"action must be one of .*got 'explode'"):
        Verdict("x", "explode", 1, {}, "m")
    with pytest.raises(TypeError, match=r"saved_steps must hold ints, got NoneType"):
        last_good_checkpoint_step([None], 3, set())
