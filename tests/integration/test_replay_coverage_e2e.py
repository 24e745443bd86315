"""The rollout's routing through verl's main_ppo to R3 replay, with routing dropped for some samples: one shared run.

One verl ``main_ppo`` run on the CPU runtime, shared by the assertions: ``hf`` rollout (bf16) -> the compact manager
-> TransferQueue -> FSDP R3 replay, with fault injection (every 3rd request's routing malformed) and
``on_invalid=skip_sample`` (those samples train on the model's own routing), two update mini-steps of two micro-batches
each per step, every group's prompt rows put once (side entries re-attached on the actors). Every response is
``max_response_length`` tokens long (``ignore_eos``), so each sample needs the same number of response rows and the
expected coverage is exactly the share of samples whose routing arrived. Where routing arrived, every update replays
exactly the rollout's experts. Fault-free runs assert coverage 1.0 (``test_two_nodes_e2e.py``,
``test_data_parallel_e2e.py``) and the guard's rule silent (``test_megatron_e2e.py``).
"""

from __future__ import annotations

import pytest

from verl_stable.integration import fsdp_engine as fe
from verl_stable.monitor.routing_metrics import COVERAGE
from verl_stable.transport.boundary import TRANSPORT_METRIC_PREFIX
from verl_stable.transport.options import MANAGER_FQN

CORRUPT_EVERY = 3
SAMPLES_PER_STEP = 16  # 4 prompts x rollout.n = 4
RESPONSE_LEN = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from transformers import AutoConfig

    from verl_stable.routing.families import layout_from_config
    from verl_stable.toy import launch
    from verl_stable.toy.assets import AssetSpec, ensure_assets

    tmp = tmp_path_factory.mktemp("coverage_e2e")
    assets = ensure_assets(tmp / "assets", AssetSpec(task="copy"))
    overrides = launch.cpu_overrides(
        assets,
        steps=2,
        precision="bf16",
        routing_capture=True,
        max_response_length=RESPONSE_LEN,
        metrics_logger=("file",),
    )
    overrides += [
        f"trainer.default_local_dir={tmp / 'checkpoints'}",
        "+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",  # two update mini-steps per step
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",  # two micro-batches per mini-step
        "actor_rollout_ref.rollout.ignore_eos=True",  # every response RESPONSE_LEN tokens
        f"+actor_rollout_ref.rollout.agent.agent_loop_manager_class={MANAGER_FQN}",
        "+verl_stable.routing.share_prompt_rows_min_bytes=0",  # share every group: the path under test
        f"+actor_rollout_ref.rollout.engine_kwargs.hf.corrupt_routing_every={CORRUPT_EVERY}",  # fault injection
        "+verl_stable.routing.on_invalid=skip_sample",
        "trainer.v1.trainer_mode=stable_sync",
    ]
    proc = launch.run_main_ppo(overrides, tmp / "run", timeout_s=1500)
    log = (tmp / "run" / "main_ppo.log").read_text()
    assert proc.returncode == 0, log[-4000:]  # the rule warns: the run goes on
    layout = layout_from_config(AutoConfig.from_pretrained(assets.model_dir))
    return launch.read_metrics(tmp / "run" / "metrics.jsonl"), log, len(layout.moe_layers), overrides


@pytest.mark.e2e
def test_the_dropped_routing_is_counted_at_the_boundary(run):
    rows, _, _, _ = run
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row[f"{TRANSPORT_METRIC_PREFIX}samples"] == SAMPLES_PER_STEP
        # every 3rd request of the server's count (3, 6, ..., 15 in step 1; 18, ..., 30 in step 2): 5 of 16
        skipped = row[f"{TRANSPORT_METRIC_PREFIX}skipped_samples"]
        assert SAMPLES_PER_STEP // CORRUPT_EVERY <= skipped <= SAMPLES_PER_STEP // CORRUPT_EVERY + 1
        assert row[f"{TRANSPORT_METRIC_PREFIX}error/ExpertIdRangeError"] == skipped


@pytest.mark.e2e
def test_response_coverage_is_the_share_of_samples_whose_routing_arrived(run):
    rows, _, moe_layers, _ = run
    for row in rows:
        skipped = row[f"{TRANSPORT_METRIC_PREFIX}skipped_samples"]
        expected = 1.0 - skipped / SAMPLES_PER_STEP  # 11 / 16 with 5 skipped
        assert row[f"{COVERAGE}/response_replayed"] == pytest.approx(expected, abs=1e-9)
        assert row[f"{COVERAGE}/response_fallback"] == pytest.approx(1.0 - expected, abs=1e-9)
        # each sample trained once per step (2 mini-steps x 8 samples), RESPONSE_LEN - 1 needed response rows each:
        # summed over micro-batches and mini-steps, not averaged
        assert row[f"{COVERAGE}/response_rows"] == SAMPLES_PER_STEP * (RESPONSE_LEN - 1) * moe_layers
        assert row[f"{COVERAGE}/response_replayed_rows"] == (SAMPLES_PER_STEP - skipped) * (RESPONSE_LEN - 1) * (
            moe_layers
        )
        assert 0.0 < row[f"{COVERAGE}/prompt_fallback"] < 1.0  # the skipped samples' prompts fell back too
        assert row[f"{COVERAGE}/not_needed"] > 0.0  # at least each sample's last token
        assert row["stable/routing/disagreement"] == 0.0  # where routing arrived, it was replayed


@pytest.mark.e2e
def test_the_guard_rule_fires_and_warns(run):
    rows, log, _, _ = run
    for row in rows:
        assert row["stable/guard/replay_coverage"] == 1.0
    assert "verl-stable guard [replay_coverage -> warn]" in log


@pytest.mark.e2e
def test_the_compact_form_reaches_the_actors_and_is_replayed(run):
    rows, _, _, _ = run
    for row in rows:  # the stable trainer logs verl's actor/stable/* as stable/*
        assert row[f"{fe.METRIC_PREFIX}disagreement"] == 0.0  # every replayed row used the rollout's experts
        assert row[f"{fe.METRIC_PREFIX}replayed_rows"] > 0
        assert row[f"{fe.METRIC_PREFIX}router_disagreement"] > 0.0  # what bf16 rollout vs fp32 training would change
        transport = {k.removeprefix(TRANSPORT_METRIC_PREFIX): v for k, v in row.items() if "transport/" in k}
        assert transport["samples"] == SAMPLES_PER_STEP and transport["bytes"] < transport["verl_bytes"]
        assert transport["prompt_rows_deduplicated"] > 0  # prompt rows put once per group, not once per sample
        assert 0 < transport["prompt_groups_shared"] <= SAMPLES_PER_STEP // 4  # at most one side entry per prompt


@pytest.mark.e2e
def test_the_logged_metrics_are_what_the_guards_preflight_assumes_this_configuration_logs(run):
    """R3 on FSDP with the compact transport: every stable/ name logged is predicted, every predicted family logged."""
    from testkit.logged import catalogue_mismatches, compose_run_config

    rows, _, _, overrides = run
    assert catalogue_mismatches(compose_run_config(overrides), rows) == []
