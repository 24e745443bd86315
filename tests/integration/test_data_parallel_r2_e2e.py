"""R2 at N = 2 on two actor ranks against one: the shipped ``minirl_n2_r2`` recipe through verl's ``main_ppo`` on the CPU
runtime, two update mini-steps per step, ``balance_batch`` and dynamic batch sizes on (several micro-batches per
mini-step and rank), two rollout replicas at dp = 2.

Two verl runs (dp = 1 and dp = 2) shared by the assertions. Rollouts are seeded per sample
(``transport/seeding.py``, through the plugin's agent-loop manager), so both runs sample the same tokens.
R2 records pi_old's routing in ``compute_log_prob`` on whichever rank holds a sample; the routing travels with the
sample through TransferQueue and verl's re-split into mini-batches, and both mini-steps replay it.

What can be compared between the two runs, and what cannot. Per mini-step verl logs (and the plugin's monitor splits
into ``stable/<group>/update_<i>/<name>``) quantities of the *mini-batch*: verl hands each dp rank a balanced shard of
the batch and every rank cuts its own shard into mini-batches (``TrainingWorker.train_mini_batch``), so mini-step i
holds different samples at dp = 1 and dp = 2 and its ``pg_loss`` legitimately differs; ``actor/pg_loss`` is the mean
over the two mini-steps, the second taken after an update on a different mini-batch. The per-mini-step checks are
therefore made within each run, on quantities that must hold whatever the split: every rank and micro-batch used the
recorded experts (``update_<i>/disagreement`` is the mean of non-negative per-micro-batch fractions), the live router
at mini-step 0 chose exactly them (``update_0/r2_drift``, same weights as pi_old) and pi_theta equals pi_old there
(``update_0`` staleness). Across runs the comparison is of what is split-independent: the samples, the old
log-probs and entropy over the whole batch, the expert loads of the recorded pi_old routing over the whole batch,
and the replay coverage row counts summed over mini-steps, micro-batches and ranks.
"""

from __future__ import annotations

import math

import pytest
from testkit.ray_logs import actors

RUNS = (1, 2)
MAX_TOKENS = 40  # ppo_max_token_len_per_gpu (and the log-prob pass's): sequences are up to 20 tokens


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from verl_stable import recipes
    from verl_stable.toy import launch
    from verl_stable.toy.assets import AssetSpec, ensure_assets
    from verl_stable.transport.options import MANAGER_FQN

    tmp = tmp_path_factory.mktemp("dp_r2")
    assets = ensure_assets(tmp / "assets", AssetSpec(task="copy"))
    path = recipes.recipe_path("fsdp", "minirl_n2_r2")
    out = {}
    for dp in RUNS:
        overrides = launch.regime_overrides("minirl_n2_r2", assets, steps=2)
        overrides += [
            f"trainer.default_local_dir={tmp / f'ckpt{dp}'}",
            'trainer.logger=["file"]',
            f"trainer.n_gpus_per_node={dp}",
            f"ray_kwargs.ray_init.num_gpus={dp}",  # one fake GPU per actor rank and rollout replica
            f"+actor_rollout_ref.rollout.agent.agent_loop_manager_class={MANAGER_FQN}",  # seeded samples
            "trainer.balance_batch=True",
            "actor_rollout_ref.actor.use_dynamic_bsz=True",
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={MAX_TOKENS}",
            f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={MAX_TOKENS}",
        ]
        args = [f"--config-path={path.parent}", f"--config-name={path.stem}", *overrides]
        proc = launch.run_main_ppo(args, tmp / f"dp{dp}", timeout_s=1500)
        log = (tmp / f"dp{dp}" / "main_ppo.log").read_text(errors="ignore")
        assert proc.returncode == 0, log[-4000:]
        out[dp] = (launch.read_metrics(tmp / f"dp{dp}" / "metrics.jsonl"), log)
    return out


@pytest.mark.e2e
def test_the_runs_have_the_shape_asked_for(runs):
    assert len(actors(runs[2][1], "WorkerDict")) == 2 and len(actors(runs[2][1], "HFRolloutServer")) == 2
    assert len(actors(runs[1][1], "HFRolloutServer")) == 1
    for dp in RUNS:
        rows = runs[dp][0]
        assert [r["step"] for r in rows] == [1, 2]
        for row in rows:
            # every rank holds more than two token budgets per step: at least one of its two mini-batches is cut
            # into several micro-batches (the log-prob pass, which takes the whole shard, into three or more)
            assert row["global_seqlen/min"] > 2 * MAX_TOKENS
            # N = 2 update mini-steps per step, no third
            assert "stable/routing/update_1/r2_drift" in row and "stable/routing/update_2/r2_drift" not in row
            assert row["stable/routing/coverage/response_rows"] > 0


