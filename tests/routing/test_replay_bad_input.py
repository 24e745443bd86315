"""Issue #14: the input holes of replay and disagreement, closed like the rest of the package (issue #13).

A replay never indexes with an id it has not checked (ids edited in place after a trace was built are refused, as
are rows made valid that carry no routing), a token mask must be bool and laid out like the input, and the
disagreement functions refuse non-integer ids (a NaN "id" would count as a flip) and non-trace arguments.
"""

from __future__ import annotations

import pytest
import torch
from routing_testkit import padded_batch, tiny_model

from verl_stable.routing import (
    MISSING,
    RoutingTrace,
    RoutingTraceError,
    bind_model,
    capture,
    expert_sets_differ,
    replay,
    routing_disagreement,
)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3_moe")  # MoE decoder layers 0 and 2, top-2 of 8 experts


def _trace(model, num_tokens: int, seed: int = 3) -> RoutingTrace:
    layout = bind_model(model).layout
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, layout.num_moe_layers, layout.num_experts, generator=g)
    return RoutingTrace.from_tensor(scores.argsort(dim=-1)[..., : layout.top_k], layout.num_experts)


def _no_hooks_left(model) -> bool:
    return not model._forward_pre_hooks and not model._forward_hooks


# ------------------------------------------------------------------------------------------------------ replay
def test_replay_refuses_an_out_of_range_id_written_into_a_built_trace(model):
    trace = _trace(model, 5)
    trace.ids[2, 1, 0] = 200  # the dataclass is frozen, its tensors are not
    with pytest.raises(
        RoutingTraceError, match=r"replay: expert id 200 out of range: expected ids in \[0, 8\)"
    ) as info:
        with replay(model, trace):
            pass
    assert type(info.value) is RoutingTraceError and "modified after it was built" in str(info.value)
    assert _no_hooks_left(model)


def test_set_trace_refuses_a_repeated_id_written_into_a_built_trace(model):
    ids, mask = padded_batch([3, 2], 3)
    good, bad = _trace(model, 5), _trace(model, 5, seed=4)
    bad.ids[1, 0, 1] = bad.ids[1, 0, 0]
    with torch.no_grad(), replay(model, good) as rp:
        with pytest.raises(RoutingTraceError, match=r"replay: token 1, MoE layer 0 repeats an expert id") as info:
            rp.set_trace(bad)
        assert type(info.value) is RoutingTraceError
        assert rp.trace is good  # the refused trace replaced nothing
        model(ids, attention_mask=mask)
    assert rp.stats.replayed_rows == 10


def test_replay_never_invents_routing_for_a_row_made_valid_after_construction(model):
    dense = _trace(model, 4).to_tensor()
    dense[2, 1] = MISSING
    trace = RoutingTrace.from_tensor(dense, 8)
    assert trace.num_missing == 1
    trace.valid[2, 1] = True  # the row holds no ids (zeros): replaying it would force experts 0 and 0
    with pytest.raises(RoutingTraceError, match=r"replay: token 2, MoE layer 1 repeats an expert id \(\[0, 0\]\)"):
        with replay(model, trace):
            pass


@pytest.mark.parametrize(
    ("token_mask", "got"),
    [
        (torch.tensor([1.0, float("nan"), 1.0, 1.0, 1.0]), "torch.float32"),
        (torch.ones(5, dtype=torch.long), "torch.int64"),
        ([True] * 5, "list"),
        (
            torch.nested.as_nested_tensor(
                [torch.ones(3, dtype=torch.bool), torch.ones(2, dtype=torch.bool)], layout=torch.jagged
            ),
            "a nested",
        ),
    ],
)
def test_replay_refuses_a_token_mask_that_is_not_bool_and_names_what_it_got(model, token_mask, got):
    with pytest.raises(RoutingTraceError, match=f"token_mask must be a bool tensor, got {got}") as info:
        with replay(model, _trace(model, 5), token_mask=token_mask):
            pass
    assert type(info.value) is RoutingTraceError


def test_replay_refuses_a_token_mask_laid_out_unlike_the_input(model):
    ids = torch.randint(3, 90, (2, 3), generator=torch.Generator().manual_seed(0))
    trace = _trace(model, 4)
    transposed = torch.tensor([[True, True], [False, True], [True, False]])  # [S, B]: same count, other layout
    with pytest.raises(
        RoutingTraceError, match=r"token_mask of shape \(3, 2\) does not match the forward's input: expected \(2, 3\)"
    ):
        with torch.no_grad(), replay(model, trace, token_mask=transposed):
            model(ids)
    # [B, S], flat and [1, B * S] all place the rows row-major, like before
    for shaped in (transposed.T.contiguous(), transposed.T.reshape(-1), transposed.T.reshape(1, -1)):
        with torch.no_grad(), replay(model, trace, token_mask=shaped), capture(model, use_attention_mask=False) as rec:
            model(ids)
        assert torch.equal(rec.trace.to_tensor()[shaped.reshape(-1)], trace.to_tensor())


