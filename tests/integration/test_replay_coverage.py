"""Replay coverage: the counts of one micro-batch, their path through verl's engine and trainer, and the fractions.

Hand-built micro-batches with known replayed, missing, padding and last-token rows; expected counts are worked out by
hand in the comments (not recomputed with the code under test). The engine tests run verl's real FSDP engine code
(``forward_backward_batch`` -> ``forward_step`` -> ``prepare_model_inputs``) on a bare instance, as
``test_fsdp_engine.py`` does.
"""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict
from testkit.moe import EXPERTS, MOE_LAYERS, NUM_LAYERS, TOPK, engine_model
from verl.utils import tensordict_utils as tu
from verl.utils import torch_functional as verl_F
from verl.utils.metric import AggregationType, Metric
from verl.workers.config import EngineRouterReplayConfig, FSDPEngineConfig

from verl_stable.integration import fsdp_engine as fe
from verl_stable.monitor.routing_metrics import COVERAGE, COVERAGE_COUNTS, replay_coverage_metrics
from verl_stable.monitor.step import StableConfig, StepMonitor
from verl_stable.monitor.update_metrics import coverage_totals
from verl_stable.routing.replay_pass import RouterReplayError, coverage_counts, token_roles

M = len(MOE_LAYERS)
# Four samples, prompt + response; response masks with a tool token inside (sample 1) and tool output after the last
# trained token (sample 3).
LENGTHS = [5, 7, 3, 6]
RESPONSE_MASKS = [[1, 1], [1, 0, 1], [1], [1, 1, 1, 0]]
# Needed rows (positions before the sample's last trained token), by hand:
#   s0: P=3, trained at 3, 4 -> prompt 0-2, response 3, not needed 4
#   s1: P=4, trained at 4, 6 -> prompt 0-3, response 4-5 (the tool token 5 feeds the log-prob of 6), not needed 6
#   s2: P=2, trained at 2    -> prompt 0-1, no response row, not needed 2
#   s3: P=2, trained at 2-4  -> prompt 0-1, response 2-3, not needed 4-5
PROMPT_TOKENS, RESPONSE_TOKENS, NOT_NEEDED_TOKENS = 11, 5, 5
pytestmark = pytest.mark.usefixtures("cpu_runtime")  # tests/integration/conftest.py


def _offsets(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def _nested(values: torch.Tensor, lengths) -> torch.Tensor:
    return torch.nested.nested_tensor_from_jagged(values, offsets=_offsets(lengths))


def _response_mask() -> torch.Tensor:
    return _nested(torch.tensor([v for m in RESPONSE_MASKS for v in m]), [len(m) for m in RESPONSE_MASKS])


def _routing(missing_samples=(3,)) -> torch.Tensor:
    """[tokens, NUM_LAYERS, TOPK] int16: distinct random experts in MoE layers, zero dense layer; zero rows at each
    sample's last token (no row from the engine), in every row of ``missing_samples`` (skipped) and in MoE layer 0
    of sample 1's prompt token 1 (one partial row)."""
    gen = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    rows = torch.zeros(total, NUM_LAYERS, TOPK, dtype=torch.int16)
    for layer in MOE_LAYERS:
        rows[:, layer] = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(total)]).to(
            torch.int16
        )
    offsets = _offsets(LENGTHS)
    for i in range(len(LENGTHS)):
        rows[offsets[i + 1] - 1] = 0
        if i in missing_samples:
            rows[offsets[i] : offsets[i + 1]] = 0
    rows[offsets[1] + 1, MOE_LAYERS[0]] = 0
    return rows


# ------------------------------------------------------------------------------------------ pure counting
def test_token_roles_from_a_nested_response_mask():
    td = TensorDict({"response_mask": _response_mask()}, batch_size=[4])
    is_prompt, trained = token_roles(td, _offsets(LENGTHS))
    assert is_prompt.tolist() == [1, 1, 1, 0, 0] + [1, 1, 1, 1, 0, 0, 0] + [1, 1, 0] + [1, 1, 0, 0, 0, 0]
    assert trained.tolist() == [0, 0, 0, 1, 1] + [0, 0, 0, 0, 1, 0, 1] + [0, 0, 1] + [0, 0, 1, 1, 1, 0]


