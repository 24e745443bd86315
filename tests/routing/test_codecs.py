"""Engine-boundary codecs: vLLM / SGLang / verl layouts, their documented quirks, and every validation error."""

from __future__ import annotations

import base64
import io
import logging

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_stable.routing.codecs import (
    BoundaryStats,
    DuplicateExpertError,
    ExpertIdRangeError,
    LayerMapError,
    RoutedRows,
    RoutingFormatError,
    RowCountError,
    ZeroRoutingError,
    concat_partial_rollout,
    decode_sglang,
    decode_verl_batch,
    decode_verl_sample,
    decode_vllm,
    decode_vllm_openai,
    decode_with_policy,
    encode_sglang,
    encode_verl_batch,
    encode_verl_sample,
    encode_vllm,
    rows_to_trace,
    smallest_uint_dtype,
    trace_to_rows,
    validate_ids,
)
from verl_stable.routing.trace import RoutingLayout

# 6 decoder layers, dense at 0 and 3 (DeepSeek/Qwen-style mixed stack), top-4 of 16 experts.
LAYOUT = RoutingLayout("qwen3_moe", "qwen3_moe", 6, (1, 2, 4, 5), 4, 16)
BIG = RoutingLayout("qwen3_moe", "qwen3_moe", 3, (0, 1, 2), 2, 300)  # > 256 experts: uint16


def random_ids(rng: np.random.Generator, rows: int, layout: RoutingLayout = LAYOUT) -> np.ndarray:
    """Distinct top-k ids per (token, layer), as a router would choose."""
    scores = rng.random((rows, layout.num_moe_layers, layout.num_experts))
    return np.argsort(scores, axis=-1)[..., : layout.top_k].astype(smallest_uint_dtype(layout.num_experts))


def full_layers(moe_ids: np.ndarray, layout: RoutingLayout = LAYOUT, dtype=np.uint8) -> np.ndarray:
    out = np.zeros((moe_ids.shape[0], layout.num_hidden_layers, layout.top_k), dtype=dtype)
    out[:, list(layout.moe_layers)] = moe_ids
    return out


# --------------------------------------------------------------------------------------------------- vLLM
@settings(max_examples=40, deadline=None)
@given(
    prompt_len=st.integers(1, 20),
    response_len=st.integers(1, 20),
    start_frac=st.floats(0, 1),
    seed=st.integers(0, 2**16),
    big=st.booleans(),
)
def test_vllm_round_trip(prompt_len, response_len, start_frac, seed, big):
    layout = BIG if big else LAYOUT
    prompt_start = int(start_frac * prompt_len)
    rows = RoutedRows(
        prompt_start, random_ids(np.random.default_rng(seed), prompt_len - prompt_start + response_len - 1, layout)
    )
    raw = encode_vllm(rows, layout)
    assert raw.dtype == (np.uint16 if big else np.uint8)
    decoded = decode_vllm(
        raw, prompt_len=prompt_len, response_len=response_len, layout=layout, prompt_start=prompt_start
    )
    assert decoded.start == prompt_start and decoded.stop == prompt_len + response_len - 1
    assert decoded.ids.dtype == smallest_uint_dtype(layout.num_experts)
    np.testing.assert_array_equal(decoded.ids, rows.ids)


def test_vllm_hand_built_layout():
    """Dense layers are zero rows, MoE layers are picked by absolute index, the last token has no row."""
    layout = RoutingLayout("qwen3_moe", "qwen3_moe", 3, (1,), 2, 8)
    raw = np.array([[[0, 0], [3, 5], [0, 0]], [[0, 0], [7, 1], [0, 0]]], dtype=np.uint8)  # prompt 2, response 1
    out = decode_vllm(raw, prompt_len=2, response_len=1, layout=layout)
    assert out.start == 0 and out.ids.tolist() == [[[3, 5]], [[7, 1]]]


