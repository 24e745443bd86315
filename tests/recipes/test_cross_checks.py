"""Cross-field rules: a setting valid on its own that cannot take effect in its run is refused before anything starts,
naming the key -- by ``recipe check``, by the preflight of ``verl-stable run``, and by verl's own ``validate_config``
in the driver (the plugin extends it), with one check per class (:mod:`verl_stable.recipes.cross_checks`).

One test per example of each class; a property test over generated rule sets x trainer modes x monitor settings x
replay settings (each configuration is either refused naming the rule's key, or every rule has a metric the
configuration logs); the catalogue itself is held against real runs' logged metrics in the end-to-end tests
(``tests/testkit/logged.py``).
"""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_stable.monitor import logged
from verl_stable.recipes import geometry
from verl_stable.recipes.compose import compose_recipe
from verl_stable.recipes.cross_checks import (
    cross_field_problems,
    monitor_problems,
    replay_problems,
    rollout_correction_problems,
    rule_metric_problems,
    rule_option_problems,
    run_shape,
)

R3 = ("fsdp", "minirl_n4_r3")
RULE = "stable.guard.rules"


def _cfg(*overrides, recipe=R3):
    return compose_recipe(*recipe, list(overrides))


def _new_rule(name, metric, **fields):
    body = ", ".join(
        f"{k}: {v}" for k, v in {"condition": "above", "metric": metric, "threshold": 0.1, **fields}.items()
    )
    return f"+{RULE}.{name}={{{body}}}"


def test_the_shipped_recipes_have_no_cross_field_problem():
    for backend in ("fsdp", "megatron"):
        for regime in ("minirl_onpolicy", "minirl_n2_r2", "minirl_n4_r3", "vespo"):
            assert cross_field_problems(compose_recipe(backend, regime, [])) == [], (backend, regime)


# --- 1. a guard that cannot act must not look like a guard ----------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "fix"),
    [
        (["trainer.v1.trainer_mode=sync"], "trainer.v1.trainer_mode=stable_sync"),
        (["trainer.v1.trainer_mode=colocate_async"], "trainer.v1.trainer_mode=stable_colocate_async"),
        (["trainer.use_v1=false"], "trainer.use_v1=true and trainer.v1.trainer_mode=stable_sync"),
    ],
)
def test_a_stable_block_on_a_trainer_without_the_monitor_is_refused_naming_the_monitored_mode(overrides, fix):
    (problem,) = monitor_problems(_cfg(*overrides))
    assert problem.startswith("stable is set") and "has no verl-stable monitor" in problem
    assert f"set {fix}" in problem


def test_verl_stable_runs_defaults_with_a_skip_update_rule_are_refused_before_anything_starts():
    """``verl-stable run`` composes verl's own trainer config (sync mode): a guard rule there was validated and then
    ignored."""
    from verl_stable.recipes import preflight
    from verl_stable.toy import launch

    base = launch.cpu_overrides(launch.asset_paths("/tmp/unused"))
    with pytest.raises(ValueError, match=r"trainer\.v1\.trainer_mode=sync has no verl-stable monitor"):
        preflight([*base, "+stable.guard.rules.train_inference_kl.action=skip_update"])
    # the monitored trainer takes it
    preflight(
        [*base, "trainer.v1.trainer_mode=stable_sync", "+stable.guard.rules.train_inference_kl.action=skip_update"]
    )


@pytest.mark.parametrize("block", ["++stable=false", "++stable.guard=false", "++stable.monitor=false"])
def test_a_block_that_only_switches_things_off_is_consistent_with_any_trainer(block):
    assert monitor_problems(_cfg("trainer.v1.trainer_mode=sync", "~stable", block.replace("++", "+"))) == []


# --- 2. a rule on a metric this configuration never logs ------------------------------------------------------------
def test_a_misspelt_stable_metric_is_refused_with_the_nearest_name():
    (problem,) = rule_metric_problems(_cfg(_new_rule("typo", "stable/train_inf/kl_k33")))
    assert problem.startswith(f"{RULE}.typo: metric 'stable/train_inf/kl_k33' is not a metric verl-stable logs")
    assert "did you mean 'stable/train_inf/kl_k3'" in problem


