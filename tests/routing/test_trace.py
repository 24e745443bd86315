"""RoutingTrace: compact storage, ragged sequences, the -1 sentinel, validation errors."""

from __future__ import annotations

import pytest
import torch

from verl_stable.routing import MISSING, RoutingLayout, RoutingTrace, RoutingTraceError, storage_dtype


def _ids(n: int, layers: int = 3, k: int = 2, experts: int = 8, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, layers, experts, generator=g).argsort(-1)[..., :k]


def test_storage_dtype_is_the_smallest_unsigned_type_that_holds_the_ids():
    assert storage_dtype(1) == torch.uint8
    assert storage_dtype(256) == torch.uint8
    assert storage_dtype(257) == torch.uint16
    assert storage_dtype(65536) == torch.uint16
    assert storage_dtype(65537) == torch.int32
    with pytest.raises(RoutingTraceError, match="num_experts must be >= 1"):
        storage_dtype(0)


def test_tensor_round_trip_with_missing_rows_and_sequences():
    ids = _ids(7)
    ids[2, 1] = MISSING
    ids[6, 0] = MISSING
    trace = RoutingTrace.from_tensor(ids, num_experts=8, lengths=[3, 0, 4], layer_indices=[1, 3, 5])
    assert trace.ids.dtype == torch.uint8 and trace.ids.dtype.itemsize == 1
    assert trace.num_missing == 2 and trace.num_sequences == 3
    assert torch.equal(trace.to_tensor(), ids)
    assert trace.valid_mask()[2, 1].item() is False
    assert trace.offsets().tolist() == [0, 3, 3, 7]
    parts = trace.split()
    assert [p.num_tokens for p in parts] == [3, 0, 4]
    assert torch.equal(RoutingTrace.cat(parts).to_tensor(), ids)
    assert torch.equal(trace.sequence(-1).to_tensor(), ids[3:])
    restored = RoutingTrace.from_state_dict(trace.state_dict())
    assert torch.equal(restored.to_tensor(), ids) and restored.lengths.tolist() == [3, 0, 4]
    assert restored.layer_indices == (1, 3, 5)
    assert trace.nbytes == 7 * 3 * 2 + 7 * 3


def test_large_expert_counts_use_uint16():
    ids = torch.tensor([[[300, 5]], [[0, 299]]])
    trace = RoutingTrace.from_tensor(ids, num_experts=301)
    assert trace.ids.dtype == torch.uint16
    assert torch.equal(trace.to_tensor(), ids)


def test_all_valid_mask_is_dropped_and_valid_trace_has_no_missing_rows():
    trace = RoutingTrace(ids=_ids(4).to(torch.uint8), num_experts=8, valid=torch.ones(4, 3, dtype=torch.bool))
    assert trace.valid is None and trace.num_missing == 0


@pytest.mark.parametrize(
    ("ids", "kwargs", "message"),
    [
        (torch.zeros(4, 3), {}, "integer tensor"),
        (torch.zeros(4, 3, dtype=torch.long), {}, r"\[tokens, moe_layers, top_k\]"),
        (torch.tensor([[[0, 8]]]), {}, r"expert id 8 out of range: expected ids in \[0, 8\)"),
        (torch.tensor([[[-2, 1]]]), {}, "expert id -2 out of range"),
        (torch.tensor([[[-1, 1]]]), {}, "mixes -1 with expert ids"),
        (torch.tensor([[[3, 3]]]), {}, "repeats an expert id"),
        (torch.tensor([[[0, 1]], [[2, 3]]]), {"lengths": [1, 2]}, "lengths sum to 3 but the trace has 2"),
        (torch.tensor([[[0, 1]]]), {"lengths": [-1, 2]}, "lengths must be >= 0"),
        (torch.tensor([[[0, 1]]]), {"layer_indices": [0, 1]}, "names 2 layers but ids has 1"),
    ],
)
def test_from_tensor_rejects_bad_input(ids, kwargs, message):
    with pytest.raises(RoutingTraceError, match=message):
        RoutingTrace.from_tensor(ids, num_experts=8, **kwargs)


def test_constructor_rejects_wrong_dtype_and_valid_shape():
    with pytest.raises(RoutingTraceError, match="dtype must be torch.uint8 for 8 experts, got torch.int64"):
        RoutingTrace(ids=_ids(2), num_experts=8)
    with pytest.raises(RoutingTraceError, match=r"valid must be a bool tensor of shape \(2, 3\)"):
        RoutingTrace(ids=_ids(2).to(torch.uint8), num_experts=8, valid=torch.ones(2, dtype=torch.bool))
    with pytest.raises(RoutingTraceError, match=r"expert id 9 out of range: expected ids in \[0, 8\)"):
        RoutingTrace(ids=torch.full((1, 1, 2), 9, dtype=torch.uint8), num_experts=8)
    with pytest.raises(RoutingTraceError, match=r"expert id 400 out of range: expected ids in \[0, 300\)"):
        RoutingTrace(ids=torch.full((1, 1, 1), 400).to(torch.uint16), num_experts=300)
    with pytest.raises(RoutingTraceError, match="missing fields"):
        RoutingTrace.from_state_dict({"ids": _ids(2).to(torch.uint8)})
    with pytest.raises(IndexError, match="sequence 1 out of range"):
        RoutingTrace.from_tensor(_ids(2), num_experts=8).sequence(1)


def test_validate_for_names_expected_and_received_values():
    layout = RoutingLayout("qwen3_moe", "qwen3_moe", num_hidden_layers=4, moe_layers=(1, 3), top_k=2, num_experts=8)
    RoutingTrace.from_tensor(_ids(3, layers=2), num_experts=8, layer_indices=[1, 3]).validate_for(layout)
    with pytest.raises(
        RoutingTraceError, match=r"3 MoE layers but the qwen3_moe model has 2 \(decoder layers \[1, 3\]\)"
    ):
        RoutingTrace.from_tensor(_ids(3), num_experts=8).validate_for(layout)
    with pytest.raises(RoutingTraceError, match="top_k=3 but the model routes top_k=2"):
        RoutingTrace.from_tensor(_ids(3, layers=2, k=3), num_experts=8).validate_for(layout)
    with pytest.raises(RoutingTraceError, match="num_experts=9 but the model has 8"):
        RoutingTrace.from_tensor(_ids(3, layers=2), num_experts=9).validate_for(layout)
    with pytest.raises(RoutingTraceError, match="traces differ in top_k: expected 2, received 3"):
        RoutingTrace.cat(
            [RoutingTrace.from_tensor(_ids(3), num_experts=8), RoutingTrace.from_tensor(_ids(3, k=3), num_experts=8)]
        )
    assert layout.bytes_per_token == 2 * 2 * 1 and layout.trace_dtype == torch.uint8
