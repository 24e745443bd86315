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
Nothing here imports verl, vLLM or SGLang.
"""

from __future__ import annotations

import base64
import io
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from verl_stable.routing.trace import RoutingLayout, RoutingTrace, storage_dtype

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
]


class RoutingFormatError(ValueError):
    """Routing data that cannot be trusted: replaying it would misroute tokens."""


class LayerMapError(RoutingFormatError):
    """Layer count / top-k differ from the model, or a layer declared dense carries routing."""


class RowCountError(RoutingFormatError):
    """The number of routed rows does not match the tokens they claim to cover."""


class ExpertIdRangeError(RoutingFormatError):
    """An expert id outside ``[0, num_experts)``."""


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


@dataclass
class RoutedRows:
    """Routing of one sequence for the contiguous token positions ``[start, start + len(ids))``.

    Attributes:
        start: first token position (0 = first prompt token) that has a row.
        ids: ``[rows, num_moe_layers, top_k]`` expert ids in the layout's smallest unsigned dtype.
    """

    start: int
    ids: np.ndarray

    @property
    def stop(self) -> int:
        """One past the last covered token position."""
        return self.start + int(self.ids.shape[0])

    @property
    def num_rows(self) -> int:
        """Number of covered token positions."""
        return int(self.ids.shape[0])


def _as_numpy(values: Any, what: str) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        if values.is_nested:
            raise TypeError(f"{what}: expected a dense tensor, got a nested one (unbind it first)")
        return values.detach().cpu().numpy()
    if isinstance(values, np.ndarray):
        return values
    if isinstance(values, (list, tuple)):
        return np.asarray(values)
    raise TypeError(f"{what}: unsupported type {type(values).__name__}; expected numpy, torch or nested lists")


def _locate(mask: np.ndarray, layout: RoutingLayout, start: int) -> str:
    row, ordinal = (int(x) for x in np.argwhere(mask)[0][:2])
    return f"token position {start + row}, MoE layer {ordinal} (decoder layer {layout.moe_layers[ordinal]})"


def validate_ids(ids: np.ndarray, layout: RoutingLayout, *, start: int = 0) -> None:
    """Check MoE-layer ids ``[rows, num_moe_layers, top_k]`` against the layout; raise on the first problem.

    Checks, in order: shape; integer dtype; ``0 <= id < num_experts``; no all-zero row when ``top_k >= 2``
    (for ``top_k == 1`` a whole MoE layer of zeros over 8 or more rows, which random routing produces with
    probability ``num_experts**-8``); distinct ids within every row.

    Raises:
        LayerMapError: wrong number of MoE layers or top-k.
        ExpertIdRangeError, ZeroRoutingError, DuplicateExpertError: as named.
    """
    if ids.ndim != 3:
        raise LayerMapError(f"routing must be [rows, moe_layers, top_k], got shape {tuple(ids.shape)}")
    if ids.shape[1] != layout.num_moe_layers or ids.shape[2] != layout.top_k:
        raise LayerMapError(
            f"routing has {ids.shape[1]} MoE layers x top-{ids.shape[2]}; the model expects "
            f"{layout.num_moe_layers} MoE layers x top-{layout.top_k}"
        )
    if not np.issubdtype(ids.dtype, np.integer):
        raise RoutingFormatError(f"expert ids must be integers, got dtype {ids.dtype}")
    if ids.size == 0:
        return
    alive = np.zeros(layout.num_moe_layers, dtype=bool)
    # chunks bound the temporaries (masks, sorted copy) to a few MiB whatever the sequence length
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


def _validate_chunk(ids: np.ndarray, layout: RoutingLayout, start: int) -> None:
    out_of_range = ids >= layout.num_experts
    if np.issubdtype(ids.dtype, np.signedinteger):
        out_of_range |= ids < 0
    if out_of_range.any():
        bad = ids[out_of_range]
        raise ExpertIdRangeError(
            f"expert ids outside [0, {layout.num_experts}) (e.g. {int(bad.flat[0])}) at "
            f"{_locate(out_of_range.any(axis=2), layout, start)}"
        )
    if layout.top_k < 2:
        return
    zero_rows = ~ids.any(axis=2)  # [rows, moe_layers]
    if zero_rows.any():
        raise ZeroRoutingError(
            f"all-zero (token, MoE layer) rows, first at {_locate(zero_rows, layout, start)}"
            ": the engine returned no routing for them (known failure of some fused MoE kernels)"
        )
    ordered = np.sort(ids, axis=2)
    dup = (ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=2)
    if dup.any():
        row, ordinal = (int(x) for x in np.argwhere(dup)[0])
        raise DuplicateExpertError(
            f"a row repeats an expert id at {_locate(dup, layout, start)}: {ids[row, ordinal].tolist()}"
        )


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


def _check_rows(got: int, expected: int, what: str, detail: str) -> None:
    if got != expected:
        raise RowCountError(f"{what}: {got} routed rows, expected {expected} ({detail})")


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
        routed_experts: ``[prompt_len - prompt_start + response_len - 1, num_hidden_layers, top_k]`` uint8/uint16.
        prompt_len: prompt tokens sent to the engine.
        response_len: tokens the engine generated for this completion.
        layout: the served model's layer layout.
        prompt_start: ``SamplingParams.routed_experts_prompt_start`` of the request.
    """
    if not 0 <= prompt_start <= prompt_len:
        raise RowCountError(f"vLLM: routed_experts_prompt_start={prompt_start} outside [0, prompt_len={prompt_len}]")
    if response_len < 1:
        raise RowCountError(f"vLLM: a completion has at least one generated token, got response_len={response_len}")
    full = _as_numpy(routed_experts, "vLLM routed_experts")
    expected = prompt_len - prompt_start + response_len - 1
    _check_rows(
        full.shape[0] if full.ndim else -1,
        expected,
        "vLLM",
        f"prompt_len {prompt_len} - prompt_start {prompt_start} + response_len {response_len} - 1 for the last token",
    )
    return _finish(_select_moe_layers(full, layout, prompt_start, "vLLM"), layout, prompt_start)


