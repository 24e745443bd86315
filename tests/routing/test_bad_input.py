"""Issue #13 (routing): every case of untrusted input gets its exact error class and a message naming what was
expected; zero-token samples are valid samples with zero rows; nothing crashes with an untyped error."""

from __future__ import annotations

import base64
import io
import pickle
import time
import types

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from verl_stable.routing import (
    RoutingLayout,
    RoutingTrace,
    RoutingTraceError,
    UnsupportedModelError,
    bind_model,
    describe_model_routing,
    format_routing_report,
    layout_from_config,
    storage_dtype,
)
from verl_stable.routing import alignment as al
from verl_stable.routing.codecs import (
    BoundaryStats,
    DuplicateExpertError,
    ExpertIdRangeError,
    LayerMapError,
    RoutedRows,
    RoutingFormatError,
    RowCountError,
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
    trace_to_rows,
    validate_ids,
)
from verl_stable.transport.fields import (
    dense_rows_from_fields,
    rows_from_fields,
    sample_fields,
    trace_from_fields,
)
from verl_stable.transport.packed import PackedRouting

LAYOUT = RoutingLayout("qwen3_moe", "qwen3_moe", 6, (1, 2, 4, 5), 4, 16)  # dense decoder layers 0 and 3
KW = dict(prompt_len=3, response_len=2, layout=LAYOUT)  # 4 routed rows


def raises_exactly(cls: type[Exception], match: str):
    """``pytest.raises`` that also refuses subclasses: the error class is part of the contract."""

    class _Exact:
        def __enter__(self):
            self._ctx = pytest.raises(cls, match=match)
            self.info = self._ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self._ctx.__exit__(*exc)
            assert type(self.info.value) is cls, f"expected exactly {cls.__name__}, got {type(self.info.value)}"
            return handled

    return _Exact()


def good_ids(rows: int, layout: RoutingLayout = LAYOUT, seed: int = 0) -> np.ndarray:
    scores = np.random.default_rng(seed).random((rows, layout.num_moe_layers, layout.num_experts))
    return np.argsort(scores, axis=-1)[..., : layout.top_k].astype(np.int64)


def with_value(value, dtype=np.int64) -> np.ndarray:
    """Two valid rows, then entry [1, 2, 0] replaced by ``value`` (in ``dtype``)."""
    ids = good_ids(2).astype(dtype)
    ids[1, 2, 0] = value
    return ids


