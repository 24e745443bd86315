"""Multi-turn rollouts with verl's own vLLM rollout on vLLM's CPU build, R3 through the compact transport.

verl 0.9.1 has no interaction (user simulator) and the tiny tokenizer cannot spell a tool call, so the test runs
verl's ``ToolAgentLoop`` with the project's test-only simulated user (:mod:`verl_stable.toy.interactions`): every
sample is assistant turn, user turn (the question again), assistant turn. Each turn is its own request to vLLM; the
last request's routed experts cover the whole conversation, and the boundary must accept every sample and R3 replay
all of them. ``response_length`` is set so that the last turn of most samples crosses it: verl's ``ToolAgentLoop``
does not cap a turn at the budget left, it cuts the response and the routing afterwards, and the boundary must accept
those samples too (their one extra row trimmed and counted), not fail their groups. One verl run of 2 steps is shared
by the assertions (131 and 169 s on the 2-core machine shared with other runs).
"""

from __future__ import annotations

import pytest

from verl_stable.transport.boundary import TRANSPORT_METRIC_PREFIX

pytest.importorskip("vllm", reason="vLLM's CPU build is not installed (VERL_STABLE_NO_VLLM=1)")

FP32_TRAINING = (
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
)
SAMPLES_PER_STEP = 16  # 4 prompts x rollout.n = 4
# The prompt is 10 tokens; a conversation is an answer of at most 4 tokens (interactions.TOKENS_PER_TURN), the user
# turn (10 tokens, 11 after an answer ended by EOS), then a second answer: 12-15 tokens come before the second answer,
# so every sample gets one, and 16 cuts most of them (16 and 15 of the 16 samples per step when measured).
MAX_RESPONSE_LENGTH = 16


@pytest.fixture(scope="module")
def vllm_multi_turn_run(tmp_path_factory):
    from verl_stable.toy import interactions, launch
    from verl_stable.toy.assets import ensure_assets
    from verl_stable.transport.options import MANAGER_FQN

    tmp = tmp_path_factory.mktemp("vllm_multi_turn")
    assets = ensure_assets(tmp / "assets", launch.asset_spec("vllm"))
    overrides = launch.cpu_overrides(
        assets,
        steps=2,
        precision="fp32",
        routing_capture=True,
        metrics_logger=("file",),
        engine="vllm",
        max_response_length=MAX_RESPONSE_LENGTH,
    )
    overrides += interactions.multi_turn_overrides(tmp / "agent_loops.yaml")
    overrides += [
        f"trainer.default_local_dir={tmp / 'checkpoints'}",
        FP32_TRAINING,
        "+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3",
        f"+actor_rollout_ref.rollout.agent.agent_loop_manager_class={MANAGER_FQN}",
        "+verl_stable.routing.share_prompt_rows_min_bytes=0",  # share every group: the path under test
        "trainer.v1.trainer_mode=stable_sync",
    ]
    proc = launch.run_main_ppo(overrides, tmp / "run", timeout_s=1200)
    log = (tmp / "run" / "main_ppo.log").read_text(errors="ignore")
    assert proc.returncode == 0, log[-4000:]
    return launch.read_metrics(tmp / "run" / "metrics.jsonl")


@pytest.mark.e2e
def test_multi_turn_samples_carry_vllms_routing_and_r3_replays_it(vllm_multi_turn_run):
    from verl_stable.monitor.routing_metrics import COVERAGE

    rows = vllm_multi_turn_run
    prefix = TRANSPORT_METRIC_PREFIX
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        # verl's count: user turns + assistant turns + 1 = 4 for every sample (prompt, answer, question, answer)
        assert row["num_turns/min"] > 2
        # every sampled sample was put and trained: no group failed (a refused sample fails its group under
        # on_invalid=raise, and the step trains on fewer samples or evicts the group)
        assert row[f"{prefix}samples"] == SAMPLES_PER_STEP
        assert row[f"{prefix}skipped_samples"] == 0.0
        assert not [k for k in row if "rollout_failure" in k or k.startswith(f"{prefix}error/")]
        # samples whose last turn verl cut at response_length: in the data (responses of exactly that length, the
        # longest of the batch) and at the boundary (each with one extra row, trimmed)
        truncated = row[f"{prefix}truncated_samples"]
        assert row["response_length/max"] == MAX_RESPONSE_LENGTH
        assert 0 < truncated <= round(row["response_length/clip_ratio"] * SAMPLES_PER_STEP)
        assert row[f"{prefix}trimmed_rows"] == truncated
        # the last request's rows cover the whole conversation: only each sample's last kept token has none (for a
        # cut sample, the row trimmed: it fed only the cut token)
        assert row[f"{prefix}missing_positions"] == SAMPLES_PER_STEP
        assert row[f"{COVERAGE}/response_replayed"] == 1.0
        assert row["stable/routing/disagreement"] == 0.0
