"""The checks of an engine's routing payload, on numpy arrays: integer ids, a wire width that holds them, valid ids.

Part of the routing package's input validation (:mod:`verl_stable.routing.checks` has the rule and the other
entry points): the engine codecs (:mod:`verl_stable.routing.codecs`) run :func:`as_integer_array` and
:func:`check_wire_width` on what an engine returned, then :func:`check_expert_ids` (range, all-zero rows, repeated
ids) through ``codecs.validate_ids`` / ``validate_rows``, before any narrowing; the transport checks the wire width of
verl's ``routed_experts`` with :func:`check_wire_width`. Each check raises one of the typed errors of
:mod:`verl_stable.routing.errors`, naming what was expected and what was received. Pure torch + numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from verl_stable.routing.checks import is_integer_dtype
from verl_stable.routing.errors import (
    DuplicateExpertError,
    ExpertIdRangeError,
    RoutingFormatError,
    ZeroRoutingError,
)


def require_integer_np_dtype(dtype: np.dtype, what: str) -> None:
    """Raise a RoutingFormatError unless ``dtype`` is a numpy integer dtype."""
    if dtype.kind not in "iu":
        raise RoutingFormatError(f"{what}: expert ids must be integers, got dtype {dtype}")


def as_integer_array(values: Any, what: str) -> np.ndarray:
    """A payload as a numpy array of integers; anything else is a :class:`RoutingFormatError`."""
    if isinstance(values, torch.Tensor):
        if values.is_nested:
            raise RoutingFormatError(f"{what}: expected a dense tensor, got a nested one (unbind it first)")
        if not is_integer_dtype(values.dtype):
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
    require_integer_np_dtype(out.dtype, what)
    return out


def check_wire_width(dtype: np.dtype, num_experts: int, what: str) -> None:
    """Raise an ExpertIdRangeError when ``dtype`` cannot hold expert id ``num_experts - 1`` (the ids wrapped)."""
    top = int(np.iinfo(dtype).max)
    if top < num_experts - 1:
        raise ExpertIdRangeError(
            f"{what}: dtype {dtype} holds expert ids up to {top}, the model has {num_experts} experts "
            f"(ids up to {num_experts - 1}): larger ids cannot be represented and would wrap"
        )


_VALIDATE_CHUNK_ROWS = 4096


def check_expert_ids(ids: np.ndarray, num_experts: int, moe_layers: Sequence[int], start: int) -> None:
    """Check integer MoE-layer ids ``[rows, len(moe_layers), top_k]`` of token positions ``start, start + 1, ...``.

    In order: ``0 <= id < num_experts``; no all-zero row when ``top_k >= 2`` (a row that repeats expert 0: the
    known failure of fused MoE kernels that return no routing); distinct ids within every row. With ``top_k == 1``
    a zero is a valid routing to expert 0, so only what random routing produces with probability at most
    ``num_experts**-8`` is refused: a MoE layer that is expert 0 for all of 8 or more rows, or a payload that is
    expert 0 everywhere over 8 or more (row, MoE layer) entries. A shorter all-zero top-1 payload (fewer than 8
    entries), or zero rows among non-zero ones, cannot be told from routing to expert 0 and is accepted. The checks
    judge one engine payload; a batch of payloads put end to end is judged sample by sample by its callers.
    Errors name the token position and the MoE / decoder layer.

    Raises:
        ExpertIdRangeError, ZeroRoutingError, DuplicateExpertError: as named.
    """
    if ids.size == 0:
        return
    alive = np.zeros(len(moe_layers), dtype=bool)
    # chunks bound the temporaries (masks, transposed copy) to a few MiB whatever the sequence length
    for lo in range(0, ids.shape[0], _VALIDATE_CHUNK_ROWS):
        chunk = ids[lo : lo + _VALIDATE_CHUNK_ROWS]
        _check_chunk(chunk, num_experts, moe_layers, start + lo)
        alive |= chunk.any(axis=(0, 2))
    if ids.shape[2] == 1 and ids.shape[0] >= 8 and not alive.all():
        layer = int(np.argmin(alive))
        raise ZeroRoutingError(
            f"MoE layer {layer} (decoder layer {moe_layers[layer]}) is expert 0 for all {ids.shape[0]} "
            "rows: the engine returned no routing for it"
        )
    if ids.shape[2] == 1 and ids.shape[0] * ids.shape[1] >= 8 and not alive.any():
        # a short payload of a model with several MoE layers: as unlikely from real routing as the rule above
        raise ZeroRoutingError(
            f"every MoE layer is expert 0 for all {ids.shape[0]} rows ({ids.shape[0] * ids.shape[1]} top-1 "
            "entries): the engine returned no routing"
        )


def _locate(mask: np.ndarray, moe_layers: Sequence[int], start: int) -> str:
    row, ordinal = (int(x) for x in np.argwhere(mask)[0][:2])
    return f"token position {start + row}, MoE layer {ordinal} (decoder layer {moe_layers[ordinal]})"


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


def _check_chunk(ids: np.ndarray, num_experts: int, moe_layers: Sequence[int], start: int) -> None:
    signed = ids.dtype.kind == "i"
    if int(ids.max()) >= num_experts or (signed and int(ids.min()) < 0):
        out_of_range = ids >= num_experts
        if signed:
            out_of_range |= ids < 0
        bad = ids[out_of_range]
        raise ExpertIdRangeError(
            f"expert ids outside [0, {num_experts}) (e.g. {int(bad.flat[0])}) at "
            f"{_locate(out_of_range.any(axis=2), moe_layers, start)}"
        )
    if ids.shape[2] < 2:
        return
    dup = _repeated_rows(ids)
    if not dup.any():
        return
    zero_rows = dup & ~ids.any(axis=2)  # with top_k >= 2 an all-zero row repeats expert 0
    if zero_rows.any():
        raise ZeroRoutingError(
            f"all-zero (token, MoE layer) rows, first at {_locate(zero_rows, moe_layers, start)}"
            ": the engine returned no routing for them (known failure of some fused MoE kernels)"
        )
    row, ordinal = (int(x) for x in np.argwhere(dup)[0])
    raise DuplicateExpertError(
        f"a row repeats an expert id at {_locate(dup, moe_layers, start)}: {ids[row, ordinal].tolist()}"
    )