def fields_of(ids: torch.Tensor, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    nested = torch.nested.as_nested_tensor([ids], layout=torch.jagged)
    return nested, torch.tensor([[start, start + ids.shape[0]]])


def npy_b64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


# ------------------------------------------------------------------ 2: trainer-side fields validated before narrowing
@pytest.mark.parametrize("value", [260, -252])
def test_trace_from_fields_refuses_out_of_range_ids_before_narrowing(value):
    ids, spans = fields_of(torch.from_numpy(with_value(value)))
    with raises_exactly(ExpertIdRangeError, rf"sample 0: expert ids outside \[0, 16\) \(e.g. {value}\)"):
        trace_from_fields(ids, spans, [3], LAYOUT)


@pytest.mark.parametrize("value", [float("nan"), 2.9])
def test_trace_from_fields_refuses_float_ids(value):
    ids, spans = fields_of(torch.from_numpy(with_value(value, np.float32)))
    with raises_exactly(RoutingFormatError, "expected integers, got dtype torch.float32"):
        trace_from_fields(ids, spans, [3], LAYOUT)


def test_trace_from_fields_refuses_duplicate_ids():
    ids = good_ids(2)
    ids[1, 3, 1] = ids[1, 3, 0]
    with raises_exactly(DuplicateExpertError, r"sample 0: a row repeats an expert id at token position 1, MoE layer 3"):
        trace_from_fields(*fields_of(torch.from_numpy(ids)), [2], LAYOUT)


@pytest.mark.parametrize("value", [260, -252])
def test_pack_and_sample_fields_refuse_out_of_range_ids(value):
    rows = RoutedRows(0, with_value(value))
    with raises_exactly(ExpertIdRangeError, rf"sample 0: expert ids outside \[0, 16\) \(e.g. {value}\)"):
        PackedRouting.pack([rows], [1], ["g"], LAYOUT)
    with raises_exactly(ExpertIdRangeError, rf"sample_fields: expert ids outside \[0, 16\) \(e.g. {value}\)"):
        sample_fields(rows, LAYOUT)


def test_pack_and_sample_fields_refuse_float_and_duplicate_ids():
    with raises_exactly(RoutingFormatError, "expert ids must be integers, got dtype float64"):
        RoutedRows(0, with_value(float("nan"), np.float64))
    rows = RoutedRows(0, good_ids(2))
    rows.ids = rows.ids.astype(np.float64) + 0.9  # RoutedRows is mutable: the consumers check again
    with raises_exactly(RoutingFormatError, "expert ids must be integers, got dtype float64"):
        PackedRouting.pack([rows], [1], ["g"], LAYOUT)
    dup = good_ids(3)
    dup[2, 0, 3] = dup[2, 0, 1]
    with raises_exactly(DuplicateExpertError, "sample 0: a row repeats an expert id at token position 2, MoE layer 0"):
        PackedRouting.pack([RoutedRows(0, dup)], [1], ["g"], LAYOUT)
    with raises_exactly(DuplicateExpertError, "sample_fields: a row repeats an expert id at token position 2"):
        sample_fields(RoutedRows(0, dup), LAYOUT)


def test_trace_constructor_refuses_duplicates_like_from_tensor():
    ids = torch.tensor([[[3, 3]], [[1, 2]]], dtype=torch.uint8)
    message = r"token 0, MoE layer 0 repeats an expert id \(\[3, 3\]\): top-k ids must be distinct"
    with raises_exactly(RoutingTraceError, message):
        RoutingTrace(ids=ids, num_experts=8)
    with raises_exactly(RoutingTraceError, message):
        RoutingTrace.from_tensor(ids.long(), num_experts=8)
    # a row without data is zero-filled and meaningless: it may repeat
    trace = RoutingTrace(ids=ids, num_experts=8, valid=torch.tensor([[False], [True]]))
    assert trace.num_missing == 1


# --------------------------------------------------------------------------------------- 3: encoders never wrap ids
def test_encode_vllm_beyond_uint16_widens_and_the_decoder_refuses_a_narrow_dtype():
    layout = RoutingLayout("qwen3_moe", "qwen3_moe", 2, (0, 1), 2, 70000)
    rows = RoutedRows(0, np.array([[[65540, 69999], [0, 1]]] * 3, dtype=np.int32))
    raw = encode_vllm(rows, layout)
    assert raw.dtype == np.int32 and raw.max() == 69999
    out = decode_vllm(raw, prompt_len=2, response_len=2, layout=layout)
    np.testing.assert_array_equal(out.ids, rows.ids)
    with raises_exactly(ExpertIdRangeError, r"dtype uint16 holds expert ids up to 65535, the model has 70000 experts"):
        decode_vllm(raw.astype(np.uint16), prompt_len=2, response_len=2, layout=layout)


def test_encode_sglang_refuses_a_wire_dtype_that_would_wrap_and_so_does_the_decoder():
    layout = RoutingLayout("qwen3_moe", "qwen3_moe", 2, (0, 1), 2, 300)
    rows = RoutedRows(0, np.array([[[260, 3], [299, 0]]] * 2, dtype=np.uint16))
    with raises_exactly(
        ExpertIdRangeError, "wire_dtype uint8: dtype uint8 holds expert ids up to 255, the model has 300"
    ):
        encode_sglang(rows, layout, wire_dtype="uint8")
    meta = encode_sglang(rows, layout, wire_dtype="uint16")
    np.testing.assert_array_equal(decode_sglang(meta, prompt_len=2, response_len=1, layout=layout).ids, rows.ids)
    wrapped = {**meta, "routed_experts_dtype": "uint8"}
    with raises_exactly(ExpertIdRangeError, "routed_experts_dtype uint8: dtype uint8 holds expert ids up to 255"):
        decode_sglang(wrapped, prompt_len=2, response_len=1, layout=layout)


def test_encode_verl_refuses_more_experts_than_int16_holds():
    layout = RoutingLayout("qwen3_moe", "qwen3_moe", 1, (0,), 1, 40000)
    with raises_exactly(ExpertIdRangeError, "dtype int16 holds expert ids up to 32767, the model has 40000"):
        encode_verl_sample(RoutedRows(0, np.array([[[39999]]])), layout, 2)


# --------------------------------------------------------------------------------- 5: zero-token samples are samples
def test_dense_verl_batch_with_an_all_zero_mask_row_decodes_to_zero_rows():
    rows = RoutedRows(0, good_ids(3).astype(np.uint8))
    dense = encode_verl_batch([rows, RoutedRows(0, good_ids(0))], LAYOUT, [4, 0], nested=False, width=5)
    mask = torch.tensor([[1, 1, 1, 1, 0], [0, 0, 0, 0, 0]])
    got = decode_verl_batch(dense, LAYOUT, attention_mask=mask)
    assert got[1].num_rows == 0 and got[0].num_rows == 3
    np.testing.assert_array_equal(got[0].ids, rows.ids)


def test_nested_verl_batch_with_an_empty_sample_round_trips():
    samples = [RoutedRows(0, good_ids(0)), RoutedRows(1, good_ids(2).astype(np.uint8))]
    nested = encode_verl_batch(samples, LAYOUT, [0, 4])
    got = decode_verl_batch(nested, LAYOUT)
    assert (got[0].start, got[0].num_rows) == (0, 0) and (got[1].start, got[1].stop) == (1, 3)


def test_zero_tokens_decode_even_under_skip_sample_and_the_trace_round_trips():
    stats = BoundaryStats()
    out = decode_with_policy(
        decode_verl_sample, torch.zeros(0, 6, 4, dtype=torch.int16), LAYOUT, on_invalid="skip_sample", stats=stats
    )
    assert out is not None and out.num_rows == 0 and stats.skipped_samples == 0
    assert decode_verl_sample(torch.zeros(3, 6, 4, dtype=torch.int16), LAYOUT, num_tokens=0).num_rows == 0
    trace = rows_to_trace([out, None], [0, 0], LAYOUT)
    assert trace.num_tokens == 0 and trace.lengths.tolist() == [0, 0]
    back = trace_to_rows(trace)
    assert [r.num_rows for r in back] == [0, 0]
    assert encode_verl_sample(back[0], LAYOUT, 0).shape == (0, 6, 4)


# ------------------------------------------------------- 6: every malformed payload is counted, never an untyped error
def _skip(decode, *args, **kwargs):
    stats = BoundaryStats()
    assert decode_with_policy(decode, *args, on_invalid="skip_sample", stats=stats, **kwargs) is None
    return stats


def _header(text: bytes, data: bytes = b"") -> str:
    return base64.b64encode(b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + data).decode()


@pytest.mark.parametrize(
    "payload, message",
    [
        ("", r"not .npy data \(expected the \\x93NUMPY magic"),
        (_header(b"{'descr': '|u1', 'fortran"), r"unreadable .npy header \(SyntaxError"),
        (_header(b"{'descr': '|u1', 'fortran_order': False, 'shape': (4, 6, 4), }")[:40], "truncated .npy header"),
        (
            _header(b"{'descr': '|u1', 'fortran_order': False, 'shape': (100000000000000,), }\n", bytes(16)),
            r"declares uint8 \(100000000000000,\) \(100000000000000 bytes\) but 16 data bytes follow",
        ),
        (_header(b"{'descr': '|O', 'fortran_order': False, 'shape': (1,), }\n", bytes(8)), "got dtype object"),
        (_header(b"{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }\n", bytes(4)), "got dtype float32"),
        # zero bytes declared, so the byte count agrees, but numpy cannot even describe the empty array
        (
            _header(b"{'descr': '<i4', 'fortran_order': False, 'shape': (0, 100000000000000000000, 2), }\n"),
            r"shape \(0, 100000000000000000000, 2\) is beyond what numpy can describe",
        ),
        (
            _header(b"{'descr': '<i4', 'fortran_order': False, 'shape': (0, 4611686018427387904, 2), }\n"),
            r"shape \(0, 4611686018427387904, 2\) is beyond what numpy can describe",
        ),
        (
            _header(b"{'descr': '<i4', 'fortran_order': False, 'shape': (" + b"0, " * 70 + b"), }\n"),
            "shape has 70 dimensions, at most 32",
        ),
    ],
    ids=[
        "empty",
        "cut-header",
        "truncated",
        "90TiB",
        "object",
        "float",
        "zero-bytes-1e20",
        "zero-bytes-2^62",
        "70-dims",
    ],
)
def test_vllm_openai_malformed_npy_is_a_counted_format_error(payload, message):
    stats = _skip(decode_vllm_openai, payload, **KW)
    assert stats.errors == {"RoutingFormatError": 1}
    with raises_exactly(RoutingFormatError, message):
        decode_vllm_openai(payload, **KW)


def test_vllm_openai_npz_and_non_string_payloads_are_format_errors():
    buffer = io.BytesIO()
    np.savez(buffer, routed=good_ids(4))
    with raises_exactly(RoutingFormatError, r"not .npy data \(expected the \\x93NUMPY magic, got b'PK"):
        decode_vllm_openai(base64.b64encode(buffer.getvalue()).decode(), **KW)
    with raises_exactly(RoutingFormatError, "expected a base64 .npy string, got list"):
        decode_vllm_openai([1, 2], **KW)
    assert _skip(decode_vllm_openai, None, **KW).errors == {"RoutingFormatError": 1}


def test_vllm_openai_fortran_order_and_big_endian_decode():
    ids = good_ids(4).astype(">u2")
    full = np.zeros((4, 6, 4), dtype=">u2")
    full[:, [1, 2, 4, 5]] = ids
    out = decode_vllm_openai(npy_b64(np.asfortranarray(full)), **KW)
    np.testing.assert_array_equal(out.ids, ids)


@pytest.mark.parametrize("start_len", ["abc", 1.5, [1], 2.0])
def test_sglang_start_len_must_be_an_integer(start_len):
    meta = {**encode_sglang(RoutedRows(0, good_ids(4)), LAYOUT), "routed_experts_start_len": start_len}
    assert _skip(decode_sglang, meta, **KW).errors == {"RowCountError": 1}
    with raises_exactly(RowCountError, "routed_experts_start_len must be an integer"):
        decode_sglang(meta, **KW)


@pytest.mark.parametrize(
    "meta, cls, message",
    [
        (None, RoutingFormatError, "meta_info must be a mapping, got NoneType"),
        ([1, 2], RoutingFormatError, "meta_info must be a mapping, got list"),
        ({"routed_experts": [[1, 2], [3]]}, RoutingFormatError, "not a rectangular integer array"),
        ({"routed_experts": ["a", "b"]}, RoutingFormatError, "expert ids must be integers, got dtype <U1"),
        ({"routed_experts": {"a": 1}}, RoutingFormatError, "unsupported type dict"),
        ({"routed_experts": "AAAA", "routed_experts_dtype": ["int32"]}, RoutingFormatError, "unknown routed_exp"),
    ],
    ids=["None", "list", "ragged", "strings", "dict", "dtype-list"],
)
def test_sglang_malformed_meta_info_is_a_counted_format_error(meta, cls, message):
    assert _skip(decode_sglang, meta, **KW).errors == {cls.__name__: 1}
    with raises_exactly(cls, message):
        decode_sglang(meta, **KW)


@pytest.mark.parametrize("name", ["", "int", "float32", "torch.int32", "INT32", " int32"])
def test_sglang_empty_or_unknown_dtype_name_is_refused_not_read_as_int32(name):
    """Only a missing / None ``routed_experts_dtype`` means SGLang's default int32; any other name that is not a
    known wire dtype (the empty string included) is refused, naming it, rather than guessed."""
    meta = encode_sglang(RoutedRows(0, good_ids(4)), LAYOUT)  # int32 bytes: read as int32 they would decode fine
    assert decode_sglang({**meta, "routed_experts_dtype": None}, **KW).num_rows == 4
    assert "routed_experts_dtype" not in meta and decode_sglang(meta, **KW).num_rows == 4
    bad = {**meta, "routed_experts_dtype": name}
    assert _skip(decode_sglang, bad, **KW).errors == {"RoutingFormatError": 1}
    with raises_exactly(RoutingFormatError, f"unknown routed_experts_dtype {name!r}"):
        decode_sglang(bad, **KW)


def test_sglang_list_payload_of_integers_is_accepted():
    ids = good_ids(4)
    full = np.zeros((4, 6, 4), dtype=np.int64)
    full[:, [1, 2, 4, 5]] = ids
    np.testing.assert_array_equal(decode_sglang({"routed_experts": full.tolist()}, **KW).ids, ids)


# ------------------------------------------------------------------------- 7: select when no sample has routing
def test_select_of_a_pack_without_any_routing():
    packed = PackedRouting.pack([None, None], [3, 2], ["a", "b"], LAYOUT)
    part = packed.select([1, 0])
    assert len(part) == 2 and part.unpack() == [None, None]
    assert part.to_trace([3, 2], LAYOUT).num_missing == 5 * LAYOUT.num_moe_layers
    assert len(packed.select([])) == 0


# ---------------------------------------------------------------------------------------------------- smaller
def test_describe_model_routing_is_linear_in_the_layer_count():
    config = AutoConfig.for_model("qwen3_moe", num_hidden_layers=20000, num_experts=8, num_experts_per_tok=2,
                                  mlp_only_layers=[5])  # fmt: skip
    begin = time.perf_counter()
    report = describe_model_routing(config)
    elapsed = time.perf_counter() - begin
    assert report["dense_layers"] == [5] and len(report["moe_layers"]) == 19999
    assert elapsed < 3.0, f"describe_model_routing took {elapsed:.1f} s for 20000 layers (a set rebuilt per layer?)"


def test_sglang_negative_response_len_and_fractional_start_len():
    meta = encode_sglang(RoutedRows(0, good_ids(4)), LAYOUT)
    with raises_exactly(RowCountError, "SGLang: response_len must be >= 0, got -1"):
        decode_sglang(meta, prompt_len=3, response_len=-1, layout=LAYOUT)
    with raises_exactly(RowCountError, "SGLang: routed_experts_start_len must be an integer, got float 1.5"):
        decode_sglang({**meta, "routed_experts_start_len": 1.5}, **KW)


def test_verl_sample_negative_num_tokens():
    with raises_exactly(RowCountError, "verl: num_tokens must be >= 0, got -1"):
        decode_verl_sample(torch.zeros(3, 6, 4, dtype=torch.int16), LAYOUT, num_tokens=-1)


@pytest.mark.parametrize(
    "array, dtype",
    [
        (np.full((4, 6, 4), np.nan), "float64"),
        (np.full((4, 6, 4), 2.9, dtype=np.float32), "float32"),
        (np.full((4, 6, 4), "3"), "<U1"),
        (np.ones((4, 6, 4), dtype=bool), "bool"),
    ],
    ids=["nan", "float", "str", "bool"],
)
def test_non_integer_arrays_get_a_dtype_error_not_a_layer_error(array, dtype):
    message = f"expert ids must be integers, got dtype {dtype}"
    with raises_exactly(RoutingFormatError, message):
        decode_vllm(array, **KW)
    with raises_exactly(RoutingFormatError, message):
        decode_verl_sample(array, LAYOUT)
    with raises_exactly(RoutingFormatError, message):
        decode_sglang({"routed_experts": array}, **KW)


def test_dense_round_trip_keeps_lengths_and_layer_indices():
    trace = rows_to_trace([RoutedRows(1, good_ids(2).astype(np.uint8)), None], [4, 2], LAYOUT)
    ids = trace.to_tensor()
    again = RoutingTrace.from_tensor(ids, trace.num_experts, trace.lengths, trace.layer_indices)  # as documented
    assert again.layer_indices == (1, 2, 4, 5) and again.lengths.tolist() == [4, 2]
    assert torch.equal(again.to_tensor(), ids)
    restored = RoutingTrace.from_state_dict(trace.state_dict())
    assert restored.layer_indices == trace.layer_indices and torch.equal(restored.to_tensor(), ids)


# ------------------------------------------------------------------------------- beyond the list: trace / layout
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_experts=8.5), "RoutingLayout.num_experts must be an integer, got float 8.5"),
        (dict(top_k=0), "RoutingLayout.top_k must be >= 1, got 0"),
        (dict(top_k=9), "RoutingLayout.top_k=9 exceeds num_experts=8"),
        (dict(moe_layers=(2, 1)), r"strictly ascending decoder-layer indices, got \[2, 1\]"),
        (dict(moe_layers=(1, 4)), r"at least one decoder layer in \[0, 4\), got \[1, 4\]"),
        (dict(moe_layers=()), "at least one decoder layer"),
        (dict(num_hidden_layers=True), "num_hidden_layers must be an integer, got bool"),
        (dict(family=None), "RoutingLayout.family must be a str"),
    ],
)
def test_routing_layout_checks_its_fields(kwargs, message):
    fields = dict(family="qwen3_moe", model_type="qwen3_moe", num_hidden_layers=4, moe_layers=(1, 3), top_k=2)
    with raises_exactly(RoutingTraceError, message):
        RoutingLayout(**{**fields, "num_experts": 8, **kwargs})


