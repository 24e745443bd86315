"""SGLang 0.5.12 codec: ``meta_info["routed_experts"]`` of one request.

Base64 of a flat row-major int32 array (or the dtype named by ``meta_info["routed_experts_dtype"]`` on newer
servers) covering token positions ``[routed_experts_start_len, seqlen - 1)`` for every decoder layer; with
``skip_tokenizer_init`` an array / tensor instead of the string.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import numpy as np

from verl_stable.routing.checks import count
from verl_stable.routing.codecs.common import (
    LayerMapError,
    RoutedRows,
    RoutingFormatError,
    RowCountError,
    _check_row_count,
    _check_wire_width,
    _finish,
    _full_rows,
    _require_layout,
    _select_moe_layers,
    _wire_ids,
    validate_rows,
)
from verl_stable.routing.trace import RoutingLayout

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
    ``meta_info["routed_experts_dtype"]`` (int32 when absent or ``None``; any other name that is not a known wire
    dtype, the empty string included, is a :class:`RoutingFormatError`); ``start_len`` is
    ``meta_info["routed_experts_start_len"]`` (0 when absent), ``seqlen = prompt_len + response_len``. With ``skip_tokenizer_init`` the payload may already be
    an array/tensor; both are accepted. verl 0.9.1 instead calls ``.numpy()`` on the base64 string in that mode.
    """
    layout = _require_layout(layout)
    if not isinstance(meta_info, Mapping):
        raise RoutingFormatError(f"SGLang: meta_info must be a mapping, got {type(meta_info).__name__}")
    prompt_len = count(prompt_len, "SGLang: prompt_len")
    response_len = count(response_len, "SGLang: response_len")
    if meta_info.get("routed_experts") is None:
        raise RoutingFormatError("SGLang: meta_info has no routed_experts (request return_routed_experts=True)")
    payload = meta_info["routed_experts"]
    start = meta_info.get("routed_experts_start_len")
    start = 0 if start is None else count(start, "SGLang: routed_experts_start_len")
    if not 0 <= start <= prompt_len:
        raise RowCountError(f"SGLang: routed_experts_start_len={start} outside [0, prompt_len={prompt_len}]")
    expected = prompt_len + response_len - 1 - start
    if expected < 0:
        raise RowCountError(
            f"SGLang: prompt_len {prompt_len} + response_len {response_len} - 1 - start_len {start} is negative"
        )
    if isinstance(payload, (str, bytes)):
        # only an absent name means SGLang's default: "" or an unknown name is refused, never read as int32
        dtype_name = meta_info.get("routed_experts_dtype")
        dtype_name = "int32" if dtype_name is None else dtype_name
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
