"""Guard verdicts on synthetic metric streams: healthy, slow entropy decline, sudden KL spike, NaNs."""

import math
import pickle

import pytest

from verl_stable.monitor.guard import (
    DEFAULT_RULES,
    Guard,
    GuardTripped,
    Rule,
    Verdict,
    last_good_checkpoint_step,
)


def _stream(n, entropy, kl, loss=lambda s: 0.1, grad=lambda s: 1.0):
    """Step metrics the way verl logs them (flat dict of floats), steps 1..n."""
    for step in range(1, n + 1):
        yield (
            step,
            {
                "stable/entropy/mean": entropy(step),
                "actor/entropy": entropy(step) * 1.1,
                "stable/train_inf/kl_k3": kl(step),
                "actor/pg_loss": loss(step),
                "actor/grad_norm": grad(step),
                "training/global_step": step,
            },
        )


def _run(guard, stream):
    fired = []
    for step, metrics in stream:
        fired.extend(guard.observe(step, metrics))
    return fired


def test_healthy_run_never_fires():
    # entropy noisy around 0.6, KL ~ 1e-3: nothing fires over 200 steps
    stream = _stream(200, entropy=lambda s: 0.6 + 0.05 * math.sin(s), kl=lambda s: 1e-3 * (1 + 0.5 * math.cos(s)))
    guard = Guard()
    assert _run(guard, stream) == []
    assert guard.flagged_steps == set() and guard.missing == {}


def test_low_but_flat_or_rising_entropy_does_not_fire():
    assert _run(Guard(), _stream(50, entropy=lambda s: 0.1, kl=lambda s: 1e-3)) == []
    assert _run(Guard(), _stream(20, entropy=lambda s: 0.01 * s, kl=lambda s: 1e-3)) == []
    # noise around a low level counts as falling in half the windows unless a tolerance is set
    noisy = _stream(50, entropy=lambda s: 0.1 + 0.002 * math.sin(1.7 * s), kl=lambda s: 1e-3)
    assert _run(Guard(), noisy) != []
    noisy = _stream(50, entropy=lambda s: 0.1 + 0.002 * math.sin(1.7 * s), kl=lambda s: 1e-3)
    tolerant = Guard.from_config({"rules": {"entropy_collapse": {"slope_tolerance": 0.005}}})
    assert _run(tolerant, noisy) == []


def test_entropy_rule_waits_for_a_full_window():
    fired = _run(Guard(), _stream(10, entropy=lambda s: 0.2 - 0.01 * s, kl=lambda s: 1e-3))
    assert [v.step for v in fired] == [5, 6, 7, 8, 9, 10]


def test_slow_entropy_decline_fires_once_below_threshold_with_values():
    guard = Guard()
    fired = _run(guard, _stream(100, entropy=lambda s: 1.0 - 0.01 * s, kl=lambda s: 1e-3))
    first = fired[0]
    # 1.0 - 0.01 s < 0.25  <=>  s > 75
    assert first.rule == "entropy_collapse" and first.step == 76 and first.action == "stop_checkpoint"
    assert first.values["stable/entropy/mean"] == pytest.approx(0.24)
    assert first.values["slope"] == pytest.approx(-0.01)
    assert "below 0.25 and falling" in first.message and "step 76" in first.message
    assert {v.step for v in fired} == set(range(76, 101))


def test_sudden_kl_spike_fires_at_the_spike_step():
    guard = Guard()
    fired = _run(guard, _stream(30, entropy=lambda s: 0.7, kl=lambda s: 0.05 if s == 17 else 1e-3))
    assert [(v.rule, v.step, v.action) for v in fired] == [("train_inference_kl", 17, "stop")]
    assert fired[0].values == {"stable/train_inf/kl_k3": pytest.approx(0.05)}
    with pytest.raises(GuardTripped, match="step 17.*train_inference_kl.*kl_k3=0.05 above 0.01"):
        Guard().check(17, {"stable/train_inf/kl_k3": 0.05})


def test_nan_loss_or_inf_grad_norm_fires():
    guard = Guard()
    stream = _stream(10, entropy=lambda s: 0.7, kl=lambda s: 1e-3, loss=lambda s: float("nan") if s >= 6 else 0.1)
    fired = _run(guard, stream)
    assert [v.step for v in fired] == [6, 7, 8, 9, 10] and all(v.rule == "non_finite" for v in fired)
    assert math.isnan(fired[0].values["actor/pg_loss"])
    inf = Guard().observe(3, {"actor/grad_norm": float("inf"), "actor/pg_loss": 0.2})
    assert [(v.rule, list(v.values)) for v in inf] == [("non_finite", ["actor/grad_norm"])]
    # a NaN KL fires the rule that watches it (test_guard_untrusted.py has the cases)
    assert [v.rule for v in Guard().observe(1, {"stable/train_inf/kl_k3": float("nan")})] == ["train_inference_kl"]