def test_token_roles_from_a_padded_response_mask_and_attention_mask():
    # verl's padded layout: left-padded prompts of width 4, right-padded responses of width 4
    attention = torch.zeros(4, 8, dtype=torch.long)
    response = torch.zeros(4, 4, dtype=torch.long)
    for i, (n, mask) in enumerate(zip(LENGTHS, RESPONSE_MASKS, strict=True)):
        prompt = n - len(mask)
        attention[i, 4 - prompt : 4 + len(mask)] = 1
        response[i, : len(mask)] = torch.tensor(mask)
    td = TensorDict({"response_mask": response, "attention_mask": attention}, batch_size=[4])
    is_prompt, trained = token_roles(td, _offsets(LENGTHS))
    nested = token_roles(TensorDict({"response_mask": _response_mask()}, batch_size=[4]), _offsets(LENGTHS))
    assert torch.equal(is_prompt, nested[0]) and torch.equal(trained, nested[1])


def test_token_roles_needs_a_response_mask_that_fits():
    assert token_roles(TensorDict({}, batch_size=[4]), _offsets(LENGTHS)) is None
    dense_alone = TensorDict({"response_mask": torch.ones(4, 2)}, batch_size=[4])
    assert token_roles(dense_alone, _offsets(LENGTHS)) is None  # no attention_mask to place the responses
    too_long = TensorDict({"response_mask": _nested(torch.ones(8), [2, 2, 2, 2])}, batch_size=[4])
    with pytest.raises(RouterReplayError, match="do not fit the sequence lengths"):
        token_roles(too_long, _offsets([5, 7, 1, 6]))


def test_coverage_counts_of_a_hand_built_micro_batch():
    routing = _routing()
    has_data = routing[:, list(MOE_LAYERS)].ne(0).any(dim=-1)
    td = TensorDict({"response_mask": _response_mask()}, batch_size=[4])
    counts = coverage_counts(has_data, _offsets(LENGTHS), *token_roles(td, _offsets(LENGTHS)), padding_tokens=3)
    assert counts == {
        "response_rows": RESPONSE_TOKENS * M,  # 10
        "response_replayed_rows": (RESPONSE_TOKENS - 2) * M,  # sample 3's two response rows fell back: 6
        "prompt_rows": PROMPT_TOKENS * M,  # 22
        "prompt_replayed_rows": (PROMPT_TOKENS - 2) * M - 1,  # sample 3's prompt and one layer of s1's token 1: 17
        "not_needed_rows": NOT_NEEDED_TOKENS * M,  # every last token, and s3's trailing tool token: 10
        "padding_rows": 3 * M,
    }
    assert tuple(counts) == COVERAGE_COUNTS


def test_a_sample_without_trained_tokens_needs_no_row():
    # verl's padding samples carry an all-zero response_mask: nothing of theirs feeds a trained log-prob
    has_data = torch.ones(5, M, dtype=torch.bool)
    is_prompt = torch.tensor([True, True, False, False, False])
    counts = coverage_counts(has_data, torch.tensor([0, 5]), is_prompt, torch.zeros(5, dtype=torch.bool), 0)
    assert counts["response_rows"] == counts["prompt_rows"] == 0 and counts["not_needed_rows"] == 5 * M


def test_coverage_counts_refuse_mismatched_inputs():
    ones = torch.ones(4, M, dtype=torch.bool)
    flags = torch.zeros(4, dtype=torch.bool)
    with pytest.raises(ValueError, match="one prompt / trained flag per token row"):
        coverage_counts(ones, torch.tensor([0, 3]), flags, flags, 0)
    with pytest.raises(ValueError, match="padding_tokens must be >= 0"):
        coverage_counts(ones, torch.tensor([0, 4]), flags, flags, -1)


# ------------------------------------------------------------------------------------------ fractions
def _counts(**over: float) -> dict[str, float]:
    base = dict(
        response_rows=10.0,
        response_replayed_rows=6.0,
        prompt_rows=22.0,
        prompt_replayed_rows=17.0,
        not_needed_rows=10.0,
        padding_rows=8.0,
    )
    return {**base, **over}


