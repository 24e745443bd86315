"""R2 / R3 router replay in verl's FSDP engine, on CPU, through verl's own engine code paths.

The engine under test is ``FSDPEngineWithLMHeadReplay`` (verl's ``FSDPEngineWithLMHead`` + our mixin) built without
FSDP sharding (a bare instance holding a tiny random Qwen3-MoE with a dense middle layer), on the project's CPU
platform and a one-rank gloo group: ``forward_backward_batch`` -> ``prepare_micro_batches`` -> ``forward_step`` ->
``prepare_model_inputs`` / ``prepare_model_outputs`` are verl's real code. References are independent: verl's base
engine run inside the routing library's own ``capture`` / ``replay`` (which place rows by concatenation or by the
attention mask, not by our alignment code), gradients of the natural model, and hand-built routing tables.
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager, nullcontext

import pytest
import torch
from tensordict import TensorDict
from testkit.moe import EXPERTS, MOE_LAYERS, NUM_LAYERS, TOPK, engine_model
from verl.utils import tensordict_utils as tu
from verl.utils import torch_functional as verl_F
from verl.utils.metric import AggregationType, Metric
from verl.workers.config import EngineRouterReplayConfig, FSDPEngineConfig
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from verl_stable.compat import import_hooks
from verl_stable.integration import fsdp_engine as fe
from verl_stable.integration.fsdp_engine import ReplayAction, RouterReplayError, replay_action
from verl_stable.routing import RoutingTrace, capture, replay
from verl_stable.transport.expansion import MOE_ROUTING_FIELD

LENGTHS = [5, 7, 3, 6]
pytestmark = pytest.mark.usefixtures("cpu_runtime")  # tests/integration/conftest.py


# ------------------------------------------------------------------------------------------------ helpers
def _engine(model, cls=None, mode="R3", forward_only_engine=False, pad_to_length=False):
    """An engine instance with exactly the state verl's FSDPEngine.__init__ / initialize give it, minus FSDP."""
    cls = fe.engine_class() if cls is None else cls
    engine = cls.__new__(cls)
    engine.module = model
    engine.engine_config = FSDPEngineConfig(
        router_replay=EngineRouterReplayConfig(mode=mode), forward_only=forward_only_engine, use_torch_compile=False
    )
    engine.use_remove_padding = True
    engine.ulysses_device_mesh = None
    engine.ulysses_sequence_parallel_size = 1
    engine.use_ulysses_sp = False
    engine.pad_to_length = pad_to_length
    engine.pad_to_length_bucket = 8
    engine._autocast_dtype = torch.float32
    engine.scaler = None
    engine.compute_entropy_from_logits = verl_F.entropy_from_logits
    if isinstance(engine, fe.RouterReplayMixin):
        engine._init_router_replay(engine.engine_config)
        engine._bind_routing(strict=mode != "disabled" and not forward_only_engine)
    return engine


