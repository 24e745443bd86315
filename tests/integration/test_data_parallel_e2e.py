"""Two actor ranks and two rollout replicas against one of each: verl's main_ppo on the CPU runtime, R3 through the
compact transport with prompt rows once per group, ``balance_batch`` and dynamic batch sizes on.

Two verl runs (dp = 1 and dp = 2, ~45 s each on 2 idle cores) shared by the assertions. Rollouts are seeded per sample
(``transport/seeding.py``), so both runs sample the same tokens whichever replica serves a sample: the dp = 2
run must then replay exactly, cover every needed row once across its ranks, and compute the same old log-probs and
loss as the dp = 1 run. One update mini-step per step, so both runs update on the same batch; after that first Adam
step (which moves every weight by ~lr whatever the gradient's size) the runs may part by float rounding, so the
comparison is made on step 1.
"""

from __future__ import annotations

import pytest
from testkit.ray_logs import actors

RUNS = (1, 2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from verl_stable.toy import launch
    from verl_stable.toy.assets import AssetSpec, ensure_assets
    from verl_stable.transport.options import MANAGER_FQN

    tmp = tmp_path_factory.mktemp("dp")
    assets = ensure_assets(tmp / "assets", AssetSpec(task="copy"))
    out = {}
    for dp in RUNS:
        overrides = launch.cpu_overrides(
            assets, steps=2, precision="bf16", routing_capture=True, metrics_logger=("file",)
        )
        overrides += [
            f"trainer.default_local_dir={tmp / f'ckpt{dp}'}",
            f"trainer.n_gpus_per_node={dp}",
            f"ray_kwargs.ray_init.num_gpus={dp}",  # one fake GPU per actor rank and rollout replica
            "+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3",
            f"+actor_rollout_ref.rollout.agent.agent_loop_manager_class={MANAGER_FQN}",
            "+verl_stable.routing.share_prompt_rows_min_bytes=0",  # share every group: the path under test
            "trainer.v1.trainer_mode=stable_sync",
            "trainer.balance_batch=True",
            "actor_rollout_ref.actor.use_dynamic_bsz=True",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=256",
        ]
        proc = launch.run_main_ppo(overrides, tmp / f"dp{dp}", timeout_s=1200)
        log = (tmp / f"dp{dp}" / "main_ppo.log").read_text(errors="ignore")
        assert proc.returncode == 0, log[-4000:]
        out[dp] = (launch.read_metrics(tmp / f"dp{dp}" / "metrics.jsonl"), log)
    return out


@pytest.mark.e2e
def test_two_ranks_and_two_replicas_replay_every_needed_row_exactly_once(runs):
    one, two = runs[1][0], runs[2][0]
    assert len(actors(runs[2][1], "WorkerDict")) == 2 and len(actors(runs[2][1], "HFRolloutServer")) == 2
    assert len(actors(runs[1][1], "HFRolloutServer")) == 1
    for row1, row2 in zip(one, two, strict=True):
        assert row2["stable/routing/disagreement"] == 0.0  # every rank, every micro-batch used the rollout's experts
        assert row2["stable/routing/coverage/response_replayed"] == 1.0
        # summed over the two ranks, exactly the rows one rank sees: none lost, none counted twice
        for key in ("response_rows", "response_replayed_rows", "prompt_rows", "prompt_replayed_rows"):
            assert row2[f"stable/routing/coverage/{key}"] == row1[f"stable/routing/coverage/{key}"] > 0, key
        assert row2["stable/routing/transport/samples"] == 16.0
        assert row2["stable/routing/transport/prompt_groups_shared"] == 4.0


@pytest.mark.e2e
def test_each_rank_reads_its_groups_shared_prompt_rows_once_per_step(runs):
    for dp in RUNS:
        for row in runs[dp][0]:
            side = {k.rsplit("/", 1)[1]: v for k, v in row.items() if k.startswith("stable/routing/transport/side_")}
            # compute_log_prob reads the rank's groups once; the update's mini-batch is served from what it holds
            assert side["side_reads"] == dp and side["side_reads_per_rank"] == 1.0, (dp, side)
            assert side["side_read_reused"] == side["side_read_entries"], (dp, side)
            # a group split across two ranks is read by both: between 4 (no split) and 4 * dp entries
            assert 4 <= side["side_read_entries"] <= 4 * dp, (dp, side)
            assert side["side_read_bytes"] > 0


@pytest.mark.e2e
def test_two_ranks_sample_and_compute_what_one_rank_does(runs):
    one, two = runs[1][0], runs[2][0]
    for row1, row2 in zip(one, two, strict=True):  # the same tokens, whichever replica sampled them
        for key in ("critic/score/mean", "response_length/mean", "critic/advantages/mean"):
            assert row2[key] == pytest.approx(row1[key], abs=1e-7), key
    first1, first2 = one[0], two[0]
    assert first2["rollout_corr/training_log_ppl"] == pytest.approx(first1["rollout_corr/training_log_ppl"], abs=1e-6)
    assert first2["actor/pg_loss"] == pytest.approx(first1["actor/pg_loss"], abs=1e-6)
    assert first2["actor/grad_norm"] == pytest.approx(first1["actor/grad_norm"], rel=1e-3)
