"""Row alignment between per-sample routing and the token rows an MoE router sees in a micro-batch.

A routing row is the top-k expert choice of one token: ``[layers, top_k]``. verl keeps routing per sample,
one row per valid token (prompt + response, padding removed), in the same order as ``input_ids``. Inside a
micro-batch the model does not see that layout; the router of every MoE layer sees ``hidden.view(-1, h)``,
i.e. the model input flattened row-major. verl builds that input in one of three ways, and these pure
functions apply the same rule to routing rows:

* padded (``use_remove_padding=False``): samples are right-padded to the longest one, ``[B, S_max]``;
  router row ``b * S_max + t`` is token ``t`` of sample ``b`` when ``t < len_b`` and a pad token otherwise;
* packed (``use_remove_padding=True``): the valid tokens of all samples concatenated, ``cu_seqlens`` marking
  the boundaries, followed by ``static_pad`` pad tokens (``pad_to_length`` buckets);
* Ulysses sequence parallel (packed, ``sp > 1``): the packed sequence is right-padded to a multiple of ``sp``
  and rank ``r`` sees rows ``[r * n / sp, (r + 1) * n / sp)`` of it.

Rows that hold no routing (pad tokens, tokens the rollout engine did not record) are carried as a boolean
``has_data`` mask next to the ids; a consumer must route them with the model's own router, never with an
invented expert. The left/right padded batch layout of verl's legacy trainer is converted to the packed one
by :func:`unpad_rows` exactly like ``verl.workers.utils.padding.left_right_2_no_padding`` does for
``input_ids``.

Layer axis: rollout engines and verl's ``routed_experts`` index routing by absolute decoder layer over all
``num_hidden_layers`` (dense layers hold zero rows); :func:`select_layers` / :func:`scatter_layers` convert
between that and the MoE-layer ordinal used inside a routing trace.

Every function checks its inputs (tensor types, integer dtypes, 0/1 masks, integer sizes, boundaries that fit the
rows) and raises ``TypeError`` for a wrong type or dtype and ``ValueError`` for a wrong shape or value, naming what
was expected. Everything here is pure torch and never imports verl.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from verl_stable.routing.checks import require_int

__all__ = [
    "AlignedRows",
    "padded_layout",
    "packed_layout",
    "ulysses_shard",
    "unshard_ulysses",
    "unpad_rows",
    "rows_from_padded_layout",
    "rows_with_data",
    "select_layers",
    "scatter_layers",
    "lengths_from_cu_seqlens",
]


@dataclass(frozen=True)
class AlignedRows:
    """Routing rows in the order a router sees tokens, and which of them hold routing.

    Attributes:
        ids: ``[N, L, K]`` integer expert ids, row ``n`` is the ``n``-th token row the router sees. Rows
            without data hold zeros.
        has_data: ``[N]`` bool, False where the row has no routing (pad token or unrecorded token).
    """

    ids: torch.Tensor
    has_data: torch.Tensor

    def __post_init__(self) -> None:
        _check_rows(self.ids, "AlignedRows.ids")
        if not isinstance(self.has_data, torch.Tensor):
            raise TypeError(f"AlignedRows.has_data must be a bool tensor, got {type(self.has_data).__name__}")
        if self.ids.dim() != 3:
            raise ValueError(f"AlignedRows.ids must be [rows, layers, top_k], got shape {tuple(self.ids.shape)}")
        if self.has_data.shape != self.ids.shape[:1] or self.has_data.dtype != torch.bool:
            raise ValueError(
                f"AlignedRows.has_data must be a bool [{self.ids.shape[0]}] mask, got "
                f"{self.has_data.dtype} {tuple(self.has_data.shape)}"
            )

    @property
    def num_rows(self) -> int:
        return int(self.ids.shape[0])

    @property
    def num_missing(self) -> int:
        """Rows without routing data (they keep the model's own routing when replayed)."""
        return int((~self.has_data).sum().item())

    def token_rows(self) -> torch.Tensor:
        """``[num rows with data, L, K]``: the ids of the rows that hold data, in router order."""
        return self.ids[self.has_data]


def _int(value: Any, what: str, minimum: int | None = 0) -> int:
    """An integer argument: TypeError for a float / bool / other type, ValueError below ``minimum``."""
    out = require_int(value, what, error=TypeError)
    if minimum is not None and out < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {out}")
    return out


def _require_integer_tensor(value: Any, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.is_nested:
        raise TypeError(f"{name} must be a dense torch.Tensor, got {type(value).__name__}")
    if value.dtype.is_floating_point or value.dtype == torch.bool or value.is_complex():
        raise TypeError(f"{name} must hold integers, got dtype {value.dtype}")
    return value


def _check_rows(rows: torch.Tensor, name: str = "rows") -> None:
    if not isinstance(rows, torch.Tensor) or rows.is_nested:
        raise TypeError(f"{name} must be a dense torch.Tensor, got {type(rows).__name__}")
    if rows.dim() != 3:
        raise ValueError(f"{name} must be [tokens, layers, top_k], got shape {tuple(rows.shape)}")
    if rows.dtype.is_floating_point or rows.dtype == torch.bool or rows.is_complex():
        raise TypeError(f"{name} must hold integer expert ids, got dtype {rows.dtype}")


def _check_cu_seqlens(cu_seqlens: torch.Tensor, total: int | None) -> torch.Tensor:
    _require_integer_tensor(cu_seqlens, "cu_seqlens")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [batch + 1], got shape {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.to(device="cpu", dtype=torch.long)
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(cu[0])}")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu.tolist()}")
    if total is not None and int(cu[-1]) != total:
        raise ValueError(
            f"cu_seqlens ends at {int(cu[-1])} tokens but the routing holds {total} rows: the routing rows do "
            "not belong to this micro-batch's input_ids"
        )
    return cu


def lengths_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-sample lengths ``len_b = cu[b + 1] - cu[b]`` as a CPU LongTensor."""
    cu = _check_cu_seqlens(cu_seqlens, None)
    return cu[1:] - cu[:-1]


def _default_has_data(rows: torch.Tensor, has_data: torch.Tensor | None) -> torch.Tensor:
    if has_data is None:
        return torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
    if not isinstance(has_data, torch.Tensor) or has_data.is_nested:
        raise TypeError(f"has_data must be a bool tensor, got {type(has_data).__name__}")
    if has_data.shape != rows.shape[:1]:
        raise ValueError(f"has_data must be [{rows.shape[0]}], got {tuple(has_data.shape)}")
    _require_zero_one(has_data, "has_data")
    return has_data.to(device=rows.device, dtype=torch.bool)


def _require_zero_one(mask: torch.Tensor, name: str) -> None:
    """A mask holds only 0 and 1 (bool, integer or float): 0.5 or 2 would be read as True."""
    if mask.is_complex():
        raise TypeError(f"{name} must be a 0/1 mask, got dtype {mask.dtype}")
    if mask.dtype != torch.bool and bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(f"{name} must hold only 0 and 1 (or True/False)")


def _append_missing(rows: AlignedRows, count: int) -> AlignedRows:
    count = _int(count, "pad size")
    if count == 0:
        return rows
    ids = torch.cat([rows.ids, rows.ids.new_zeros((count, *rows.ids.shape[1:]))])
    has_data = torch.cat([rows.has_data, rows.has_data.new_zeros(count)])
    return AlignedRows(ids, has_data)


def packed_layout(
    rows: torch.Tensor,
    cu_seqlens: torch.Tensor,
    static_pad: int = 0,
    has_data: torch.Tensor | None = None,
) -> AlignedRows:
    """Rows of a padding-removed (packed) micro-batch: all valid tokens, then ``static_pad`` pad rows.

    Args:
        rows: ``[total_nnz, L, K]`` routing of the micro-batch's valid tokens, sample after sample.
        cu_seqlens: ``[B + 1]`` sample boundaries of ``rows`` (``input_ids.offsets()``); only checked.
        static_pad: pad tokens verl appends to the packed sequence (``pad_to_length``), before any Ulysses pad.
        has_data: optional ``[total_nnz]`` mask of rows that hold routing (default: all).

    Returns:
        ``AlignedRows`` of ``total_nnz + static_pad`` rows.
    """
    _check_rows(rows)
    _check_cu_seqlens(cu_seqlens, rows.shape[0])
    static_pad = _int(static_pad, "static_pad")
    return _append_missing(AlignedRows(rows, _default_has_data(rows, has_data)), static_pad)


def ulysses_shard(rows: AlignedRows, sp_size: int, sp_rank: int) -> tuple[AlignedRows, int]:
    """The rows Ulysses rank ``sp_rank`` of ``sp_size`` sees of a packed sequence.

    The packed sequence of ``n`` rows is right-padded with ``p = (sp - n mod sp) mod sp`` rows, then split in
    ``sp`` contiguous chunks of ``(n + p) / sp`` rows; rank ``r`` gets chunk ``r``.

    Returns:
        (the rank's rows, ``p``), ``p`` being the number of pad rows appended to the global sequence.
    """
    if not isinstance(rows, AlignedRows):
        raise TypeError(f"ulysses_shard needs AlignedRows (from packed_layout), got {type(rows).__name__}")
    sp_size = _int(sp_size, "sp_size", minimum=1)
    sp_rank = _int(sp_rank, "sp_rank", minimum=None)
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank must be in [0, {sp_size}), got {sp_rank}")
    if sp_size == 1:
        return rows, 0
    pad = (sp_size - rows.num_rows % sp_size) % sp_size
    padded = _append_missing(rows, pad)
    chunk = padded.num_rows // sp_size
    window = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
    return AlignedRows(padded.ids[window], padded.has_data[window]), pad


def unshard_ulysses(shards: Sequence[torch.Tensor], pad: int) -> torch.Tensor:
    """Inverse of :func:`ulysses_shard` for per-rank tensors: concatenate ranks, drop the ``pad`` tail rows."""
    shards = list(shards)
    if not shards:
        raise ValueError("unshard_ulysses needs at least one shard")
    for i, shard in enumerate(shards):
        if not isinstance(shard, torch.Tensor) or shard.is_nested or shard.dim() < 1:
            raise TypeError(
                f"Ulysses shard {i} must be a dense tensor with a row dimension, got {type(shard).__name__}"
            )
        if shard.shape[1:] != shards[0].shape[1:] or shard.dtype != shards[0].dtype:
            raise ValueError(
                f"Ulysses shard {i} is {shard.dtype} {tuple(shard.shape)}, shard 0 {shards[0].dtype} "
                f"{tuple(shards[0].shape)}: every shard must have the same row shape and dtype"
            )
    sizes = {int(s.shape[0]) for s in shards}
    if len(sizes) != 1:
        raise ValueError(f"every Ulysses shard must have the same number of rows, got {sorted(sizes)}")
    full = torch.cat(shards)
    pad = _int(pad, "pad")
    if not 0 <= pad <= full.shape[0]:
        raise ValueError(f"pad must be in [0, {full.shape[0]}], got {pad}")
    return full[: full.shape[0] - pad]


def padded_layout(
    rows: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seq_len: int | None = None,
    has_data: torch.Tensor | None = None,
) -> AlignedRows:
    """Rows of a right-padded micro-batch ``[B, S_max]`` flattened row-major (``use_remove_padding=False``).

    Router row ``b * S_max + t`` is packed row ``cu[b] + t`` when ``t < len_b``, a pad row otherwise.

    Args:
        rows: ``[total_nnz, L, K]`` routing of the valid tokens, sample after sample.
        cu_seqlens: ``[B + 1]`` sample boundaries of ``rows``.
        max_seq_len: padded width ``S_max`` (default: the longest sample, as verl's FSDP engine uses).
        has_data: optional ``[total_nnz]`` mask of rows that hold routing (default: all).
    """
    _check_rows(rows)
    cu = _check_cu_seqlens(cu_seqlens, rows.shape[0])
    lengths = cu[1:] - cu[:-1]
    batch = lengths.numel()
    longest = int(lengths.max()) if batch else 0
    width = longest if max_seq_len is None else _int(max_seq_len, "max_seq_len")
    if width < longest:
        raise ValueError(f"max_seq_len={width} is shorter than the longest sample ({int(lengths.max())} tokens)")
    source_has_data = _default_has_data(rows, has_data)
    position = torch.arange(width).unsqueeze(0)
    valid = position < lengths.unsqueeze(1)  # [B, S_max]
    source = (cu[:-1].unsqueeze(1) + position)[valid]  # packed index of each valid padded cell
    flat_valid = valid.reshape(-1).to(rows.device)
    ids = rows.new_zeros((batch * width, *rows.shape[1:]))
    ids[flat_valid] = rows[source.to(rows.device)]
    mask = torch.zeros(batch * width, dtype=torch.bool, device=rows.device)
    mask[flat_valid] = source_has_data[source.to(rows.device)]
    return AlignedRows(ids, mask)


def rows_from_padded_layout(flat_rows: torch.Tensor, cu_seqlens: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """Inverse of :func:`padded_layout`: keep the valid cells of a flattened ``[B * S_max, ...]`` tensor.

    Returns:
        ``[total_nnz, ...]`` rows, sample after sample.
    """
    if not isinstance(flat_rows, torch.Tensor) or flat_rows.is_nested or flat_rows.dim() < 1:
        raise TypeError(f"flat_rows must be a dense tensor [B * S_max, ...], got {type(flat_rows).__name__}")
    cu = _check_cu_seqlens(cu_seqlens, None)
    lengths = cu[1:] - cu[:-1]
    batch = lengths.numel()
    max_seq_len = _int(max_seq_len, "max_seq_len")
    if batch and int(lengths.max()) > max_seq_len:
        raise ValueError(f"max_seq_len={max_seq_len} is shorter than the longest sample ({int(lengths.max())} tokens)")
    if flat_rows.shape[0] != batch * max_seq_len:
        raise ValueError(
            f"expected {batch} x {max_seq_len} = {batch * max_seq_len} router rows, got {flat_rows.shape[0]}"
        )
    valid = (torch.arange(max_seq_len).unsqueeze(0) < lengths.unsqueeze(1)).reshape(-1)
    return flat_rows[valid.to(flat_rows.device)]


def unpad_rows(padded: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Left/right padded per-position routing ``[B, S, L, K]`` -> packed valid rows, like verl's ``unpad_input``.

    verl's legacy trainer stores ``routed_experts`` aligned with ``input_ids`` = left-padded prompt + right-padded
    response; a token is valid where ``attention_mask`` is 1. The packed order is row-major over the valid cells.

    Returns:
        (``[total_nnz, L, K]`` rows, ``[B + 1]`` cu_seqlens).
    """
    if not isinstance(padded, torch.Tensor) or padded.is_nested:
        raise TypeError(f"padded routing must be a dense tensor, got {type(padded).__name__}")
    if padded.dim() != 4:
        raise ValueError(f"padded routing must be [batch, seq, layers, top_k], got shape {tuple(padded.shape)}")
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.is_nested:
        raise TypeError(f"attention_mask must be a dense tensor, got {type(attention_mask).__name__}")
    if attention_mask.shape != padded.shape[:2]:
        raise ValueError(
            f"attention_mask {tuple(attention_mask.shape)} does not match routing [batch, seq] "
            f"{tuple(padded.shape[:2])}"
        )
    _require_zero_one(attention_mask, "attention_mask")
    valid = attention_mask.to(device=padded.device).bool()
    lengths = valid.sum(dim=1).to(device="cpu", dtype=torch.long)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(lengths, 0)
    return padded[valid], cu


def rows_with_data(ids: torch.Tensor) -> torch.Tensor:
    """Which (token, MoE layer) rows hold real routing, judged from the ids alone.

    Rollout engines leave unrecorded tokens (the last sampled token, tool output, anything after the last
    generation) as zero rows and verl pads with zero rows. A genuine top-k choice with ``K >= 2`` never repeats an
    expert, so row ``(n, l)`` is taken to hold data iff ``ids[n, l]`` has ``K`` distinct experts. With ``K == 1``
    repetition cannot be seen; a token is then taken to hold no data only when it is zero in every layer.

    Args:
        ids: ``[N, L, K]`` expert ids over MoE layers only (dense layers removed, see :func:`select_layers`).

    Returns:
        ``[N, L]`` bool.
    """
    _check_rows(ids, "ids")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        return torch.ones(ids.shape[:2], dtype=torch.bool, device=ids.device)
    k = ids.shape[2]
    if k == 1:
        return (ids != 0).flatten(1).any(dim=1, keepdim=True).expand(ids.shape[:2]).clone()
    if k > 16:
        ordered, _ = ids.sort(dim=-1)
        return ~(ordered[..., 1:] == ordered[..., :-1]).any(dim=-1)
    # pairwise compares of contiguous top-k columns: several times faster than sorting every row at small K
    # (benchmarks/bench_actor_routing.py)
    cols = ids.movedim(2, 0).contiguous()
    repeated = torch.zeros(ids.shape[:2], dtype=torch.bool, device=ids.device)
    for i in range(k - 1):
        for j in range(i + 1, k):
            repeated |= cols[i] == cols[j]
    return ~repeated


def select_layers(rows: torch.Tensor, moe_layers: Sequence[int]) -> torch.Tensor:
    """Absolute decoder-layer routing ``[N, num_hidden_layers, K]`` -> MoE-layer ordinal ``[N, len(moe_layers), K]``."""
    _check_rows(rows)
    layers = _layer_list(moe_layers)
    if any(not 0 <= layer < rows.shape[1] for layer in layers):
        raise ValueError(
            f"MoE layers {layers} do not fit routing with {rows.shape[1]} decoder layers: expected routing indexed "
            "by absolute decoder layer over num_hidden_layers"
        )
    return rows[:, layers]


def scatter_layers(rows: torch.Tensor, moe_layers: Sequence[int], num_hidden_layers: int) -> torch.Tensor:
    """MoE-layer ordinal routing ``[N, M, K]`` -> absolute decoder layers ``[N, num_hidden_layers, K]``, dense = 0."""
    _check_rows(rows)
    layers = _layer_list(moe_layers)
    num_hidden_layers = _int(num_hidden_layers, "num_hidden_layers", minimum=1)
    if len(layers) != rows.shape[1]:
        raise ValueError(f"routing has {rows.shape[1]} MoE layers but {len(layers)} MoE layer indices were given")
    if any(not 0 <= layer < num_hidden_layers for layer in layers):
        raise ValueError(f"MoE layers {layers} out of range for num_hidden_layers={num_hidden_layers}")
    out = rows.new_zeros((rows.shape[0], num_hidden_layers, rows.shape[2]))
    out[:, layers] = rows
    return out


def _layer_list(moe_layers: Sequence[int]) -> list[int]:
    """Distinct integer layer indices (a repeated layer would be selected twice or scattered over itself)."""
    if isinstance(moe_layers, (str, bytes)) or not isinstance(moe_layers, (Sequence, torch.Tensor)):
        raise TypeError(f"moe_layers must be a sequence of integers, got {type(moe_layers).__name__}")
    layers = [_int(layer, "moe_layers entry", minimum=None) for layer in list(moe_layers)]
    if len(set(layers)) != len(layers):
        raise ValueError(f"moe_layers must be distinct, got {layers}")
    return layers