def test_an_extreme_fraction_for_a_tau_the_monitor_does_not_compute_is_refused_naming_the_taus():
    (problem,) = rule_metric_problems(_cfg(_new_rule("f3", "stable/train_inf/extreme_frac_tau3")))
    assert problem.startswith(f"{RULE}.f3 (action warn) can never fire")
    assert "stable.monitor.taus are [2.0, 5.0]" in problem
    assert (
        rule_metric_problems(_cfg(_new_rule("f3", "stable/train_inf/extreme_frac_tau3"), "stable.monitor.taus=[3]"))
        == []
    )


def test_a_stable_rule_with_the_monitor_off_is_refused_but_a_rule_with_a_verl_fallback_is_not():
    cfg = _cfg("stable.monitor.enable=false", _new_rule("kl", "stable/train_inf/kl_k1"))
    (problem,) = rule_metric_problems(cfg)
    assert problem.startswith(f"{RULE}.kl (action warn) can never fire") and "needs the monitor" in problem
    # the default train_inference_kl rule falls back to verl's rollout_corr/k3_kl, which verl logs without the monitor
    assert "train_inference_kl" not in problem


def test_a_routing_rule_without_replay_is_refused_and_an_optional_one_is_kept():
    rule = _new_rule("cov", "stable/routing/coverage/response_replayed", condition="below")
    (problem,) = rule_metric_problems(_cfg(rule, recipe=("fsdp", "minirl_onpolicy")))
    assert problem.startswith(f"{RULE}.cov") and "router_replay.mode=R2 or R3" in problem
    assert rule_metric_problems(_cfg(rule)) == []  # the R3 recipe logs it
    optional = _new_rule("cov", "stable/routing/coverage/response_replayed", condition="below", optional="true")
    assert rule_metric_problems(_cfg(optional, recipe=("fsdp", "minirl_onpolicy"))) == []


def test_a_verl_metric_the_catalogue_does_not_know_needs_optional():
    (problem,) = rule_metric_problems(_cfg(_new_rule("len", "response_length/p99")))
    assert "is not one verl-stable knows verl to log" in problem and f"{RULE}.len.optional=true" in problem
    assert rule_metric_problems(_cfg(_new_rule("len", "response_length/p99", optional="true"))) == []


def test_the_default_kl_rule_in_bypass_mode_is_refused_with_what_would_log_its_metrics():
    (problem,) = rule_metric_problems(_cfg("algorithm.rollout_correction.bypass_mode=true"))
    assert problem.startswith(f"{RULE}.train_inference_kl (action stop) can never fire")
    assert "bypass_mode=false" in problem and f"({RULE}.train_inference_kl=null)" in problem


# --- 3. options that do nothing, escalations that change nothing, names the counters take ---------------------------
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [f"+{RULE}.train_inference_kl.max_skips=3"],
            r"train_inference_kl\.max_skips is read only by action 'skip_update'",
        ),
        (
            [f"{RULE}.train_inference_kl.action=stop_checkpoint", f"+{RULE}.train_inference_kl.max_rollbacks=2"],
            r"max_rollbacks is read only by action 'rollback', not 'stop_checkpoint'",
        ),
        ([f"+{RULE}.train_inference_kl.window=4"], r"train_inference_kl\.window is read only by condition"),
        ([_new_rule("nf", "actor/pg_loss", condition="non_finite")], r"nf\.threshold is not read by condition"),
        ([_new_rule("rollbacks", "stable/train_inf/kl_k3")], r"'rollbacks' is the name of the guard's own counter"),
        ([_new_rule("skipped_updates", "stable/train_inf/kl_k3")], r"own counter stable/guard/skipped_updates"),
        (
            [
                _new_rule("kl2", "stable/train_inf/kl_k3", action="rollback"),
                "trainer.v1.trainer_mode=stable_colocate_async",
            ],
            r"roll back, which trainer_mode stable_colocate_async cannot",
        ),
        ([_new_rule("kl2", "stable/train_inf/kl_k3", action="rollback")], r"trainer\.save_freq=-1 saves none"),
    ],
)
def test_options_that_do_nothing_for_their_rule_are_refused(overrides, message):
    problems = rule_option_problems(_cfg(*overrides))
    assert any(re.search(message, p) for p in problems), problems


def test_an_escalation_to_what_is_already_in_force_is_refused_and_a_stricter_one_passes():
    rule = f"{RULE}.train_inference_kl"
    same = _cfg(f"{rule}.action=escalate", f"+{rule}.escalate_to.rollout_is_threshold=5.0")
    (problem,) = rule_option_problems(same)
    assert "is what algorithm.rollout_correction already has in force" in problem
    stricter = _cfg(f"{rule}.action=escalate", f"+{rule}.escalate_to.rollout_is_threshold=2.0")
    assert rule_option_problems(stricter) == []


