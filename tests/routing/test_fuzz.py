"""Property-based fuzzing of every routing codec and carrier (issue #13).

Two properties, over random layouts (2..70000 experts, top-1..8, 1..5 decoder layers with random dense ones):

* random valid routing round-trips exactly through every encoder / decoder pair (vLLM array and OpenAI base64 .npy,
  SGLang meta, verl dense and nested, per-sample transport fields, packed routing, RoutingTrace), lengths 0..n;
* random bytes / shapes / dtypes / values only ever give a RoutingFormatError (counted and skipped under
  ``on_invalid="skip_sample"``), never another exception.

The budget is bounded (``max_examples`` per test, no deadline): the whole file runs in well under 30 s on one core.
"""

from __future__ import annotations

import base64
import io
import pickle

import numpy as np
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays
from tensordict import TensorDict

from verl_stable.routing.codecs import (
    BoundaryStats,
    ExpertIdRangeError,
    RoutedRows,
    RoutingFormatError,
    decode_sglang,
    decode_verl_batch,
    decode_verl_sample,
    decode_vllm,
    decode_vllm_openai,
    decode_with_policy,
    encode_sglang,
    encode_verl_batch,
    encode_vllm,
    rows_to_trace,
    smallest_uint_dtype,
    trace_to_rows,
)
from verl_stable.routing.trace import RoutingLayout, RoutingTrace
from verl_stable.transport.expansion import expand_compact_routing
from verl_stable.transport.fields import (
    IDS_FIELD,
    SPAN_FIELD,
    dense_rows_from_fields,
    rows_from_fields,
    sample_fields,
    trace_from_fields,
)
from verl_stable.transport.packed import PackedRouting

FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BOUNDARY_EXPERTS = [2, 3, 8, 128, 255, 256, 257, 4096, 32767, 32768, 32769, 65535, 65536, 65537, 70000]


@st.composite
def layouts(draw, max_experts: int = 70000) -> RoutingLayout:
    experts = draw(
        st.one_of(st.sampled_from([e for e in BOUNDARY_EXPERTS if e <= max_experts]), st.integers(2, max_experts))
    )
    top_k = draw(st.integers(1, min(8, experts)))
    hidden = draw(st.integers(1, 5))
    moe = draw(st.lists(st.integers(0, hidden - 1), min_size=1, max_size=hidden, unique=True))
    return RoutingLayout("qwen3_moe", "qwen3_moe", hidden, tuple(sorted(moe)), top_k, experts)