def test_trace_entry_points_refuse_wrong_types_and_values():
    ids = torch.tensor([[[0, 1]], [[2, 3]]], dtype=torch.uint8)
    with raises_exactly(RoutingTraceError, "num_experts must be an integer, got float nan"):
        storage_dtype(float("nan"))
    with raises_exactly(RoutingTraceError, "num_experts must be an integer, got float 8.0"):
        RoutingTrace.from_tensor(ids.long(), num_experts=8.0)
    with raises_exactly(RoutingTraceError, "lengths must be a 1-D integer sequence, got torch.float32"):
        RoutingTrace(ids=ids, num_experts=8, lengths=[0.5, 1.5])
    with raises_exactly(
        RoutingTraceError, r"layer_indices must be strictly ascending decoder-layer indices, got \[3, 2\]"
    ):
        RoutingTrace(ids=ids, num_experts=8, layer_indices=[3, 2])
    with raises_exactly(RoutingTraceError, "layer_indices entry must be >= 0, got -1"):
        RoutingTrace(ids=ids, num_experts=8, layer_indices=[-1])
    with raises_exactly(RoutingTraceError, "ids must be a dense torch.Tensor, got list"):
        RoutingTrace.from_tensor([[[0, 1]]], num_experts=8)
    with raises_exactly(RoutingTraceError, r"valid must be a bool tensor of shape \(2, 1\), got list"):
        RoutingTrace(ids=ids, num_experts=8, valid=[True, False])
    trace = RoutingTrace(ids=ids, num_experts=8, lengths=[1, 1])
    with raises_exactly(TypeError, "sequence index must be an integer, got float 1.0"):
        trace.sequence(1.0)
    with raises_exactly(IndexError, r"token rows \[1, 5\) out of range for a trace of 2 rows"):
        trace.slice_tokens(1, 5)
    with raises_exactly(TypeError, "cat needs RoutingTrace objects, got Tensor"):
        RoutingTrace.cat([trace, ids])
    with raises_exactly(TypeError, "validate_for needs a RoutingLayout, got str"):
        trace.validate_for("qwen3_moe")
    with raises_exactly(RoutingTraceError, "state must be a mapping, got list"):
        RoutingTrace.from_state_dict([ids, 8])
    with raises_exactly(RoutingTraceError, "num_experts must be an integer, got str '8'"):
        RoutingTrace.from_state_dict({"ids": ids, "num_experts": "8", "lengths": [2]})


