"""Compact transport of rollout routing from the rollout workers to the actors.

verl 0.9.1 moves routing as int16 ``[prompt_len + response_len, num_hidden_layers, top_k]`` per sample (zero rows
for dense layers, and in the legacy trainer zero-padded to ``prompt_length + response_length`` for every sample).
Here routing travels as the smallest unsigned dtype over MoE layers only, without padding, and -- in the batch
form :class:`~verl_stable.transport.packed.PackedRouting` -- with the prompt rows of the ``rollout.n`` responses of one prompt stored once.

Bytes per real token, for ``L`` MoE layers of ``H`` decoder layers, top-``K``, ``n`` responses per prompt of
``P`` prompt and ``R`` response tokens, ``W`` padded width (verl legacy) and storage itemsize ``b`` (1 for <= 256
experts):

* verl: ``2 * H * K * W / (P + R)``;
* per-sample fields (:func:`sample_fields`): ``b * L * K``;
* packed batch: ``b * L * K * (P / n + R) / (P + R)`` plus a few int64 per sample.

This module holds the per-sample fields (:data:`IDS_FIELD`, :data:`SPAN_FIELD`) of verl's V1 trainer, where
every sample is its own TransferQueue row and verl stacks ragged tensors as jagged nested tensors; the batch carrier
with prompt rows once per group is :class:`~verl_stable.transport.packed.PackedRouting`. Both expand, on the actor, to a token-aligned :class:`~verl_stable.routing.trace.RoutingTrace` whose invalid rows
(positions the engine did not record: the last sampled token, prefix offsets, tool output after the last turn)
keep the model's own routing. Pure torch/numpy; no verl import.

Everything that arrives here is checked before it is narrowed or indexed: routing ids against the layout (range,
distinct ids per row, as at the engine boundary), spans and lengths as non-negative integers, packed index arrays
for consistency. Malformed routing raises a :class:`~verl_stable.routing.codecs.RoutingFormatError`.
The structural checks (integer dtypes, spans, counts) come from :mod:`verl_stable.routing.checks`, the id checks
and the one narrowing step (``validated_ids_tensor``) from :mod:`verl_stable.routing.codecs`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from verl_stable.routing.checks import (
    counts,
    span_pairs,
    unbind_integer,
)
from verl_stable.routing.codecs import RoutedRows, rows_to_trace, validate_rows
from verl_stable.routing.codecs.common import (
    _require_layout,
    narrowed_ids_tensor,
    smallest_uint_dtype,
    validated_ids_tensor,
)
from verl_stable.routing.errors import RoutingFormatError, RowCountError
from verl_stable.routing.trace import RoutingLayout, RoutingTrace, storage_dtype

__all__ = [
    "IDS_FIELD",
    "SPAN_FIELD",
    "dense_rows_from_fields",
    "rows_from_fields",
    "sample_fields",
    "trace_from_fields",
]

IDS_FIELD = "stable_routed_experts"
"""Per-sample ``[stop - start, num_moe_layers, top_k]`` ids of the recorded positions (smallest unsigned dtype)."""
SPAN_FIELD = "stable_routing_span"
"""Per-sample int64 ``[2]``: the token positions ``[start, stop)`` that :data:`IDS_FIELD` covers."""


def empty_rows(layout: RoutingLayout) -> torch.Tensor:
    """An empty ``[0, num_moe_layers, top_k]`` ids tensor in the layout's storage dtype."""
    return torch.zeros(0, layout.num_moe_layers, layout.top_k, dtype=storage_dtype(layout.num_experts))