def make_ids(layout: RoutingLayout, rows: int, seed: int) -> np.ndarray:
    """Valid routing: distinct ids per row (spread over the whole range, the largest id included at times), no
    all-zero row or layer even for top-1 (verl's layout reads a leading / trailing zero row as unrecorded)."""
    rng = np.random.default_rng(seed)
    experts, k, layers = layout.num_experts, layout.top_k, layout.num_moe_layers
    base = rng.integers(0, experts, size=(rows, layers, 1))
    base[rng.random((rows, layers, 1)) < 0.2] = experts - 1
    ids = rng.permuted((base + np.arange(k) * (experts // k)) % experts, axis=2)
    if k == 1 and rows:
        ids[:, 0, 0] = np.where(ids[:, :, 0].any(axis=1), ids[:, 0, 0], 1)
        ids[0, :, 0] = np.maximum(ids[0, :, 0], 1)
    return ids.astype(smallest_uint_dtype(experts))


@st.composite
def samples(draw, layout: RoutingLayout, max_samples: int = 4):
    """``(samples, seq_lens)``: each sample None or rows on ``[start, stop)`` within its 0..10 tokens."""
    out, lens = [], []
    for i in range(draw(st.integers(0, max_samples))):
        n = draw(st.integers(0, 10))
        lens.append(n)
        if draw(st.integers(0, 4)) == 0:
            out.append(None)
            continue
        start = draw(st.integers(0, n))
        rows = draw(st.integers(0, n - start))
        out.append(RoutedRows(start, make_ids(layout, rows, draw(st.integers(0, 2**32 - 1)) + i)))
    return out, lens


def assert_same(got: RoutedRows | None, want: RoutedRows | None, layout: RoutingLayout) -> None:
    if want is None or want.num_rows == 0:
        assert got is None or got.num_rows == 0
        return
    assert got is not None and (got.start, got.stop) == (want.start, want.stop)
    assert got.ids.dtype == smallest_uint_dtype(layout.num_experts)
    np.testing.assert_array_equal(got.ids, want.ids)


def npy_b64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


# --------------------------------------------------------------------------------------------------- round trips
@FUZZ
@given(
    layout=layouts(),
    prompt_len=st.integers(0, 10),
    response_len=st.integers(1, 8),
    data=st.data(),
    form=st.sampled_from(["array", "tensor", "openai", "openai-fortran"]),
)
def test_vllm_round_trip(layout, prompt_len, response_len, data, form):
    prompt_start = data.draw(st.integers(0, prompt_len))
    rows = RoutedRows(prompt_start, make_ids(layout, prompt_len - prompt_start + response_len - 1, data.draw(st.integers(0, 2**32 - 1))))  # fmt: skip
    raw = encode_vllm(rows, layout)
    assert raw.dtype == smallest_uint_dtype(layout.num_experts)  # uint8 / uint16 like vLLM, int32 past 65536
    kwargs = dict(prompt_len=prompt_len, response_len=response_len, layout=layout, prompt_start=prompt_start)
    if form == "array":
        out = decode_vllm(raw, **kwargs)
    elif form == "tensor":
        out = decode_vllm(torch.from_numpy(raw), **kwargs)
    else:
        out = decode_vllm_openai(npy_b64(np.asfortranarray(raw) if form == "openai-fortran" else raw), **kwargs)
    assert out.start == prompt_start
    assert_same(out, rows, layout)


@FUZZ
@given(layout=layouts(), prompt_len=st.integers(0, 10), response_len=st.integers(0, 8), data=st.data())
def test_sglang_round_trip(layout, prompt_len, response_len, data):
    rows_total = prompt_len + response_len - 1
    start = data.draw(st.integers(0, max(min(prompt_len, rows_total), 0)))
    rows = RoutedRows(start, make_ids(layout, max(rows_total - start, 0), data.draw(st.integers(0, 2**32 - 1))))
    fitting = [w for w, top in (("int32", 2**31), ("uint16", 65536), ("int16", 32768), ("uint8", 256))
               if layout.num_experts <= top]  # fmt: skip
    wire = data.draw(st.sampled_from(fitting))
    meta = encode_sglang(rows, layout, wire_dtype=wire)
    if rows_total < 0:
        try:
            decode_sglang(meta, prompt_len=prompt_len, response_len=response_len, layout=layout)
        except RoutingFormatError:
            return
        raise AssertionError("a negative row count was accepted")
    out = decode_sglang(meta, prompt_len=prompt_len, response_len=response_len, layout=layout)
    assert out.start == start
    assert_same(out, rows, layout)
    as_array = {"routed_experts": np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=wire)}
    as_array["routed_experts_start_len"] = start
    assert_same(decode_sglang(as_array, prompt_len=prompt_len, response_len=response_len, layout=layout), rows, layout)


@FUZZ
@given(layout=layouts(), data=st.data(), nested=st.booleans())
def test_verl_round_trip_dense_and_nested(layout, data, nested):
    batch, lens = data.draw(samples(layout))
    filled = [s if s is not None else RoutedRows(0, make_ids(layout, 0, 0)) for s in batch]
    if layout.num_experts > 32768:  # verl stores int16: refused, never wrapped
        try:
            encode_verl_batch(filled, layout, lens, nested=nested)
        except ExpertIdRangeError:
            return
        raise AssertionError("int16 cannot hold these ids")
    if nested and not filled:
        return
    pads = [data.draw(st.integers(0, 3)) for _ in filled]
    encoded = encode_verl_batch(filled, layout, lens, nested=nested, left_pad=pads)
    if nested:
        decoded = decode_verl_batch(encoded, layout)
    else:
        mask = torch.zeros(encoded.shape[:2], dtype=torch.long)
        for i, (pad, n) in enumerate(zip(pads, lens, strict=True)):
            mask[i, pad : pad + n] = 1
        decoded = decode_verl_batch(encoded, layout, attention_mask=mask)
    assert len(decoded) == len(batch)
    for got, want in zip(decoded, batch, strict=True):
        assert_same(got, want, layout)


@FUZZ
@given(layout=layouts(), data=st.data())
def test_transport_fields_and_trace_round_trip(layout, data):
    batch, lens = data.draw(samples(layout))
    fields = [sample_fields(s, layout) for s in batch]
    ids = [f[IDS_FIELD] for f in fields]
    spans = torch.stack([f[SPAN_FIELD] for f in fields]) if fields else torch.zeros(0, 2, dtype=torch.int64)
    carried = torch.nested.as_nested_tensor(ids, layout=torch.jagged) if ids else ids
    for got, want in zip(rows_from_fields(carried, spans, layout=layout), batch, strict=True):
        assert_same(got, want, layout)
    reference = rows_to_trace(batch, lens, layout)
    trace = trace_from_fields(carried, spans, lens, layout)
    assert torch.equal(trace.to_tensor(), reference.to_tensor()) and trace.lengths.tolist() == lens
    offsets = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int64)
    assert torch.equal(dense_rows_from_fields(carried, spans, offsets, layout), reference.to_tensor())
    for got, want in zip(trace_to_rows(trace), batch, strict=True):
        assert_same(got, want, layout)
    again = RoutingTrace.from_tensor(trace.to_tensor(), trace.num_experts, trace.lengths, trace.layer_indices)
    assert torch.equal(again.to_tensor(), trace.to_tensor()) and again.layer_indices == layout.moe_layers
    unpickled = pickle.loads(pickle.dumps(trace))  # uint16 ids included (torch itself cannot pickle them)
    assert torch.equal(unpickled.ids, trace.ids) and unpickled.lengths.tolist() == lens


@FUZZ
@given(layout=layouts(max_experts=32768), data=st.data())
def test_actor_expansion_equals_the_per_sample_verl_encoding(layout, data):
    """The actor's one-pass expansion of the transport fields is verl's per-sample int16 layout, token for token."""
    batch, lens = data.draw(samples(layout))
    if not batch:
        return
    fields = [sample_fields(s, layout) for s in batch]
    td = TensorDict(
        {
            "input_ids": torch.nested.as_nested_tensor(
                [torch.zeros(n, dtype=torch.long) for n in lens], layout=torch.jagged
            ),
            IDS_FIELD: torch.nested.as_nested_tensor([f[IDS_FIELD] for f in fields], layout=torch.jagged),
            SPAN_FIELD: torch.stack([f[SPAN_FIELD] for f in fields]),
        },
        batch_size=[len(batch)],
    )
    assert expand_compact_routing(td, layout)
    filled = [s if s is not None else RoutedRows(0, make_ids(layout, 0, 0)) for s in batch]
    want = encode_verl_batch(filled, layout, lens, nested=True)
    got = td["routed_experts"]
    assert got.dtype == torch.int16 and torch.equal(got.offsets(), td["input_ids"].offsets())
    for i, (g, w) in enumerate(zip(got.unbind(), want.unbind(), strict=True)):
        assert torch.equal(g, w), i


@FUZZ
@given(layout=layouts(), data=st.data())
def test_packed_routing_round_trip(layout, data):
    batch, lens = data.draw(samples(layout, max_samples=6))
    plens = [data.draw(st.integers(0, n)) for n in lens]
    groups = [data.draw(st.sampled_from("ab")) for _ in batch]
    packed = pickle.loads(pickle.dumps(PackedRouting.pack(batch, plens, groups, layout)))
    for got, want in zip(packed.unpack(), batch, strict=True):
        assert_same(got, want, layout)
    assert torch.equal(packed.to_trace(lens, layout).to_tensor(), rows_to_trace(batch, lens, layout).to_tensor())
    chosen = data.draw(st.lists(st.integers(0, len(batch) - 1), max_size=len(batch))) if batch else []
    part = packed.select(chosen)
    for got, i in zip(part.unpack(), chosen, strict=True):
        assert_same(got, batch[i], layout)


# ------------------------------------------------------------------------------------------------ garbage in
SMALL = RoutingLayout("qwen3_moe", "qwen3_moe", 3, (0, 2), 2, 8)  # dense decoder layer 1, top-2 of 8
DTYPES = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64, np.float16,
          np.float32, np.float64, np.bool_, np.complex64]  # fmt: skip