# ------------------------------------------------------------------------------------ beyond the list: codecs
def test_codec_arguments_are_integers_and_layouts():
    with raises_exactly(RowCountError, "vLLM: prompt_len must be an integer, got float 3.0"):
        decode_vllm(np.zeros((4, 6, 4), np.uint8), prompt_len=3.0, response_len=2, layout=LAYOUT)
    with raises_exactly(RowCountError, "RoutedRows.start must be >= 0, got -1"):
        RoutedRows(-1, good_ids(1))
    with raises_exactly(RowCountError, "RoutedRows.start must be an integer, got float 2.9"):
        RoutedRows(2.9, good_ids(1))
    with raises_exactly(LayerMapError, r"RoutedRows: ids must be \[rows, moe_layers, top_k\], got shape \(4,\)"):
        RoutedRows(0, np.arange(4))
    with raises_exactly(TypeError, "layout must be a RoutingLayout, got dict"):
        decode_vllm(np.zeros((4, 6, 4), np.uint8), prompt_len=3, response_len=2, layout={})
    with raises_exactly(ExpertIdRangeError, r"expert ids outside \[0, 16\) \(e.g. 16\)"):
        validate_ids(with_value(16).tolist(), LAYOUT)
    with raises_exactly(RoutingFormatError, "piece 1: expected RoutedRows, got dict"):
        concat_partial_rollout([RoutedRows(0, good_ids(1)), {"start": 1}])
    with raises_exactly(TypeError, "decode must be a decode_\\* function, got str"):
        decode_with_policy("decode_vllm", on_invalid="skip_sample")
    with raises_exactly(TypeError, "stats must be a BoundaryStats or None, got dict"):
        decode_with_policy(decode_vllm, on_invalid="skip_sample", stats={})


