"""Compact routing transport: per-sample fields, group-deduplicated packing, selection per rank, byte counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_stable.routing.codecs import LayerMapError, RoutedRows, RowCountError, encode_verl_batch, rows_to_trace
from verl_stable.routing.trace import RoutingLayout
from verl_stable.transport.fields import (
    IDS_FIELD,
    SPAN_FIELD,
    rows_from_fields,
    sample_fields,
    trace_from_fields,
)
from verl_stable.transport.packed import PackedRouting

LAYOUT = RoutingLayout("qwen3_moe", "qwen3_moe", 6, (1, 2, 4, 5), 4, 16)


def random_ids(rng: np.random.Generator, rows: int) -> np.ndarray:
    scores = rng.random((rows, LAYOUT.num_moe_layers, LAYOUT.num_experts))
    return np.argsort(scores, axis=-1)[..., : LAYOUT.top_k].astype(np.uint8)


def make_group_batch(rng, num_groups, n, prompt_lens, response_lens):
    """Samples whose prompt rows are identical within a group, as a rollout engine reports them."""
    samples, groups, plens, seq_lens = [], [], [], []
    for g in range(num_groups):
        prompt = random_ids(rng, prompt_lens[g])
        for j in range(n):
            r = response_lens[g * n + j]
            samples.append(RoutedRows(0, np.concatenate([prompt, random_ids(rng, r - 1)])))
            groups.append(f"uid-{g}")
            plens.append(prompt_lens[g])
            seq_lens.append(prompt_lens[g] + r)
    return samples, groups, plens, seq_lens


def assert_same(got: RoutedRows | None, want: RoutedRows | None) -> None:
    if want is None or want.num_rows == 0:
        assert got is None or got.num_rows == 0
        return
    assert got is not None and got.start == want.start
    np.testing.assert_array_equal(got.ids, want.ids)


@settings(max_examples=30, deadline=None)
@given(
    num_groups=st.integers(1, 4),
    n=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_pack_round_trip_and_prompt_stored_once(num_groups, n, seed):
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(1, 9, size=num_groups).tolist()
    response_lens = rng.integers(1, 9, size=num_groups * n).tolist()
    samples, groups, plens, seq_lens = make_group_batch(rng, num_groups, n, prompt_lens, response_lens)
    packed = PackedRouting.pack(samples, plens, groups, LAYOUT)
    for got, want in zip(packed.unpack(), samples, strict=True):
        assert_same(got, want)
    assert packed.stats.prompt_rows == sum(plens)
    assert packed.stats.prompt_rows_stored == sum(prompt_lens)
    assert packed.stats.prompt_mismatches == 0
    # ids hold each prompt once plus every response's rows, nothing else
    assert packed.ids.shape[0] == sum(prompt_lens) + sum(r - 1 for r in response_lens)
    assert packed.ids.dtype == torch.uint8
    # selection keeps sharing and content
    idx = rng.permutation(len(samples))[: max(1, len(samples) // 2)].tolist()
    sub = packed.select(idx)
    for got, i in zip(sub.unpack(), idx, strict=True):
        assert_same(got, samples[i])
    # the token-aligned trace is the same as building it from the unpacked rows
    trace = packed.to_trace(seq_lens, LAYOUT)
    ref = rows_to_trace(samples, seq_lens, LAYOUT)
    assert torch.equal(trace.to_tensor(), ref.to_tensor())


def test_prompt_rows_that_differ_are_kept_apart():
    """Batch-variant prefill can give siblings different prompt routing: store both, never merge."""
    rng = np.random.default_rng(0)
    samples, groups, plens, _ = make_group_batch(rng, 1, 3, [5], [3, 3, 3])
    changed = samples[2].ids.copy()
    changed[1, 0] = np.roll(samples[2].ids[1, 0], 1)  # still distinct ids, different order = different row bytes
    samples[2] = RoutedRows(0, changed)
    packed = PackedRouting.pack(samples, plens, groups, LAYOUT)
    assert packed.stats.prompt_mismatches == 1 and packed.stats.prompt_rows_stored == 10
    for got, want in zip(packed.unpack(), samples, strict=True):
        assert_same(got, want)


def test_prompt_offsets_and_missing_samples():
    rng = np.random.default_rng(1)
    a = RoutedRows(2, random_ids(rng, 6))  # prompt 5 with offset 2: prompt rows are positions 2..4
    b = RoutedRows(2, np.concatenate([a.ids[:3], random_ids(rng, 2)]))
    c = RoutedRows(0, random_ids(rng, 7))  # same group, no offset: its prompt segment is distinct
    packed = PackedRouting.pack([a, None, b, c], [5, 5, 5, 5], ["g", "g", "g", "g"], LAYOUT)
    assert packed.prompt_segment[0] == packed.prompt_segment[2] and packed.prompt_segment[1] == -1
    assert packed.stats.prompt_rows_stored == 3 + 5
    for got, want in zip(packed.unpack(), [a, None, b, c], strict=True):
        assert_same(got, want)


def test_pack_rejects_wrong_layout():
    bad = RoutedRows(0, np.zeros((3, 2, 4), dtype=np.uint8))
    with pytest.raises(LayerMapError, match="2 MoE layers"):
        PackedRouting.pack([bad], [2], ["g"], LAYOUT)
    packed = PackedRouting.pack([RoutedRows(0, random_ids(np.random.default_rng(2), 3))], [2], ["g"], LAYOUT)
    other = RoutingLayout("qwen3_moe", "qwen3_moe", 6, (1, 2, 4, 5), 4, 32)
    with pytest.raises(LayerMapError, match="16 experts"):
        packed.to_trace([4], other)


def test_sample_fields_through_a_jagged_batch():
    """The V1 carrier: per-sample tensors stacked jagged like verl's list_of_dict_to_tensordict does."""
    rng = np.random.default_rng(3)
    samples = [RoutedRows(0, random_ids(rng, 6)), None, RoutedRows(1, random_ids(rng, 2))]
    seq_lens = [7, 3, 4]
    samples[0].ids.flags.writeable = False  # as vLLM may hand it out
    fields = [sample_fields(s, LAYOUT) for s in samples]
    assert not np.shares_memory(fields[0][IDS_FIELD].numpy(), samples[0].ids)
    ids = torch.nested.as_nested_tensor([f[IDS_FIELD] for f in fields], layout=torch.jagged)
    spans = torch.stack([f[SPAN_FIELD] for f in fields])
    assert ids.dtype == torch.uint8 and spans.tolist() == [[0, 6], [0, 0], [1, 3]]
    for got, want in zip(rows_from_fields(ids, spans), samples, strict=True):
        assert_same(got, want)
    # TransferQueue returns even equal-sized per-sample fields jagged: [B, j] with j == 2
    jagged_spans = torch.nested.as_nested_tensor([f[SPAN_FIELD] for f in fields], layout=torch.jagged)
    for got, want in zip(rows_from_fields(ids, jagged_spans), samples, strict=True):
        assert_same(got, want)
    trace = trace_from_fields(ids, spans, seq_lens, LAYOUT)
    assert torch.equal(trace.to_tensor(), rows_to_trace(samples, seq_lens, LAYOUT).to_tensor())
    assert trace.num_missing == (1 + 3 + 2) * LAYOUT.num_moe_layers
    with pytest.raises(RowCountError, match="span"):
        rows_from_fields(ids, torch.tensor([[0, 5], [0, 0], [1, 3]]))