@st.composite
def junk_arrays(draw, rows: int = 4, layout: RoutingLayout = SMALL) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = draw(
        st.one_of(
            array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5),
            st.just((rows, layout.num_hidden_layers, layout.top_k)),
        )
    )
    if dtype.kind in "iu" and draw(st.booleans()):  # small values reach the range / duplicate / dense checks
        return draw(arrays(dtype, shape, elements=st.integers(0, min(layout.num_experts + 1, np.iinfo(dtype).max))))
    return draw(arrays(dtype, shape))


JUNK = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=12),
        st.binary(max_size=24),
        st.binary(max_size=64).map(lambda b: base64.b64encode(b).decode()),
    ),
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=4), children)),
    max_leaves=8,
)


def only_format_errors(decode, *args, **kwargs) -> None:
    """The decoder returns rows or raises RoutingFormatError; under skip_sample that is a counted ``None``."""
    try:
        out = decode(*args, **kwargs)
    except RoutingFormatError:
        stats = BoundaryStats()
        assert decode_with_policy(decode, *args, on_invalid="skip_sample", stats=stats, **kwargs) is None
        assert stats.skipped_samples == 1 and sum(stats.errors.values()) == 1
        return
    assert isinstance(out, (RoutedRows, list))


@FUZZ
@given(array=junk_arrays(), prompt_len=st.integers(-2, 4), response_len=st.integers(-1, 3), as_tensor=st.booleans())
def test_vllm_garbage_arrays(array, prompt_len, response_len, as_tensor):
    payload = torch.from_numpy(array) if as_tensor and array.ndim else array
    only_format_errors(decode_vllm, payload, prompt_len=prompt_len, response_len=response_len, layout=SMALL)