# ------------------------------------------------------------------------------------------------ disagreement
@pytest.mark.parametrize(
    ("a", "message"),
    [
        (torch.tensor([[float("nan"), 1.0]]), "expert ids must be an integer tensor, got torch.float32"),
        (torch.tensor([[True, False]]), "expert ids must be an integer tensor, got torch.bool"),
        ([[0, 1]], r"expected a dense \[..., top_k\] id tensor, got list"),
        (torch.tensor(1), "expected \\[..., top_k\\] ids with a top-k dimension, got a 0-d tensor"),
    ],
)
def test_expert_sets_differ_refuses_ids_that_are_not_integer_tensors(a, message):
    with pytest.raises(RoutingTraceError, match=f"expert_sets_differ a: {message}") as info:
        expert_sets_differ(a, torch.tensor([[0, 1]]))
    assert type(info.value) is RoutingTraceError
    with pytest.raises(RoutingTraceError, match=f"expert_sets_differ b: {message}"):
        expert_sets_differ(torch.tensor([[0, 1]]), a)


def test_expert_sets_differ_still_takes_any_integer_ids():
    a = torch.tensor([[MISSING, MISSING], [3, 1], [300, 2]], dtype=torch.int32)
    b = torch.tensor([[MISSING, MISSING], [1, 3], [2, 301]], dtype=torch.int64)
    assert expert_sets_differ(a, b).tolist() == [False, False, True]
    assert expert_sets_differ(a.to(torch.uint16)[1:], b.to(torch.uint16)[1:]).tolist() == [False, True]


def test_routing_disagreement_refuses_arguments_that_are_not_traces():
    trace = RoutingTrace.from_tensor(torch.tensor([[[0, 1]]]), 4)
    with pytest.raises(TypeError, match="routing_disagreement needs RoutingTrace objects, got Tensor for a"):
        routing_disagreement(trace.to_tensor(), trace)
    with pytest.raises(TypeError, match="routing_disagreement needs RoutingTrace objects, got Tensor for b"):
        routing_disagreement(trace, trace.to_tensor())


# ------------------------------------------------------------------------------------ checked rows (the engine)
def test_checked_rows_replay_exactly_like_the_trace_they_came_from(model):
    """``set_checked_rows`` skips the trace's checks, not its meaning: same outputs, stats and (lazy) trace."""
    from verl_stable.routing.replay import RoutingReplayer

    routing = bind_model(model)
    ids, mask = padded_batch([3, 2], 3)
    dense = _trace(model, 5).to_tensor()
    dense[1, 0] = MISSING  # a row without data keeps the model's own routing on both paths
    trace = RoutingTrace.from_tensor(dense, 8, layer_indices=routing.layout.moe_layers)
    with torch.no_grad():
        own = model(ids, attention_mask=mask).logits
        with replay(model, trace) as reference:
            want = model(ids, attention_mask=mask).logits
        checked = RoutingReplayer(model, routing, None, checked_rows=dense)
        checked.install()
        try:
            got = model(ids, attention_mask=mask).logits
        finally:
            checked.remove()
    assert not torch.allclose(own, want)  # the trace changes the routing: equal outputs below are not vacuous
    assert torch.equal(got, want)
    assert checked.stats.as_dict() == reference.stats.as_dict() and checked.stats.missing_rows == 1
    assert torch.equal(checked.trace.to_tensor(), trace.to_tensor()) and checked.trace.layer_indices == (0, 2)
    assert _no_hooks_left(model)


def test_checked_rows_refuse_what_does_not_fit_the_model(model):
    from verl_stable.routing.replay import RoutingReplayer

    routing = bind_model(model)
    rows = _trace(model, 4).to_tensor()
    with pytest.raises(RoutingTraceError, match=r"int64 \[tokens, moe_layers, top_k\] tensor, got torch.int16"):
        RoutingReplayer(model, routing, None, checked_rows=rows.to(torch.int16))
    with pytest.raises(RoutingTraceError, match=r"\[1 MoE layers, top_k 2\], the model expects \[2 MoE layers"):
        RoutingReplayer(model, routing, None, checked_rows=rows[:, :1])
    with pytest.raises(ValueError, match="a trace or checked_rows, not both"):
        RoutingReplayer(model, routing, _trace(model, 4), checked_rows=rows)
    with pytest.raises(RoutingTraceError, match="token_mask marks 3 token rows but the trace has 4"):
        RoutingReplayer(model, routing, None, checked_rows=rows, token_mask=torch.tensor([True, True, True, False]))
    assert _no_hooks_left(model)
