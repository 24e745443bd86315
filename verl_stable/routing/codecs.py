"""Engine-boundary codecs for routed experts: vLLM, SGLang and verl layouts in, validated compact rows out.

Every inference engine reports, per generated sequence, the top-k expert ids that each token was routed to in
each decoder layer. The formats differ in dtype, in which layers they cover and in which token rows they hold:

* vLLM 0.24 ``CompletionOutput.routed_experts``: uint8 (<= 256 experts) or uint16 numpy,
  ``[prompt_len - prompt_start + n_output - 1, num_hidden_layers, top_k]``. Dense layers are zero rows; the last
  sampled token was never fed through the model, so it has no row; ``SamplingParams.routed_experts_prompt_start``
  skips the first ``prompt_start`` prompt rows. The OpenAI endpoint returns the same array as base64 ``.npy``.
* SGLang 0.5.12 ``meta_info["routed_experts"]``: base64 of flat int32 (or the dtype named by
  ``meta_info["routed_experts_dtype"]`` on newer servers) covering token positions
  ``[routed_experts_start_len, seqlen - 1)`` for every decoder layer.
* verl 0.9.1 ``routed_experts``: int16 ``[prompt_len + response_len, num_hidden_layers, top_k]`` per sample
  (zero rows where nothing was recorded), stacked either left/right padded to a fixed width or as a jagged tensor.

All of them decode to :class:`RoutedRows`: the ids of the contiguous token positions ``[start, start + rows)``
for the MoE layers only (MoE-layer ordinal ``m`` is absolute decoder layer ``layout.moe_layers[m]``), stored in the
smallest unsigned dtype that holds ``num_experts - 1``. Positions outside ``[start, stop)`` have no recorded routing;
a replay uses the model's own routing there and counts them.

Validation at the boundary (:func:`validate_ids`) rejects, with an error naming what was expected and received:
expert ids outside ``[0, num_experts)``, a repeated id within one (token, layer) row, all-zero rows in a MoE layer
(a known engine failure mode where a fused kernel returns no routing), and row counts that do not match the tokens.
Every malformed payload -- wrong type, dtype or shape, bad base64 or ``.npy`` bytes, non-integer counts, a wire
dtype too narrow for the model's expert ids (they would have wrapped) -- raises a :class:`RoutingFormatError`, so
``decode_with_policy(..., on_invalid="skip_sample")`` can count and skip it. Every function that takes
:class:`RoutedRows` and a layout validates them before narrowing them to a smaller dtype; an encoder never wraps.
A wrong ``layout`` argument (not a :class:`RoutingLayout`) is a caller bug and raises ``TypeError``.
Nothing here imports verl, vLLM or SGLang.
"""

from __future__ import annotations

import ast
import base64
import logging
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from verl_stable.routing.trace import RoutingLayout, RoutingTrace, _ids_checked, require_int, storage_dtype

_logger = logging.getLogger("verl_stable.routing")

__all__ = [
    "BoundaryStats",
    "decode_with_policy",
    "rows_to_trace",
    "trace_to_rows",
    "DuplicateExpertError",
    "ExpertIdRangeError",
    "LayerMapError",
    "RoutedRows",
    "RoutingFormatError",
    "RowCountError",
    "ZeroRoutingError",
    "concat_partial_rollout",
    "decode_sglang",
    "decode_verl_sample",
    "decode_verl_batch",
    "decode_vllm",
    "decode_vllm_openai",
    "encode_sglang",
    "encode_verl_batch",
    "encode_verl_sample",
    "encode_vllm",
    "smallest_uint_dtype",
    "validate_ids",
    "validate_rows",
]


class RoutingFormatError(ValueError):
    """Routing data that cannot be trusted: replaying it would misroute tokens."""


class LayerMapError(RoutingFormatError):
    """Layer count / top-k differ from the model, or a layer declared dense carries routing."""


class RowCountError(RoutingFormatError):
    """The number of routed rows does not match the tokens they claim to cover."""


class ExpertIdRangeError(RoutingFormatError):
    """An expert id outside ``[0, num_experts)``, or a dtype too narrow to hold every id of the model."""


class DuplicateExpertError(RoutingFormatError):
    """The same expert id twice in one (token, layer) row: top-k selects distinct experts."""


class ZeroRoutingError(RoutingFormatError):
    """All-zero rows in a MoE layer: the engine returned no routing (a known failure mode)."""


def smallest_uint_dtype(num_experts: int) -> np.dtype:
    """Numpy twin of :func:`verl_stable.routing.trace.storage_dtype`: uint8 / uint16 / int32."""
    return np.dtype(str(storage_dtype(num_experts)).removeprefix("torch."))


def _dense_layers(layout: RoutingLayout) -> tuple[int, ...]:
    moe = set(layout.moe_layers)
    return tuple(i for i in range(layout.num_hidden_layers) if i not in moe)


def _require_layout(layout: Any) -> RoutingLayout:
    if not isinstance(layout, RoutingLayout):
        raise TypeError(f"layout must be a RoutingLayout, got {type(layout).__name__}")
    return layout


def _count(value: Any, what: str, minimum: int = 0) -> int:
    """A token / row count or position: an integer >= ``minimum`` (floats are refused, never truncated)."""
    return require_int(value, what, minimum=minimum, error=RowCountError)