def test_replay_coverage_fractions_are_exact_ratios_of_the_counts():
    out = replay_coverage_metrics(_counts())
    assert out == {
        f"{COVERAGE}/response_replayed": 0.6,
        f"{COVERAGE}/response_fallback": 0.4,
        f"{COVERAGE}/prompt_replayed": 17 / 22,
        f"{COVERAGE}/prompt_fallback": 5 / 22,
        f"{COVERAGE}/not_needed": 10 / 50,
        f"{COVERAGE}/padding": 8 / 50,
    }
    # full metric names work as well (the trainer passes them)
    assert replay_coverage_metrics({f"{COVERAGE}/{k}": v for k, v in _counts().items()}) == out


def test_replay_coverage_leaves_out_empty_classes_and_passes_non_finite_counts_on():
    out = replay_coverage_metrics(_counts(response_rows=0.0, response_replayed_rows=0.0))
    assert f"{COVERAGE}/response_replayed" not in out and out[f"{COVERAGE}/prompt_replayed"] == 17 / 22
    assert replay_coverage_metrics(dict.fromkeys(COVERAGE_COUNTS, 0.0)) == {}
    nan = replay_coverage_metrics(_counts(response_replayed_rows=math.nan))
    assert math.isnan(nan[f"{COVERAGE}/response_replayed"])


def test_replay_coverage_refuses_bad_counts():
    with pytest.raises(ValueError, match="lack 'padding_rows'"):
        replay_coverage_metrics({k: v for k, v in _counts().items() if k != "padding_rows"})
    with pytest.raises(ValueError, match="must be >= 0"):
        replay_coverage_metrics(_counts(not_needed_rows=-1.0))
    with pytest.raises(ValueError, match="replay 11.0 response rows of 10.0"):
        replay_coverage_metrics(_counts(response_replayed_rows=11.0))
    with pytest.raises(TypeError, match="must be a real number"):
        replay_coverage_metrics(_counts(prompt_rows="22"))
    with pytest.raises(TypeError, match="must be a mapping"):
        replay_coverage_metrics([1.0])


# ------------------------------------------------------------------------------------------ verl's engine
def _engine(mode="R3", pad_to_length=False):
    """An engine instance with the state verl's FSDPEngine.__init__ / initialize give it, minus FSDP."""
    cls = fe.engine_class()
    engine = cls.__new__(cls)
    engine.module = engine_model()
    engine.engine_config = FSDPEngineConfig(router_replay=EngineRouterReplayConfig(mode=mode), use_torch_compile=False)
    engine.use_remove_padding = True
    engine.ulysses_device_mesh = None
    engine.ulysses_sequence_parallel_size = 1
    engine.use_ulysses_sp = False
    engine.pad_to_length = pad_to_length
    engine.pad_to_length_bucket = 8
    engine._autocast_dtype = torch.float32
    engine.scaler = None
    engine.compute_entropy_from_logits = verl_F.entropy_from_logits
    engine._init_router_replay(engine.engine_config)
    engine._bind_routing(strict=True)
    return engine


def _batch(routed: torch.Tensor, *, remove_padding=True, with_response_mask=True) -> TensorDict:
    gen = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    fields = {
        "input_ids": _nested(torch.randint(1, 64, (total,), generator=gen), LENGTHS),
        "position_ids": _nested(torch.cat([torch.arange(n) for n in LENGTHS]), LENGTHS),
        "loss_mask": _nested(torch.ones(total, dtype=torch.int64), LENGTHS),
        "routed_experts": _nested(routed, LENGTHS),
    }
    if with_response_mask:
        fields["response_mask"] = _response_mask()
    td = TensorDict(fields, batch_size=[len(LENGTHS)])
    tu.assign_non_tensor(
        td,
        use_remove_padding=remove_padding,
        temperature=1.0,
        pad_token_id=0,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=2,  # micro-batches {s0, s1} (12 tokens) and {s2, s3} (9 tokens)
        max_token_len_per_gpu=12,
        return_model_output=False,
    )
    return td


def _loss(model_output, data, dp_group=None):
    return -model_output["log_probs"].values().sum(), {}


def _coverage_output(engine, batch, forward_only=False) -> dict[str, Metric]:
    out = engine.forward_backward_batch(batch, _loss, forward_only=forward_only)
    return {k.removeprefix(f"{COVERAGE}/"): v for k, v in out["metrics"].items() if k.startswith(f"{COVERAGE}/")}