# --- 4. settings verl judges only at step 1 -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algorithm.rollout_correction.rollout_is_threshold=nan", r"rollout_is_threshold must be a finite number > 0"),
        ("algorithm.rollout_correction.rollout_is_threshold=-1", r"rollout_is_threshold must be a finite number > 0"),
        ("algorithm.rollout_correction.rollout_is_threshold=0", r"rollout_is_threshold must be a finite number > 0"),
        ("algorithm.rollout_correction.rollout_is=tokens", r"rollout_is must be token, sequence or null, got 'tokens'"),
        (
            "algorithm.rollout_correction.rollout_rs=tokn_k3",
            r"verl's rollout correction refuses .*'rollout_rs': 'tokn_k3'",
        ),
    ],
)
def test_the_runs_own_rollout_correction_is_judged_by_verl_before_the_run(override, message):
    problems = rollout_correction_problems(_cfg(override))
    assert len(problems) == 1 and re.search(message, problems[0]), problems


def test_a_nan_threshold_is_what_verl_itself_would_take_silently():
    """The reason for the finite check: verl's own code returns NaN weights for it, without an error."""
    import torch
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    weights, _, _ = compute_rollout_correction_and_rejection_mask(
        torch.zeros(1, 3), torch.tensor([[0.0, -0.5, 0.5]]), torch.ones(1, 3), rollout_is="token",
        rollout_is_threshold=math.nan,
    )  # fmt: skip
    assert torch.isnan(weights.batch["rollout_is_weights"]).all()


# --- 5. replay without its data; 6. parallel sizes and batch sizes that do not divide --------------------------------------
@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_r3_without_the_rollouts_routing_export_is_refused(backend):
    cfg = compose_recipe(backend, "minirl_n4_r3", ["actor_rollout_ref.rollout.enable_rollout_routing_replay=false"])
    (problem,) = replay_problems(cfg)
    assert "router_replay.mode=R3 replays the rollout's routing" in problem
    assert "enable_rollout_routing_replay=false" in problem


@pytest.mark.parametrize(
    ("recipe", "message"),
    [
        (("fsdp", "minirl_n4_r3"), r"the fsdp engine measures them as part of its replay, every pass: remove it"),
        (
            ("megatron", "minirl_onpolicy"),
            r"actor_rollout_ref\.actor\.megatron\.router_replay\.mode=disabled replays nothing: remove it",
        ),
    ],
)
def test_a_replay_metrics_interval_with_no_megatron_replay_to_sample_is_refused(recipe, message):
    cfg = compose_recipe(*recipe, ["+stable.monitor.replay_metrics_interval=4"])
    (problem,) = replay_problems(cfg)
    assert problem.startswith("stable.monitor.replay_metrics_interval=4 samples") and re.search(message, problem)
    # 1 (the default: every step) is accepted anywhere; on Megatron under replay any interval takes effect
    assert replay_problems(compose_recipe(*recipe, ["+stable.monitor.replay_metrics_interval=1"])) == []
    assert (
        replay_problems(compose_recipe("megatron", "minirl_n4_r3", ["+stable.monitor.replay_metrics_interval=4"])) == []
    )


def test_a_replay_rule_on_megatron_whose_metrics_are_never_measured_is_refused():
    rule = _new_rule("cov", "stable/routing/coverage/response_replayed", condition="below")
    megatron = ("megatron", "minirl_n4_r3")
    assert rule_metric_problems(_cfg(rule, "+stable.monitor.replay_metrics_interval=3", recipe=megatron)) == []
    (problem,) = rule_metric_problems(_cfg(rule, "+stable.monitor.replay_metrics_interval=0", recipe=megatron))
    assert problem.startswith(f"{RULE}.cov") and "replay_metrics_interval > 0" in problem
    shape = run_shape(_cfg("+stable.monitor.replay_metrics_interval=0", recipe=megatron))
    assert shape.replays and not shape.replay_measured
    # the run's own metrics: none of the actor's replay families is predicted any more
    assert not logged.logged_by("stable/routing/disagreement", shape)
    assert logged.logged_by("stable/routing/disagreement", run_shape(_cfg(recipe=megatron)))