def _ids_structure(ids: Any, what: str) -> None:
    if not isinstance(ids, np.ndarray):
        raise RoutingFormatError(f"{what}: ids must be a numpy array, got {type(ids).__name__}")
    if ids.ndim != 3:
        raise LayerMapError(f"{what}: ids must be [rows, moe_layers, top_k], got shape {tuple(ids.shape)}")
    _require_integer_dtype(ids.dtype, what)


@dataclass
class RoutedRows:
    """Routing of one sequence for the contiguous token positions ``[start, start + len(ids))``.

    Attributes:
        start: first token position (0 = first prompt token) that has a row; an integer >= 0.
        ids: ``[rows, num_moe_layers, top_k]`` integer expert ids (decoders give the layout's smallest unsigned
            dtype). Construction checks the structure; functions that take a layout check the values.
    """

    start: int
    ids: np.ndarray

    def __post_init__(self) -> None:
        self.start = _count(self.start, "RoutedRows.start")
        _ids_structure(self.ids, "RoutedRows")

    @property
    def stop(self) -> int:
        """One past the last covered token position."""
        return self.start + int(self.ids.shape[0])

    @property
    def num_rows(self) -> int:
        """Number of covered token positions."""
        return int(self.ids.shape[0])


def _require_integer_dtype(dtype: np.dtype, what: str) -> None:
    if dtype.kind not in "iu":
        raise RoutingFormatError(f"{what}: expert ids must be integers, got dtype {dtype}")


def _as_numpy(values: Any, what: str) -> np.ndarray:
    """A payload as a numpy array of integers; anything else is a :class:`RoutingFormatError`."""
    if isinstance(values, torch.Tensor):
        if values.is_nested:
            raise RoutingFormatError(f"{what}: expected a dense tensor, got a nested one (unbind it first)")
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise RoutingFormatError(f"{what}: expert ids must be integers, got dtype {values.dtype}")
        return values.detach().cpu().numpy()
    if isinstance(values, np.ndarray):
        out = values
    elif isinstance(values, (list, tuple)):
        try:
            out = np.asarray(values)
        except (ValueError, TypeError, OverflowError) as exc:
            raise RoutingFormatError(f"{what}: nested lists are not a rectangular integer array ({exc})") from exc
    else:
        raise RoutingFormatError(
            f"{what}: unsupported type {type(values).__name__}; expected numpy, torch or nested lists"
        )
    _require_integer_dtype(out.dtype, what)
    return out


def _wire_ids(values: Any, layout: RoutingLayout, what: str) -> np.ndarray:
    """An engine payload as integer ids whose dtype can hold every expert id of the model (else they wrapped)."""
    out = _as_numpy(values, what)
    _check_wire_width(out.dtype, layout, what)
    return out


def _check_wire_width(dtype: np.dtype, layout: RoutingLayout, what: str) -> None:
    top = int(np.iinfo(dtype).max)
    if top < layout.num_experts - 1:
        raise ExpertIdRangeError(
            f"{what}: dtype {dtype} holds expert ids up to {top}, the model has {layout.num_experts} experts "
            f"(ids up to {layout.num_experts - 1}): larger ids cannot be represented and would wrap"
        )


def _locate(mask: np.ndarray, layout: RoutingLayout, start: int) -> str:
    row, ordinal = (int(x) for x in np.argwhere(mask)[0][:2])
    return f"token position {start + row}, MoE layer {ordinal} (decoder layer {layout.moe_layers[ordinal]})"


def validate_ids(ids: np.ndarray, layout: RoutingLayout, *, start: int = 0) -> None:
    """Check MoE-layer ids ``[rows, num_moe_layers, top_k]`` against the layout; raise on the first problem.

    Checks, in order: shape; integer dtype; ``0 <= id < num_experts``; no all-zero row when ``top_k >= 2``
    (for ``top_k == 1`` a whole MoE layer of zeros over 8 or more rows, which random routing produces with
    probability ``num_experts**-8``); distinct ids within every row. ``ids`` may also be a tensor or nested lists.

    Raises:
        LayerMapError: wrong number of MoE layers or top-k.
        ExpertIdRangeError, ZeroRoutingError, DuplicateExpertError: as named.
        RoutingFormatError: not an integer array.
    """
    layout = _require_layout(layout)
    start = _count(start, "start")
    if not isinstance(ids, np.ndarray):
        ids = _as_numpy(ids, "routing")
    if ids.ndim != 3:
        raise LayerMapError(f"routing must be [rows, moe_layers, top_k], got shape {tuple(ids.shape)}")
    if ids.shape[1] != layout.num_moe_layers or ids.shape[2] != layout.top_k:
        raise LayerMapError(
            f"routing has {ids.shape[1]} MoE layers x top-{ids.shape[2]}; the model expects "
            f"{layout.num_moe_layers} MoE layers x top-{layout.top_k}"
        )
    if ids.dtype.kind not in "iu":
        raise RoutingFormatError(f"expert ids must be integers, got dtype {ids.dtype}")
    if ids.size == 0:
        return
    alive = np.zeros(layout.num_moe_layers, dtype=bool)
    # chunks bound the temporaries (masks, transposed copy) to a few MiB whatever the sequence length
    for lo in range(0, ids.shape[0], _VALIDATE_CHUNK_ROWS):
        chunk = ids[lo : lo + _VALIDATE_CHUNK_ROWS]
        _validate_chunk(chunk, layout, start + lo)
        alive |= chunk.any(axis=(0, 2))
    if layout.top_k == 1 and ids.shape[0] >= 8 and not alive.all():
        layer = int(np.argmin(alive))
        raise ZeroRoutingError(
            f"MoE layer {layer} (decoder layer {layout.moe_layers[layer]}) is expert 0 for all {ids.shape[0]} "
            "rows: the engine returned no routing for it"
        )