@pytest.mark.parametrize(
    ("remove_padding", "pad_to_length", "padding_tokens"),
    [
        (True, False, 0),  # packed, no pad
        (True, True, 4 + 7),  # packed to the bucket of 8: 12 -> 16, 9 -> 16
        (False, False, (2 * 7 - 12) + (2 * 6 - 9)),  # padded to each micro-batch's longest sample
    ],
)
def test_engine_returns_summable_coverage_counts_per_micro_batch(remove_padding, pad_to_length, padding_tokens):
    engine = _engine(pad_to_length=pad_to_length)
    coverage = _coverage_output(engine, _batch(_routing(), remove_padding=remove_padding))
    assert set(coverage) == set(COVERAGE_COUNTS)
    assert all(m.aggregation is AggregationType.SUM and len(m.values) == 2 for m in coverage.values())
    totals = {name: float(sum(m.values)) for name, m in coverage.items()}
    assert totals == {
        "response_rows": RESPONSE_TOKENS * M,
        "response_replayed_rows": (RESPONSE_TOKENS - 2) * M,
        "prompt_rows": PROMPT_TOKENS * M,
        "prompt_replayed_rows": (PROMPT_TOKENS - 2) * M - 1,
        "not_needed_rows": NOT_NEEDED_TOKENS * M,
        "padding_rows": padding_tokens * M,
    }
    # per micro-batch: the first holds s0 and s1 (routed but one layer of s1's token 1), the second s2 (no
    # response row) and the skipped s3
    assert coverage["response_replayed_rows"].values == [3 * M, 0]
    assert coverage["prompt_replayed_rows"].values == [7 * M - 1, 2 * M]


def test_a_fully_routed_batch_has_full_coverage_and_the_fractions_follow_verls_reduction():
    engine = _engine()
    coverage = _coverage_output(engine, _batch(_routing(missing_samples=())))
    # verl's train_mini_batch: Metric.aggregate_dp over ranks (one here), then the trainer sums the mini-steps
    raw = {f"{COVERAGE}/{name}": [Metric.aggregate_dp([m])] for name, m in coverage.items()}
    fractions = replay_coverage_metrics(coverage_totals(raw))
    assert fractions[f"{COVERAGE}/response_replayed"] == 1.0 and fractions[f"{COVERAGE}/response_fallback"] == 0.0
    assert fractions[f"{COVERAGE}/prompt_replayed"] == (PROMPT_TOKENS * M - 1) / (PROMPT_TOKENS * M)


def test_counts_are_scaled_by_the_data_parallel_size_so_verls_rank_mean_is_their_sum():
    engine = _engine()
    batch = _batch(_routing())
    original = fe.RouterReplayMixin.forward_step

    def forward_step(self, micro_batch, loss_function, forward_only):
        tu.assign_non_tensor(micro_batch, dp_size=4)  # as verl sets it on a 4-rank data-parallel group
        return original(self, micro_batch, loss_function, forward_only)

    engine.forward_step = forward_step.__get__(engine)
    coverage = _coverage_output(engine, batch)
    assert sum(coverage["response_rows"].values) == 4 * RESPONSE_TOKENS * M
    # four ranks with these counts: verl averages a SUM metric over ranks and sums the micro-batches
    assert Metric.aggregate_dp([coverage["response_rows"]] * 4) == 4 * RESPONSE_TOKENS * M


def test_no_coverage_without_replay_or_without_a_response_mask():
    routed = _routing()
    assert _coverage_output(_engine(mode="disabled"), _batch(routed)) == {}  # observe only: nothing replayed
    assert _coverage_output(_engine(), _batch(routed, with_response_mask=False)) == {}
    # R2's pi_old pass records, it does not replay
    assert _coverage_output(_engine(mode="R2"), _batch(routed), forward_only=True) == {}


# ------------------------------------------------------------------------------------------ driver side
def test_coverage_totals_sum_the_mini_steps():
    raw = {
        f"{COVERAGE}/response_rows": [10.0, 14.0],
        f"actor/{COVERAGE}/padding_rows": [2.0, 0.0],
        "stable/routing/replayed_rows": [5.0, 5.0],
    }
    assert coverage_totals(raw) == {f"{COVERAGE}/response_rows": 24.0, f"{COVERAGE}/padding_rows": 2.0}
    assert coverage_totals({"actor/pg_loss": [1.0]}) == {}
    with pytest.raises(ValueError, match="not a number"):
        coverage_totals({f"{COVERAGE}/response_rows": [[1.0]]})