def test_r2_in_bypass_mode_is_refused():
    cfg = compose_recipe("fsdp", "minirl_n2_r2", ["algorithm.rollout_correction.bypass_mode=true"])
    assert any("R2 records routing in the pi_old pass" in p for p in replay_problems(cfg))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["actor_rollout_ref.actor.megatron.expert_model_parallel_size=3"], r"expert \(3\) x expert-tensor \(1\)"),
        (
            ["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
             "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=4"],
            r"expert \(2\) x expert-tensor \(1\) x pipeline \(4\) parallel = 8 ranks do not divide the world of 4",
        ),
        (["trainer.n_gpus_per_node=6", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4"], r"tensor \(4\)"),
    ],
)  # fmt: skip
def test_megatron_parallel_sizes_that_do_not_divide_the_world_are_refused(overrides, message):
    problems = geometry.layout_problems(compose_recipe("megatron", "minirl_n4_r3", overrides))
    assert any(re.search(message, p) for p in problems), problems


def test_megatron_layouts_that_divide_the_world_pass():
    ok = ["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
          "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"]  # fmt: skip
    assert geometry.layout_problems(compose_recipe("megatron", "minirl_n4_r3", ok)) == []


# --- the runtime: verl's own validate_config in the driver ----------------------------------------------------------
def test_verls_validate_config_refuses_what_preflight_refuses():
    """What ``python -m verl.trainer.main_ppo`` calls first, before ``ray.init``: the plugin extends it."""
    import verl.utils.config as verl_config
    from verl.trainer.ppo.utils import need_critic, need_reference_policy

    from verl_stable.integration import driver_checks

    driver_checks.register()
    cfg = _cfg("trainer.v1.trainer_mode=sync")
    with pytest.raises(driver_checks.VerlStableConfigError, match="has no verl-stable monitor"):
        verl_config.validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))


def test_the_monitored_trainer_refuses_at_construction():
    from verl.trainer.ppo.v1.trainer_base import get_trainer_cls  # noqa: F401 - verl's registry

    from verl_stable.integration import trainer as T

    T.register()
    cls = T.stable_trainer_classes()["stable_sync"]
    with pytest.raises(ValueError, match=r"train_inference_kl \(action stop\) can never fire"):
        cls(_cfg("algorithm.rollout_correction.bypass_mode=true"))


# --- property: refused naming the key, or every rule can fire -------------------------------------------------------
POOL = [
    "stable/train_inf/kl_k3",
    "stable/train_inf/kl_k33",
    "stable/train_inf/extreme_frac_tau2",
    "stable/train_inf/extreme_frac_tau3",
    "stable/train_inf/frac_truncated",
    "stable/is/ess",
    "stable/entropy/mean",
    "stable/entropy/slope",
    "stable/routing/coverage/response_replayed",
    "stable/routing/router_disagreement",
    "stable/routing/r2_drift",
    "stable/routing/load/max_over_mean",
    "stable/staleness/kl_k3",
    "stable/staleness/update_1/kl_k3",
    "stable/routing/transport/skipped_samples",
    "actor/entropy",
    "actor/pg_loss",
    "rollout_corr/k3_kl",
    "response_length/mean",
    "stable/valid_token",
]
MODES = ["stable_sync", "stable_colocate_async", "sync", "v0"]

configs = st.fixed_dictionaries(
    {
        "mode": st.sampled_from(MODES),
        "monitor": st.booleans(),
        "taus": st.sampled_from(["[2, 5]", "[3]", "[2]"]),
        "replay": st.sampled_from(["disabled", "R2", "R3"]),
        "export": st.booleans(),
        "bypass": st.booleans(),
        "rules": st.lists(
            st.tuples(st.lists(st.sampled_from(POOL), min_size=1, max_size=2, unique=True), st.booleans()),
            max_size=3,
        ),
    }
)