_VALIDATE_CHUNK_ROWS = 4096


def _repeated_rows(ids: np.ndarray) -> np.ndarray:
    """``[rows, layers]`` bool: the row repeats an expert id. Pairwise compares of contiguous top-k columns for
    small K (several times faster than sorting every row), a sort beyond."""
    k = ids.shape[2]
    if k > 16:
        ordered = np.sort(ids, axis=2)
        return (ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=2)
    cols = np.ascontiguousarray(np.moveaxis(ids, 2, 0))
    dup = np.zeros(ids.shape[:2], dtype=bool)
    for i in range(k - 1):
        for j in range(i + 1, k):
            np.logical_or(dup, cols[i] == cols[j], out=dup)
    return dup


def _validate_chunk(ids: np.ndarray, layout: RoutingLayout, start: int) -> None:
    signed = ids.dtype.kind == "i"
    if int(ids.max()) >= layout.num_experts or (signed and int(ids.min()) < 0):
        out_of_range = ids >= layout.num_experts
        if signed:
            out_of_range |= ids < 0
        bad = ids[out_of_range]
        raise ExpertIdRangeError(
            f"expert ids outside [0, {layout.num_experts}) (e.g. {int(bad.flat[0])}) at "
            f"{_locate(out_of_range.any(axis=2), layout, start)}"
        )
    if layout.top_k < 2:
        return
    dup = _repeated_rows(ids)
    if not dup.any():
        return
    zero_rows = dup & ~ids.any(axis=2)  # with top_k >= 2 an all-zero row repeats expert 0
    if zero_rows.any():
        raise ZeroRoutingError(
            f"all-zero (token, MoE layer) rows, first at {_locate(zero_rows, layout, start)}"
            ": the engine returned no routing for them (known failure of some fused MoE kernels)"
        )
    row, ordinal = (int(x) for x in np.argwhere(dup)[0])
    raise DuplicateExpertError(
        f"a row repeats an expert id at {_locate(dup, layout, start)}: {ids[row, ordinal].tolist()}"
    )


def validate_rows(rows: Any, layout: RoutingLayout, what: str = "routing") -> RoutedRows:
    """Validate :class:`RoutedRows` (structure, then :func:`validate_ids` against ``layout``) before anything
    narrows them; every consumer of rows with a layout calls it. Errors keep their class and get ``what`` (e.g.
    ``"sample 3"``) in front of the message."""
    if not isinstance(rows, RoutedRows):
        raise RoutingFormatError(f"{what}: expected RoutedRows, got {type(rows).__name__}")
    try:
        rows.__post_init__()  # RoutedRows is mutable: re-check what construction checked
        validate_ids(rows.ids, layout, start=rows.start)
    except RoutingFormatError as exc:
        raise type(exc)(f"{what}: {exc}") from None
    return rows


def _select_moe_layers(full: np.ndarray, layout: RoutingLayout, start: int, what: str) -> np.ndarray:
    """``[rows, num_hidden_layers, top_k]`` -> ``[rows, num_moe_layers, top_k]``, dense layers checked empty."""
    if full.ndim != 3:
        raise LayerMapError(f"{what}: expected [rows, num_hidden_layers, top_k], got shape {tuple(full.shape)}")
    if full.shape[1] != layout.num_hidden_layers or full.shape[2] != layout.top_k:
        raise LayerMapError(
            f"{what}: engine returned {full.shape[1]} layers x top-{full.shape[2]}, the model has "
            f"{layout.num_hidden_layers} decoder layers x top-{layout.top_k}"
        )
    dense = _dense_layers(layout)
    if dense:
        dense_block = full[:, list(dense), :]
        if dense_block.any():
            row, pos = (int(x) for x in np.argwhere(dense_block.any(axis=2))[0])
            raise LayerMapError(
                f"{what}: decoder layer {dense[pos]} is dense in the layer map but the engine routed token position "
                f"{start + row} there: the layer map does not match the served model"
            )
    if len(layout.moe_layers) == layout.num_hidden_layers:
        return full  # every layer is MoE: a view, no copy
    return full[:, list(layout.moe_layers), :]


def _empty_rows(layout: RoutingLayout) -> RoutedRows:
    return RoutedRows(
        0, np.zeros((0, layout.num_moe_layers, layout.top_k), dtype=smallest_uint_dtype(layout.num_experts))
    )


def _finish(moe_ids: np.ndarray, layout: RoutingLayout, start: int) -> RoutedRows:
    validate_ids(moe_ids, layout, start=start)
    ids = moe_ids.astype(smallest_uint_dtype(layout.num_experts), copy=False)
    return RoutedRows(start=start, ids=np.ascontiguousarray(ids))


def _check_row_count(got: int, expected: int, what: str, detail: str) -> None:
    if got != expected:
        raise RowCountError(f"{what}: {got} routed rows, expected {expected} ({detail})")


