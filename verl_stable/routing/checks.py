"""Input validation of the routing package: the checks that guard every entry point, in one place.

The rule: validate once, at every entry point, before any dtype narrowing. Narrowing wraps silently (expert id 300
becomes 44 in uint8, a valid-looking id), so ranges are checked on the wide values and only then narrowed; ids that
reach a replay are used as indices (out of range: a device-side assert on GPU; repeated: one expert weighted twice).
Entry points and what they run, all from here:

* ``RoutingTrace(...)`` and its unpickling: :func:`check_id_range`, :func:`trace_lengths`, :func:`check_valid_mask`,
  :func:`check_distinct_ids`, :func:`require_layers`; slices and concatenations of checked traces skip the id scan
  inside :func:`ids_checked`. ``RoutingTrace.from_tensor``: :func:`dense_ids` on the int64 values, then narrows.
* ``RoutingLayout``: :func:`require_int`, :func:`require_layers`.
* engine codecs (``codecs``): the numpy checks of an engine's payload, in :mod:`verl_stable.routing.payload_checks`
  (``as_integer_array``, ``check_wire_width``: the wire dtype can hold every expert id of the model, else the ids
  wrapped; ``check_expert_ids``: range, all-zero rows, repeated ids), and :func:`count` for positions, through
  ``codecs.validate_ids`` / ``validate_rows`` before narrowing.
* transport fields and ``PackedRouting``: :func:`unbind_integer`, :func:`span_pairs`, :func:`counts`, then
  ``codecs.common.validated_ids_tensor`` (``validate_rows``, then the one narrowing step of trainer-side rows).
* ``replay`` / ``RoutingReplayer.set_trace``: the trace must fit the model (``RoutingTrace.validate_for``) and its
  ids are checked again (:func:`check_id_range`, :func:`check_distinct_ids`): a frozen trace still holds mutable
  tensors. ``RoutingReplayer.set_checked_rows`` (the FSDP engine, per micro-batch) checks only shapes: the engine
  checked the rows' range (:func:`check_id_range` on verl's int16 rows) as it aligned them, and a row it replays
  has distinct ids by its definition of a row with data. ``routing_disagreement`` / ``expert_sets_differ``:
  :func:`require_id_tensor`, equal shapes.
* model configs (``families``): :func:`config_int`.

Each check raises one of the typed errors of :mod:`verl_stable.routing.errors`, naming what was expected and
what was received. Pure torch + numpy.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import numpy as np
import torch

from verl_stable.routing.errors import (
    RoutingFormatError,
    RoutingTraceError,
    RowCountError,
    UnsupportedModelError,
)


# ------------------------------------------------------------------------------------------ integers and counts
def is_integer_dtype(dtype: torch.dtype) -> bool:
    """True for torch integer dtypes (bool, floating and complex dtypes are not integers)."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def require_int(value: Any, what: str, *, minimum: int | None = None, error: type = RoutingTraceError) -> int:
    """``value`` as a Python int: an int, numpy integer or 0-d integer tensor (never a bool, float or string).

    Raises ``error`` naming ``what`` and the expected range; floats are refused rather than truncated.
    """
    if isinstance(value, torch.Tensor) and value.dim() == 0 and is_integer_dtype(value.dtype):
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise error(f"{what} must be an integer, got {type(value).__name__} {value!r:.80}")
    out = int(value)
    if minimum is not None and out < minimum:
        raise error(f"{what} must be >= {minimum}, got {out}")
    return out


def require_layers(values: Any, what: str, *, error: type = RoutingTraceError) -> tuple[int, ...]:
    """Decoder-layer indices as a tuple of strictly ascending non-negative ints."""
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, (Sequence, torch.Tensor, np.ndarray)):
        raise error(f"{what} must be a sequence of decoder-layer indices, got {type(values).__name__}")
    out = tuple(require_int(v, f"{what} entry", minimum=0, error=error) for v in list(values))
    if any(b <= a for a, b in zip(out, out[1:], strict=False)):
        raise error(f"{what} must be strictly ascending decoder-layer indices, got {list(out)}")
    return out


def count(value: Any, what: str, minimum: int = 0) -> int:
    """A token / row count or position: an integer >= ``minimum`` (floats are refused, never truncated)."""
    return require_int(value, what, minimum=minimum, error=RowCountError)