def test_step_monitor_logs_the_totals_and_fractions_and_the_guard_warns():
    monitor = StepMonitor(StableConfig.from_dict({}))
    # verl's reduction: the mean over two mini-steps, under actor/; the trainer's totals replace it
    metrics = {f"actor/{COVERAGE}/{k}": v / 2 for k, v in _counts().items()}
    totals = {f"{COVERAGE}/{k}": v for k, v in _counts().items()}
    verdicts = monitor.step(3, None, metrics, coverage=totals)
    assert metrics[f"{COVERAGE}/response_rows"] == 10.0 and f"actor/{COVERAGE}/response_rows" not in metrics
    assert metrics[f"{COVERAGE}/response_replayed"] == 0.6 and metrics[f"{COVERAGE}/padding"] == 8 / 50
    assert [(v.rule, v.action) for v in verdicts] == [("replay_coverage", "warn")]
    assert metrics["stable/guard/replay_coverage"] == 1.0
    # without the trainer's totals the reduced counts give the same fractions (the same factor on every count)
    metrics = {f"actor/{COVERAGE}/{k}": v / 2 for k, v in _counts().items()}
    monitor.step(4, None, metrics)
    assert metrics[f"{COVERAGE}/response_replayed"] == 0.6


def test_step_monitor_without_replay_logs_no_coverage_and_reports_no_missing_rule():
    monitor = StepMonitor(StableConfig.from_dict({}))
    metrics = {"actor/pg_loss": 0.1}
    assert monitor.step(1, None, metrics) == []
    assert not any(k.startswith(COVERAGE) for k in metrics) and metrics["stable/guard/replay_coverage"] == 0.0
    assert "replay_coverage" not in monitor.guard.missing


def test_step_monitor_full_coverage_does_not_fire():
    monitor = StepMonitor(StableConfig.from_dict({}))
    metrics = {f"{COVERAGE}/{k}": v for k, v in _counts(response_replayed_rows=10.0).items()}
    assert monitor.step(1, None, metrics) == [] and metrics[f"{COVERAGE}/response_replayed"] == 1.0


class _ActorWorkerGroup:
    """Stands in for verl's remote actor worker group: answers ``update_actor`` as verl's worker lays it out."""

    def __init__(self, metrics):
        self.metrics = metrics

    def update_actor(self, batch):
        return tu.get_tensordict(
            tensor_dict={}, non_tensor_dict={"metrics": {k: list(v) for k, v in self.metrics.items()}}
        )


def test_trainer_sums_coverage_over_mini_steps_and_local_updates(tmp_path):
    import os

    import verl
    from hydra import compose, initialize_config_dir
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1 import get_trainer_cls

    from verl_stable.integration import trainer as T

    T.register()
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=["trainer.v1.trainer_mode=stable_sync"])
    trainer = get_trainer_cls("stable_sync")(cfg)
    trainer.global_steps = 1  # verl's fit sets it before the first step
    per_mini_step = {f"{COVERAGE}/{k}": [v, v] for k, v in _counts().items()}  # two mini-steps
    trainer.actor_rollout_wg = _ActorWorkerGroup({**per_mini_step, "mfu": [0.1, 0.1]})
    trainer._stable_coverage = {}
    metrics = {}
    for _ in range(2):  # two local updates in one logged step (an async mode's parameter_sync_step = 2)
        trainer._update_actor(KVBatchMeta(partition_id="train", keys=["a"], tags=[{}]), metrics)
    assert trainer._stable_coverage == {f"{COVERAGE}/{k}": 4 * v for k, v in _counts().items()}
    assert metrics[f"actor/{COVERAGE}/response_rows"] == 10.0  # verl's own reduction: the mean over mini-steps
    trainer._stable_state().step(1, None, metrics, coverage=trainer._stable_coverage)
    assert metrics[f"{COVERAGE}/response_rows"] == 40.0 and metrics[f"{COVERAGE}/response_replayed"] == 0.6
