"""vLLM 0.24 codec: ``CompletionOutput.routed_experts`` arrays and the OpenAI endpoint's base64 ``.npy`` of them.

``[prompt_len - prompt_start + n_output - 1, num_hidden_layers, top_k]`` uint8 (<= 256 experts) or uint16: dense
layers are zero rows, the last sampled token has no row (it was never fed through the model), and
``SamplingParams.routed_experts_prompt_start`` skips the first ``prompt_start`` prompt rows. The ``.npy`` bytes are
parsed here, never with ``np.load``: no pickles, and nothing is allocated from a declared shape.
"""

from __future__ import annotations

import ast
import base64
import struct
from typing import Any

import numpy as np

from verl_stable.routing.checks import count
from verl_stable.routing.codecs.common import (
    RoutedRows,
    RoutingFormatError,
    RowCountError,
    _check_row_count,
    _finish,
    _full_rows,
    _require_layout,
    _select_moe_layers,
    _wire_ids,
    smallest_uint_dtype,
    validate_rows,
)
from verl_stable.routing.payload_checks import require_integer_np_dtype
from verl_stable.routing.trace import RoutingLayout


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
    prompt_len = count(prompt_len, "vLLM: prompt_len")
    response_len = count(response_len, "vLLM: response_len")
    prompt_start = count(prompt_start, "vLLM: routed_experts_prompt_start")
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
_NPY_MAX_DIMS = 32  # numpy 1.x's limit (2.x allows 64); routing has 3
_INTP_MAX = int(np.iinfo(np.intp).max)


def _parse_npy(raw: bytes, what: str) -> np.ndarray:
    """An integer array from ``.npy`` bytes without pickles and without allocating: the declared shape and dtype
    must account for exactly the bytes that follow the header, and the data is a read-only view of ``raw``.

    Every malformed payload raises :class:`RoutingFormatError`, among them shapes numpy cannot describe even when
    they declare no data (``(0, 10**20, 2)``: numpy counts the bytes of the non-zero sizes and refuses more than
    ``intp`` holds, or more than :data:`_NPY_MAX_DIMS` dimensions), which ``reshape`` would refuse with a
    ``ValueError`` that ``on_invalid="skip_sample"`` does not catch.
    """
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
    require_integer_np_dtype(dtype, what)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise RoutingFormatError(f"{what}: .npy shape {shape!r:.200} is not a tuple of sizes")
    if len(shape) > _NPY_MAX_DIMS:
        raise RoutingFormatError(f"{what}: .npy shape has {len(shape)} dimensions, at most {_NPY_MAX_DIMS} supported")
    count, extent = 1, dtype.itemsize
    for n in shape:
        count *= n
        extent *= max(n, 1)  # numpy's own bound: the bytes of the non-zero sizes must fit in intp
    if extent > _INTP_MAX:
        raise RoutingFormatError(f"{what}: .npy shape {shape!r:.200} is beyond what numpy can describe")
    data = len(raw) - offset - header_len
    if count * dtype.itemsize != data:
        raise RoutingFormatError(
            f"{what}: .npy header declares {dtype} {shape!r:.200} ({count * dtype.itemsize} bytes) but "
            f"{data} data bytes follow"
        )
    try:
        flat = np.frombuffer(raw, dtype=dtype, count=count, offset=offset + header_len)
        return flat.reshape(shape[::-1]).transpose() if fortran else flat.reshape(shape)
    except (ValueError, MemoryError) as exc:  # a limit of this numpy that the checks above do not know
        raise RoutingFormatError(f"{what}: numpy cannot build the .npy array {shape!r:.200}: {exc}") from exc


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