def counts(values: Sequence[int] | torch.Tensor, what: str) -> list[int]:
    """Non-negative integer counts (an integer tensor / array or a sequence of integers)."""
    if isinstance(values, np.ndarray):
        values = torch.from_numpy(values) if values.dtype.kind in "iub" else values.astype(np.float64)
    if isinstance(values, (torch.Tensor, np.ndarray)):
        if not isinstance(values, torch.Tensor) or not is_integer_dtype(values.dtype):
            raise RowCountError(f"{what} must be integers, got dtype {values.dtype}")
        values = values.reshape(-1).tolist()
    elif not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise RowCountError(f"{what} must be a sequence of integers, got {type(values).__name__}")
    return [require_int(v, f"{what}[{i}]", minimum=0, error=RowCountError) for i, v in enumerate(values)]


def trace_lengths(lengths: Sequence[int] | torch.Tensor | None, num_tokens: int) -> torch.Tensor:
    """A trace's per-response token counts as a 1-D int64 CPU tensor summing to ``num_tokens`` (None: one response)."""
    if lengths is None:
        return torch.tensor([num_tokens], dtype=torch.long)
    try:
        out = torch.as_tensor(lengths if isinstance(lengths, torch.Tensor) else list(lengths) or [], dtype=None)
        out = out.long() if out.numel() == 0 else out
    except (TypeError, ValueError, RuntimeError) as exc:
        raise RoutingTraceError(f"lengths must be integer token counts, got {type(lengths).__name__}: {exc}") from exc
    if not is_integer_dtype(out.dtype) or out.dim() > 1:
        raise RoutingTraceError(f"lengths must be a 1-D integer sequence, got {out.dtype} {tuple(out.shape)}")
    out = out.to(dtype=torch.long, device="cpu").reshape(-1)
    if (out < 0).any():
        raise RoutingTraceError(f"lengths must be >= 0, got {out.tolist()}")
    total = int(out.sum())
    if total != num_tokens:
        raise RoutingTraceError(f"lengths sum to {total} but the trace has {num_tokens} token rows")
    return out


def config_int(config: Any, attr: str, default: int | None = None, *, minimum: int = 0) -> int:
    """An integer config attribute (``None`` / absent -> ``default``); a non-integer, fractional or too small value
    raises :class:`UnsupportedModelError` naming the attribute (never truncated: ``8.5`` experts is not 8)."""
    value = getattr(config, attr, None)
    if value is None and default is not None:
        return default
    return config_int_value(value, attr, minimum)