def test_fallback_metric_and_missing_metrics_are_reported():
    guard = Guard()
    assert guard.observe(1, {"rollout_corr/k3_kl": 0.5})[0].values == {"rollout_corr/k3_kl": 0.5}
    assert set(guard.missing) == {"entropy_collapse", "non_finite"}
    guard.observe(2, {"actor/entropy": 1.0, "actor/loss": 0.0})
    assert guard.missing == {}


def test_config_overrides_disables_and_adds_rules():
    guard = Guard.from_config(
        {
            "rules": {
                "entropy_collapse": {"threshold": 0.5, "window": 3, "action": "warn"},
                "train_inference_kl": None,
                "non_finite": {"enabled": False},
                "f5": {"condition": "above", "metric": "stable/train_inf/extreme_frac_tau5", "threshold": 0.01},
            }
        }
    )
    assert [r.name for r in guard.rules] == ["entropy_collapse", "replay_coverage", "f5"]
    assert guard.rules[0] == Rule("entropy_collapse", "below_and_falling", DEFAULT_RULES[0].metrics, 0.5, 3, "warn")
    assert guard.observe(1, {"stable/train_inf/kl_k3": 9.0, "stable/train_inf/extreme_frac_tau5": 0.02})[0].rule == "f5"
    assert Guard.from_config(None).rules == DEFAULT_RULES
    assert Guard.from_config({"use_defaults": False}).rules == ()


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"rulez": {}}, r"stable\.guard\.rulez: unknown key \(known: enable, rules, use_defaults\)"),
        (
            {"rules": {"entropy_collapse": {"treshold": 1}}},
            r"rules\.entropy_collapse\.treshold: unknown key \(known: action, ",
        ),
        ({"rules": {"entropy_collapse": {"action": "panic"}}}, "action must be one of"),
        ({"rules": {"entropy_collapse": {"window": 1}}}, "window >= 2"),
        ({"rules": {"new": {"threshold": 1.0}}}, "needs 'condition'"),
        ({"rules": {"new": {"condition": "above", "metric": "x"}}}, "finite threshold"),
        ({"rules": {"new": {"condition": "sideways", "metric": "x", "threshold": 1}}}, "condition must be"),
        ({"rules": {"entropy_collapse": {"slope_tolerance": -1}}}, "slope_tolerance"),
    ],
)
def test_bad_config_raises_clear_errors(config, match):
    with pytest.raises(ValueError, match=match):
        Guard.from_config(config)


def test_a_rule_that_is_not_a_mapping_raises_type_error():
    with pytest.raises(TypeError, match=r"stable\.guard\.rules\.new must be a mapping, got str 'above'"):
        Guard.from_config({"rules": {"new": "above"}})


def test_guard_tripped_survives_pickling_with_its_verdicts():
    verdict = Verdict("non_finite", "stop_checkpoint", 9, {"actor/grad_norm": float("inf")}, "step 9: boom", "/ck/7")
    exc = pickle.loads(pickle.dumps(GuardTripped([verdict])))
    assert isinstance(exc, GuardTripped) and exc.verdicts == (verdict,)
    assert "last good checkpoint: /ck/7" in str(exc) and "step 9" in str(exc)
    with pytest.raises(ValueError):
        GuardTripped([])


def test_describe_without_a_checkpoint_says_none_was_resumable():
    # Checkpoints may have been saved and still not be named: verl's rotation leaves older folders without weights,
    # and a checkpoint the guard flagged is not good. So "none saved" would be wrong.
    verdict = Verdict("non_finite", "stop_checkpoint", 9, {"actor/grad_norm": float("inf")}, "step 9: boom")
    assert verdict.describe() == (
        "step 9: boom; last good checkpoint: none (no resumable checkpoint before the trip that no rule flagged)"
    )
    assert Verdict("non_finite", "stop", 9, {}, "step 9: boom").describe() == "step 9: boom"


def test_last_good_checkpoint_step():
    # weights saved at c produce the rollout measured at c + 1
    assert last_good_checkpoint_step([2, 4, 6, 8], trip_step=9, flagged_steps={9}) == 6
    assert last_good_checkpoint_step([2, 4, 6, 8], trip_step=9, flagged_steps={7, 9}) == 4
    assert last_good_checkpoint_step([2, 4, 6, 8], trip_step=9, flagged_steps={5, 9}) == 6
    assert last_good_checkpoint_step([5], trip_step=6, flagged_steps={6}) is None
    assert last_good_checkpoint_step([], trip_step=6, flagged_steps=set()) is None


def test_guard_metrics_flag_the_rules_that_fired():
    guard = Guard()
    verdicts = guard.observe(1, {"stable/train_inf/kl_k3": 1.0})
    assert guard.metrics(verdicts) == {
        "stable/guard/entropy_collapse": 0.0,
        "stable/guard/train_inference_kl": 1.0,
        "stable/guard/non_finite": 0.0,
        "stable/guard/replay_coverage": 0.0,
    }
