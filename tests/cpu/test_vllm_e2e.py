"""verl's own trainer with ``rollout.name=vllm`` on vLLM's CPU build: weight sync, R3 on vLLM's routed experts through
the compact transport, the monitor's metrics, a bad routing payload handled as configured, and a rerun with the same
seed sampling the same tokens.

One verl run (~90 s on 2 idle cores) is shared by the weight-sync, R3 and fault assertions. Its server runs the
test-only fault injection ``engine_kwargs.vllm.corrupt_routing_every=3``: the routed experts of the requests whose
sampling seed is a multiple of 3 (about one in 3, the same samples in every run) leave the server malformed (expert ids
out of range), and with ``on_invalid=skip_sample`` those samples train on the actor's own routing. The rest of vLLM's
payloads must all pass the boundary and be replayed, so the R3 assertions hold on them and the exact sync still holds (fp32 on both sides: the actor's own router routes as vLLM
does before the step's update). Every response is ``max_response_length`` tokens long (``ignore_eos``), so the
expected replay coverage is exactly the share of samples whose routing arrived. The rerun test adds one more identical
run (see its docstring). Partial rollouts with vLLM: ``test_vllm_partial_rollouts.py`` (its own file, so that a second
test worker can run it alongside).
"""

from __future__ import annotations

import json

import pytest

from verl_stable.transport.boundary import TRANSPORT_METRIC_PREFIX

pytest.importorskip("vllm", reason="vLLM's CPU build is not installed (VERL_STABLE_NO_VLLM=1)")

FP32_TRAINING = (
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
)
CORRUPT_EVERY = 3
SAMPLES_PER_STEP = 16  # 4 prompts x rollout.n = 4
RESPONSE_LEN = 4  # cpu_overrides' max_response_length


@pytest.fixture(scope="module")
def vllm_assets(tmp_path_factory):
    from verl_stable.toy import launch
    from verl_stable.toy.assets import ensure_assets

    return ensure_assets(tmp_path_factory.mktemp("vllm_assets"), launch.asset_spec("vllm"))


def _run_r3_with_faults(assets, tmp):
    """The shared run's command (see the module docstring) in ``tmp``; returns (metrics rows, log, dumped samples)."""
    from verl_stable.toy import launch
    from verl_stable.transport.options import MANAGER_FQN

    overrides = launch.cpu_overrides(
        assets, steps=2, precision="fp32", routing_capture=True, metrics_logger=("file",), engine="vllm"
    )
    overrides += [
        f"trainer.default_local_dir={tmp / 'checkpoints'}",
        f"trainer.rollout_data_dir={tmp / 'rollouts'}",  # verl dumps every step's samples (text, score)
        FP32_TRAINING,  # fp32 on both sides: any remaining rollout/actor gap is a bug, not numerics
        "+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",  # two update mini-steps per step
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",  # two micro-batches per mini-step
        "actor_rollout_ref.rollout.ignore_eos=True",  # every response RESPONSE_LEN tokens
        f"+actor_rollout_ref.rollout.agent.agent_loop_manager_class={MANAGER_FQN}",
        "+verl_stable.routing.share_prompt_rows_min_bytes=0",  # share every group: the path under test
        f"+actor_rollout_ref.rollout.engine_kwargs.vllm.corrupt_routing_every={CORRUPT_EVERY}",  # fault injection
        "+verl_stable.routing.on_invalid=skip_sample",
        "trainer.v1.trainer_mode=stable_sync",
    ]
    proc = launch.run_main_ppo(overrides, tmp / "run", timeout_s=1200)
    log = (tmp / "run" / "main_ppo.log").read_text(errors="ignore")
    assert proc.returncode == 0, log[-4000:]  # the coverage rule warns: the run goes on
    return launch.read_metrics(tmp / "run" / "metrics.jsonl"), log, _dumped_samples(tmp / "rollouts")


def _dumped_samples(folder) -> dict[int, list[tuple]]:
    """Per step, the sorted (prompt text, the sample's (session, index) in its key, response text, score) of every
    sample verl dumped; the prompt's uid is a fresh uuid per run, so it is left out."""
    steps = {}
    for path in folder.glob("*.jsonl"):
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        steps[int(path.stem)] = sorted(
            (r["input"], tuple(r["uid"].rsplit("_", 2)[1:]), r["output"], r["score"]) for r in records
        )
    return steps


@pytest.fixture(scope="module")
def vllm_run(vllm_assets, tmp_path_factory):
    return _run_r3_with_faults(vllm_assets, tmp_path_factory.mktemp("vllm_e2e"))


@pytest.fixture(scope="module")
def moe_layers(vllm_assets):
    from transformers import AutoConfig

    from verl_stable.routing import layout_from_config

    return len(layout_from_config(AutoConfig.from_pretrained(vllm_assets.model_dir)).moe_layers)


@pytest.mark.e2e
def test_vllm_serves_the_synced_policy_exactly(vllm_run):
    """verl starts vLLM on dummy weights: equal log-probs at step 1 come from the initial sync, at step 2 from the
    sync of the updated weights (the update moved them: a stale rollout would differ)."""
    rows, log, _ = vllm_run
    assert [r["step"] for r in rows] == [1, 2]
    assert "CpuVllmHttpServer" in log and "Sleep mode" not in log
    for row in rows:
        assert row["training/rollout_probs_diff_max"] < 1e-5
        assert abs(row["rollout_corr/kl"]) < 1e-6
    assert rows[0]["actor/grad_norm"] > 0 and rows[0]["actor/lr"] > 0