def test_compact_bytes_versus_verl_layout():
    """Hand-computed: uint8 over MoE layers vs int16 over all layers, with and without prompt sharing."""
    rng = np.random.default_rng(4)
    prompt, n, resp = 10, 4, 6
    samples, groups, plens, seq_lens = make_group_batch(rng, 2, n, [prompt, prompt], [resp] * 2 * n)
    verl = encode_verl_batch(samples, LAYOUT, seq_lens, nested=False)  # equal lengths: no padding at all
    verl_bytes = verl.numel() * verl.element_size()
    assert verl_bytes == 2 * n * (prompt + resp) * 6 * 4 * 2
    packed = PackedRouting.pack(samples, plens, groups, LAYOUT)
    rows = 2 * prompt + 2 * n * (resp - 1)
    assert packed.ids.numel() == rows * 4 * 4
    assert packed.nbytes == rows * 16 + 8 * (packed.segment_offsets.numel() + 4 * 2 * n)
    assert packed.nbytes < 0.5 * verl_bytes


def test_jagged_parts_are_the_samples_unbind_gives():
    """The offsets-sliced views equal ``unbind`` (zero-length samples too), and other layouts fall back to it."""
    from verl_stable.routing.checks import jagged_parts

    parts = [torch.arange(n * 6).reshape(n, 3, 2) for n in (3, 0, 5, 1)]
    jagged = torch.nested.as_nested_tensor(parts, layout=torch.jagged)
    strided = torch.nested.nested_tensor(parts)
    dense = torch.stack([p[:1] for p in (parts[0], parts[2], parts[3])])
    for tensor, want in ((jagged, parts), (strided, parts), (dense, list(dense.unbind(0)))):
        got = jagged_parts(tensor)
        assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    with_holes = torch.nested.narrow(
        torch.arange(12).reshape(3, 4), 1, torch.tensor([0, 1, 2]), torch.tensor([2, 3, 1]), layout=torch.jagged
    )
    assert [p.tolist() for p in jagged_parts(with_holes)] == [[0, 1], [5, 6, 7], [10]]