@st.composite
def npy_like(draw) -> bytes:
    """Random bytes, a valid payload cut or with bytes flipped, or a hand-made header with random content."""
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.binary(max_size=200))
    buffer = io.BytesIO()
    np.save(buffer, draw(junk_arrays()))
    raw = bytearray(buffer.getvalue())
    if kind == 1:
        return bytes(raw[: draw(st.integers(0, len(raw)))])
    if kind == 2:
        for _ in range(draw(st.integers(1, 4))):
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
        return bytes(raw)
    header = draw(st.one_of(st.text(max_size=80), st.sampled_from([
        "{'descr': '<u8', 'fortran_order': False, 'shape': (10**12, 3), }",
        "{'descr': [('a', '<i4')], 'fortran_order': False, 'shape': (1,), }",
        "{'descr': '<i4', 'fortran_order': 0, 'shape': (4, 3, 2), }",
        "{'descr': 'bogus', 'fortran_order': False, 'shape': (1,), }",
        "{'descr': '<i4', 'fortran_order': False, 'shape': (-1, 3, 2), }",
        "((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((",
    ]))).encode("utf8")  # fmt: skip
    version = draw(st.sampled_from([b"\x01\x00", b"\x02\x00", b"\x03\x00", b"\x09\x00"]))
    width = 2 if version[0] == 1 else 4
    return b"\x93NUMPY" + version + len(header).to_bytes(width, "little") + header + draw(st.binary(max_size=64))