def config_int_value(value: Any, attr: str, minimum: int = 0) -> int:
    """One integer config value (``4.0`` from a JSON file is 4); anything else raises UnsupportedModelError."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise UnsupportedModelError(f"config {attr} must be an integer, got {type(value).__name__} {value!r:.80}")
    if value < minimum:
        raise UnsupportedModelError(f"config {attr} must be >= {minimum}, got {value}")
    return int(value)


# -------------------------------------------------------------------------------------------- trace ids (torch)
_DUP_CHUNK_ROWS = 8192
_IDS_CHECKED: ContextVar[bool] = ContextVar("verl_stable_routing_ids_checked", default=False)


@contextmanager
def ids_checked() -> Iterator[None]:
    """Inside, ``RoutingTrace(...)`` skips its id scan (range, distinct ids; every other field is still checked): for
    ids validated already, as slices / concatenations of traces and ``rows_to_trace`` after ``validate_ids`` are."""
    token = _IDS_CHECKED.set(True)
    try:
        yield
    finally:
        _IDS_CHECKED.reset(token)


def ids_already_checked() -> bool:
    """Whether the caller is inside :func:`ids_checked`."""
    return _IDS_CHECKED.get()


def check_id_range(ids: torch.Tensor, num_experts: int) -> None:
    """Raise a RoutingTraceError unless every entry of integer ids is in ``[0, num_experts)`` (storage dtypes
    uint8 / uint16 / int32, or the int16 / int64 of verl's and the engines' layouts); rows without data must hold
    in-range values too (0 in the storage dtypes and in verl's zero rows)."""
    if not ids.numel():
        return
    # uint16 lacks reductions in torch; widen for the range check only
    wide = ids.to(torch.int32) if ids.dtype == torch.uint16 else ids
    if ids.dtype.is_signed:
        low, high = (int(v) for v in torch.aminmax(wide))
    else:
        low, high = 0, int(wide.max())
    if high >= num_experts or low < 0:
        raise RoutingTraceError(
            f"expert id {high if high >= num_experts else low} out of range: expected ids in [0, {num_experts})"
        )


def first_repeated_row(ids: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[int, int] | None:
    """``(token, layer)`` of the first row of ``ids [N, L, K]`` that repeats an expert id (rows with ``valid``
    False are ignored), or None. Pairwise compares for small K (faster than a sort), chunked to bound memory."""
    k = ids.shape[2]
    if k < 2 or ids.numel() == 0:
        return None
    for lo in range(0, ids.shape[0], _DUP_CHUNK_ROWS):
        chunk = ids[lo : lo + _DUP_CHUNK_ROWS]
        chunk = chunk.to(torch.int32) if chunk.dtype == torch.uint16 else chunk
        if k <= 16:
            cols = chunk.permute(2, 0, 1).contiguous()
            dup = torch.zeros(chunk.shape[:2], dtype=torch.bool, device=chunk.device)
            for i in range(k - 1):
                for j in range(i + 1, k):
                    dup |= cols[i] == cols[j]
        else:
            ordered = chunk.sort(dim=-1).values
            dup = (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1)
        if valid is not None:
            dup &= valid[lo : lo + _DUP_CHUNK_ROWS].to(dup.device)
        if bool(dup.any()):
            n, layer = dup.nonzero()[0].tolist()
            return lo + n, layer
    return None


def check_distinct_ids(ids: torch.Tensor, valid: torch.Tensor | None) -> None:
    """Raise a RoutingTraceError naming the first row with data that repeats an expert id."""
    repeated = first_repeated_row(ids, valid)
    if repeated is not None:
        n, layer = repeated
        raise RoutingTraceError(
            f"token {n}, MoE layer {layer} repeats an expert id ({ids[n, layer].tolist()}): top-k ids must be "
            "distinct in every row with routing data"
        )


def check_valid_mask(valid: Any, ids: torch.Tensor) -> torch.Tensor | None:
    """A trace's ``valid`` mask: a ``[N, L]`` bool tensor on the ids' device; None when every row is valid."""
    if valid is None:
        return None
    is_tensor = isinstance(valid, torch.Tensor) and not valid.is_nested
    if not is_tensor or valid.dtype != torch.bool or tuple(valid.shape) != tuple(ids.shape[:2]):
        got = f"{valid.dtype} {tuple(valid.shape)}" if is_tensor else type(valid).__name__
        raise RoutingTraceError(f"valid must be a bool tensor of shape {tuple(ids.shape[:2])}, got {got}")
    if valid.device != ids.device:
        raise RoutingTraceError(f"valid is on {valid.device} but ids are on {ids.device}")
    return None if bool(valid.all()) else valid


def dense_ids(ids: Any, num_experts: int, *, missing: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked dense ``[N, L, K]`` integer ids as an int64 CPU tensor, and the ``[N, L]`` rows without data.

    A row without data is ``missing`` in every top-k slot; every other entry must be in ``[0, num_experts)``
    (checked on the int64 values, before the caller narrows them). Distinct ids are left to the trace constructor.
    """
    if not isinstance(ids, torch.Tensor) or ids.is_nested:
        raise RoutingTraceError(f"ids must be a dense torch.Tensor, got {type(ids).__name__}")
    if not is_integer_dtype(ids.dtype):
        raise RoutingTraceError(f"ids must be an integer tensor, got {ids.dtype}")
    if ids.dim() != 3:
        raise RoutingTraceError(f"ids must be [tokens, moe_layers, top_k], got shape {tuple(ids.shape)}")
    ids = ids.detach().to(device="cpu", dtype=torch.long)
    is_missing = ids == missing
    row_missing = is_missing.all(dim=-1)
    if bool((is_missing.any(dim=-1) & ~row_missing).any()):
        n, layer = (is_missing.any(dim=-1) & ~row_missing).nonzero()[0].tolist()
        raise RoutingTraceError(
            f"row (token {n}, layer {layer}) mixes {missing} with expert ids {ids[n, layer].tolist()}; "
            f"a missing row must be {missing} in every top-k slot"
        )
    present = ids[~row_missing]
    if present.numel():
        lo, hi = int(present.min()), int(present.max())
        if lo < 0 or hi >= num_experts:
            bad = lo if lo < 0 else hi
            raise RoutingTraceError(
                f"expert id {bad} out of range: expected ids in [0, {num_experts}) (or {missing} for a missing row)"
            )
    return ids, row_missing


def require_id_tensor(ids: Any, what: str) -> None:
    """Raise a RoutingTraceError unless ``ids`` is a dense integer ``[..., top_k]`` tensor (any values: a float would
    compare by value, and NaN never equals itself)."""
    if not isinstance(ids, torch.Tensor) or ids.is_nested:
        got = "a nested tensor" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise RoutingTraceError(f"{what}: expected a dense [..., top_k] id tensor, got {got}")
    if not is_integer_dtype(ids.dtype):
        raise RoutingTraceError(f"{what}: expert ids must be an integer tensor, got {ids.dtype}")
    if ids.dim() < 1:
        raise RoutingTraceError(f"{what}: expected [..., top_k] ids with a top-k dimension, got a 0-d tensor")


# -------------------------------------------------------------------------------------- transport fields (torch)
def require_integer_tensor(part: torch.Tensor, what: str) -> None:
    """Raise a RoutingFormatError unless ``part`` has an integer dtype (a float would be truncated)."""
    if not is_integer_dtype(part.dtype):
        raise RoutingFormatError(f"{what}: expected integers, got dtype {part.dtype}")


def jagged_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The per-sample tensors of a nested tensor, or of a stacked one along dim 0.

    A jagged tensor ragged in dim 1 without holes (what TransferQueue and verl build) is sliced from its values by
    its offsets: views, and several times faster than ``unbind`` on nested tensors, whose dispatch dominates at
    the batch sizes of one actor call. Anything else goes through ``unbind``.
    """
    if not tensor.is_nested:
        return list(tensor.unbind(0))
    if tensor.layout != torch.jagged or getattr(tensor, "_ragged_idx", 1) != 1 or tensor._lengths is not None:
        return list(tensor.unbind())
    values = tensor.values()
    bounds = tensor.offsets().tolist()
    return [values[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


def unbind_integer(ids: torch.Tensor | Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
    """Per-sample integer tensors of a jagged / stacked tensor or a list of tensors."""
    if isinstance(ids, torch.Tensor):
        parts = jagged_parts(ids) if ids.dim() else [ids]
    elif isinstance(ids, (list, tuple)):
        parts = list(ids)
    else:
        raise RoutingFormatError(f"{what}: expected a tensor or a list of tensors, got {type(ids).__name__}")
    for i, part in enumerate(parts):
        if not isinstance(part, torch.Tensor):
            raise RoutingFormatError(f"{what} entry {i}: expected a tensor, got {type(part).__name__}")
        require_integer_tensor(part, f"{what} entry {i}")
    return parts


def span_pairs(spans: torch.Tensor | Sequence[torch.Tensor], what: str) -> torch.Tensor:
    """``[B, 2]`` int64 ``[start, stop)`` spans with ``0 <= start <= stop``, from a ``[B, 2]`` tensor or a jagged
    tensor / list of ``[2]`` entries (TransferQueue hands per-sample fields back jagged even when equal-sized)."""
    if isinstance(spans, torch.Tensor) and not spans.is_nested:
        require_integer_tensor(spans, what)
        if spans.numel() % 2:
            raise RowCountError(f"{what} must be [B, 2] (start, stop), got shape {tuple(spans.shape)}")
        out = spans.detach().cpu().reshape(-1, 2).to(torch.int64)
    else:
        parts = unbind_integer(spans, what)
        if any(p.numel() != 2 for p in parts):
            raise RowCountError(f"every {what} entry must be [start, stop], got {[tuple(p.shape) for p in parts]}")
        stacked = [p.detach().cpu().reshape(2).to(torch.int64) for p in parts]
        out = torch.stack(stacked) if stacked else torch.zeros(0, 2, dtype=torch.int64)
    bad = (out[:, 0] < 0) | (out[:, 1] < out[:, 0])
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise RowCountError(f"sample {i}: span {out[i].tolist()} is not [start, stop) with 0 <= start <= stop")
    return out
