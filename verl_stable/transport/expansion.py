"""The actor side: a (micro-)batch's compact routing fields back to a trace or to verl's ``routed_experts``.

What the agent-loop workers stored per sample (:data:`~verl_stable.transport.fields.IDS_FIELD` /
:data:`~verl_stable.transport.fields.SPAN_FIELD`, plus a reference to its group's shared prompt rows, see
:mod:`.sharing`) is rebuilt here, on the actor, after verl's balancing, shuffling and micro-batching:

* :func:`routing_trace_from_batch`: the token-aligned :class:`~verl_stable.routing.trace.RoutingTrace`;
* :func:`attach_moe_routing`: the rows over MoE layers only, checked, as one jagged field
  (:data:`MOE_ROUTING_FIELD`) aligned with ``input_ids``: what the FSDP replay engine aligns to its routers, with no
  detour through all decoder layers and no second check;
* :func:`expand_compact_routing`: verl's own jagged int16 ``routed_experts`` over all decoder layers, for code
  written against verl's layout (verl's Megatron replay, the driver's monitor). Both live only on the actor (or the
  driver), transiently; transport stays compact.

The ids are checked here once, on the batch being processed (range, distinct top-k, the zero rule; a bad batch is
checked again sample by sample to name the sample): this is the actor's one check of rows that left the rollout
side's boundary check. Whoever consumes these fields trusts them.

Both re-attach the shared prompt rows first (one TransferQueue read of the entries not already held by the rank's
:class:`~.side_rows.SharedRowReader`, or one per batch without one) and give verl's synthetic padding
samples no routing. No verl import.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from verl_stable.routing.checks import jagged_parts, span_pairs, unbind_integer
from verl_stable.routing.codecs import (
    RoutedRows,
    RoutingFormatError,
    RowCountError,
    ZeroRoutingError,
    rows_to_trace,
    validate_ids,
    validate_rows,
)
from verl_stable.routing.payload_checks import check_wire_width
from verl_stable.routing.trace import RoutingLayout, RoutingTrace
from verl_stable.transport.boundary import BOUNDARY_FIELD
from verl_stable.transport.fields import IDS_FIELD, SPAN_FIELD, rows_from_fields
from verl_stable.transport.sharing import PROMPT_REF_FIELD
from verl_stable.transport.side_rows import SharedRowReader, attach_shared_prompt_rows, merged_sample_rows

__all__ = [
    "COMPACT_FIELDS",
    "MOE_ROUTING_FIELD",
    "attach_moe_routing",
    "expand_compact_routing",
    "routing_trace_from_batch",
    "without_compact_fields",
]

COMPACT_FIELDS = (IDS_FIELD, SPAN_FIELD, PROMPT_REF_FIELD, BOUNDARY_FIELD)
"""The per-sample fields of the compact transport, in the order the agent-loop workers emit them."""

MOE_ROUTING_FIELD = "stable_moe_routing"
"""The actor's checked MoE-layer rows (:func:`attach_moe_routing`): jagged ``[B, tokens_i, num_moe_layers, top_k]``
uint8 up to 256 experts, int16 beyond (verl's own width: at most 32768 experts), one row per token of
``input_ids``."""


def _sequence_lengths(data: Any) -> list[int]:
    if "input_ids" in data.keys() and data["input_ids"].is_nested:
        return data["input_ids"].offsets().diff().tolist()
    if "prompts" in data.keys() and data["prompts"].is_nested:
        return (data["prompts"].offsets().diff() + data["responses"].offsets().diff()).tolist()
    raise RowCountError("cannot tell sequence lengths: expected jagged input_ids or prompts/responses")


def _batch_rows(data: Any, lengths: list[int]) -> list[RoutedRows | None]:
    """Per-sample rows of a batch; verl's synthetic padding samples get none.

    verl's V1 trainer pads a batch to a divisible size with copies of a real sample's fields on a synthetic
    ``SYNTHETIC_PADDING_SEQ_LEN`` sequence with an all-zero ``response_mask`` (``padding_utils``), so their copied
    routing overruns their tokens. Such a sample trains nothing and gets no routing; an overrun on a sample with
    generated tokens is an error.
    """
    rows: list[RoutedRows | None] = list(rows_from_fields(data[IDS_FIELD], data[SPAN_FIELD]))
    masks = None
    for i, (sample, length) in enumerate(zip(rows, lengths, strict=True)):
        if sample is None or sample.stop <= length:
            continue
        if masks is None:
            if "response_mask" not in data.keys():
                raise RowCountError(f"sample {i}: routing covers positions up to {sample.stop} of {length} tokens")
            mask = data["response_mask"]
            masks = list(mask.unbind()) if mask.is_nested else list(mask.unbind(0))
        if masks[i].any():
            raise RowCountError(f"sample {i}: routing covers positions up to {sample.stop} of its {length} tokens")
        rows[i] = None
    return rows


def _no_rows(layout: RoutingLayout) -> RoutedRows:
    return RoutedRows(0, np.zeros((0, layout.num_moe_layers, layout.top_k), dtype=np.uint8))


def routing_trace_from_batch(data: Any, layout: RoutingLayout, kv_batch_get: Any = None) -> RoutingTrace | None:
    """Actor side: the token-aligned RoutingTrace of a (micro-)batch carrying the compact fields, else ``None``.

    Sequence ``i`` has ``prompt_len_i + response_len_i`` rows (``prompts`` / ``responses`` as stored per sample,
    or ``input_ids``), in the order of the sample's tokens, valid where the engine recorded routing. Shared prompt
    rows are re-attached first (:func:`~.side_rows.attach_shared_prompt_rows`, reading with ``kv_batch_get``, default
    TransferQueue's).
    """
    if IDS_FIELD not in data.keys():
        return None
    attach_shared_prompt_rows(data, kv_batch_get, layout)
    lengths = _sequence_lengths(data)
    return rows_to_trace(_batch_rows(data, lengths), lengths, layout)


def expand_compact_routing(
    data: Any, layout: RoutingLayout, kv_batch_get: Any = None, reader: SharedRowReader | None = None
) -> bool:
    """Actor or driver side, per (mini-/micro-)batch: add verl's ``routed_experts`` from the compact fields, in place.

    Produces verl's V1 form, jagged int16 ``[B, (prompt_len_i + response_len_i), num_hidden_layers, top_k]`` aligned
    with the jagged ``input_ids``, zero rows where nothing was recorded (dense layers included), so code written for
    verl's layout (verl's Megatron replay, the monitor) consumes it unchanged. The rows are gathered and checked as
    in :func:`attach_moe_routing`, then scattered into the MoE layers. Returns True when it added the field.
    """
    if IDS_FIELD not in data.keys() or "routed_experts" in data.keys():
        return False
    check_wire_width(np.dtype(np.int16), layout.num_experts, "verl routed_experts")
    moe, offsets = _checked_moe_rows(data, layout, kv_batch_get, reader, torch.int16)
    rows = torch.zeros(moe.shape[0], layout.num_hidden_layers, layout.top_k, dtype=torch.int16)
    rows[:, list(layout.moe_layers)] = moe
    data["routed_experts"] = torch.nested.nested_tensor_from_jagged(rows.to(data["input_ids"].device), offsets)
    return True


def attach_moe_routing(
    data: Any, layout: RoutingLayout, kv_batch_get: Any = None, reader: SharedRowReader | None = None
) -> bool:
    """Actor side, per (mini-)batch: add :data:`MOE_ROUTING_FIELD` from the compact fields, in place.

    The field is jagged ``[B, (prompt_len_i + response_len_i), num_moe_layers, top_k]`` aligned with the jagged
    ``input_ids``, uint8 up to 256 experts and int16 beyond, zero rows where nothing was recorded. Shared prompt rows
    are put in front of each sample's own rows first (:func:`~.side_rows.merged_sample_rows`: through the rank's
    ``reader`` if given, else one ``kv_batch_get`` of the batch's groups, default TransferQueue's); verl's synthetic
    padding samples get no routing. The whole batch is validated and scattered in one pass, not sample by sample (this
    runs at every actor call); an invalid batch is checked again per sample to name the sample. A batch that already
    carries verl's ``routed_experts`` (R2's recording of pi_old, made by ``compute_log_prob``) keeps it: nothing is
    added. Returns True when it added the field.
    """
    if IDS_FIELD not in data.keys() or MOE_ROUTING_FIELD in data.keys() or "routed_experts" in data.keys():
        return False
    dtype = _moe_dtype(layout)
    check_wire_width(torch.empty(0, dtype=dtype).numpy().dtype, layout.num_experts, MOE_ROUTING_FIELD)
    moe, offsets = _checked_moe_rows(data, layout, kv_batch_get, reader, dtype)
    data[MOE_ROUTING_FIELD] = torch.nested.nested_tensor_from_jagged(moe.to(data["input_ids"].device), offsets)
    return True


def _moe_dtype(layout: RoutingLayout) -> torch.dtype:
    """uint8 up to 256 experts, else int16 (torch's uint16 lacks the indexing and comparison kernels used here), as
    verl's own form: a model with more than 32768 experts is refused by the caller's width check, not wrapped."""
    return torch.uint8 if layout.num_experts <= 256 else torch.int16


def _checked_moe_rows(
    data: Any, layout: RoutingLayout, kv_batch_get: Any, reader: SharedRowReader | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's rows ``[tokens, num_moe_layers, top_k]`` as ``dtype`` over ``input_ids``' offsets, ids checked."""
    input_ids = data["input_ids"]
    if not input_ids.is_nested:
        raise RowCountError("expanding compact routing needs jagged input_ids (verl's V1 / TransferQueue batches)")
    merged = merged_sample_rows(data, kv_batch_get, layout, reader)
    parts = unbind_integer(data[IDS_FIELD], IDS_FIELD) if merged is None else merged[0]
    offsets = input_ids.offsets()
    return _moe_rows(data, parts, offsets.cpu(), layout, dtype), offsets


def _moe_rows(
    data: Any, parts: list[torch.Tensor], offsets: torch.Tensor, layout: RoutingLayout, dtype: torch.dtype
) -> torch.Tensor:
    """The batch's routing as ``[tokens, num_moe_layers, top_k]`` ``dtype`` over ``offsets``, zero rows without
    data."""
    spans = span_pairs(data[SPAN_FIELD], SPAN_FIELD)
    if len(parts) != spans.shape[0]:
        raise RowCountError(f"{len(parts)} routing entries but {spans.shape[0]} spans")
    for i, (part, (start, stop)) in enumerate(zip(parts, spans.tolist(), strict=True)):
        if part.dim() != 3 or part.shape[0] != stop - start:
            raise RowCountError(f"sample {i}: span [{start}, {stop}) but {tuple(part.shape)} routing rows")
    lengths = offsets.diff()
    if lengths.numel() != len(parts):
        raise RowCountError(f"{len(parts)} routing entries for {lengths.numel()} sequences")
    keep = _drop_padding_samples(data, spans, lengths)
    kept = [part for part, k in zip(parts, keep, strict=True) if k]
    out = torch.zeros(int(offsets[-1]), layout.num_moe_layers, layout.top_k, dtype=dtype)
    if not kept:
        return out
    values = torch.cat([part.detach().cpu() for part in kept])
    try:
        validate_ids(values.numpy(), layout)
    except RoutingFormatError as exc:
        for i, (part, (start, _)) in enumerate(zip(parts, spans.tolist(), strict=True)):
            if keep[i] and part.shape[0]:
                validate_rows(RoutedRows(start, part.detach().cpu().numpy()), layout, f"sample {i}")
        # every sample passed: only the top-1 all-zero rule, which judges one engine payload, can refuse short
        # samples put end to end (each accepted at the boundary); anything else is unexplained and raises
        if not (isinstance(exc, ZeroRoutingError) and layout.top_k == 1):
            raise
    mask = torch.tensor(keep)
    counts = (spans[:, 1] - spans[:, 0])[mask]
    first = (offsets[:-1] + spans[:, 0])[mask]  # where each kept sample's first routed row lands
    sample = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    position = first[sample] + torch.arange(values.shape[0]) - (counts.cumsum(0) - counts)[sample]
    out[position] = values.to(dtype)  # checked above: every id fits (uint8 only up to 256 experts)
    return out


def _drop_padding_samples(data: Any, spans: torch.Tensor, lengths: torch.Tensor) -> list[bool]:
    """Which samples keep their routing: all but verl's synthetic padding samples (see :func:`_batch_rows`)."""
    keep = [True] * spans.shape[0]
    over = (spans[:, 1] > lengths).nonzero().flatten().tolist()
    if not over:
        return keep
    if "response_mask" not in data.keys():
        i = over[0]
        raise RowCountError(
            f"sample {i}: routing covers positions up to {int(spans[i, 1])} of {int(lengths[i])} tokens"
        )
    masks = jagged_parts(data["response_mask"])
    for i in over:
        if masks[i].any():
            raise RowCountError(
                f"sample {i}: routing covers positions up to {int(spans[i, 1])} of its {int(lengths[i])} tokens"
            )
        keep[i] = False
    return keep


def without_compact_fields(data: Any) -> Any:
    """``data`` without :data:`COMPACT_FIELDS` (a shallow copy; ``data`` itself is left as it is), or ``data``.

    Once :func:`attach_moe_routing` or :func:`expand_compact_routing` has added its field, the engine needs none of
    them; verl's micro-batch split indexes every field of a batch, and a jagged field costs a few milliseconds per split
    on the CPU runtime (``benchmarks/bench_dp_overhead.py``), so they are left out before it.
    """
    present = [name for name in COMPACT_FIELDS if name in data.keys()]
    return data.exclude(*present) if present else data