def test_verl_batch_arguments():
    rows = RoutedRows(0, good_ids(2))
    with raises_exactly(RowCountError, "verl: left pad 0 must be >= 0, got -1"):
        encode_verl_batch([rows], LAYOUT, [3], nested=False, left_pad=[-1])
    with raises_exactly(RowCountError, "an empty batch has no nested"):
        encode_verl_batch([], LAYOUT, [])
    assert encode_verl_batch([], LAYOUT, [], nested=False).shape == (0, 0, 6, 4)
    dense = encode_verl_batch([rows], LAYOUT, [3], nested=False, width=5)
    with raises_exactly(RoutingFormatError, "expected a torch.Tensor, got ndarray"):
        decode_verl_batch(dense.numpy(), LAYOUT, attention_mask=torch.ones(1, 5))
    with raises_exactly(RowCountError, "attention_mask must hold only 0 and 1"):
        decode_verl_batch(dense, LAYOUT, attention_mask=torch.tensor([[2, 2, 2, 0, 0]]))
    with raises_exactly(RowCountError, "sample 0: attention_mask has gaps between positions 0 and 3"):
        decode_verl_batch(dense, LAYOUT, attention_mask=torch.tensor([[1, 1, 0, 1, 0]]))
    with raises_exactly(RowCountError, "sample 0: routing found on padding positions"):
        decode_verl_batch(dense, LAYOUT, attention_mask=torch.zeros(1, 5, dtype=torch.long))
    with raises_exactly(LayerMapError, r"expected \[batch, seq, num_hidden_layers, top_k\]"):
        decode_verl_batch(dense[0], LAYOUT, attention_mask=torch.ones(5, 6))