# ------------------------------------------------------------------------------------------- per-sample fields
def sample_fields(rows: RoutedRows | None, layout: RoutingLayout, *, checked: bool = False) -> dict[str, torch.Tensor]:
    """The two per-sample tensors that carry one sample's routing (``None``: no routing, replay nothing).

    ``checked=True``: ``rows`` come straight from a decoder that validated them against ``layout`` and narrowed them
    to its storage dtype (the rollout boundary's :func:`~verl_stable.transport.boundary.compact_token_routing`), with
    nothing in between: they are not validated a second time (one check per hop; the check was ~2/3 of this
    function's time per sample). Anything else is validated here.
    """
    layout = _require_layout(layout)
    if rows is not None and not isinstance(rows, RoutedRows):
        raise RoutingFormatError(f"sample_fields: expected RoutedRows or None, got {type(rows).__name__}")
    if rows is None or rows.num_rows == 0:
        return {IDS_FIELD: empty_rows(layout), SPAN_FIELD: torch.zeros(2, dtype=torch.int64)}
    if checked and rows.ids.dtype == smallest_uint_dtype(layout.num_experts):
        ids = narrowed_ids_tensor(rows, layout)
    else:
        ids = validated_ids_tensor(rows, layout, "sample_fields")
    return {IDS_FIELD: ids, SPAN_FIELD: torch.tensor([rows.start, rows.stop], dtype=torch.int64)}


def rows_from_fields(
    ids: torch.Tensor | Sequence[torch.Tensor],
    spans: torch.Tensor,
    *,
    layout: RoutingLayout | None = None,
) -> list[RoutedRows]:
    """Per-sample :class:`RoutedRows` from a batch of the two fields (jagged nested ids, ``[B, 2]`` spans).

    Structure (integer dtypes, span sizes) is always checked; with ``layout`` the ids are validated too
    (:func:`~verl_stable.routing.codecs.validate_ids`). :func:`trace_from_fields` validates them once, on the way in.
    """
    parts = unbind_integer(ids, IDS_FIELD)
    spans = span_pairs(spans, SPAN_FIELD)
    if len(parts) != spans.shape[0]:
        raise RowCountError(f"{len(parts)} routing entries but {spans.shape[0]} spans")
    layout = None if layout is None else _require_layout(layout)
    out = []
    for i, (part, (start, stop)) in enumerate(zip(parts, spans.tolist(), strict=True)):
        if part.dim() != 3 or part.shape[0] != stop - start:
            raise RowCountError(f"sample {i}: span [{start}, {stop}) but {tuple(part.shape)} routing rows")
        rows = RoutedRows(int(start), part.detach().cpu().contiguous().numpy())
        if layout is not None and rows.num_rows:
            validate_rows(rows, layout, f"sample {i}")
        out.append(rows)
    return out


def trace_from_fields(
    ids: torch.Tensor | Sequence[torch.Tensor],
    spans: torch.Tensor,
    seq_lens: Sequence[int] | torch.Tensor,
    layout: RoutingLayout,
) -> RoutingTrace:
    """Actor side: the token-aligned trace of a (micro-)batch, ``seq_lens[i]`` = prompt + response tokens of i.

    The ids are validated against ``layout`` (in :func:`~verl_stable.routing.codecs.rows_to_trace`) before they
    are narrowed to the trace's dtype.
    """
    return rows_to_trace(rows_from_fields(ids, spans), counts(seq_lens, "seq_lens"), _require_layout(layout))


def dense_rows_from_fields(
    ids: torch.Tensor | Sequence[torch.Tensor],
    spans: torch.Tensor,
    offsets: torch.Tensor,
    layout: RoutingLayout,
) -> torch.Tensor:
    """Actor side, for the FSDP replay engine: the micro-batch's routing as packed token rows.

    Args:
        ids: the micro-batch's :data:`IDS_FIELD` (jagged).
        spans: its :data:`SPAN_FIELD`, ``[B, 2]``.
        offsets: ``input_ids.offsets()`` of the (jagged) micro-batch, ``[B + 1]``.
        layout: the model's routing layout.

    Returns:
        int64 ``[offsets[-1], num_moe_layers, top_k]``: row ``offsets[i] + t`` is token ``t`` of sample ``i``;
        ``MISSING`` (-1) in every slot of a row the engine did not record.
    """
    cu = torch.as_tensor(counts(offsets, "offsets"), dtype=torch.long)
    if cu.numel() == 0 or int(cu[0]) != 0:
        raise RowCountError(f"offsets must start at 0 ([B + 1] CSR offsets), got {cu.tolist()[:8]}")
    lens = cu.diff()
    if bool((lens < 0).any()):
        raise RowCountError(f"offsets must be non-decreasing, got {cu.tolist()}")
    return trace_from_fields(ids, spans, lens, layout).to_tensor()