def test_vllm_missing_last_row_is_the_contract():
    rng = np.random.default_rng(0)
    raw = full_layers(random_ids(rng, 5 + 3))  # one row too many: as if the last token had a row
    with pytest.raises(RowCountError, match="8 routed rows, expected 7"):
        decode_vllm(raw, prompt_len=5, response_len=3, layout=LAYOUT)
    with pytest.raises(RowCountError, match="expected 9"):
        decode_vllm(raw, prompt_len=5, response_len=5, layout=LAYOUT)


def test_vllm_prompt_offset():
    rng = np.random.default_rng(1)
    ids = random_ids(rng, 10 - 4 + 3 - 1)
    out = decode_vllm(full_layers(ids), prompt_len=10, response_len=3, layout=LAYOUT, prompt_start=4)
    assert (out.start, out.stop) == (4, 12)
    with pytest.raises(RowCountError, match="prompt_start"):
        decode_vllm(full_layers(ids), prompt_len=10, response_len=3, layout=LAYOUT, prompt_start=11)


def test_vllm_openai_base64_npy():
    rng = np.random.default_rng(2)
    ids = random_ids(rng, 6)
    buffer = io.BytesIO()
    np.save(buffer, full_layers(ids))
    payload = base64.b64encode(buffer.getvalue()).decode()
    out = decode_vllm_openai(payload, prompt_len=4, response_len=3, layout=LAYOUT)
    np.testing.assert_array_equal(out.ids, ids)
    with pytest.raises(RoutingFormatError, match="base64 .npy"):
        decode_vllm_openai("not base64!", prompt_len=4, response_len=3, layout=LAYOUT)


def test_vllm_layer_map_errors():
    rng = np.random.default_rng(3)
    raw = full_layers(random_ids(rng, 4))
    with pytest.raises(LayerMapError, match="5 layers x top-4, the model has 6 decoder layers"):
        decode_vllm(raw[:, :5], prompt_len=3, response_len=2, layout=LAYOUT)
    raw[2, 3, :] = [1, 2, 3, 4]  # decoder layer 3 is dense in the map
    with pytest.raises(LayerMapError, match="decoder layer 3 is dense .* token position 2"):
        decode_vllm(raw, prompt_len=3, response_len=2, layout=LAYOUT)


# ------------------------------------------------------------------------------------------------- SGLang
@settings(max_examples=30, deadline=None)
@given(
    prompt_len=st.integers(1, 16),
    response_len=st.integers(1, 16),
    start_frac=st.floats(0, 1),
    seed=st.integers(0, 2**16),
    wire=st.sampled_from(["int32", "uint8", "int16"]),
)
def test_sglang_round_trip(prompt_len, response_len, start_frac, seed, wire):
    start = int(start_frac * prompt_len)
    rows = RoutedRows(start, random_ids(np.random.default_rng(seed), prompt_len + response_len - 1 - start))
    meta = encode_sglang(rows, LAYOUT, wire_dtype=wire)
    out = decode_sglang(meta, prompt_len=prompt_len, response_len=response_len, layout=LAYOUT)
    assert out.start == start
    np.testing.assert_array_equal(out.ids, rows.ids)


def test_sglang_default_wire_is_flat_int32_base64():
    """Built by hand the way SGLang 0.5.12 sends it (no dtype key, no start key)."""
    rng = np.random.default_rng(4)
    ids = random_ids(rng, 4)
    flat = full_layers(ids, dtype=np.int32).reshape(-1)
    meta = {"routed_experts": base64.b64encode(flat.tobytes()).decode()}
    out = decode_sglang(meta, prompt_len=3, response_len=2, layout=LAYOUT)
    np.testing.assert_array_equal(out.ids, ids)
    # skip_tokenizer_init hands over an array/tensor instead of a string; verl 0.9.1 breaks on the string form
    out = decode_sglang({"routed_experts": torch.from_numpy(flat)}, prompt_len=3, response_len=2, layout=LAYOUT)
    np.testing.assert_array_equal(out.ids, ids)