def _full_rows(rows: RoutedRows, layout: RoutingLayout, dtype: Any) -> np.ndarray:
    """``[rows, num_hidden_layers, top_k]`` in ``dtype`` with zero dense layers (rows already validated)."""
    full = np.zeros((rows.num_rows, layout.num_hidden_layers, layout.top_k), dtype=dtype)
    full[:, list(layout.moe_layers), :] = rows.ids
    return full


# ----------------------------------------------------------------------------------------------------------- vLLM
def decode_vllm(
    routed_experts: Any,
    *,
    prompt_len: int,
    response_len: int,
    layout: RoutingLayout,
    prompt_start: int = 0,
) -> RoutedRows:
    """Decode vLLM 0.24 ``CompletionOutput.routed_experts`` for one completion.

    Rows cover token positions ``[prompt_start, prompt_len + response_len - 1)``: the last sampled token has no row.

    Args:
        routed_experts: ``[prompt_len - prompt_start + response_len - 1, num_hidden_layers, top_k]`` uint8/uint16
            (any integer dtype wide enough for the model's expert ids).
        prompt_len: prompt tokens sent to the engine.
        response_len: tokens the engine generated for this completion.
        layout: the served model's layer layout.
        prompt_start: ``SamplingParams.routed_experts_prompt_start`` of the request.
    """
    layout = _require_layout(layout)
    prompt_len = _count(prompt_len, "vLLM: prompt_len")
    response_len = _count(response_len, "vLLM: response_len")
    prompt_start = _count(prompt_start, "vLLM: routed_experts_prompt_start")
    if not 0 <= prompt_start <= prompt_len:
        raise RowCountError(f"vLLM: routed_experts_prompt_start={prompt_start} outside [0, prompt_len={prompt_len}]")
    if response_len < 1:
        raise RowCountError(f"vLLM: a completion has at least one generated token, got response_len={response_len}")
    full = _wire_ids(routed_experts, layout, "vLLM routed_experts")
    expected = prompt_len - prompt_start + response_len - 1
    _check_row_count(
        full.shape[0] if full.ndim else -1,
        expected,
        "vLLM",
        f"prompt_len {prompt_len} - prompt_start {prompt_start} + response_len {response_len} - 1 for the last token",
    )
    return _finish(_select_moe_layers(full, layout, prompt_start, "vLLM"), layout, prompt_start)


_NPY_MAGIC = b"\x93NUMPY"
_NPY_MAX_HEADER = 10_000  # numpy's own default limit for np.load


def _parse_npy(raw: bytes, what: str) -> np.ndarray:
    """An integer array from ``.npy`` bytes without pickles and without allocating: the declared shape and dtype
    must account for exactly the bytes that follow the header, and the data is a read-only view of ``raw``."""
    if raw[:6] != _NPY_MAGIC or len(raw) < 10:
        raise RoutingFormatError(f"{what}: not .npy data (expected the \\x93NUMPY magic, got {raw[:8]!r})")
    major = raw[6]
    if major == 1:
        (header_len,), offset = struct.unpack("<H", raw[8:10]), 10
    elif major in (2, 3) and len(raw) >= 12:
        (header_len,), offset = struct.unpack("<I", raw[8:12]), 12
    else:
        raise RoutingFormatError(f"{what}: unsupported or truncated .npy version {major}.{raw[7]}")
    if header_len > _NPY_MAX_HEADER:
        raise RoutingFormatError(f"{what}: .npy header of {header_len} bytes, expected at most {_NPY_MAX_HEADER}")
    if offset + header_len > len(raw):
        raise RoutingFormatError(f"{what}: truncated .npy header: {header_len} bytes declared, {len(raw)} in all")
    try:
        header = ast.literal_eval(raw[offset : offset + header_len].decode("utf8" if major == 3 else "latin1"))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as exc:
        raise RoutingFormatError(f"{what}: unreadable .npy header ({type(exc).__name__}: {exc})") from exc
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise RoutingFormatError(f"{what}: .npy header must hold descr, fortran_order and shape, got {header!r:.200}")
    descr, fortran, shape = header["descr"], header["fortran_order"], header["shape"]
    if not isinstance(descr, str) or not isinstance(fortran, bool) or not isinstance(shape, tuple):
        raise RoutingFormatError(f"{what}: malformed .npy header {header!r:.200}")
    try:
        dtype = np.dtype(descr)
    except (TypeError, ValueError) as exc:
        raise RoutingFormatError(f"{what}: .npy dtype {descr!r} is not a numpy dtype") from exc
    _require_integer_dtype(dtype, what)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise RoutingFormatError(f"{what}: .npy shape {shape!r:.200} is not a tuple of sizes")
    count = 1
    for n in shape:
        count *= n
    data = len(raw) - offset - header_len
    if count * dtype.itemsize != data:
        raise RoutingFormatError(
            f"{what}: .npy header declares {dtype} {shape!r:.200} ({count * dtype.itemsize} bytes) but "
            f"{data} data bytes follow"
        )
    flat = np.frombuffer(raw, dtype=dtype, count=count, offset=offset + header_len)
    return flat.reshape(shape[::-1]).transpose() if fortran else flat.reshape(shape)