def _random_routing(num_tokens: int, seed: int) -> torch.Tensor:
    """[tokens, num_hidden_layers, K] distinct random experts in MoE layers, zero rows in the dense layer."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.zeros(num_tokens, NUM_LAYERS, TOPK, dtype=torch.int16)
    for layer in MOE_LAYERS:
        rows[:, layer] = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(num_tokens)]).to(
            torch.int16
        )
    return rows


def _batch(lengths=LENGTHS, routed=None, *, remove_padding=True, micro=2, dynamic=False, seed=0) -> TensorDict:
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    input_ids = torch.nested.nested_tensor_from_jagged(torch.randint(1, 64, (total,), generator=gen), offsets=offsets)
    position_ids = torch.nested.nested_tensor_from_jagged(torch.cat([torch.arange(n) for n in lengths]), offsets)
    loss_mask = torch.nested.nested_tensor_from_jagged(torch.ones(total, dtype=torch.int64), offsets)
    fields = {"input_ids": input_ids, "position_ids": position_ids, "loss_mask": loss_mask}
    if routed is not None:
        fields["routed_experts"] = torch.nested.nested_tensor_from_jagged(routed, offsets)
    td = TensorDict(fields, batch_size=[len(lengths)])
    tu.assign_non_tensor(
        td,
        use_remove_padding=remove_padding,
        temperature=1.0,
        pad_token_id=0,
        use_dynamic_bsz=dynamic,
        micro_batch_size_per_gpu=micro,
        max_token_len_per_gpu=12,
        return_model_output=True,
    )
    return td


def _sum_logp_loss(model_output, data, dp_group=None):
    loss = -model_output["log_probs"].values().sum()
    return loss, {}


def _run(engine, data, forward_only=True, loss=None):
    out = engine.forward_backward_batch(data, loss_function=loss, forward_only=forward_only)
    return out["model_output"], out["metrics"]


def _metric(metrics, name):
    """The per-micro-batch values of one of our metrics, which reach verl as ``Metric`` objects."""
    value = metrics[fe.METRIC_PREFIX + name]
    assert isinstance(value, Metric), f"{name} must reach verl as a Metric, got {type(value).__name__}"
    return value.values


def _packed_trace(routed: torch.Tensor) -> RoutingTrace:
    """The MoE-layer trace of packed rows (zero rows = no data), built without the alignment module."""
    ids = routed[:, list(MOE_LAYERS)].to(torch.long)
    zero = (ids == 0).all(dim=-1, keepdim=True)
    return RoutingTrace.from_tensor(ids.masked_fill(zero, -1), num_experts=EXPERTS)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# ----------------------------------------------------------------------------------------------- decisions
@pytest.mark.parametrize(
    ("mode", "forward_only", "engine_forward_only", "reference", "has_routing", "flag", "expected"),
    [
        ("R2", True, False, False, False, None, ReplayAction.RECORD),  # pi_old pass
        ("R2", False, False, False, True, None, ReplayAction.REPLAY),  # update mini-steps
        ("R3", True, False, False, True, None, ReplayAction.REPLAY),
        ("R3", False, False, False, True, None, ReplayAction.REPLAY),
        ("R3", True, True, False, True, None, ReplayAction.NONE),  # the reference engine never replays
        ("R2", True, True, False, True, None, ReplayAction.NONE),
        ("R3", True, False, True, True, None, ReplayAction.NONE),  # LoRA actor computing the reference
        ("R3", True, False, False, True, False, ReplayAction.NONE),  # verl's worker flag says no
        ("disabled", True, False, False, False, None, ReplayAction.NONE),
        ("disabled", False, False, False, True, None, ReplayAction.OBSERVE),
        ("disabled", True, True, False, True, None, ReplayAction.NONE),
    ],
)
def test_replay_action_table(mode, forward_only, engine_forward_only, reference, has_routing, flag, expected):
    action = replay_action(
        mode,
        forward_only=forward_only,
        engine_forward_only=engine_forward_only,
        reference_pass=reference,
        batch_has_routing=has_routing,
        worker_flag=flag,
    )
    assert action is expected


def test_replay_action_rejects_unknown_mode():
    with pytest.raises(ValueError, match="router_replay.mode must be one of"):
        replay_action("R4", forward_only=True, engine_forward_only=False, reference_pass=False, batch_has_routing=True)


# ----------------------------------------------------------------------------------------------- R2 record
@pytest.mark.parametrize("remove_padding", [True, False])
def test_r2_record_returns_the_models_own_routing_and_leaves_log_probs_unchanged(remove_padding):
    model = engine_model()
    data = _batch(remove_padding=remove_padding, micro=2)
    base = _engine(model, cls=FSDPEngineWithLMHead)
    with capture(model, use_attention_mask=True) as rec:
        ref_out, _ = _run(base, _batch(remove_padding=remove_padding, micro=2))
    out, metrics = _run(_engine(model, mode="R2"), data)

    assert torch.equal(out["log_probs"].values(), ref_out["log_probs"].values())
    routed = out["routed_experts"]
    assert routed.dtype == torch.int16 and routed.is_nested
    assert torch.equal(routed.offsets(), data["input_ids"].offsets())
    values = routed.values()
    assert values.shape == (sum(LENGTHS), NUM_LAYERS, TOPK)
    assert not values[:, 1].any(), "the dense decoder layer must hold zero rows"
    # The library, told where the valid tokens are by verl's own model inputs, saw the same routing.
    assert torch.equal(values[:, list(MOE_LAYERS)].to(torch.long), rec.trace.to_tensor())
    assert _metric(metrics, "recorded_rows") == [2.0 * n for n in (12, 9)]


def test_r2_recorded_routing_follows_its_sample_through_dynamic_micro_batches():
    model = engine_model()
    fixed, _ = _run(_engine(model, mode="R2"), _batch(micro=1))
    dynamic, _ = _run(_engine(model, mode="R2"), _batch(dynamic=True))
    for a, b in zip(fixed["routed_experts"].unbind(), dynamic["routed_experts"].unbind(), strict=True):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------- replay
def test_r3_forces_the_rollout_routing_in_compute_log_prob():
    model = engine_model()
    routed = _random_routing(sum(LENGTHS), seed=1)
    out, metrics = _run(_engine(model, mode="R3"), _batch(routed=routed, micro=4))
    base = _engine(model, cls=FSDPEngineWithLMHead)
    with replay(model, _packed_trace(routed)):
        ref_out, _ = _run(base, _batch(micro=4))
    natural, _ = _run(base, _batch(micro=4))

    assert torch.equal(out["log_probs"].values(), ref_out["log_probs"].values())
    assert not torch.equal(out["log_probs"].values(), natural["log_probs"].values())
    assert _metric(metrics, "disagreement") == [0.0]
    assert _metric(metrics, "router_disagreement")[0] > 0.5  # random routing vs the router's own choice
    assert _metric(metrics, "replayed_rows") == [sum(LENGTHS) * len(MOE_LAYERS)]
    assert _metric(metrics, "missing_rows") == [0.0]
    assert "routed_experts" not in out


def test_r3_padded_layout_matches_the_library_placing_rows_by_attention_mask():
    model = engine_model()
    routed = _random_routing(sum(LENGTHS), seed=2)
    out, metrics = _run(_engine(model, mode="R3"), _batch(routed=routed, remove_padding=False, micro=4))
    with replay(model, _packed_trace(routed)):
        ref_out, _ = _run(_engine(model, cls=FSDPEngineWithLMHead), _batch(remove_padding=False, micro=4))
    assert torch.equal(out["log_probs"].values(), ref_out["log_probs"].values())
    assert _metric(metrics, "disagreement") == [0.0]
    assert _metric(metrics, "padding_rows") == [(4 * 7 - sum(LENGTHS)) * len(MOE_LAYERS)]


def test_r3_with_pad_to_length_keeps_pad_rows_on_the_models_routing():
    model = engine_model()
    routed = _random_routing(sum(LENGTHS), seed=3)
    out, metrics = _run(_engine(model, mode="R3", pad_to_length=True), _batch(routed=routed, micro=4))
    with replay(model, _packed_trace(routed)):
        ref_out, _ = _run(_engine(model, cls=FSDPEngineWithLMHead), _batch(micro=4))
    assert torch.allclose(out["log_probs"].values(), ref_out["log_probs"].values(), atol=1e-6)
    assert _metric(metrics, "padding_rows") == [(24 - 21) * len(MOE_LAYERS)]
    assert _metric(metrics, "disagreement") == [0.0]


def test_r3_on_the_compact_transports_moe_rows_replays_exactly_as_on_verls_rows():
    """The FSDP engine aligns the compact transport's MoE-layer rows (uint8, no dense layers) as verl's int16 rows."""
    model = engine_model()
    routed = _random_routing(sum(LENGTHS), seed=6)
    routed[torch.tensor(LENGTHS).cumsum(0) - 1] = 0  # rows without data travel as zero rows in both forms
    verl_out, verl_metrics = _run(_engine(model, mode="R3"), _batch(routed=routed, micro=4))
    data = _batch(micro=4)
    moe_rows = routed[:, list(MOE_LAYERS)].to(torch.uint8)
    data[MOE_ROUTING_FIELD] = torch.nested.nested_tensor_from_jagged(moe_rows, data["input_ids"].offsets())
    out, metrics = _run(_engine(model, mode="R3"), data)
    assert torch.equal(out["log_probs"].values(), verl_out["log_probs"].values())
    for name in ("disagreement", "replayed_rows", "missing_rows", "router_disagreement"):
        assert _metric(metrics, name) == _metric(verl_metrics, name)
    assert _metric(metrics, "missing_rows") == [len(LENGTHS) * len(MOE_LAYERS)]
    # rows for another layer count are refused with both shapes named
    bad = _batch(micro=4)
    bad[MOE_ROUTING_FIELD] = torch.nested.nested_tensor_from_jagged(routed.to(torch.uint8), bad["input_ids"].offsets())
    with pytest.raises(RouterReplayError, match=r"\(3, 2\) but the .* expects \[2 MoE layers, top_k 2\]"):
        _run(_engine(model, mode="R3"), bad)


def test_rows_without_data_keep_the_models_routing_and_are_counted():
    model = engine_model()
    routed = _random_routing(sum(LENGTHS), seed=4)
    last = torch.tensor(LENGTHS).cumsum(0) - 1
    routed[last] = 0  # the rollout engine has no row for the last sampled token
    out, metrics = _run(_engine(model, mode="R3"), _batch(routed=routed, micro=4))
    # Reference: the library replaying the same rows, the zero rows marked missing (-1) by hand.
    with replay(model, _packed_trace(routed)) as rp:
        ref_out, _ = _run(_engine(model, cls=FSDPEngineWithLMHead), _batch(micro=4))
    assert rp.stats.missing_rows == len(LENGTHS) * len(MOE_LAYERS)
    assert torch.equal(out["log_probs"].values(), ref_out["log_probs"].values())
    assert _metric(metrics, "missing_rows") == [len(LENGTHS) * len(MOE_LAYERS)]
    assert _metric(metrics, "replayed_rows") == [(sum(LENGTHS) - len(LENGTHS)) * len(MOE_LAYERS)]
    assert _metric(metrics, "disagreement") == [0.0]


def test_r2_update_replays_pi_old_routing_bit_for_bit_with_router_gradients():
    # Natural update vs R2 update replaying the pi_old routing recorded on the same weights: identical loss and
    # identical gradients, router included (gate weights recomputed from the live logits).
    model = engine_model()
    recorded, _ = _run(_engine(model, mode="R2"), _batch(micro=2))
    model.zero_grad()
    natural, _ = _run(_engine(model, cls=FSDPEngineWithLMHead), _batch(micro=2), False, _sum_logp_loss)
    natural_grads = _grads(model)
    model.zero_grad()
    data = _batch(routed=recorded["routed_experts"].values(), micro=2)
    replayed, metrics = _run(_engine(model, mode="R2"), data, False, _sum_logp_loss)
    grads = _grads(model)
    assert torch.equal(replayed["log_probs"].values(), natural["log_probs"].values())
    router = "model.layers.0.mlp.gate.weight"
    assert grads[router].abs().sum() > 0
    assert natural_grads.keys() == grads.keys()
    for name in grads:
        assert torch.equal(grads[name], natural_grads[name]), name
    assert _metric(metrics, "disagreement") == [0.0, 0.0]
    assert _metric(metrics, "router_disagreement") == [0.0, 0.0]


def test_r2_padded_update_with_other_micro_batches_replays_the_same_rows():
    # The e2e layout: pi_old recorded on one big padded micro-batch, updates on smaller padded micro-batches.
    model = engine_model()
    recorded, _ = _run(_engine(model, mode="R2"), _batch(remove_padding=False, micro=4))
    data = _batch(routed=recorded["routed_experts"].values(), remove_padding=False, micro=1)
    natural, _ = _run(_engine(model, cls=FSDPEngineWithLMHead), _batch(remove_padding=False, micro=1))
    out, metrics = _run(_engine(model, mode="R2"), data, False, _sum_logp_loss)
    assert _metric(metrics, "disagreement") == [0.0] * 4
    assert _metric(metrics, "router_disagreement") == [0.0] * 4  # same weights: pi_old's routing is the router's
    assert _metric(metrics, "padding_rows") == [0.0] * 4  # one sample per micro-batch: no pad rows
    assert torch.allclose(out["log_probs"].values(), natural["log_probs"].values(), atol=1e-6)


def test_r2_drift_per_mini_step_against_the_perturbed_router_by_hand():
    # Two update mini-steps replaying the same pi_old routing; between them the last MoE layer's router is perturbed
    # (as an optimizer step would). Layer 0 is untouched, so every hidden state entering layer 2 is what pi_old saw
    # and the live router's choice there is top-k(h @ W'^T), computed here by hand.
    model = engine_model()
    recorded, _ = _run(_engine(model, mode="R2"), _batch(micro=4))
    pi_old = recorded["routed_experts"].values().to(torch.long)
    data = _batch(routed=recorded["routed_experts"].values(), micro=4)
    engine = _engine(model, mode="R2")
    _, step0 = _run(engine, data, False, _sum_logp_loss)
    assert _metric(step0, "r2_drift") == [0.0]  # same weights as pi_old: no drift
    assert _metric(step0, "r2_drift/layer_0") == _metric(step0, "r2_drift/layer_1") == [0.0]

    gate = model.model.layers[2].mlp.gate
    with torch.no_grad():
        gate.weight.add_(0.05 * torch.randn(gate.weight.shape, generator=torch.Generator().manual_seed(9)))
    hidden = []
    handle = model.model.layers[2].mlp.register_forward_pre_hook(lambda _m, args: hidden.append(args[0].detach()))
    try:
        _, step1 = _run(engine, _batch(routed=recorded["routed_experts"].values(), micro=4), False, _sum_logp_loss)
    finally:
        handle.remove()
    h = hidden[-1].reshape(-1, hidden[-1].shape[-1])
    assert h.shape[0] == sum(LENGTHS)
    live = torch.topk(h @ gate.weight.detach().T, TOPK, dim=-1).indices.sort(-1).values
    differ = (live != pi_old[:, 2].sort(-1).values).any(-1)
    drift_layer2 = differ.double().mean().item()
    assert 0 < drift_layer2 < 1, "the perturbation should move some but not all routing decisions"
    assert _metric(step1, "r2_drift/layer_0") == [0.0]
    assert _metric(step1, "r2_drift/layer_1") == [pytest.approx(drift_layer2)]  # MoE-layer ordinal 1 = layer 2
    assert _metric(step1, "r2_drift") == [pytest.approx(drift_layer2 / 2)]  # over (token, MoE layer) rows
    assert _metric(step1, "router_disagreement") == _metric(step1, "r2_drift")
    assert _metric(step1, "disagreement") == [0.0]  # the update still used pi_old's experts
    assert step1[fe.METRIC_PREFIX + "r2_drift"].aggregation is AggregationType.MEAN


def test_r3_and_observe_report_no_r2_drift():
    model = engine_model()
    routed = _random_routing(sum(LENGTHS), seed=10)
    _, r3 = _run(_engine(model, mode="R3"), _batch(routed=routed, micro=4), False, _sum_logp_loss)
    _, observed = _run(_engine(model, mode="disabled"), _batch(routed=routed, micro=4), False, _sum_logp_loss)
    for metrics in (r3, observed):
        assert _metric(metrics, "router_disagreement")[0] > 0.5
        assert not any(key.startswith(fe.METRIC_PREFIX + "r2_drift") for key in metrics)


def test_loss_extremes_are_relabelled_for_verls_per_mini_step_aggregation():
    def loss_with_stats(model_output, data, dp_group=None):
        loss, _ = _sum_logp_loss(model_output, data)
        n = float(data["input_ids"].offsets()[-1])
        stats = {"actor/stable/staleness/ratio_max": n, "actor/stable/staleness/ratio_mean": n, "actor/x_max": n}
        return loss, Metric.from_dict(stats, aggregation=AggregationType.MEAN)  # what verl's ppo_loss hands back

    _, metrics = _run(_engine(engine_model(), mode="disabled"), _batch(micro=2), False, loss_with_stats)
    micro_tokens = [5.0 + 7.0, 3.0 + 6.0]
    assert metrics["actor/stable/staleness/ratio_max"].aggregation is AggregationType.MAX
    assert metrics["actor/stable/staleness/ratio_max"].values == micro_tokens
    assert Metric.aggregate_dp([metrics["actor/stable/staleness/ratio_max"]]) == 12.0
    assert metrics["actor/stable/staleness/ratio_mean"].aggregation is AggregationType.MEAN
    assert metrics["actor/x_max"].aggregation is AggregationType.MEAN  # not ours: verl's choice is kept


def test_replay_survives_gradient_checkpointing_recompute():
    routed = _random_routing(sum(LENGTHS), seed=5)
    grads = []
    for checkpointing in (False, True):
        model = engine_model()
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        _run(_engine(model, mode="R3"), _batch(routed=routed, micro=2), False, _sum_logp_loss)
        grads.append(_grads(model))
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6), name


# ----------------------------------------------------------------------------------------------- never replay
def test_reference_engine_and_reference_pass_never_replay():
    model = engine_model()
    routed = _random_routing(sum(LENGTHS), seed=6)
    natural, _ = _run(_engine(model, cls=FSDPEngineWithLMHead), _batch(micro=4))
    ref_engine = _engine(model, mode="R3", forward_only_engine=True)
    out, metrics = _run(ref_engine, _batch(routed=routed, micro=4))
    assert torch.equal(out["log_probs"].values(), natural["log_probs"].values())
    assert not any(k.startswith(fe.METRIC_PREFIX) for k in metrics)

    actor = _engine(model, mode="R3")
    with actor._reference_scope(nullcontext()):
        out, metrics = _run(actor, _batch(routed=routed, micro=4))
    assert torch.equal(out["log_probs"].values(), natural["log_probs"].values())
    assert not any(k.startswith(fe.METRIC_PREFIX) for k in metrics)


def test_disabled_is_verls_engine_and_only_observes_when_routing_is_present():
    model = engine_model()
    natural, natural_metrics = _run(_engine(model, cls=FSDPEngineWithLMHead), _batch(micro=2))
    out, metrics = _run(_engine(model, mode="disabled"), _batch(micro=2))
    assert torch.equal(out["log_probs"].values(), natural["log_probs"].values())
    assert metrics == natural_metrics and set(out.keys()) == set(natural.keys())

    routed = _random_routing(sum(LENGTHS), seed=7)
    out, metrics = _run(_engine(model, mode="disabled"), _batch(routed=routed, micro=2))
    assert torch.equal(out["log_probs"].values(), natural["log_probs"].values())
    assert min(_metric(metrics, "disagreement")) > 0.5
    assert _metric(metrics, "disagreement") == _metric(metrics, "router_disagreement")


def test_disagreement_per_layer_and_per_token_against_a_routing_changed_in_one_layer_by_hand():
    # The reference routing is the model's own (recorded by an R2 log-prob pass) except in MoE layer 2 (ordinal 1),
    # where every other token gets random experts: observing it, the engine must find disagreement only there.
    model = engine_model()
    recorded, _ = _run(_engine(model, mode="R2"), _batch(micro=len(LENGTHS)))
    natural = recorded["routed_experts"].values().clone()
    target = natural.clone()
    changed = torch.arange(natural.shape[0]) % 2 == 0
    target[changed, 2] = _random_routing(natural.shape[0], seed=11)[changed, 2]
    differ = (target[:, 2].sort(-1).values != natural[:, 2].sort(-1).values).any(-1)
    assert 0 < int(differ.sum()) <= int(changed.sum())
    share = differ.double().mean().item()
    _, metrics = _run(_engine(model, mode="disabled"), _batch(routed=target, micro=len(LENGTHS)))
    assert _metric(metrics, "disagreement/layer_0") == [0.0]
    assert _metric(metrics, "disagreement/layer_1") == [pytest.approx(share)]
    assert _metric(metrics, "disagreement/layer_max") == [pytest.approx(share)]
    assert _metric(metrics, "disagreement") == [pytest.approx(share / 2)]  # over (token, MoE layer) rows
    assert _metric(metrics, "disagreement/token_any_layer") == [pytest.approx(share)]  # one layer differs per token
    _, replayed = _run(_engine(model, mode="R3"), _batch(routed=target, micro=len(LENGTHS)))
    assert _metric(replayed, "disagreement/layer_max") == [0.0]  # R3 used exactly the target
    assert _metric(replayed, "disagreement/token_any_layer") == [0.0]


# ----------------------------------------------------------------------------------------------- errors
def test_replay_without_routing_names_the_missing_switch():
    engine = _engine(engine_model(), mode="R3")
    with pytest.raises(RouterReplayError, match="enable_rollout_routing_replay=True"):
        _run(engine, _batch(micro=2))
    r2 = _engine(engine_model(), mode="R2")
    with pytest.raises(RouterReplayError, match="bypass_mode"):
        _run(r2, _batch(micro=2), False, _sum_logp_loss)


def test_bad_routing_shapes_raise_with_expected_and_received():
    engine = _engine(engine_model(), mode="R3")
    moe_only = _random_routing(sum(LENGTHS), seed=8)[:, list(MOE_LAYERS)]
    with pytest.raises(RouterReplayError, match=r"\[2 layers, top_k 2\].*\[3 decoder layers, top_k 2\]"):
        _run(engine, _batch(routed=moe_only, micro=2))
    out_of_range = _random_routing(sum(LENGTHS), seed=8)
    out_of_range[0, 0] = torch.tensor([EXPERTS, 1], dtype=torch.int16)
    with pytest.raises(ValueError, match="expert id 8 out of range"):
        _run(engine, _batch(routed=out_of_range, micro=2))
    data = _batch(routed=_random_routing(sum(LENGTHS), seed=8), micro=2)
    shifted = torch.tensor([0, 6, 12, 15, 21])
    data["routed_experts"] = torch.nested.nested_tensor_from_jagged(data["routed_experts"].values(), shifted)
    with pytest.raises(
        RouterReplayError, match=r"rows per sample \[6, 6\] do not match the input_ids lengths \[5, 7\]"
    ):
        _run(engine, data)
    assert engine._replay_pass is None, "a failed pass must remove its hooks"


def test_replay_on_a_dense_model_fails_at_bind_time():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dense = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        )
    )
    with pytest.raises(RouterReplayError, match="needs a Hugging Face MoE model"):
        _engine(dense, mode="R3")
    _engine(dense, mode="disabled")  # disabled never requires a MoE model


# ----------------------------------------------------------------------------------------------- registration
@contextmanager
def _engine_env(device: str, vendor: str):
    saved = {k: os.environ.get(k) for k in ("VERL_ENGINE_DEVICE", "VERL_ENGINE_VENDOR")}
    os.environ["VERL_ENGINE_DEVICE"], os.environ["VERL_ENGINE_VENDOR"] = device, vendor
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_register_selects_the_replay_engine_for_cuda_and_cpu_without_touching_verls_keys():
    first = fe.register()
    assert fe.register() == first  # idempotent
    cls = fe.engine_class()
    for device, vendor in (("cuda", "nvidia"), ("cuda", "amd"), ("cpu", "cpu")):
        with _engine_env(device, vendor):
            for backend in ("fsdp", "fsdp2"):
                assert EngineRegistry.get_engine_cls("language_model", backend) is cls
    assert EngineRegistry._engines["language_model"]["fsdp"]["cuda"] is FSDPEngineWithLMHead
    with _engine_env("cuda", "nvidia"):
        assert EngineRegistry.get_engine_cls("value_model", "fsdp") is not cls


def test_register_refuses_a_key_held_by_another_engine():
    table = EngineRegistry._engines["language_model"]["fsdp"]
    saved = table[("cpu", "cpu")]
    table[("cpu", "cpu")] = FSDPEngineWithLMHead
    try:
        with pytest.raises(RuntimeError, match="already held by"):
            fe.register_engine()
    finally:
        table[("cpu", "cpu")] = saved


def test_register_waits_for_verls_engine_package_through_the_shared_import_hook(monkeypatch):
    # This process imported verl's engines already; a process that has not is simulated by hiding the package.
    with import_hooks.hooks_restored():
        monkeypatch.delitem(sys.modules, fe.ENGINE_PACKAGE)
        pending = fe.register()
        assert pending == [
            "engine:language_model/fsdp|fsdp2/cuda:nvidia|cuda:amd|cpu:cpu (on import of verl.workers.engine)"
        ]
        assert fe.register() == pending  # idempotent: still one hook
        (hook,) = import_hooks.pending_hooks(fe.ENGINE_PACKAGE)
        assert hook.callback is fe.register_engine and import_hooks.finder_installed()
        monkeypatch.setattr(fe, "NATIVE_REPLAY_MODULE", "verl.utils.tensordict_utils")
        assert fe.register()[0].startswith("skipped: verl has native FSDP router replay")
        assert import_hooks.pending_hooks(fe.ENGINE_PACKAGE) == []  # stepping aside cancels the pending hook


@pytest.mark.e2e
def test_plugin_registration_is_deferred_until_verl_imports_its_engines():
    code = (
        "import sys, verl\n"
        "from verl_stable.integration import fsdp_engine as fe\n"
        "print(fe.register()[0].endswith('(on import of verl.workers.engine)'))\n"
        "print('verl.workers.engine' in sys.modules)\n"
        "from verl.workers.engine import EngineRegistry\n"
        "print(EngineRegistry._engines['language_model']['fsdp2'][('cpu', 'cpu')].__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False", "FSDPEngineWithLMHeadReplay"]


# ----------------------------------------------------------------------------------------------- end to end
# This engine runs through verl's real trainer (main_ppo, V1) on the CPU runtime with the ``hf`` rollout exporting
# routing in: tests/integration/test_rollout_routing.py::test_e2e_r3_actors_receive_the_compact_form_and_replay_it (R3,
# bf16 rollout, two update mini-steps of two micro-batches), tests/integration/test_data_parallel_r2_e2e.py (R2, the
# minirl_n2_r2 recipe) and tests/integration/test_monitor_e2e.py (replay off: the bf16 rollout's routing differs).


# ----------------------------------------------------------------------------------------------- upstream verl
# A verl that replays routing in its own FSDP engine (verl 0.9.1 + patches/verl-0.9.1-fsdp-router-replay.diff): the
# plugin must leave verl's engine in place, or every routing site would be recorded / replayed twice.
def _patch_test_module():
    import importlib

    directory = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "patches")
    if directory not in sys.path:
        sys.path.insert(0, directory)  # what pytest's default (prepend) import mode does for that test file
    return importlib.import_module("test_fsdp_router_replay_patch")


patched_verl = _patch_test_module().patched_verl  # fixture: a copy of the installed verl with the diff applied


def test_register_steps_aside_when_verl_ships_the_native_replay_module(monkeypatch):
    engines = {b: dict(EngineRegistry._engines["language_model"][b]) for b in fe.BACKENDS}
    monkeypatch.setattr(fe, "NATIVE_REPLAY_MODULE", "verl.utils.tensordict_utils")  # a module this verl has
    assert fe.verl_has_native_replay()
    assert fe.register() == ["skipped: verl has native FSDP router replay (verl.utils.tensordict_utils)"]
    assert {b: EngineRegistry._engines["language_model"][b] for b in fe.BACKENDS} == engines
    assert import_hooks.pending_hooks(fe.ENGINE_PACKAGE) == []
    monkeypatch.setattr(fe, "NATIVE_REPLAY_MODULE", "verl.utils.no_such_module_here")
    assert not fe.verl_has_native_replay()
    assert fe.register()[0].startswith("engine:language_model/")  # verl 0.9.1 as installed: our engine


_NATIVE_CHECK = """
import json, os, sys
import verl  # loads verl-stable's plugin through verl's entry points, as every verl process does
from verl_stable.integration import fsdp_engine as fe, plugin
from verl_stable.compat import import_hooks
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl_stable.cpu import engines