@FUZZ
@given(raw=npy_like(), prompt_len=st.integers(0, 4), response_len=st.integers(1, 3))
def test_vllm_openai_garbage_bytes(raw, prompt_len, response_len):
    payload = base64.b64encode(raw).decode()
    only_format_errors(decode_vllm_openai, payload, prompt_len=prompt_len, response_len=response_len, layout=SMALL)


@FUZZ
@given(
    meta=st.one_of(
        JUNK,
        st.fixed_dictionaries(
            {},
            optional={
                "routed_experts": st.one_of(JUNK, junk_arrays(rows=3)),
                "routed_experts_start_len": st.one_of(JUNK, st.integers(-1, 5)),
                "routed_experts_dtype": st.one_of(JUNK, st.sampled_from(["int32", "uint8", "int16", "uint16"])),
            },
        ),
    ),
    prompt_len=st.integers(-1, 4),
    response_len=st.integers(-1, 3),
)
def test_sglang_garbage_meta_info(meta, prompt_len, response_len):
    only_format_errors(decode_sglang, meta, prompt_len=prompt_len, response_len=response_len, layout=SMALL)


@FUZZ
@given(
    array=junk_arrays(rows=5),
    num_tokens=st.one_of(st.none(), st.integers(-2, 7), st.floats(allow_nan=True), st.text(max_size=2)),
    mask=arrays(np.int64, st.tuples(st.integers(1, 3), st.integers(0, 6)), elements=st.integers(-1, 2)),
)
def test_verl_garbage_samples_and_batches(array, num_tokens, mask):
    only_format_errors(decode_verl_sample, array, SMALL, num_tokens=num_tokens)
    if array.ndim == 4 or (array.ndim == 3 and array.size):
        batch = torch.from_numpy(array if array.ndim == 4 else array[None])
        only_format_errors(decode_verl_batch, batch, SMALL, attention_mask=torch.from_numpy(mask))
        only_format_errors(
            decode_verl_batch, batch, SMALL, attention_mask=torch.ones(batch.shape[:2], dtype=torch.long)
        )
    if array.ndim == 3 and array.dtype.kind in "iub":
        parts = [torch.from_numpy(array), torch.from_numpy(array[:1])]
        only_format_errors(decode_verl_batch, torch.nested.as_nested_tensor(parts, layout=torch.jagged), SMALL)


@FUZZ
@given(
    parts=st.lists(junk_arrays(rows=2), max_size=3),
    spans=st.one_of(junk_arrays(), arrays(np.int64, (3, 2), elements=st.integers(-2, 6))),
    seq_lens=st.one_of(st.lists(st.one_of(st.integers(-1, 6), st.floats()), max_size=3), st.just([4, 4, 4])),
)
def test_transport_garbage_fields(parts, spans, seq_lens):
    ids = [torch.from_numpy(p) for p in parts]
    try:
        trace = trace_from_fields(ids, torch.from_numpy(np.atleast_1d(spans)), seq_lens, SMALL)
    except RoutingFormatError:
        return
    assert trace.num_sequences == len(parts)