def decode_vllm_openai(payload: str, **kwargs: Any) -> RoutedRows:
    """Decode ``choices[i].routed_experts`` of vLLM's OpenAI endpoint (base64 of ``.npy`` bytes).

    Keyword arguments are those of :func:`decode_vllm`. The ``.npy`` bytes are parsed here (never ``np.load``):
    no pickles, and a header declaring more data than the payload carries is refused before anything is allocated.
    """
    what = "vLLM OpenAI routed_experts"
    if not isinstance(payload, (str, bytes)):
        raise RoutingFormatError(f"{what}: expected a base64 .npy string, got {type(payload).__name__}")
    try:
        raw = base64.b64decode(payload, validate=True)
    except ValueError as exc:
        raise RoutingFormatError(f"{what} is not base64 .npy data: {exc}") from exc
    return decode_vllm(_parse_npy(raw, what), **kwargs)


def encode_vllm(rows: RoutedRows, layout: RoutingLayout) -> np.ndarray:
    """Inverse of :func:`decode_vllm`: ``[rows, num_hidden_layers, top_k]`` with zero dense layers (fixtures).

    uint8 up to 256 experts, uint16 up to 65536 (vLLM's dtypes); beyond, vLLM has no dtype for the ids and this
    gives int32 rather than wrap them.
    """
    layout = _require_layout(layout)
    validate_rows(rows, layout, "encode_vllm")
    return _full_rows(rows, layout, smallest_uint_dtype(layout.num_experts))


# --------------------------------------------------------------------------------------------------------- SGLang
_SGLANG_WIRE_DTYPES = {"int32": np.int32, "int16": np.int16, "uint8": np.uint8, "uint16": np.uint16}


def _wire_dtype(name: Any, what: str) -> np.dtype:
    if not isinstance(name, str) or name not in _SGLANG_WIRE_DTYPES:
        raise RoutingFormatError(f"{what}: unknown routed_experts_dtype {name!r:.80}; expected one of "
                                 f"{sorted(_SGLANG_WIRE_DTYPES)}")  # fmt: skip
    return np.dtype(_SGLANG_WIRE_DTYPES[name])


def decode_sglang(
    meta_info: dict[str, Any],
    *,
    prompt_len: int,
    response_len: int,
    layout: RoutingLayout,
) -> RoutedRows:
    """Decode SGLang 0.5.12 ``meta_info["routed_experts"]`` for one request.

    The payload is base64 of a flat row-major ``[seqlen - 1 - start_len, num_hidden_layers, top_k]`` array in
    ``meta_info.get("routed_experts_dtype", "int32")``; ``start_len`` is ``meta_info["routed_experts_start_len"]``
    (0 when absent), ``seqlen = prompt_len + response_len``. With ``skip_tokenizer_init`` the payload may already be
    an array/tensor; both are accepted. verl 0.9.1 instead calls ``.numpy()`` on the base64 string in that mode.
    """
    layout = _require_layout(layout)
    if not isinstance(meta_info, Mapping):
        raise RoutingFormatError(f"SGLang: meta_info must be a mapping, got {type(meta_info).__name__}")
    prompt_len = _count(prompt_len, "SGLang: prompt_len")
    response_len = _count(response_len, "SGLang: response_len")
    if meta_info.get("routed_experts") is None:
        raise RoutingFormatError("SGLang: meta_info has no routed_experts (request return_routed_experts=True)")
    payload = meta_info["routed_experts"]
    start = meta_info.get("routed_experts_start_len")
    start = 0 if start is None else _count(start, "SGLang: routed_experts_start_len")
    if not 0 <= start <= prompt_len:
        raise RowCountError(f"SGLang: routed_experts_start_len={start} outside [0, prompt_len={prompt_len}]")
    expected = prompt_len + response_len - 1 - start
    if expected < 0:
        raise RowCountError(
            f"SGLang: prompt_len {prompt_len} + response_len {response_len} - 1 - start_len {start} is negative"
        )
    if isinstance(payload, (str, bytes)):
        dtype_name = meta_info.get("routed_experts_dtype") or "int32"
        dtype = _wire_dtype(dtype_name, "SGLang")
        _check_wire_width(dtype, layout, f"SGLang routed_experts_dtype {dtype_name}")
        try:
            raw = base64.b64decode(payload, validate=True)
        except ValueError as exc:
            raise RoutingFormatError(f"SGLang: routed_experts is not valid base64: {exc}") from exc
        if len(raw) % dtype.itemsize:
            raise RoutingFormatError(f"SGLang: {len(raw)} payload bytes is not a multiple of {dtype_name}")
        flat = np.frombuffer(raw, dtype=dtype)
    else:
        flat = _wire_ids(payload, layout, "SGLang routed_experts").reshape(-1)
    per_row = layout.num_hidden_layers * layout.top_k
    if flat.size % per_row:
        raise LayerMapError(
            f"SGLang: {flat.size} ids is not a whole number of rows of {layout.num_hidden_layers} layers x "
            f"top-{layout.top_k}: the payload does not match the model"
        )
    rows = flat.size // per_row
    _check_row_count(
        rows, expected, "SGLang", f"prompt_len {prompt_len} + response_len {response_len} - 1 - start_len {start}"
    )
    full = flat.reshape(rows, layout.num_hidden_layers, layout.top_k)
    return _finish(_select_moe_layers(full, layout, start, "SGLang"), layout, start)


