"""What every engine codec shares: :class:`RoutedRows`, its validation against a layout, and the layout helpers.

Validation (:func:`validate_ids`; :func:`validate_rows` for :class:`RoutedRows`) rejects, with an error naming what
was expected and received: expert ids outside ``[0, num_experts)``, a repeated id within one (token, layer) row,
all-zero rows in a MoE layer (a known engine failure mode where a fused kernel returns no routing), and row counts
that do not match the tokens. Every malformed payload -- wrong type, dtype or shape, non-integer counts, a wire
dtype too narrow for the model's expert ids (they would have wrapped) -- raises a :class:`RoutingFormatError`, so
``decode_with_policy(..., on_invalid="skip_sample")`` can count and skip it. Every function that takes
:class:`RoutedRows` and a layout validates them before narrowing them to a smaller dtype; an encoder never wraps.
A wrong ``layout`` argument (not a :class:`RoutingLayout`) is a caller bug and raises ``TypeError``.

The error classes live in :mod:`verl_stable.routing.errors` and the layout-free checks in
:mod:`verl_stable.routing.checks` and :mod:`verl_stable.routing.payload_checks` (shared with the trace and the
transport); the error classes are importable from here and from :mod:`verl_stable.routing.codecs` as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from verl_stable.routing.checks import count
from verl_stable.routing.errors import (
    DuplicateExpertError,
    ExpertIdRangeError,
    LayerMapError,
    RoutingFormatError,
    RowCountError,
    ZeroRoutingError,
)
from verl_stable.routing.payload_checks import (
    as_integer_array,
    check_expert_ids,
    check_wire_width,
    require_integer_np_dtype,
)
from verl_stable.routing.trace import RoutingLayout, storage_dtype

__all__ = [
    "DuplicateExpertError",
    "ExpertIdRangeError",
    "LayerMapError",
    "RoutedRows",
    "RoutingFormatError",
    "RowCountError",
    "ZeroRoutingError",
    "smallest_uint_dtype",
    "validate_ids",
    "validate_rows",
]


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


def _ids_structure(ids: Any, what: str) -> None:
    if not isinstance(ids, np.ndarray):
        raise RoutingFormatError(f"{what}: ids must be a numpy array, got {type(ids).__name__}")
    if ids.ndim != 3:
        raise LayerMapError(f"{what}: ids must be [rows, moe_layers, top_k], got shape {tuple(ids.shape)}")
    require_integer_np_dtype(ids.dtype, what)


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
        self.start = count(self.start, "RoutedRows.start")
        _ids_structure(self.ids, "RoutedRows")

    @property
    def stop(self) -> int:
        """One past the last covered token position."""
        return self.start + int(self.ids.shape[0])

    @property
    def num_rows(self) -> int:
        """Number of covered token positions."""
        return int(self.ids.shape[0])


def _wire_ids(values: Any, layout: RoutingLayout, what: str) -> np.ndarray:
    """An engine payload as integer ids whose dtype can hold every expert id of the model (else they wrapped)."""
    out = as_integer_array(values, what)
    _check_wire_width(out.dtype, layout, what)
    return out


def _check_wire_width(dtype: np.dtype, layout: RoutingLayout, what: str) -> None:
    check_wire_width(dtype, layout.num_experts, what)


def validate_ids(ids: np.ndarray, layout: RoutingLayout, *, start: int = 0) -> None:
    """Check MoE-layer ids ``[rows, num_moe_layers, top_k]`` against the layout; raise on the first problem.

    Checks, in order: shape; integer dtype; ``0 <= id < num_experts``; no all-zero row when ``top_k >= 2``
    (for ``top_k == 1`` a whole MoE layer of zeros over 8 or more rows, or an all-zero payload of 8 or more
    (row, MoE layer) entries, which random routing produces with probability at most ``num_experts**-8``; shorter
    or partly zero top-1 payloads cannot be told from routing to expert 0, see
    :func:`~verl_stable.routing.payload_checks.check_expert_ids`); distinct ids within every row. ``ids`` may also
    be a tensor or nested lists.

    Raises:
        LayerMapError: wrong number of MoE layers or top-k.
        ExpertIdRangeError, ZeroRoutingError, DuplicateExpertError: as named.
        RoutingFormatError: not an integer array.
    """
    layout = _require_layout(layout)
    start = count(start, "start")
    if not isinstance(ids, np.ndarray):
        ids = as_integer_array(ids, "routing")
    if ids.ndim != 3:
        raise LayerMapError(f"routing must be [rows, moe_layers, top_k], got shape {tuple(ids.shape)}")
    if ids.shape[1] != layout.num_moe_layers or ids.shape[2] != layout.top_k:
        raise LayerMapError(
            f"routing has {ids.shape[1]} MoE layers x top-{ids.shape[2]}; the model expects "
            f"{layout.num_moe_layers} MoE layers x top-{layout.top_k}"
        )
    if ids.dtype.kind not in "iu":
        raise RoutingFormatError(f"expert ids must be integers, got dtype {ids.dtype}")
    check_expert_ids(ids, layout.num_experts, layout.moe_layers, start)


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


def validated_ids_tensor(rows: RoutedRows, layout: RoutingLayout, what: str) -> torch.Tensor:
    """``rows.ids`` validated against ``layout`` (:func:`validate_rows`), then narrowed to the layout's storage dtype
    as a writable CPU tensor: the one place where trainer-side rows are narrowed (transport, :func:`rows_to_trace`)."""
    validate_rows(rows, layout, what)  # range and distinct ids, before the narrowing below
    return narrowed_ids_tensor(rows, layout)


def narrowed_ids_tensor(rows: RoutedRows, layout: RoutingLayout) -> torch.Tensor:
    """``rows.ids`` in the layout's storage dtype as a writable CPU tensor, unchecked: for rows already validated
    (:func:`validated_ids_tensor` checks first; a decoder's own output was checked where it was decoded)."""
    # engines may hand out read-only buffers: copy those rather than let torch alias them
    return torch.from_numpy(
        np.require(rows.ids.astype(smallest_uint_dtype(layout.num_experts), copy=False), requirements="CW")
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


def _check_row_count(got: int, expected: int, what: str, detail: str) -> None:
    if got != expected:
        raise RowCountError(f"{what}: {got} routed rows, expected {expected} ({detail})")


def _full_rows(rows: RoutedRows, layout: RoutingLayout, dtype: Any) -> np.ndarray:
    """``[rows, num_hidden_layers, top_k]`` in ``dtype`` with zero dense layers (rows already validated)."""
    full = np.zeros((rows.num_rows, layout.num_hidden_layers, layout.top_k), dtype=dtype)
    full[:, list(layout.moe_layers), :] = rows.ids
    return full
