"""Capture and replay on tiny models of every supported family, checked against independent references."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from routing_testkit import FAMILY_MODEL_TYPES, padded_batch, tiny_model

from verl_stable.routing import (
    RoutingTrace,
    RoutingTraceError,
    bind_model,
    capture,
    replay,
    routing_disagreement,
)
from verl_stable.routing.families import ROUTE_METHOD

FAMILIES = pytest.mark.parametrize("model_type", FAMILY_MODEL_TYPES)


def _random_trace(layout, num_tokens: int, seed: int = 7, lengths=None) -> RoutingTrace:
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, layout.num_moe_layers, layout.num_experts, generator=g)
    ids = scores.argsort(dim=-1)[..., : layout.top_k]
    return RoutingTrace.from_tensor(ids, num_experts=layout.num_experts, lengths=lengths)


def _blocks(model):
    routing = bind_model(model)
    modules = dict(model.named_modules())
    out = []
    for site in routing.sites:
        name = site.name if routing.spec.site_kind == ROUTE_METHOD else site.name.rsplit(".", 1)[0]
        out.append(modules[name])
    return out


# ------------------------------------------------------------------------------------- reference MoE blocks
def _expert(experts, e: int, x: torch.Tensor, model_type: str) -> torch.Tensor:
    if model_type == "gpt_oss":
        gate_up = x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
        gate = gate_up[..., ::2].clamp(max=experts.limit)
        up = gate_up[..., 1::2].clamp(min=-experts.limit, max=experts.limit)
        glu = gate * torch.sigmoid(gate * experts.alpha)
        return ((up + 1) * glu) @ experts.down_proj[e] + experts.down_proj_bias[e]
    gate, up = (x @ experts.gate_up_proj[e].T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ experts.down_proj[e].T


def _reference_block(model_type: str, config, block, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """MoE block output for rows x [T, H] routed to ids [T, K], written from the papers' formulas."""
    if model_type in ("deepseek_v3", "glm4_moe"):
        s = torch.sigmoid(x.float() @ block.gate.weight.float().T)
        w = s.gather(1, ids)
        if config.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        w = w * config.routed_scaling_factor
    elif model_type == "gpt_oss":
        z = x @ block.router.weight.T + block.router.bias
        w = torch.softmax(z.gather(1, ids), dim=-1)
    else:
        p = torch.softmax(x.float() @ block.gate.weight.float().T, dim=-1)
        w = p.gather(1, ids)
        if model_type in ("mixtral", "qwen3_5_moe_text") or config.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
    experts = block.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            out[t] = out[t] + w[t, k] * _expert(experts, int(ids[t, k]), x[t], model_type)
    if model_type in ("qwen2_moe", "qwen3_5_moe_text"):
        out = out + torch.sigmoid(x @ block.shared_expert_gate.weight.T) * block.shared_expert(x)
    if model_type in ("deepseek_v3", "glm4_moe"):
        out = out + block.shared_experts(x)
    return out


# --------------------------------------------------------------------------------------------------- tests
@FAMILIES
def test_capture_then_replay_is_identical_to_plain_forward(model_type):
    model = tiny_model(model_type)
    ids, mask = padded_batch([6, 9, 3], 9)
    with torch.no_grad():
        plain = model(ids, attention_mask=mask).logits
        with capture(model) as rec:
            captured = model(ids, attention_mask=mask).logits
        trace = rec.trace
        roundtrip = RoutingTrace.from_tensor(trace.to_tensor(), num_experts=trace.num_experts)
        with replay(model, roundtrip) as rp:
            replayed = model(ids, attention_mask=mask).logits
    assert torch.equal(plain, captured)
    assert torch.equal(plain, replayed)
    layout = bind_model(model).layout
    assert trace.ids.dtype == torch.uint8
    assert trace.lengths.tolist() == [6, 9, 3]
    assert tuple(trace.ids.shape) == (18, layout.num_moe_layers, layout.top_k)
    assert trace.layer_indices == layout.moe_layers
    assert rp.stats.replayed_rows == 18 * layout.num_moe_layers
    assert rp.stats.padding_rows == (27 - 18) * layout.num_moe_layers
    assert rp.stats.missing_rows == 0