def test_sglang_errors():
    rng = np.random.default_rng(5)
    meta = encode_sglang(RoutedRows(0, random_ids(rng, 4)), LAYOUT)
    with pytest.raises(RowCountError, match="4 routed rows, expected 5"):
        decode_sglang(meta, prompt_len=3, response_len=3, layout=LAYOUT)
    with pytest.raises(RoutingFormatError, match="no routed_experts"):
        decode_sglang({}, prompt_len=3, response_len=2, layout=LAYOUT)
    with pytest.raises(RoutingFormatError, match="not valid base64"):
        decode_sglang({"routed_experts": "@@@"}, prompt_len=3, response_len=2, layout=LAYOUT)
    truncated = base64.b64encode(base64.b64decode(meta["routed_experts"])[:-4]).decode()
    with pytest.raises(LayerMapError, match="not a whole number of rows"):
        decode_sglang({"routed_experts": truncated}, prompt_len=3, response_len=2, layout=LAYOUT)
    with pytest.raises(RoutingFormatError, match="unknown routed_experts_dtype"):
        decode_sglang({**meta, "routed_experts_dtype": "float8"}, prompt_len=3, response_len=2, layout=LAYOUT)
    with pytest.raises(RowCountError, match="start_len=9"):
        decode_sglang({**meta, "routed_experts_start_len": 9}, prompt_len=3, response_len=2, layout=LAYOUT)


# ---------------------------------------------------------------------------------------- partial rollouts
def test_partial_rollout_keeps_held_rows_and_appends_new_ones():
    rng = np.random.default_rng(6)
    prompt, n1, n2 = 5, 3, 4
    first = RoutedRows(0, random_ids(rng, prompt + n1 - 1))
    # the resumed request re-sends prompt + n1 tokens; its overlap rows differ (weights were updated)
    second = RoutedRows(0, random_ids(rng, prompt + n1 + n2 - 1))
    joined = concat_partial_rollout([first, second])
    assert (joined.start, joined.stop) == (0, prompt + n1 + n2 - 1)
    np.testing.assert_array_equal(joined.ids[: first.stop], first.ids)
    np.testing.assert_array_equal(joined.ids[first.stop :], second.ids[first.stop :])
    # a resumed piece that starts later (prompt offset) is fine as long as it leaves no gap
    third = RoutedRows(first.stop - 1, random_ids(rng, 3))
    assert concat_partial_rollout([first, third]).stop == first.stop + 2
    with pytest.raises(RowCountError, match="after the 7 positions"):
        concat_partial_rollout([first, RoutedRows(first.stop + 1, random_ids(rng, 2))])


# --------------------------------------------------------------------------------------------------- verl
@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(2, 12), min_size=1, max_size=5), seed=st.integers(0, 2**16))
def test_verl_batch_round_trip_nested_and_padded(lengths, seed):
    rng = np.random.default_rng(seed)
    samples = []
    for n in lengths:
        start = int(rng.integers(0, n - 1))
        samples.append(RoutedRows(start, random_ids(rng, int(rng.integers(1, n - start + 1)))))
    nested = encode_verl_batch(samples, LAYOUT, lengths)
    assert nested.is_nested and nested.dtype == torch.int16
    for got, want in zip(decode_verl_batch(nested, LAYOUT), samples, strict=True):
        assert (got.start, got.stop) == (want.start, want.stop)
        np.testing.assert_array_equal(got.ids, want.ids)
    pads = [int(rng.integers(0, 3)) for _ in lengths]
    dense = encode_verl_batch(samples, LAYOUT, lengths, nested=False, left_pad=pads)
    mask = torch.zeros(dense.shape[:2], dtype=torch.long)
    for i, (p, n) in enumerate(zip(pads, lengths, strict=True)):
        mask[i, p : p + n] = 1
    for got, want in zip(decode_verl_batch(dense, LAYOUT, attention_mask=mask), samples, strict=True):
        assert (got.start, got.stop) == (want.start, want.stop)
        np.testing.assert_array_equal(got.ids, want.ids)


