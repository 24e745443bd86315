"""verl's own trainer with ``rollout.name=vllm`` on vLLM's CPU build: weight sync, R3 on vLLM's routed experts through
the compact transport, the monitor's metrics. One verl run (~90 s on 2 cores) shared by the assertions."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is not installed (VERL_STABLE_NO_VLLM=1)")

FP32_TRAINING = (
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
)


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    from verl_stable.cpu import launch
    from verl_stable.integration import rollout
    from verl_stable.lab.assets import ensure_assets

    tmp = tmp_path_factory.mktemp("vllm_e2e")
    assets = ensure_assets(tmp / "assets", launch.asset_spec("vllm"))
    overrides = launch.cpu_overrides(
        assets, steps=2, precision="fp32", routing_capture=True, metrics_logger=("file",), engine="vllm"
    )
    overrides += [
        f"trainer.default_local_dir={tmp / 'checkpoints'}",
        FP32_TRAINING,  # fp32 on both sides: any remaining rollout/actor gap is a bug, not numerics
        "+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",  # two update mini-steps per step
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",  # two micro-batches per mini-step
        f"+actor_rollout_ref.rollout.agent.agent_loop_manager_class={rollout.MANAGER_FQN}",
        "trainer.v1.trainer_mode=stable_sync",
    ]
    proc = launch.run_main_ppo(overrides, tmp / "run", timeout_s=1200)
    log = (tmp / "run" / "main_ppo.log").read_text(errors="ignore")
    assert proc.returncode == 0, log[-4000:]
    return launch.read_metrics(tmp / "run" / "metrics.jsonl"), log


@pytest.mark.e2e
def test_vllm_serves_the_synced_policy_exactly(vllm_run):
    """verl starts vLLM on dummy weights: equal log-probs at step 1 come from the initial sync, at step 2 from the
    sync of the updated weights (the update moved them: a stale rollout would differ)."""
    rows, log = vllm_run
    assert [r["step"] for r in rows] == [1, 2]
    assert "CpuVllmHttpServer" in log and "Sleep mode" not in log
    for row in rows:
        assert row["training/rollout_probs_diff_max"] < 1e-5
        assert abs(row["rollout_corr/kl"]) < 1e-6
    assert rows[0]["actor/grad_norm"] > 0 and rows[0]["actor/lr"] > 0


@pytest.mark.e2e
def test_r3_replays_vllms_routed_experts_through_the_compact_transport(vllm_run):
    from verl_stable.integration import fsdp_engine as fe
    from verl_stable.integration import rollout

    rows, _ = vllm_run
    for row in rows:
        assert row[f"{fe.METRIC_PREFIX}disagreement"] == 0.0  # every update used vLLM's experts
        assert row[f"{fe.METRIC_PREFIX}replayed_rows"] > 0
        # Before any update of the step, the fp32 actor's own router agrees with fp32 vLLM on every token (5-10 %
        # apart before the CPU MoE reload fix); the second mini-step runs on updated weights, and its router drifts.
        assert row[f"{fe.METRIC_PREFIX}update_0/router_disagreement"] == 0.0
        assert row[f"{fe.METRIC_PREFIX}update_1/router_disagreement"] > 0.0
        transport = {k.removeprefix(rollout.TRANSPORT_METRIC_PREFIX): v for k, v in row.items() if "transport/" in k}
        assert transport["samples"] == 16.0 and transport["skipped_samples"] == 0.0
        assert 0 < transport["bytes"] < transport["verl_bytes"]
        assert transport["prompt_groups_shared"] == 4.0


@pytest.fixture(scope="module")
def vllm_r2_run(tmp_path_factory):
    """The shipped N = 2 regime (``recipes/fsdp/minirl_n2_r2.yaml``: minirl, R2, stable_sync) with vLLM bf16 rollouts."""
    from verl_stable import recipes
    from verl_stable.cpu import launch
    from verl_stable.lab.assets import ensure_assets

    tmp = tmp_path_factory.mktemp("vllm_r2")
    assets = ensure_assets(tmp / "assets", launch.asset_spec("vllm"))
    path = recipes.recipe_path("fsdp", "minirl_n2_r2")
    overrides = [
        f"--config-path={path.parent}",
        f"--config-name={path.stem}",
        *launch.regime_overrides("minirl_n2_r2", assets, steps=2, engine="vllm", precision="bf16"),
        f"trainer.default_local_dir={tmp / 'ckpt'}",
    ]
    proc = launch.run_main_ppo(overrides, tmp / "run", timeout_s=1200)
    log = (tmp / "run" / "main_ppo.log").read_text(errors="ignore")
    assert proc.returncode == 0, log[-4000:]
    return launch.read_metrics(tmp / "run" / "metrics.jsonl")


@pytest.mark.e2e
def test_r2_recipe_on_vllm_replays_the_recorded_old_policy_routing(vllm_r2_run):
    """R2 records pi_old's routing in the old-log-prob pass and replays it in both update mini-steps; the bf16 vLLM
    rollout is the inference engine whose mismatch the IS weight corrects."""
    rows = vllm_r2_run
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["stable/routing/disagreement"] == 0.0  # both updates used pi_old's experts
        assert row["stable/routing/update_0/r2_drift"] == 0.0  # the first update runs on pi_old itself
        assert "stable/staleness/update_1/ratio_dev_max" in row
        assert 0.0 < row["training/rollout_probs_diff_max"] < 0.05  # bf16 rollout vs fp32-weight actor: real, small
        assert row["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=0.05)