engines.register(force=True)  # verl's engines on device cpu, as in a process that selected the CPU platform
selected = {}
for device, vendor in (("cuda", "nvidia"), ("cuda", "amd"), ("cpu", "cpu")):
    os.environ["VERL_ENGINE_DEVICE"], os.environ["VERL_ENGINE_VENDOR"] = device, vendor
    for backend in ("fsdp", "fsdp2"):
        cls = EngineRegistry.get_engine_cls("language_model", backend)
        selected[f"{backend}/{device}:{vendor}"] = f"{cls.__module__}.{cls.__qualname__}"
status = plugin.STATUS["fsdp_router_replay"]
print(json.dumps({
    "verl_file": verl.__file__,
    "engine_file": sys.modules[FSDPEngineWithLMHead.__module__].__file__,
    "selected": selected,
    "step_ok": status.ok,
    "step_registered": status.registered,
    "subclass_built": fe._ENGINE_CLASS is not None,
    "registered_classes": sorted({c.__qualname__ for t in EngineRegistry._engines["language_model"].values()
                                  for c in t.values()}),
    "import_hook_left": bool(import_hooks.pending_hooks("verl.workers.engine")),
}))
"""


def test_plugin_leaves_verls_engine_in_place_on_a_verl_with_native_fsdp_replay(patched_verl):
    env = dict(os.environ, PYTHONPATH=str(patched_verl), OMP_NUM_THREADS="1")
    env.pop("VERL_USE_EXTERNAL_PLUGINS", None)  # "auto": verl loads the verl-stable plugin itself
    proc = subprocess.run(
        [sys.executable, "-c", _NATIVE_CHECK], env=env, cwd=patched_verl, capture_output=True, text=True, timeout=300
    )
    import json

    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["verl_file"].startswith(str(patched_verl)) and result["engine_file"].startswith(str(patched_verl))
    native = "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead"
    assert set(result["selected"].values()) == {native}, result["selected"]
    assert result["step_ok"]
    assert result["step_registered"] == ["skipped: verl has native FSDP router replay (verl.utils.fsdp_router_replay)"]
    assert not result["subclass_built"] and not result["import_hook_left"]
    assert "FSDPEngineWithLMHeadReplay" not in result["registered_classes"]


# ------------------------------------------------------------------- gradients under replay, against the gate formula
def _gate_formula_forward(block, ids: torch.Tensor):
    """Qwen3-MoE's sparse block written out at given expert ids, independent of transformers' and our routing code:
    ``p = softmax(x W_r^T)``, ``w_k = p[ids_k] / sum_j p[ids_j]`` (``norm_topk_prob``), ``y = sum_k w_k E_{ids_k}(x)``
    with ``E_e(x) = (act(x G_e^T) * (x U_e^T)) D_e^T``: the router's gradient flows through ``w`` only."""
    experts = block.experts

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        assert x.shape[0] == ids.shape[0], "the reference needs one id row per token of the micro-batch"
        probs = torch.softmax(x @ block.gate.weight.T, dim=-1, dtype=torch.float)
        w = probs.gather(1, ids)
        if block.gate.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        gate_up = experts.gate_up_proj[ids]  # [T, K, 2I, H]
        g, u = torch.einsum("th,tkih->tki", x, gate_up).chunk(2, dim=-1)
        y = torch.einsum("tki,tkhi->tkh", experts.act_fn(g) * u, experts.down_proj[ids])
        return (w.to(y.dtype).unsqueeze(-1) * y).sum(dim=1).reshape(shape)

    return forward