def test_verl_sample_layout_matches_agent_loop():
    """verl's as_dict: int16 [prompt + response, num_hidden_layers, K], zero rows past what was recorded."""
    rng = np.random.default_rng(7)
    rows = RoutedRows(0, random_ids(rng, 6))
    tensor = encode_verl_sample(rows, LAYOUT, 7)
    assert tensor.shape == (7, 6, 4) and tensor.dtype == torch.int16
    assert not tensor[6].any() and not tensor[:, [0, 3]].any()
    np.testing.assert_array_equal(tensor[:6, [1, 2, 4, 5]].numpy(), rows.ids.astype(np.int16))
    with pytest.raises(RowCountError, match="sequence has 5 tokens"):
        encode_verl_sample(rows, LAYOUT, 5)


def test_verl_misaligned_padding_is_refused():
    rng = np.random.default_rng(8)
    rows = RoutedRows(0, random_ids(rng, 4))
    dense = encode_verl_batch([rows], LAYOUT, [5], nested=False, left_pad=[2], width=8)
    shifted_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])  # mask one to the right of the routing
    with pytest.raises(RowCountError, match="padding"):
        decode_verl_batch(dense, LAYOUT, attention_mask=shifted_mask)
    with pytest.raises(ValueError, match="attention_mask"):
        decode_verl_batch(dense, LAYOUT)
    with pytest.raises(RowCountError, match="past the sample's 3 tokens"):
        decode_verl_sample(encode_verl_sample(rows, LAYOUT, 5), LAYOUT, num_tokens=3)


def test_verl_interior_zero_row_is_an_engine_failure():
    rng = np.random.default_rng(9)
    tensor = encode_verl_sample(RoutedRows(0, random_ids(rng, 6)), LAYOUT, 7)
    tensor[2, 4] = 0  # one MoE layer of one token came back empty
    with pytest.raises(ZeroRoutingError, match="token position 2, MoE layer 2 \\(decoder layer 4\\)"):
        decode_verl_sample(tensor, LAYOUT)


# --------------------------------------------------------------------------------------------- validation
def test_validation_errors_name_the_position():
    rng = np.random.default_rng(10)
    ids = random_ids(rng, 5).astype(np.int64)
    validate_ids(ids, LAYOUT)
    bad = ids.copy()
    bad[3, 1, 0] = 16
    with pytest.raises(ExpertIdRangeError, match=r"outside \[0, 16\) \(e.g. 16\) at token position 3, MoE layer 1"):
        validate_ids(bad, LAYOUT)
    bad = ids.copy()
    bad[1, 0, 0] = -1
    with pytest.raises(ExpertIdRangeError, match="e.g. -1"):
        validate_ids(bad, LAYOUT)
    bad = ids.copy()
    bad[4, 3, 1] = bad[4, 3, 0]
    with pytest.raises(DuplicateExpertError, match="token position 4, MoE layer 3 \\(decoder layer 5\\)"):
        validate_ids(bad, LAYOUT)
    bad = ids.copy()
    bad[0, 2] = 0
    with pytest.raises(ZeroRoutingError, match="known failure"):
        validate_ids(bad, LAYOUT)
    with pytest.raises(LayerMapError, match="3 MoE layers x top-4; the model expects 4 MoE layers"):
        validate_ids(ids[:, :3], LAYOUT)
    with pytest.raises(RoutingFormatError, match="integers"):
        validate_ids(ids.astype(np.float32), LAYOUT)