@FUZZ
@given(
    field=st.sampled_from(["ids", "segment_offsets", "prompt_segment", "response_segment", "start", "prompt_lens"]),
    junk=junk_arrays(rows=3),
    seed=st.integers(0, 2**16),
)
def test_packed_routing_garbage_fields(field, junk, seed):
    batch = [RoutedRows(1, make_ids(SMALL, 3, seed)), None, RoutedRows(0, make_ids(SMALL, 2, seed + 1))]
    packed = PackedRouting.pack(batch, [2, 2, 1], ["g", "g", "h"], SMALL)
    packed.__dict__[field] = torch.from_numpy(junk) if junk.ndim else junk  # as if corrupted on the wire
    try:
        restored = PackedRouting.__new__(PackedRouting)
        restored.__setstate__(dict(packed.__dict__))  # what unpickling does (torch cannot pickle every dtype)
        restored.to_trace([5, 2, 3], SMALL)
        restored.select([2, 0])
    except RoutingFormatError:
        return


# ------------------------------------------------------------- mutated valid payloads: reach every deep check
INT_DTYPES = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.int64, np.uint64]


@st.composite
def mutated(draw, valid: np.ndarray, layout: RoutingLayout) -> np.ndarray:
    """``valid`` (``[rows, layers, top_k]``) with one realistic defect: a wrong / repeated / zeroed id, a routed
    dense layer, a narrowed or float dtype, a row too many or too few."""
    out = valid.astype(np.int64)
    kind = draw(st.sampled_from(["value", "repeat", "zero-row", "zero-layer", "dtype", "rows", "nothing"]))
    rows = out.shape[0]
    if kind == "value" and out.size:
        special = [-1, 0, layout.num_experts - 1, layout.num_experts, layout.num_experts + 1, 255, 256, 65536]
        for _ in range(draw(st.integers(1, 3))):
            out.flat[draw(st.integers(0, out.size - 1))] = draw(st.sampled_from(special))
    elif kind == "repeat" and rows and out.shape[2] >= 2:
        row, layer = draw(st.integers(0, rows - 1)), draw(st.integers(0, out.shape[1] - 1))
        out[row, layer, 1] = out[row, layer, 0]
    elif kind == "zero-row" and rows:
        out[draw(st.integers(0, rows - 1)), draw(st.integers(0, out.shape[1] - 1))] = 0
    elif kind == "zero-layer":
        out[:, draw(st.integers(0, out.shape[1] - 1))] = 0
    elif kind == "rows":
        out = out[: draw(st.integers(0, rows))] if draw(st.booleans()) else np.concatenate([out, out[:1]])
    dtype = draw(st.sampled_from(INT_DTYPES + [np.float32, np.bool_])) if kind == "dtype" else out.dtype
    return out.astype(dtype)  # an integer dtype too narrow wraps, as a careless engine would


def accepted_is_valid(out, layout: RoutingLayout) -> None:
    """What a decoder accepts is valid routing in the layout's dtype."""
    assert out.ids.dtype == smallest_uint_dtype(layout.num_experts)
    RoutingTrace.from_tensor(torch.from_numpy(out.ids.astype(np.int64)), layout.num_experts)  # range + distinct


@FUZZ
@given(layout=layouts(max_experts=300), data=st.data(), prompt_len=st.integers(1, 9), response_len=st.integers(1, 9))
def test_vllm_mutated_payloads(layout, data, prompt_len, response_len):
    full = encode_vllm(RoutedRows(0, make_ids(layout, prompt_len + response_len - 1, data.draw(st.integers(0, 2**32 - 1)))), layout)  # fmt: skip
    if data.draw(st.booleans()):  # route a dense decoder layer instead
        dense = [i for i in range(layout.num_hidden_layers) if i not in layout.moe_layers]
        if dense and full.shape[0]:
            full = full.copy()
            full[data.draw(st.integers(0, full.shape[0] - 1)), data.draw(st.sampled_from(dense))] = 1
    bad = data.draw(mutated(full, layout))
    kwargs = dict(prompt_len=prompt_len, response_len=response_len, layout=layout)
    for decode, payload in ((decode_vllm, bad), (decode_vllm_openai, npy_b64(bad))):
        try:
            accepted_is_valid(decode(payload, **kwargs), layout)
        except RoutingFormatError:
            only_format_errors(decode, payload, **kwargs)