def decode_vllm_openai(payload: str, **kwargs: Any) -> RoutedRows:
    """Decode ``choices[i].routed_experts`` of vLLM's OpenAI endpoint (base64 of ``.npy`` bytes).

    Keyword arguments are those of :func:`decode_vllm`.
    """
    try:
        array = np.load(io.BytesIO(base64.b64decode(payload, validate=True)), allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise RoutingFormatError(f"vLLM OpenAI routed_experts is not base64 .npy data: {exc}") from exc
    return decode_vllm(array, **kwargs)


def encode_vllm(rows: RoutedRows, layout: RoutingLayout) -> np.ndarray:
    """Inverse of :func:`decode_vllm`: ``[rows, num_hidden_layers, top_k]`` with zero dense layers (fixtures)."""
    dtype = np.uint8 if layout.num_experts <= 256 else np.uint16
    full = np.zeros((rows.num_rows, layout.num_hidden_layers, layout.top_k), dtype=dtype)
    full[:, list(layout.moe_layers), :] = rows.ids
    return full


# --------------------------------------------------------------------------------------------------------- SGLang
_SGLANG_WIRE_DTYPES = {"int32": np.int32, "int16": np.int16, "uint8": np.uint8, "uint16": np.uint16}


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
    if "routed_experts" not in meta_info or meta_info["routed_experts"] is None:
        raise RoutingFormatError("SGLang: meta_info has no routed_experts (request return_routed_experts=True)")
    payload = meta_info["routed_experts"]
    start = int(meta_info.get("routed_experts_start_len", 0) or 0)
    if not 0 <= start <= prompt_len:
        raise RowCountError(f"SGLang: routed_experts_start_len={start} outside [0, prompt_len={prompt_len}]")
    if isinstance(payload, (str, bytes)):
        dtype_name = meta_info.get("routed_experts_dtype") or "int32"
        if dtype_name not in _SGLANG_WIRE_DTYPES:
            raise RoutingFormatError(f"SGLang: unknown routed_experts_dtype {dtype_name!r}")
        try:
            raw = base64.b64decode(payload, validate=True)
        except ValueError as exc:
            raise RoutingFormatError(f"SGLang: routed_experts is not valid base64: {exc}") from exc
        itemsize = np.dtype(_SGLANG_WIRE_DTYPES[dtype_name]).itemsize
        if len(raw) % itemsize:
            raise RoutingFormatError(f"SGLang: {len(raw)} payload bytes is not a multiple of {dtype_name}")
        flat = np.frombuffer(raw, dtype=_SGLANG_WIRE_DTYPES[dtype_name])
    else:
        flat = _as_numpy(payload, "SGLang routed_experts").reshape(-1)
    per_row = layout.num_hidden_layers * layout.top_k
    if flat.size % per_row:
        raise LayerMapError(
            f"SGLang: {flat.size} ids is not a whole number of rows of {layout.num_hidden_layers} layers x "
            f"top-{layout.top_k}: the payload does not match the model"
        )
    rows = flat.size // per_row
    _check_rows(
        rows,
        prompt_len + response_len - 1 - start,
        "SGLang",
        f"prompt_len {prompt_len} + response_len {response_len} - 1 - start_len {start}",
    )
    full = flat.reshape(rows, layout.num_hidden_layers, layout.top_k)
    return _finish(_select_moe_layers(full, layout, start, "SGLang"), layout, start)


def encode_sglang(rows: RoutedRows, layout: RoutingLayout, *, wire_dtype: str = "int32") -> dict[str, Any]:
    """Inverse of :func:`decode_sglang`: the ``meta_info`` entries SGLang sends (fixtures)."""
    full = np.zeros((rows.num_rows, layout.num_hidden_layers, layout.top_k), dtype=_SGLANG_WIRE_DTYPES[wire_dtype])
    full[:, list(layout.moe_layers), :] = rows.ids
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
    if not pieces:
        raise ValueError("no pieces to concatenate")
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
def encode_verl_sample(rows: RoutedRows, layout: RoutingLayout, total_length: int) -> torch.Tensor:
    """One sample in verl 0.9.1's layout: int16 ``[total_length, num_hidden_layers, top_k]``, zero where unrecorded.

    This is what verl's ``AgentLoopOutput.as_dict`` stores and its Megatron replay consumes.
    """
    if rows.stop > total_length:
        raise RowCountError(f"routing covers positions up to {rows.stop}, the sequence has {total_length} tokens")
    if layout.num_experts - 1 > np.iinfo(np.int16).max:
        raise ValueError(f"verl stores int16 ids; num_experts={layout.num_experts} does not fit")
    out = torch.zeros(total_length, layout.num_hidden_layers, layout.top_k, dtype=torch.int16)
    out[rows.start : rows.stop][:, list(layout.moe_layers)] = torch.from_numpy(rows.ids.astype(np.int16))
    return out


def decode_verl_sample(routed_experts: Any, layout: RoutingLayout, *, num_tokens: int | None = None) -> RoutedRows:
    """Decode one sample of verl's layout ``[seq, num_hidden_layers, top_k]`` (token-aligned, zero = unrecorded).

    Leading and trailing positions whose MoE layers are all zero are unrecorded (verl zero-fills them); they are
    dropped so that ``start``/``stop`` bound the recorded rows. Zero rows in between are refused by validation.

    Args:
        routed_experts: the sample's tensor, positions aligned with its prompt + response tokens.
        layout: the model's layer layout.
        num_tokens: real tokens of the sample; rows past it must be zero (padding).
    """
    full = _as_numpy(routed_experts, "verl routed_experts")
    if num_tokens is not None:
        if full.ndim < 1 or num_tokens > full.shape[0]:
            raise RowCountError(f"verl: {full.shape[0] if full.ndim else 0} rows for a {num_tokens}-token sample")
        if full[num_tokens:].any():
            raise RowCountError(f"verl: routing found past the sample's {num_tokens} tokens (padding misaligned)")
        full = full[:num_tokens]
    moe = _select_moe_layers(full, layout, 0, "verl")
    recorded = np.flatnonzero(moe.reshape(moe.shape[0], -1).any(axis=1))
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
    if len(samples) != len(lengths):
        raise ValueError(f"{len(samples)} samples but {len(lengths)} lengths")
    per_sample = [encode_verl_sample(s, layout, n) for s, n in zip(samples, lengths, strict=True)]
    if nested:
        return torch.nested.as_nested_tensor(per_sample, layout=torch.jagged)
    pads = list(left_pad) if left_pad is not None else [0] * len(samples)
    width = width if width is not None else max(p + n for p, n in zip(pads, lengths, strict=True))
    out = torch.zeros(len(samples), width, layout.num_hidden_layers, layout.top_k, dtype=torch.int16)
    for i, (tensor, pad) in enumerate(zip(per_sample, pads, strict=True)):
        if pad + tensor.shape[0] > width:
            raise RowCountError(f"sample {i}: left pad {pad} + {tensor.shape[0]} tokens exceed width {width}")
        out[i, pad : pad + tensor.shape[0]] = tensor
    return out


def decode_verl_batch(
    routed_experts: torch.Tensor,
    layout: RoutingLayout,
    *,
    attention_mask: torch.Tensor | None = None,
) -> list[RoutedRows]:
    """Decode verl's batch layout (nested, or dense with ``attention_mask`` marking the real tokens)."""
    if routed_experts.is_nested:
        return [decode_verl_sample(t, layout) for t in routed_experts.unbind()]
    if attention_mask is None:
        raise ValueError("a dense verl routed_experts batch needs attention_mask to locate each sample's tokens")
    if attention_mask.shape != routed_experts.shape[:2]:
        raise RowCountError(
            f"attention_mask {tuple(attention_mask.shape)} does not match routed_experts {tuple(routed_experts.shape)}"
        )
    out = []
    for i in range(routed_experts.shape[0]):
        real = torch.nonzero(attention_mask[i]).flatten()
        if real.numel() == 0:
            out.append(decode_verl_sample(routed_experts[i, :0], layout))
            continue
        first, last = int(real[0]), int(real[-1]) + 1
        if routed_experts[i, :first].any() or routed_experts[i, last:].any():
            raise RowCountError(f"sample {i}: routing found on padding positions (misaligned padding)")
        out.append(decode_verl_sample(routed_experts[i, first:last], layout))
    return out


# ------------------------------------------------------------------------------------------------- RoutingTrace
def rows_to_trace(samples: Sequence[RoutedRows | None], seq_lens: Sequence[int], layout: RoutingLayout) -> RoutingTrace:
    """Token-aligned :class:`RoutingTrace` of whole sequences: sample ``i`` gets ``seq_lens[i]`` rows, valid on
    ``[start, stop)`` and invalid (model's own routing) elsewhere; ``None`` marks a sample without routing."""
    if len(samples) != len(seq_lens):
        raise ValueError(f"{len(samples)} samples but {len(seq_lens)} sequence lengths")
    total = int(sum(seq_lens))
    ids = torch.zeros(total, layout.num_moe_layers, layout.top_k, dtype=storage_dtype(layout.num_experts))
    valid = torch.zeros(total, layout.num_moe_layers, dtype=torch.bool)
    offset = 0
    for i, (rows, n) in enumerate(zip(samples, seq_lens, strict=True)):
        if rows is not None and rows.num_rows:
            if rows.ids.shape[1:] != (layout.num_moe_layers, layout.top_k):
                raise LayerMapError(
                    f"sample {i}: rows are {rows.ids.shape[1]} MoE layers x top-{rows.ids.shape[2]}, the layout has "
                    f"{layout.num_moe_layers} x top-{layout.top_k}"
                )
            if rows.start < 0 or rows.stop > n:
                raise RowCountError(f"sample {i}: routing covers positions [{rows.start}, {rows.stop}) of {n} tokens")
            values = np.require(rows.ids.astype(smallest_uint_dtype(layout.num_experts), copy=False), requirements="CW")
            ids[offset + rows.start : offset + rows.stop] = torch.from_numpy(values)
            valid[offset + rows.start : offset + rows.stop] = True
        offset += int(n)
    return RoutingTrace(
        ids=ids, num_experts=layout.num_experts, lengths=list(seq_lens), valid=valid, layer_indices=layout.moe_layers
    )


def trace_to_rows(trace: RoutingTrace) -> list[RoutedRows]:
    """Inverse of :func:`rows_to_trace`: the recorded span of every sequence (it must be contiguous and whole)."""
    out = []
    valid = trace.valid_mask()
    for i, seq_valid in enumerate(valid.split(trace.lengths.tolist())):
        token_valid = seq_valid.all(dim=1)
        if bool((seq_valid.any(dim=1) & ~token_valid).any()):
            raise RoutingFormatError(f"sequence {i}: some MoE layers of a token have routing and others not")
        where = torch.nonzero(token_valid).flatten()
        lo = int(trace.offsets()[i])
        if where.numel() == 0:
            out.append(RoutedRows(0, trace.ids[lo:lo].numpy()))
            continue
        first, last = int(where[0]), int(where[-1]) + 1
        if last - first != where.numel():
            raise RoutingFormatError(f"sequence {i}: routed positions are not contiguous ({where.tolist()})")
        out.append(RoutedRows(first, trace.ids[lo + first : lo + last].numpy()))
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
    counts the error class in ``stats`` and logs a warning.
    """
    if on_invalid not in ON_INVALID:
        raise ValueError(f"on_invalid must be one of {ON_INVALID}, got {on_invalid!r}")
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