def test_all_zero_engine_output_is_refused_at_every_boundary():
    zeros = np.zeros((4, 6, 4), dtype=np.uint8)
    with pytest.raises(ZeroRoutingError):
        decode_vllm(zeros, prompt_len=3, response_len=2, layout=LAYOUT)
    meta = {"routed_experts": base64.b64encode(zeros.astype(np.int32).tobytes()).decode()}
    with pytest.raises(ZeroRoutingError):
        decode_sglang(meta, prompt_len=3, response_len=2, layout=LAYOUT)


def test_top1_dead_layer_is_detected():
    layout = RoutingLayout("mixtral", "mixtral", 2, (0, 1), 1, 8)
    rng = np.random.default_rng(11)
    ids = rng.integers(1, 8, size=(9, 2, 1))
    validate_ids(ids, layout)
    ids[:, 1] = 0
    with pytest.raises(ZeroRoutingError, match="MoE layer 1 .* expert 0 for all 9 rows"):
        validate_ids(ids, layout)
    validate_ids(ids[:7], layout)  # too few rows to tell a dead layer from chance


# ------------------------------------------------------------------------------------------ trace + policy
def test_rows_to_trace_round_trip_and_invalid_rows():
    rng = np.random.default_rng(12)
    samples = [RoutedRows(2, random_ids(rng, 5)), None, RoutedRows(0, random_ids(rng, 3))]
    trace = rows_to_trace(samples, [8, 4, 4], LAYOUT)
    assert trace.lengths.tolist() == [8, 4, 4] and trace.layer_indices == LAYOUT.moe_layers
    dense = trace.to_tensor()
    assert (dense[:2] == -1).all() and (dense[7] == -1).all() and (dense[8:12] == -1).all() and (dense[15] == -1).all()
    np.testing.assert_array_equal(dense[2:7].numpy(), samples[0].ids)
    back = trace_to_rows(trace)
    assert back[1].num_rows == 0
    for got, want in ((back[0], samples[0]), (back[2], samples[2])):
        assert got.start == want.start
        np.testing.assert_array_equal(got.ids, want.ids)
    with pytest.raises(RowCountError, match=r"covers positions \[2, 7\) of 6 tokens"):
        rows_to_trace(samples, [6, 4, 4], LAYOUT)


def test_policy_raise_or_skip_and_count(caplog):
    zeros = np.zeros((4, 6, 4), dtype=np.uint8)
    with pytest.raises(ZeroRoutingError):
        decode_with_policy(decode_vllm, zeros, prompt_len=3, response_len=2, layout=LAYOUT)
    stats = BoundaryStats()
    good = full_layers(random_ids(np.random.default_rng(13), 4))
    with caplog.at_level(logging.WARNING, logger="verl_stable.routing"):
        assert (
            decode_with_policy(
                decode_vllm, zeros, prompt_len=3, response_len=2, layout=LAYOUT, on_invalid="skip_sample", stats=stats
            )
            is None
        )
        out = decode_with_policy(
            decode_vllm, good, prompt_len=3, response_len=2, layout=LAYOUT, on_invalid="skip_sample", stats=stats
        )
    assert out is not None and out.num_rows == 4
    assert stats.as_metrics() == {
        "stable/routing/samples": 2.0,
        "stable/routing/skipped_samples": 1.0,
        "stable/routing/error/ZeroRoutingError": 1.0,
    }
    assert "dropped" in caplog.text and "all-zero" in caplog.text
    with pytest.raises(ValueError, match="on_invalid"):
        decode_with_policy(decode_vllm, good, prompt_len=3, response_len=2, layout=LAYOUT, on_invalid="guess")


def test_validation_is_chunked_but_reports_global_positions():
    ids = random_ids(np.random.default_rng(14), 9000)
    validate_ids(ids, LAYOUT, start=3)
    ids[8500, 2, 1] = ids[8500, 2, 3]
    with pytest.raises(DuplicateExpertError, match="token position 8503, MoE layer 2"):
        validate_ids(ids, LAYOUT, start=3)