# --------------------------------------------------------------------------------- beyond the list: transport
def test_transport_spans_lengths_and_indices():
    ids, _ = fields_of(torch.from_numpy(good_ids(2).astype(np.uint8)))
    with raises_exactly(RoutingFormatError, "stable_routing_span: expected integers, got dtype torch.float32"):
        rows_from_fields(ids, torch.tensor([[0.0, 2.0]]))
    with raises_exactly(RowCountError, r"sample 0: span \[-1, 1\] is not \[start, stop\) with 0 <= start <= stop"):
        rows_from_fields(ids, torch.tensor([[-1, 1]]))
    with raises_exactly(RowCountError, r"seq_lens\[0\] must be an integer, got float 2.5"):
        trace_from_fields(ids, torch.tensor([[0, 2]]), [2.5], LAYOUT)
    with raises_exactly(RowCountError, "offsets must be integers, got dtype torch.float32"):
        dense_rows_from_fields(ids, torch.tensor([[0, 2]]), torch.tensor([0.0, 2.0]), LAYOUT)
    with raises_exactly(RowCountError, r"offsets must start at 0"):
        dense_rows_from_fields(ids, torch.tensor([[0, 2]]), torch.tensor([1, 3]), LAYOUT)
    packed = PackedRouting.pack([RoutedRows(0, good_ids(2).astype(np.uint8)), None], [1, 1], ["g", "g"], LAYOUT)
    with raises_exactly(TypeError, "indices must be integer sample indices, got dtype torch.bool"):
        packed.select(torch.tensor([True, False]))
    with raises_exactly(IndexError, r"indices \[2\] out of range for 2 packed samples"):
        packed.select([2])
    with raises_exactly(IndexError, "sample 5 out of range for 2 packed samples"):
        packed.sample(5)
    with raises_exactly(RowCountError, r"prompt_lens\[0\] must be >= 0, got -3"):
        PackedRouting.pack([None], [-3], ["g"], LAYOUT)
    with raises_exactly(TypeError, "group id 0 must be hashable"):
        PackedRouting.pack([None], [3], [["g"]], LAYOUT)


