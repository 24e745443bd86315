"""RoutedRows beyond one engine response: partial-rollout joins and the token-aligned RoutingTrace of sequences.

:func:`concat_partial_rollout` joins the pieces of an aborted and resumed rollout; :func:`rows_to_trace` /
:func:`trace_to_rows` convert per-sample rows to and from a :class:`~verl_stable.routing.trace.RoutingTrace` whose
rows outside each sample's recorded span are invalid (the model keeps its own routing there).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from verl_stable.routing.checks import count, ids_checked
from verl_stable.routing.codecs.common import (
    LayerMapError,
    RoutedRows,
    RoutingFormatError,
    RowCountError,
    _require_layout,
    validated_ids_tensor,
)
from verl_stable.routing.trace import RoutingLayout, RoutingTrace, storage_dtype


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


def rows_to_trace(samples: Sequence[RoutedRows | None], seq_lens: Sequence[int], layout: RoutingLayout) -> RoutingTrace:
    """Token-aligned :class:`RoutingTrace` of whole sequences: sample ``i`` gets ``seq_lens[i]`` rows, valid on
    ``[start, stop)`` and invalid (model's own routing) elsewhere; ``None`` marks a sample without routing.

    Every sample's ids are validated against ``layout`` (range, distinct ids) before they are narrowed.
    """
    layout = _require_layout(layout)
    samples = list(samples)
    if isinstance(seq_lens, torch.Tensor):
        seq_lens = seq_lens.reshape(-1) if seq_lens.dim() else seq_lens
    lens = [count(n, f"sequence length {i}") for i, n in enumerate(seq_lens)]
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
                values = validated_ids_tensor(rows, layout, f"sample {i}")
                if rows.stop > n:
                    raise RowCountError(
                        f"sample {i}: routing covers positions [{rows.start}, {rows.stop}) of {n} tokens"
                    )
                ids[offset + rows.start : offset + rows.stop] = values
                valid[offset + rows.start : offset + rows.stop] = True
        offset += n
    with ids_checked():  # every sample passed validate_ids above, rows without data are not scanned anyway
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