@FUZZ
@given(
    data=st.data(),
    key=st.sampled_from(["descr", "fortran_order", "shape"]),
    value=st.one_of(
        JUNK,
        st.sampled_from(["<i4", "<f8", "|b1", "|O", "<u8", ">i2", "S3", "<M8[s]", "V4", "<c8"]),
        st.lists(st.integers(-2, 10**13), max_size=4).map(tuple),
    ),
)
def test_vllm_openai_mutated_headers(data, key, value):
    full = encode_vllm(RoutedRows(0, make_ids(SMALL, 4, data.draw(st.integers(0, 99)))), SMALL)
    header = {"descr": full.dtype.str, "fortran_order": False, "shape": full.shape, key: value}
    text = repr(header).encode("latin1", "replace") + b"\n"
    raw = b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + full.tobytes()
    only_format_errors(decode_vllm_openai, base64.b64encode(raw).decode(), prompt_len=3, response_len=2, layout=SMALL)


# sizes that overflow numpy's intp alone or in a product, next to small and empty ones
DIMS = st.one_of(
    st.integers(-3, 6),
    st.sampled_from([0, 0, 2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64, 10**20, 10**40, -(2**63)]),
)
DESCRS = ["<i4", "|u1", "<u2", ">i2", "<i8", ">u8", "|i1", "<f4", "<f8", "|b1", "|O", "<c8", "V4", "S3", "<M8[s]",
          "<U2", "bogus", "", "<i0", "<i3"]  # fmt: skip


@st.composite
def npy_headers(draw) -> bytes:
    """A ``.npy`` payload with a random, well-formed-looking header: any dtype string, any fortran flag, shapes of
    0..70 dims with huge / zero / negative sizes; the data either the declared byte count (when small enough to
    build), none, or random; the header length field exact or off."""
    shape = tuple(draw(st.one_of(st.lists(DIMS, min_size=3, max_size=3), st.lists(DIMS, max_size=70))))
    descr = draw(st.one_of(st.sampled_from(["<i4", "|u1"]), st.sampled_from(DESCRS), st.text(max_size=6)))
    fortran = draw(st.one_of(st.booleans(), st.sampled_from([0, 1, None, "False"])))
    text = repr({"descr": descr, "fortran_order": fortran, "shape": shape}).encode("utf8") + b"\n"
    try:
        declared = int(np.prod(shape, dtype=object)) * np.dtype(descr).itemsize
    except Exception:  # not a dtype: any data will do
        declared = -1
    data_kind = draw(st.sampled_from(["declared", "none", "random", "one-off"]))
    if data_kind == "declared" and 0 <= declared <= 4096:
        data = bytes(draw(st.integers(0, 3)) for _ in range(declared))  # tiny ids: reach the routing checks
    elif data_kind == "one-off" and 0 <= declared <= 4096:
        data = bytes(max(declared + draw(st.sampled_from([-1, 1])), 0))
    elif data_kind == "random":
        data = draw(st.binary(max_size=64))
    else:
        data = b""
    version = draw(st.sampled_from([1, 2, 3]))
    length = len(text) + draw(st.sampled_from([0] * 6 + [-1, 1, 10**4, -len(text)]))
    width = 2 if version == 1 else 4
    field = max(length, 0).to_bytes(width, "little") if max(length, 0) < 256**width else b"\xff" * width
    return b"\x93NUMPY" + bytes([version, 0]) + field + text + data


def npy_raw(descr: str, shape: tuple, data: bytes = b"") -> bytes:
    text = repr({"descr": descr, "fortran_order": False, "shape": shape}).encode() + b"\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + data