@pytest.mark.e2e
def test_r3_replays_vllms_routed_experts_through_the_compact_transport(vllm_run):
    from verl_stable.integration import fsdp_engine as fe

    rows, _, _ = vllm_run
    for row in rows:
        assert row[f"{fe.METRIC_PREFIX}disagreement"] == 0.0  # every update used vLLM's experts where they arrived
        assert row[f"{fe.METRIC_PREFIX}replayed_rows"] > 0
        # Before any update of the step, the fp32 actor's own router agrees with fp32 vLLM on every token (5-10 %
        # apart before the CPU MoE reload fix); the second mini-step runs on updated weights, and its router drifts.
        assert row[f"{fe.METRIC_PREFIX}update_0/router_disagreement"] == 0.0
        assert row[f"{fe.METRIC_PREFIX}update_1/router_disagreement"] > 0.0
        transport = {k.removeprefix(TRANSPORT_METRIC_PREFIX): v for k, v in row.items() if "transport/" in k}
        # every payload vLLM returned passed the boundary; only the injected faults (out-of-range ids) were skipped
        assert transport["samples"] == SAMPLES_PER_STEP
        assert 0 < transport["skipped_samples"] == transport["error/ExpertIdRangeError"] < SAMPLES_PER_STEP
        assert 0 < transport["bytes"] < transport["verl_bytes"]
        assert transport["prompt_groups_shared"] == 4.0  # every group kept at least two routed samples


@pytest.mark.e2e
def test_a_bad_routing_payload_from_vllm_is_skipped_counted_and_warned_about(vllm_run, moe_layers):
    """``on_invalid=skip_sample`` with real vLLM: the boundary refuses the corrupted payloads by class, the replay
    coverage shows the drop exactly, and the guard's replay_coverage rule fires (a warning: the run goes on)."""
    from verl_stable.monitor.routing_metrics import COVERAGE

    rows, log, _ = vllm_run
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        # the seeds (hashes of the samples' identities) decide which samples are corrupted: about one in 3
        corrupted = row[f"{TRANSPORT_METRIC_PREFIX}error/ExpertIdRangeError"]
        assert corrupted == int(corrupted) and 1 <= corrupted <= SAMPLES_PER_STEP - 1
        replayed = SAMPLES_PER_STEP - corrupted
        assert row[f"{COVERAGE}/response_replayed"] == pytest.approx(replayed / SAMPLES_PER_STEP, abs=1e-9)
        assert row[f"{COVERAGE}/response_fallback"] == pytest.approx(corrupted / SAMPLES_PER_STEP, abs=1e-9)
        # summed over micro-batches and mini-steps: each sample trained once per step, RESPONSE_LEN - 1 needed rows
        assert row[f"{COVERAGE}/response_rows"] == SAMPLES_PER_STEP * (RESPONSE_LEN - 1) * moe_layers
        assert row[f"{COVERAGE}/response_replayed_rows"] == replayed * (RESPONSE_LEN - 1) * moe_layers
        assert 0.0 < row[f"{COVERAGE}/prompt_fallback"] < 1.0  # the skipped samples' prompts fell back too
        assert row["stable/guard/replay_coverage"] == 1.0
    assert "verl-stable guard [replay_coverage -> warn]" in log


@pytest.fixture(scope="module")
def vllm_r2_run(vllm_assets, tmp_path_factory):
    """The shipped N = 2 regime (``recipes/fsdp/minirl_n2_r2.yaml``: minirl, R2, stable_sync), vLLM bf16 rollouts."""
    from verl_stable import recipes
    from verl_stable.toy import launch

    tmp = tmp_path_factory.mktemp("vllm_r2")
    assets = vllm_assets
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


@pytest.fixture(scope="module")
def vllm_rerun(vllm_assets, tmp_path_factory):
    return _run_r3_with_faults(vllm_assets, tmp_path_factory.mktemp("vllm_rerun"))


# values that follow from the sampled tokens alone, and from which samples the fault injection chose (by their seeds)
EXACT_PREFIXES = (
    "critic/score/", "critic/rewards/", "critic/advantages/", "response_length/", "stable/routing/transport/error/",
    "stable/routing/transport/skipped_samples", "stable/routing/coverage/response_",
)  # fmt: skip


@pytest.mark.e2e
def test_a_rerun_with_the_same_seed_samples_the_same_tokens(vllm_run, vllm_rerun):
    """Reproducibility with vLLM: verl-stable's agent loop gives every sample a seed of its own
    (``SamplingParams.seed``, derived from the sample's identity), so a second run of the same command samples the
    same responses, whatever vLLM batched together and in whatever order requests finished; rewards and advantages
    follow. The fault injection picks samples by their seeds, so both runs skip the routing of the same samples and
    train alike (it once counted answers, and a rerun then sampled different tokens at step 2)."""
    rows, _, samples = vllm_run
    rows_again, _, samples_again = vllm_rerun
    assert sorted(samples) == [1, 2] and all(len(s) == SAMPLES_PER_STEP for s in samples.values())
    assert len({response for step in samples.values() for _, _, response, _ in step}) > 1  # not one fixed answer
    assert samples_again == samples
    for row, again in zip(rows, rows_again, strict=True):
        exact = {k: v for k, v in row.items() if k.startswith(EXACT_PREFIXES)}
        assert {"critic/score/mean", "critic/advantages/max"} <= exact.keys()
        assert exact["stable/routing/transport/skipped_samples"] > 0  # the same samples' routing skipped in both
        assert {k: again[k] for k in exact} == exact
