"""What every engine codec shares: the error classes, :class:`RoutedRows`, id validation and the layout helpers.

Validation (:func:`validate_ids`; :func:`validate_rows` for :class:`RoutedRows`) rejects, with an error naming what
was expected and received: expert ids outside ``[0, num_experts)``, a repeated id within one (token, layer) row,
all-zero rows in a MoE layer (a known engine failure mode where a fused kernel returns no routing), and row counts
that do not match the tokens. Every malformed payload -- wrong type, dtype or shape, non-integer counts, a wire
dtype too narrow for the model's expert ids (they would have wrapped) -- raises a :class:`RoutingFormatError`, so
``decode_with_policy(..., on_invalid="skip_sample")`` can count and skip it. Every function that takes
:class:`RoutedRows` and a layout validates them before narrowing them to a smaller dtype; an encoder never wraps.
A wrong ``layout`` argument (not a :class:`RoutingLayout`) is a caller bug and raises ``TypeError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from verl_stable.routing.trace import RoutingLayout, require_int, storage_dtype


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