@pytest.mark.e2e
@pytest.mark.parametrize("dp", RUNS)
def test_every_rank_and_micro_batch_replays_pi_olds_routing_in_both_mini_steps(runs, dp):
    for row in runs[dp][0]:
        for i in (0, 1):
            # the mean over ranks and micro-batches of fractions >= 0: zero only if each one is
            assert row[f"stable/routing/update_{i}/disagreement"] == 0.0, (dp, row["step"], i)
        # mini-step 0 runs on pi_old's weights: the live router picks exactly the recorded experts on every rank
        # (routing detached from its sample by the dp split or the mini-batch re-split would show here) ...
        assert row["stable/routing/update_0/r2_drift"] == 0.0
        assert row["stable/routing/update_0/router_disagreement"] == 0.0
        # ... and the replayed forward reproduces pi_old's log-probs
        assert row["stable/staleness/update_0/ratio_dev_max"] < 1e-4
        assert row["stable/staleness/update_0/frac_outside_trust_region"] == 0.0
        # mini-step 1 runs after one optimizer step: the policy moved, R2 still replays pi_old's experts
        assert row["stable/staleness/update_1/ratio_dev_max"] > 10 * row["stable/staleness/update_0/ratio_dev_max"]
        assert 0.0 <= row["stable/routing/update_1/r2_drift"] <= 1.0
        assert row["stable/routing/missing_rows"] == 0.0  # compute_log_prob recorded every token of every sample
        # coverage, summed over both mini-steps, all micro-batches and ranks: every needed row replayed
        assert row["stable/routing/coverage/response_replayed"] == 1.0
        assert row["stable/routing/coverage/prompt_replayed"] == 1.0
        assert row["stable/routing/coverage/padding_rows"] >= 0.0


@pytest.mark.e2e
def test_two_ranks_cover_the_same_rows_as_one(runs):
    one, two = runs[1][0], runs[2][0]
    for row1, row2 in zip(one, two, strict=True):
        # the same needed rows in total, each mini-step's batch split over two ranks: none lost, none counted twice
        for key in ("response_rows", "response_replayed_rows", "prompt_rows", "prompt_replayed_rows"):
            assert row2[f"stable/routing/coverage/{key}"] == row1[f"stable/routing/coverage/{key}"] > 0, key


@pytest.mark.e2e
def test_two_ranks_sample_and_record_what_one_rank_does(runs):
    one, two = runs[1][0], runs[2][0]
    for row1, row2 in zip(one, two, strict=True):  # the same tokens, whichever replica sampled them
        for key in ("critic/score/mean", "response_length/mean", "critic/advantages/mean", "stable/valid_tokens"):
            assert row2[key] == pytest.approx(row1[key], abs=1e-7), key
    first1, first2 = one[0], two[0]
    # step 1, pi_old over the whole batch (same weights in both runs): old log-probs, their entropy, the mismatch
    # against the rollout's log-probs, all computed under dynamic micro-batches of different shapes
    for key in ("rollout_corr/training_log_ppl", "stable/entropy/mean", "stable/train_inf/kl_k3"):
        assert first2[key] == pytest.approx(first1[key], rel=1e-5, abs=1e-6), key
    # the routing compute_log_prob recorded (the monitor reads it back from TransferQueue): the same expert loads
    # over the whole batch, in every MoE layer, whichever rank recorded a sample
    loads = sorted(k for k in first1 if k.startswith("stable/routing/load/"))
    assert any("/layer_" in k for k in loads), sorted(k for k in first1 if k.startswith("stable/routing/"))
    assert loads == sorted(k for k in first2 if k.startswith("stable/routing/load/"))
    for key in loads:
        assert first2[key] == pytest.approx(first1[key], abs=1e-9), key


@pytest.mark.e2e
@pytest.mark.parametrize("dp", RUNS)
def test_the_recipe_trains_with_minirl_and_the_monitor_reduces_the_mini_steps(runs, dp):
    """The shipped recipe as the monitor sees it (the one e2e run of ``minirl_n2_r2`` on the hf backend)."""
    rows = runs[dp][0]
    for row in rows:
        # verl's reduction over the two updates, moved from actor/stable/... to stable/...
        assert row["stable/staleness/ratio_dev_max"] == pytest.approx(row["stable/staleness/update_1/ratio_dev_max"])
        drift = (row["stable/routing/update_0/r2_drift"] + row["stable/routing/update_1/r2_drift"]) / 2
        assert row["stable/routing/r2_drift"] == pytest.approx(drift)
        assert row["stable/routing/disagreement"] == 0.0  # both updates used pi_old's experts
        assert not any(k.startswith("actor/stable/") for k in row)
        # the recipe itself: minirl loss with token IS weights, R2 replay through the plugin's FSDP engine
        assert math.isfinite(row["actor/pg_loss"]) and row["actor/grad_norm"] > 0
        assert "rollout_corr/k3_kl" in row  # token IS weights were computed and reached the loss
        assert "actor/MiniRL/ratio_mean" in row and "stable/entropy/mean" in row
        assert row["stable/routing/replayed_rows"] > 0
    # N = 2: the second mini-step of a step sees pi_theta != pi_old (on-policy the ratio would be exactly 1)
    assert rows[0]["actor/MiniRL/ratio_min"] < 1.0 < rows[0]["actor/MiniRL/ratio_max"]