@FUZZ
@given(raw=npy_headers(), prompt_len=st.integers(0, 4), response_len=st.integers(1, 3))
@example(raw=npy_raw("<i4", (0, 10**20, 2)), prompt_len=0, response_len=1)  # issue #25: zero bytes declared
@example(raw=npy_raw("<i4", (0, 2**62, 2)), prompt_len=0, response_len=1)
@example(raw=npy_raw("|u1", (0,) * 70), prompt_len=0, response_len=1)
@example(raw=npy_raw("<i4", (0, 2**40, 2)), prompt_len=0, response_len=1)
def test_vllm_openai_random_npy_headers(raw, prompt_len, response_len):
    """Whatever a header declares, the payload decodes to valid rows or is a RoutingFormatError (counted and skipped
    under skip_sample): numpy's own errors for shapes it cannot describe never escape."""
    payload = base64.b64encode(raw).decode()
    kwargs = dict(prompt_len=prompt_len, response_len=response_len, layout=SMALL)
    try:
        accepted_is_valid(decode_vllm_openai(payload, **kwargs), SMALL)
    except RoutingFormatError:
        only_format_errors(decode_vllm_openai, payload, **kwargs)


@FUZZ
@given(layout=layouts(max_experts=300), data=st.data(), prompt_len=st.integers(1, 9), response_len=st.integers(1, 9))
def test_sglang_mutated_payloads(layout, data, prompt_len, response_len):
    rows = RoutedRows(0, make_ids(layout, prompt_len + response_len - 1, data.draw(st.integers(0, 2**32 - 1))))
    meta = encode_sglang(rows, layout)
    flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
    bad = data.draw(mutated(flat.reshape(rows.num_rows, layout.num_hidden_layers, layout.top_k), layout))
    name = data.draw(st.sampled_from(["int32", "int16", "uint8", "uint16"]))
    raw = bad.astype(name).tobytes()
    if data.draw(st.booleans()):  # cut the payload at any byte
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    meta = {"routed_experts": base64.b64encode(raw).decode(), "routed_experts_dtype": name}
    meta["routed_experts_start_len"] = data.draw(st.one_of(st.integers(-1, 3), JUNK))
    kwargs = dict(prompt_len=prompt_len, response_len=response_len, layout=layout)
    try:
        accepted_is_valid(decode_sglang(meta, **kwargs), layout)
    except RoutingFormatError:
        only_format_errors(decode_sglang, meta, **kwargs)


@FUZZ
@given(layout=layouts(max_experts=300), data=st.data(), length=st.integers(1, 9))
def test_verl_and_transport_mutated_rows(layout, data, length):
    start = data.draw(st.integers(0, length - 1))
    rows = RoutedRows(start, make_ids(layout, data.draw(st.integers(1, length - start)), data.draw(st.integers(0, 99))))
    bad = data.draw(mutated(rows.ids, layout))
    sample = torch.zeros(length, layout.num_hidden_layers, layout.top_k, dtype=torch.int64)
    width = min(bad.shape[0], length - start)
    sample[start : start + width, list(layout.moe_layers)] = torch.from_numpy(bad[:width].astype(np.int64))
    tensor = torch.from_numpy(sample.numpy().astype(bad.dtype))
    try:
        accepted_is_valid(decode_verl_sample(tensor, layout), layout)
    except RoutingFormatError:
        only_format_errors(decode_verl_sample, tensor, layout)
    ids = torch.from_numpy(np.ascontiguousarray(bad))
    spans = torch.tensor([[start, start + bad.shape[0]]])
    try:  # the trainer-side carriers: refused before any narrowing, or exactly the valid rows
        trace = trace_from_fields([ids], spans, [length], layout)
        packed = PackedRouting.pack([RoutedRows(start, bad)], [start], ["g"], layout)
    except RoutingFormatError:
        return
    assert torch.equal(trace.to_tensor()[start : start + bad.shape[0]], torch.from_numpy(bad.astype(np.int64)))
    assert torch.equal(packed.to_trace([length], layout).to_tensor(), trace.to_tensor())