def encode_sglang(rows: RoutedRows, layout: RoutingLayout, *, wire_dtype: str = "int32") -> dict[str, Any]:
    """Inverse of :func:`decode_sglang`: the ``meta_info`` entries SGLang sends (fixtures).

    Raises :class:`ExpertIdRangeError` when ``wire_dtype`` cannot hold every expert id of the model.
    """
    layout = _require_layout(layout)
    dtype = _wire_dtype(wire_dtype, "encode_sglang")
    _check_wire_width(dtype, layout, f"encode_sglang wire_dtype {wire_dtype}")
    validate_rows(rows, layout, "encode_sglang")
    full = _full_rows(rows, layout, dtype)
    meta = {"routed_experts": base64.b64encode(full.tobytes()).decode("ascii"), "routed_experts_start_len": rows.start}
    if wire_dtype != "int32":
        meta["routed_experts_dtype"] = wire_dtype
    return meta


# ----------------------------------------------------------------------------------------------- partial rollouts
def concat_partial_rollout(pieces: Sequence[RoutedRows]) -> RoutedRows:
    """Join the routing of a rollout that was aborted and resumed (partial rollout).

    Each resumed request re-sends prompt + tokens so far, so piece ``i + 1`` re-covers positions piece ``i`` already
    has. Like verl's ``llm_server``, rows already held are kept (the weights may have changed since) and only the
    new positions are taken from the later piece. A gap between pieces would leave tokens without routing in the
    middle of a sequence and is refused.
    """
    pieces = list(pieces)
    if not pieces:
        raise ValueError("no pieces to concatenate")
    for i, piece in enumerate(pieces):
        if not isinstance(piece, RoutedRows):
            raise RoutingFormatError(f"piece {i}: expected RoutedRows, got {type(piece).__name__}")
        piece.__post_init__()
    out = [pieces[0].ids]
    start, stop = pieces[0].start, pieces[0].stop
    for i, piece in enumerate(pieces[1:], start=1):
        if piece.ids.shape[1:] != pieces[0].ids.shape[1:]:
            raise LayerMapError(f"piece {i} has shape {piece.ids.shape[1:]}, piece 0 has {pieces[0].ids.shape[1:]}")
        if piece.start > stop:
            raise RowCountError(f"piece {i} starts at token {piece.start}, after the {stop} positions covered so far")
        if piece.stop > stop:
            out.append(piece.ids[stop - piece.start :])
            stop = piece.stop
    return RoutedRows(start=start, ids=np.concatenate(out, axis=0))


# ----------------------------------------------------------------------------------------------------------- verl
_VERL_DTYPE = np.dtype(np.int16)


def encode_verl_sample(rows: RoutedRows, layout: RoutingLayout, total_length: int) -> torch.Tensor:
    """One sample in verl 0.9.1's layout: int16 ``[total_length, num_hidden_layers, top_k]``, zero where unrecorded.

    This is what verl's ``AgentLoopOutput.as_dict`` stores and its Megatron replay consumes. More than 32768 experts
    do not fit int16 and raise :class:`ExpertIdRangeError`.
    """
    layout = _require_layout(layout)
    total_length = _count(total_length, "verl: total_length")
    _check_wire_width(_VERL_DTYPE, layout, "verl routed_experts")
    validate_rows(rows, layout, "encode_verl_sample")
    if rows.num_rows and rows.stop > total_length:
        raise RowCountError(f"routing covers positions up to {rows.stop}, the sequence has {total_length} tokens")
    out = torch.zeros(total_length, layout.num_hidden_layers, layout.top_k, dtype=torch.int16)
    if rows.num_rows:
        out[rows.start : rows.stop] = torch.from_numpy(_full_rows(rows, layout, _VERL_DTYPE))
    return out


def decode_verl_sample(routed_experts: Any, layout: RoutingLayout, *, num_tokens: int | None = None) -> RoutedRows:
    """Decode one sample of verl's layout ``[seq, num_hidden_layers, top_k]`` (token-aligned, zero = unrecorded).

    Leading and trailing positions whose MoE layers are all zero are unrecorded (verl zero-fills them); they are
    dropped so that ``start``/``stop`` bound the recorded rows. Zero rows in between are refused by validation.
    A sample of zero tokens (or with nothing recorded) decodes to zero rows.

    Args:
        routed_experts: the sample's tensor, positions aligned with its prompt + response tokens.
        layout: the model's layer layout.
        num_tokens: real tokens of the sample; rows past it must be zero (padding).
    """
    layout = _require_layout(layout)
    full = _wire_ids(routed_experts, layout, "verl routed_experts")
    if full.ndim != 3:
        raise LayerMapError(f"verl: expected [rows, num_hidden_layers, top_k], got shape {tuple(full.shape)}")
    if num_tokens is not None:
        num_tokens = _count(num_tokens, "verl: num_tokens")
        if num_tokens > full.shape[0]:
            raise RowCountError(f"verl: {full.shape[0]} rows for a {num_tokens}-token sample")
        if full[num_tokens:].any():
            raise RowCountError(f"verl: routing found past the sample's {num_tokens} tokens (padding misaligned)")
        full = full[:num_tokens]
    moe = _select_moe_layers(full, layout, 0, "verl")
    recorded = np.flatnonzero(moe.any(axis=(1, 2)))
    if recorded.size == 0:
        return _empty_rows(layout)
    first, last = int(recorded[0]), int(recorded[-1]) + 1
    return _finish(moe[first:last], layout, first)