def _overrides(c):
    ov = [f"stable.monitor.enable={str(c['monitor']).lower()}", f"stable.monitor.taus={c['taus']}"]
    ov.append("trainer.use_v1=false" if c["mode"] == "v0" else f"trainer.v1.trainer_mode={c['mode']}")
    ov += [
        f"actor_rollout_ref.actor.fsdp_config.router_replay.mode={c['replay']}",
        f"actor_rollout_ref.rollout.enable_rollout_routing_replay={str(c['export']).lower()}",
        f"algorithm.rollout_correction.bypass_mode={str(c['bypass']).lower()}",
    ]
    for i, (metrics, optional) in enumerate(c["rules"]):
        ov.append(
            _new_rule(f"r{i}", "[" + ", ".join(metrics) + "]", optional=str(optional).lower()).replace(
                "metric:", "metrics:"
            )
        )
    return ov


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs)
def test_every_configuration_is_refused_naming_the_key_or_every_rule_can_fire(c):
    cfg = _cfg(*_overrides(c))
    problems = cross_field_problems(cfg)
    shape = run_shape(cfg)
    refused_rules = {name for name, _ in shape.rules if any(p.startswith(f"{RULE}.{name}") for p in problems)}
    if not shape.monitored:
        assert any("has no verl-stable monitor" in p for p in problems)
        return
    for i, (metrics, optional) in enumerate(c["rules"]):
        name = f"r{i}"
        if name in refused_rules:
            continue
        unknown = [m for m in metrics if not logged.known(m)]
        assert not [m for m in unknown if m.startswith("stable/")], (name, metrics, problems)
        if not optional:
            # accepted and not optional: the configuration logs one of its metrics
            assert any(logged.logged_by(m, shape) for m in metrics), (name, metrics, problems)
    for p in problems:  # every refusal names a key
        assert p.startswith(("stable", "actor_rollout_ref", "algorithm", f"{RULE}")), p


def test_the_catalogues_staleness_names_are_the_losses():
    from verl_stable.monitor.staleness import STALENESS_NAMES

    assert logged.STALENESS == STALENESS_NAMES


# --- 6. the batch geometry: the first update's assertion, before the run ------------------------------------------
def test_the_issues_megatron_layout_with_the_recipes_micro_batches_is_refused_naming_the_keys():
    """EP 2 x PP 2 on four ranks with the recipe's fixed micro-batches of 16: verl asserts at the first update."""
    layout = [
        "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
        "actor_rollout_ref.actor.use_dynamic_bsz=false",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.rollout.n=4",
    ]
    cfg = compose_recipe(
        "megatron", "minirl_n4_r3", [*layout, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16"]
    )
    (problem,) = [p for p in geometry.batch_problems(cfg) if "update mini-batch" in p]
    assert "4 samples of an update mini-batch" in problem and "over 2 ranks" in problem  # dp = 4 / (PP 2)
    assert "ppo_micro_batch_size_per_gpu=16" in problem and "ppo_mini_batch_size=2" in problem
    ok = compose_recipe(
        "megatron",
        "minirl_n4_r3",
        [
            *layout,
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        ],
    )
    assert geometry.batch_problems(ok) == []


def test_a_mini_batch_that_does_not_split_over_the_ranks_is_refused_and_dynamic_batches_are_not_judged():
    fixed = [
        "actor_rollout_ref.actor.use_dynamic_bsz=false",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false",
    ]
    geometry_ = ["trainer.n_gpus_per_node=3", "data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                 "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1"]  # fmt: skip
    (problem,) = geometry.batch_problems(_cfg(*fixed, *geometry_))
    assert (
        "an update mini-batch of 2 samples" in problem and "does not split over the actor's 3 data-parallel" in problem
    )
    assert geometry.batch_problems(_cfg(*geometry_)) == []  # the recipe's dynamic batch sizes: verl packs by tokens


def test_the_old_log_prob_pass_share_counts_verls_padding():
    """verl pads the step to lcm(dp, mini x n): 2 prompts x 4 = 8 samples on 2 ranks with mini-batches of 8 -> 4 a rank;
    log-prob micro-batches of 3 do not split 4."""
    fixed = ["actor_rollout_ref.actor.use_dynamic_bsz=false", "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false",
             "trainer.n_gpus_per_node=2", "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
             "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]  # fmt: skip
    (problem,) = geometry.batch_problems(_cfg(*fixed, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3"))
    assert "4 samples of the old-log-prob pass" in problem and "log_prob_micro_batch_size_per_gpu=3" in problem
    assert geometry.batch_problems(_cfg(*fixed, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2")) == []


def test_the_cpu_runtime_refuses_megatron_layouts_it_cannot_run_exactly():
    cpu = ["trainer.device=cpu", "trainer.n_gpus_per_node=2"]
    r2_tp2 = compose_recipe(
        "megatron", "minirl_n2_r2", [*cpu, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"]
    )
    # R2's pad rows make the expert-tensor ranks' token counts uneven: the runtime's even collectives take them
    assert geometry.layout_problems(r2_tp2) == []
    etp = compose_recipe(
        "megatron",
        "minirl_n4_r3",
        [
            *cpu,
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1",
        ],
    )
    assert any("expert_tensor_parallel_size=1 differs from tensor_model_parallel_size=2" in p
               for p in geometry.layout_problems(etp))  # fmt: skip