@FAMILIES
def test_replayed_routing_matches_independent_moe_forward_and_router_gradient(model_type):
    model = tiny_model(model_type)
    layout = bind_model(model).layout
    ids, mask = padded_batch([5, 4], 5, seed=3)
    trace = _random_trace(layout, 9)
    blocks = _blocks(model)
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = [
        b.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, (a[0], o[0] if isinstance(o, tuple) else o)))
        for i, b in enumerate(blocks)
    ]
    try:
        with replay(model, trace):
            model(ids, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()
    rows = mask.reshape(-1).bool()
    forced = trace.to_tensor()
    r = torch.randn(int(rows.sum()), model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for ordinal, block in enumerate(blocks):
        x_in, y = seen[ordinal]
        x = x_in.reshape(-1, x_in.shape[-1])[rows].detach()
        y = y.reshape(-1, y.shape[-1])[rows]
        expected = _reference_block(model_type, model.config, block, x, forced[:, ordinal])
        torch.testing.assert_close(y, expected, atol=2e-5, rtol=1e-4)
        router = block.router if model_type == "gpt_oss" else block.gate
        got = torch.autograd.grad((y * r).sum(), router.weight, retain_graph=True)[0]
        want = torch.autograd.grad((expected * r).sum(), router.weight)[0]
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@FAMILIES
def test_router_parameters_get_gradients_under_replay(model_type):
    model = tiny_model(model_type).train()
    layout = bind_model(model).layout
    ids, mask = padded_batch([8, 6], 8, seed=5)
    with replay(model, _random_trace(layout, 14)):
        logits = model(ids, attention_mask=mask).logits
        logits.float().log_softmax(-1).mean().backward()
    for site in bind_model(model).sites:
        router = site.module.gate if model_type in ("deepseek_v3", "glm4_moe") else site.module
        assert router.weight.grad is not None and torch.isfinite(router.weight.grad).all()
        assert router.weight.grad.abs().sum() > 0, f"no gradient reached the router of layer {site.layer}"


@FAMILIES
def test_gradient_checkpointing_recompute_sees_the_replayed_rows(model_type):
    base = tiny_model(model_type)
    layout = bind_model(base).layout
    ids, mask = padded_batch([7, 4, 6], 7, seed=9)
    trace = _random_trace(layout, 17, seed=2)
    grads = []
    for checkpointing in (False, True):
        model = copy.deepcopy(base).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        with replay(model, trace) as rp:
            model(ids, attention_mask=mask, use_cache=False).logits.float().logsumexp(-1).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        if checkpointing:
            assert rp.stats.recompute_calls == layout.num_moe_layers
            assert rp.stats.replayed_rows == 17 * layout.num_moe_layers  # recompute not double counted
            with capture(model) as rec:
                model(ids, attention_mask=mask, use_cache=False).logits.sum().backward()
            assert rec.trace.num_tokens == 17  # recompute appends nothing
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5, msg=name)


@FAMILIES
def test_packed_inputs_take_consecutive_rows(model_type):
    model = tiny_model(model_type)
    lengths = [5, 7, 3]
    ids, mask = padded_batch(lengths, 7, left=False)
    packed = torch.cat([ids[i, :n] for i, n in enumerate(lengths)]).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with torch.no_grad():
        with capture(model) as padded_rec:
            model(ids, attention_mask=mask)
        padded_trace = padded_rec.trace
        # the padded batch's rows land, in order, on the packed rows
        with replay(model, padded_trace), capture(model) as nested:
            model(packed, position_ids=positions)
        assert torch.equal(nested.trace.ids, padded_trace.ids)
        plain = model(packed, position_ids=positions).logits
        with capture(model) as rec:
            model(packed, position_ids=positions)
        with replay(model, rec.trace):
            again = model(packed, position_ids=positions).logits
    assert torch.equal(plain, again)


@FAMILIES
def test_missing_rows_and_padding_keep_the_model_routing_and_are_counted(model_type):
    model = tiny_model(model_type)
    layout = bind_model(model).layout
    ids, mask = padded_batch([6, 4], 6, seed=11)
    with torch.no_grad(), capture(model) as own:
        model(ids, attention_mask=mask)
    forced = _random_trace(layout, 10, seed=4).to_tensor()
    missing = torch.zeros(10, layout.num_moe_layers, dtype=torch.bool)
    missing[[0, 3, 9], 0] = True
    missing[[2, 3], -1] = True
    forced[missing] = -1
    trace = RoutingTrace.from_tensor(forced, num_experts=layout.num_experts)
    assert trace.num_missing == int(missing.sum())
    with torch.no_grad(), replay(model, trace) as rp, capture(model, use_attention_mask=False) as got:
        model(ids, attention_mask=mask)
    all_rows = got.trace.to_tensor()  # every routed row, padding included
    rows = mask.reshape(-1).bool()
    valid_rows = all_rows[rows]
    assert torch.equal(valid_rows[~missing], forced[~missing])
    # model's own routing where the trace has no data; own routing was captured on the same input
    own_ids = own.trace.to_tensor()
    assert torch.equal(valid_rows[missing], own_ids[missing])
    assert rp.stats.missing_rows == int(missing.sum())
    assert rp.stats.replayed_rows == 10 * layout.num_moe_layers - int(missing.sum())
    assert rp.stats.padding_rows == 2 * layout.num_moe_layers
    with torch.no_grad(), capture(model, use_attention_mask=False) as plain:
        model(ids, attention_mask=mask)
    assert torch.equal(all_rows[~rows], plain.trace.to_tensor()[~rows])  # padding rows: own routing, not expert 0


@FAMILIES
def test_kv_cache_generation_capture_per_sequence(model_type):
    model = tiny_model(model_type)
    ids, mask = padded_batch([4, 6], 6, seed=21)
    with torch.no_grad(), capture(model) as rec:
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    assert len(rec.forwards) == 3  # prefill + 2 decode steps; the last sampled token is never fed
    per_seq = rec.per_sequence()
    assert per_seq.lengths.tolist() == [4 + 2, 6 + 2]
    fed = out[:, :-1]
    fed_mask = torch.cat([mask, torch.ones(2, 2, dtype=mask.dtype)], dim=1)
    with torch.no_grad(), capture(model) as full:
        model(fed, attention_mask=fed_mask)
    # a full forward over the fed tokens routes the same tokens the same way (tiny fp32 model, decisive router)
    assert routing_disagreement(full.trace, per_seq)["overall"] == 0.0
    assert rec.trace.num_tokens == per_seq.num_tokens


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_context_exit_restores_the_model_also_on_exception(model_type):
    model = tiny_model(model_type)
    ids, mask = padded_batch([5, 5], 5)
    sites = bind_model(model).sites

    def hooks_state():
        return [
            (len(m._forward_hooks), len(m._forward_pre_hooks), sorted(vars(m)))
            for m in [model, *[s.module for s in sites]]
        ]

    before = hooks_state()
    with torch.no_grad():
        plain = model(ids, attention_mask=mask).logits
        trace = _random_trace(bind_model(model).layout, 10)
        with pytest.raises(RuntimeError, match="boom"):
            with replay(model, trace), capture(model):
                model(ids, attention_mask=mask)
                raise RuntimeError("boom")
        assert hooks_state() == before
        assert torch.equal(model(ids, attention_mask=mask).logits, plain)
        with replay(model, trace):
            pass
        assert hooks_state() == before


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_contexts_may_exit_in_any_order(model_type):
    model = tiny_model(model_type)
    ids, mask = padded_batch([5, 3], 5)
    sites = [s.module for s in bind_model(model).sites]
    before = [sorted(vars(m)) for m in sites]
    with torch.no_grad():
        with capture(model) as own:
            model(ids, attention_mask=mask)
        trace = _random_trace(bind_model(model).layout, 8)
        replay_cm, capture_cm = replay(model, trace), capture(model)
        replay_cm.__enter__()
        rec = capture_cm.__enter__()
        model(ids, attention_mask=mask)
        replay_cm.__exit__(None, None, None)  # outer context leaves first
        model(ids, attention_mask=mask)
        capture_cm.__exit__(None, None, None)
    assert [sorted(vars(m)) for m in sites] == before
    assert rec.trace.lengths.tolist() == [5, 3, 5, 3]
    forced, after = rec.trace.ids[:8], rec.trace.ids[8:]
    assert torch.equal(forced, trace.ids)  # replay active: capture saw the replayed ids
    assert torch.equal(after, own.trace.ids)  # replay gone: the model's own routing


def test_set_trace_switches_micro_batches_inside_one_context():
    model = tiny_model("qwen3_moe")
    layout = bind_model(model).layout
    a_ids, a_mask = padded_batch([3, 5], 5, seed=1)
    b_ids, b_mask = padded_batch([4], 4, seed=2)
    ta, tb = _random_trace(layout, 8, seed=1), _random_trace(layout, 4, seed=2)
    with torch.no_grad(), replay(model, ta) as rp, capture(model) as rec:
        model(a_ids, attention_mask=a_mask)
        rp.set_trace(tb)
        model(b_ids, attention_mask=b_mask)
    assert torch.equal(rec.trace.ids, RoutingTrace.cat([ta, tb]).ids)
    assert rp.stats.forwards == 2


def test_token_mask_overrides_the_attention_mask():
    model = tiny_model("olmoe")
    layout = bind_model(model).layout
    ids = torch.randint(3, 90, (2, 5), generator=torch.Generator().manual_seed(0))
    token_mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    trace = _random_trace(layout, 5)
    with torch.no_grad(), replay(model, trace, token_mask=token_mask), capture(model, use_attention_mask=False) as rec:
        model(ids)
    assert torch.equal(rec.trace.to_tensor()[token_mask.reshape(-1)], trace.to_tensor())


def test_mixtral_jitter_in_training_mode_still_uses_replayed_experts():
    model = tiny_model("mixtral", router_jitter_noise=0.2).train()
    layout = bind_model(model).layout
    ids, mask = padded_batch([6, 6], 6)
    trace = _random_trace(layout, 12)
    with replay(model, trace), capture(model) as rec:
        model(ids, attention_mask=mask).logits.sum().backward()
    assert torch.equal(rec.trace.ids, trace.ids)
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------- error paths
def test_replay_rejects_traces_that_do_not_fit_the_model():
    model = tiny_model("qwen3_moe")  # 2 MoE layers (decoder layers 0 and 2), top-2 of 8
    ids, mask = padded_batch([4, 3], 4)
    good = _random_trace(bind_model(model).layout, 7)
    cases = [
        (
            torch.zeros(7, 3, 2, dtype=torch.long) + torch.arange(2),
            8,
            None,
            "3 MoE layers but the qwen3_moe model has 2",
        ),
        (torch.zeros(7, 2, 3, dtype=torch.long) + torch.arange(3), 8, None, "top_k=3 but the model routes top_k=2"),
        (good.to_tensor(), 16, None, "num_experts=16 but the model has 8 experts"),
        (good.to_tensor(), 8, [0, 1], r"decoder layers \[0, 1\] but the model's MoE layers are \[0, 2\]"),
    ]
    for tensor, experts, layers, message in cases:
        trace = RoutingTrace.from_tensor(tensor, num_experts=experts, layer_indices=layers)
        with pytest.raises(RoutingTraceError, match=message):
            with replay(model, trace):
                pass
    with pytest.raises(RoutingTraceError, match="trace has 6 token rows but the forward has 7 valid tokens"):
        with replay(model, good.slice_tokens(0, 6)):
            model(ids, attention_mask=mask)
    with pytest.raises(RoutingTraceError, match="trace has 7 token rows but the forward has 2x4 = 8 tokens"):
        with replay(model, good):
            model(ids)
    with pytest.raises(RoutingTraceError, match="token_mask marks 3 token rows but the trace has 7"):
        with replay(model, good, token_mask=torch.tensor([True, True, True])):
            pass
    with pytest.raises(TypeError, match="needs a RoutingTrace"):
        with replay(model, good.to_tensor()):
            pass


def test_capture_and_replay_refuse_a_bypassed_moe_block(monkeypatch):
    model = tiny_model("qwen3_moe")
    ids, mask = padded_batch([3], 3)
    block_cls = type(model.model.layers[0].mlp)
    monkeypatch.setattr(block_cls, "forward", lambda self, h: torch.zeros_like(h))
    with pytest.raises(Exception, match=r"routers of MoE decoder layers \[0, 2\] did not run"):
        with capture(model):
            model(ids, attention_mask=mask)