def encode_verl_batch(
    samples: Sequence[RoutedRows],
    layout: RoutingLayout,
    lengths: Sequence[int],
    *,
    nested: bool = True,
    left_pad: Sequence[int] | None = None,
    width: int | None = None,
) -> torch.Tensor:
    """Stack samples in verl's batch layout.

    ``nested=True`` gives the jagged ``[bsz, (length_i), num_hidden_layers, top_k]`` form (verl's V1 / TransferQueue
    path and ``workers/utils/padding.py``); otherwise a dense ``[bsz, width, ...]`` tensor where sample ``i`` starts
    at column ``left_pad[i]`` (verl's legacy agent loop: left-padded prompt then right-padded response).
    """
    layout = _require_layout(layout)
    _check_wire_width(_VERL_DTYPE, layout, "verl routed_experts")
    samples, lengths = list(samples), [_count(n, f"verl: length of sample {i}") for i, n in enumerate(lengths)]
    if len(samples) != len(lengths):
        raise RowCountError(f"{len(samples)} samples but {len(lengths)} lengths")
    per_sample = [encode_verl_sample(s, layout, n) for s, n in zip(samples, lengths, strict=True)]
    if nested:
        if not per_sample:
            raise RowCountError("an empty batch has no nested (jagged) form; pass nested=False")
        return torch.nested.as_nested_tensor(per_sample, layout=torch.jagged)
    pads = (
        [0] * len(samples) if left_pad is None else [_count(p, f"verl: left pad {i}") for i, p in enumerate(left_pad)]
    )
    if len(pads) != len(samples):
        raise RowCountError(f"{len(samples)} samples but {len(pads)} left pads")
    ends = [p + n for p, n in zip(pads, lengths, strict=True)]
    width = (max(ends) if ends else 0) if width is None else _count(width, "verl: width")
    out = torch.zeros(len(samples), width, layout.num_hidden_layers, layout.top_k, dtype=torch.int16)
    for i, (tensor, pad) in enumerate(zip(per_sample, pads, strict=True)):
        if pad + tensor.shape[0] > width:
            raise RowCountError(f"sample {i}: left pad {pad} + {tensor.shape[0]} tokens exceed width {width}")
        out[i, pad : pad + tensor.shape[0]] = tensor
    return out


def _real_span(mask_row: torch.Tensor, i: int) -> tuple[int, int]:
    """``[first, last)`` of a 0/1 attention-mask row whose ones are contiguous (``(0, 0)`` when none)."""
    real = torch.nonzero(mask_row).flatten()
    if real.numel() == 0:
        return 0, 0
    first, last = int(real[0]), int(real[-1]) + 1
    if real.numel() != last - first:
        raise RowCountError(f"sample {i}: attention_mask has gaps between positions {first} and {last - 1}")
    return first, last


def decode_verl_batch(
    routed_experts: torch.Tensor,
    layout: RoutingLayout,
    *,
    attention_mask: torch.Tensor | None = None,
) -> list[RoutedRows]:
    """Decode verl's batch layout (nested, or dense with ``attention_mask`` marking the real tokens).

    A sample without real tokens (an all-zero mask row, an empty nested sample) decodes to zero rows.
    """
    layout = _require_layout(layout)
    if not isinstance(routed_experts, torch.Tensor):
        raise RoutingFormatError(f"verl routed_experts: expected a torch.Tensor, got {type(routed_experts).__name__}")
    if routed_experts.is_nested:
        return [decode_verl_sample(t, layout) for t in routed_experts.unbind()]
    if routed_experts.dim() != 4:
        raise LayerMapError(
            f"verl routed_experts: expected [batch, seq, num_hidden_layers, top_k], got {tuple(routed_experts.shape)}"
        )
    _wire_ids(routed_experts[:0], layout, "verl routed_experts")  # dtype before any position check
    if attention_mask is None:
        raise RowCountError("a dense verl routed_experts batch needs attention_mask to locate each sample's tokens")
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.is_nested:
        raise RowCountError(f"attention_mask must be a dense tensor, got {type(attention_mask).__name__}")
    if attention_mask.shape != routed_experts.shape[:2]:
        raise RowCountError(
            f"attention_mask {tuple(attention_mask.shape)} does not match routed_experts {tuple(routed_experts.shape)}"
        )
    if attention_mask.is_complex() or bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        raise RowCountError("attention_mask must hold only 0 and 1")
    out = []
    for i in range(routed_experts.shape[0]):
        first, last = _real_span(attention_mask[i], i)
        if routed_experts[i, :first].any() or routed_experts[i, last:].any():
            raise RowCountError(f"sample {i}: routing found on padding positions (misaligned padding)")
        out.append(decode_verl_sample(routed_experts[i, first:last], layout))
    return out