def test_packed_routing_is_checked_when_built_or_unpickled():
    packed = PackedRouting.pack([RoutedRows(0, good_ids(3).astype(np.uint8))], [1], ["g"], LAYOUT)
    state = pickle.dumps(packed)
    assert pickle.loads(state).unpack()[0].num_rows == 3
    corrupt = pickle.loads(state)
    corrupt.__dict__["response_segment"] = torch.tensor([7])
    with raises_exactly(RowCountError, r"PackedRouting.response_segment must index \[-1, 2\), got \[7\]"):
        pickle.loads(pickle.dumps(corrupt))
    corrupt.__dict__.update(response_segment=packed.response_segment, ids=packed.ids.clone().fill_(200))
    with raises_exactly(ExpertIdRangeError, r"PackedRouting: expert ids outside \[0, 16\)"):
        pickle.loads(pickle.dumps(corrupt))


# ------------------------------------------------------------------------------------ beyond the list: alignment
def test_alignment_refuses_float_offsets_masks_and_sizes():
    rows = torch.zeros(5, 2, 2, dtype=torch.long)
    with raises_exactly(TypeError, "cu_seqlens must hold integers, got dtype torch.float32"):
        al.packed_layout(rows, torch.tensor([0.0, 5.0]))
    with raises_exactly(ValueError, "has_data must hold only 0 and 1"):
        al.packed_layout(rows, torch.tensor([0, 5]), has_data=torch.full((5,), 0.5))
    with raises_exactly(TypeError, "static_pad must be an integer, got float 1.5"):
        al.packed_layout(rows, torch.tensor([0, 5]), static_pad=1.5)
    with raises_exactly(TypeError, "sp_size must be an integer, got float 2.0"):
        al.ulysses_shard(al.packed_layout(rows, torch.tensor([0, 5])), 2.0, 0)
    with raises_exactly(TypeError, "ulysses_shard needs AlignedRows"):
        al.ulysses_shard(rows, 2, 0)
    with raises_exactly(ValueError, "every shard must have the same row shape and dtype"):
        al.unshard_ulysses([torch.zeros(2, 1, 1), torch.zeros(2, 1, 3)], 0)
    with raises_exactly(ValueError, "max_seq_len=2 is shorter than the longest sample"):
        al.rows_from_padded_layout(torch.zeros(4, 2, 2), torch.tensor([0, 3, 4]), 2)
    with raises_exactly(ValueError, r"cu_seqlens must be non-decreasing"):
        al.lengths_from_cu_seqlens(torch.tensor([0, 3, 1]))
    with raises_exactly(ValueError, r"moe_layers must be distinct, got \[1, 1\]"):
        al.scatter_layers(rows, [1, 1], 3)
    with raises_exactly(ValueError, "attention_mask must hold only 0 and 1"):
        al.unpad_rows(torch.zeros(1, 3, 2, 2), torch.tensor([[1, 2, 0]]))
    with raises_exactly(TypeError, "AlignedRows.has_data must be a bool tensor, got list"):
        al.AlignedRows(rows, [True] * 5)