@contextmanager
def _blocks_at(model, routed: torch.Tensor):
    """Every MoE block of ``model`` computes :func:`_gate_formula_forward` at the packed rows' ids of its layer."""
    blocks = {layer: model.model.layers[layer].mlp for layer in MOE_LAYERS}
    try:
        for layer, block in blocks.items():
            block.forward = _gate_formula_forward(block, routed[:, layer].to(torch.long))
        yield
    finally:
        for block in blocks.values():
            del block.forward


@pytest.mark.parametrize(("routes", "norm_topk_prob"), [("native", False), ("other", False), ("other", True)])
def test_r3_update_gradients_equal_the_gate_formula_at_the_replayed_ids(routes, norm_topk_prob):
    """Through verl's FSDP engine, an R3 update's log-probs and every gradient (router included) equal verl's own
    engine running the MoE blocks written out at the same ids: the router's own choice (``native``: then also the
    natural model's) or random other experts (``other``: the gate weights are the live softmax at the replayed ids,
    renormalised over them with ``norm_topk_prob``)."""
    model = engine_model()
    model.config.norm_topk_prob = norm_topk_prob
    for layer in MOE_LAYERS:
        model.model.layers[layer].mlp.gate.norm_topk_prob = norm_topk_prob
    if routes == "native":
        routed = _run(_engine(model, mode="R2"), _batch(micro=4))[0]["routed_experts"].values()
    else:
        routed = _random_routing(sum(LENGTHS), seed=3)
    model.zero_grad()
    out, _ = _run(_engine(model, mode="R3"), _batch(routed=routed, micro=4), False, _sum_logp_loss)
    replayed = _grads(model)
    model.zero_grad()
    with _blocks_at(model, routed):  # one micro-batch of the four samples in order: rows in the packed order
        ref, _ = _run(_engine(model, cls=FSDPEngineWithLMHead), _batch(micro=4), False, _sum_logp_loss)
    reference = _grads(model)
    assert torch.allclose(out["log_probs"].values(), ref["log_probs"].values(), atol=1e-5)
    router = "model.layers.0.mlp.gate.weight"
    assert replayed.keys() == reference.keys() and reference[router].abs().sum() > 0
    for name, grad in replayed.items():
        assert torch.allclose(grad, reference[name], rtol=1e-4, atol=1e-6), name
    if routes == "native":
        model.zero_grad()
        natural, _ = _run(_engine(model, cls=FSDPEngineWithLMHead), _batch(micro=4), False, _sum_logp_loss)
        assert torch.equal(natural["log_probs"].values(), out["log_probs"].values())
        for name, grad in _grads(model).items():
            assert torch.equal(grad, replayed[name]), name