# ------------------------------------------------------------------------------------------------- RoutingTrace
def rows_to_trace(samples: Sequence[RoutedRows | None], seq_lens: Sequence[int], layout: RoutingLayout) -> RoutingTrace:
    """Token-aligned :class:`RoutingTrace` of whole sequences: sample ``i`` gets ``seq_lens[i]`` rows, valid on
    ``[start, stop)`` and invalid (model's own routing) elsewhere; ``None`` marks a sample without routing.

    Every sample's ids are validated against ``layout`` (range, distinct ids) before they are narrowed.
    """
    layout = _require_layout(layout)
    samples = list(samples)
    if isinstance(seq_lens, torch.Tensor):
        seq_lens = seq_lens.reshape(-1) if seq_lens.dim() else seq_lens
    lens = [_count(n, f"sequence length {i}") for i, n in enumerate(seq_lens)]
    if len(samples) != len(lens):
        raise RowCountError(f"{len(samples)} samples but {len(lens)} sequence lengths")
    total = sum(lens)
    ids = torch.zeros(total, layout.num_moe_layers, layout.top_k, dtype=storage_dtype(layout.num_experts))
    valid = torch.zeros(total, layout.num_moe_layers, dtype=torch.bool)
    offset = 0
    for i, (rows, n) in enumerate(zip(samples, lens, strict=True)):
        if rows is not None:
            if not isinstance(rows, RoutedRows):
                raise RoutingFormatError(f"sample {i}: expected RoutedRows or None, got {type(rows).__name__}")
            if rows.num_rows:
                validate_rows(rows, layout, f"sample {i}")
                if rows.stop > n:
                    raise RowCountError(
                        f"sample {i}: routing covers positions [{rows.start}, {rows.stop}) of {n} tokens"
                    )
                values = np.require(
                    rows.ids.astype(smallest_uint_dtype(layout.num_experts), copy=False), requirements="CW"
                )
                ids[offset + rows.start : offset + rows.stop] = torch.from_numpy(values)
                valid[offset + rows.start : offset + rows.stop] = True
        offset += n
    with _ids_checked():  # every sample passed validate_ids above, rows without data are not scanned anyway
        return RoutingTrace(ids, layout.num_experts, lens, valid, layout.moe_layers)


def trace_to_rows(trace: RoutingTrace) -> list[RoutedRows]:
    """Inverse of :func:`rows_to_trace`: the recorded span of every sequence (it must be contiguous and whole)."""
    if not isinstance(trace, RoutingTrace):
        raise TypeError(f"trace_to_rows needs a RoutingTrace, got {type(trace).__name__}")
    out = []
    valid = trace.valid_mask().cpu()
    all_ids = trace.ids.cpu()
    offsets = trace.offsets().tolist()
    for i, seq_valid in enumerate(valid.split(trace.lengths.tolist())):
        token_valid = seq_valid.all(dim=1)
        if bool((seq_valid.any(dim=1) & ~token_valid).any()):
            raise RoutingFormatError(f"sequence {i}: some MoE layers of a token have routing and others not")
        where = torch.nonzero(token_valid).flatten()
        lo = int(offsets[i])
        if where.numel() == 0:
            out.append(RoutedRows(0, all_ids[lo:lo].numpy()))
            continue
        first, last = int(where[0]), int(where[-1]) + 1
        if last - first != where.numel():
            raise RoutingFormatError(f"sequence {i}: routed positions are not contiguous ({where.tolist()})")
        out.append(RoutedRows(first, all_ids[lo + first : lo + last].numpy()))
    return out


# ----------------------------------------------------------------------------------------------- fallback policy
ON_INVALID = ("raise", "skip_sample")


@dataclass
class BoundaryStats:
    """Counts kept by :func:`decode_with_policy` (logged by the caller, exported as ``stable/routing/*`` metrics)."""

    samples: int = 0
    skipped_samples: int = 0
    errors: dict[str, int] | None = None

    def as_metrics(self, prefix: str = "stable/routing/") -> dict[str, float]:
        """Flat float metrics."""
        out = {f"{prefix}samples": float(self.samples), f"{prefix}skipped_samples": float(self.skipped_samples)}
        for name, count in (self.errors or {}).items():
            out[f"{prefix}error/{name}"] = float(count)
        return out


def decode_with_policy(
    decode: Any, *args: Any, on_invalid: str = "raise", stats: BoundaryStats | None = None, **kwargs: Any
) -> RoutedRows | None:
    """Run a ``decode_*`` codec under the user's fallback policy.

    ``on_invalid="raise"`` (default) propagates every :class:`RoutingFormatError`. ``"skip_sample"`` returns
    ``None`` instead (the sample is then trained with the model's own routing, never with guessed routes),
    counts the error class in ``stats`` and logs a warning. Every malformed payload the codecs see raises a
    :class:`RoutingFormatError`; other exceptions (a wrong ``layout`` argument, a bug) always propagate.
    """
    if not isinstance(on_invalid, str) or on_invalid not in ON_INVALID:
        raise ValueError(f"on_invalid must be one of {ON_INVALID}, got {on_invalid!r}")
    if not callable(decode):
        raise TypeError(f"decode must be a decode_* function, got {type(decode).__name__}")
    if stats is not None and not isinstance(stats, BoundaryStats):
        raise TypeError(f"stats must be a BoundaryStats or None, got {type(stats).__name__}")
    if stats is not None:
        stats.samples += 1
    try:
        return decode(*args, **kwargs)
    except RoutingFormatError as exc:
        if on_invalid == "raise":
            raise
        if stats is not None:
            stats.skipped_samples += 1
            stats.errors = stats.errors or {}
            name = type(exc).__name__
            stats.errors[name] = stats.errors.get(name, 0) + 1
        _logger.warning("verl-stable: routing of one sample dropped (on_invalid=skip_sample): %s", exc)
        return None