# ------------------------------------------------------------------------------------- beyond the list: families
@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_experts=8.5), "config num_experts must be an integer, got float 8.5"),
        (dict(num_experts=float("inf")), "config num_experts must be an integer, got float inf"),
        (dict(num_experts_per_tok="2"), "config num_experts_per_tok must be an integer, got str"),
        (dict(decoder_sparse_step=-1), "config decoder_sparse_step must be >= 0, got -1"),
        (dict(mlp_only_layers=[0.5]), "config mlp_only_layers entry must be an integer, got float 0.5"),
    ],
)
def test_layout_from_config_refuses_non_integer_config_values(overrides, message):
    # a plain object: transformers' own configs check these fields, a remote-code or hand-built config may not
    config = types.SimpleNamespace(model_type="qwen3_moe", num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
    config.__dict__.update(overrides)
    with raises_exactly(UnsupportedModelError, message):
        layout_from_config(config)
    report = describe_model_routing(config)
    assert report["replayable"] is False and message.split(",")[0] in report["reason"]


def test_family_entry_points_refuse_odd_inputs():
    config = AutoConfig.for_model("deepseek_v3", num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2)
    config.first_k_dense_replace = -2
    with raises_exactly(UnsupportedModelError, "config first_k_dense_replace must be >= 0, got -2"):
        layout_from_config(config)
    with raises_exactly(UnsupportedModelError, "bind_model needs a torch.nn.Module"):
        bind_model("Qwen/Qwen3-30B-A3B")
    assert "no string 'model_type'" in describe_model_routing({"model_type": 5})["reason"]
    with raises_exactly(ValueError, "expected a describe_model_routing report dict, got list"):
        format_routing_report([])
