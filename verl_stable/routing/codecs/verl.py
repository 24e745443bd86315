"""verl 0.9.1 codec: ``routed_experts`` per sample and per batch.

int16 ``[prompt_len + response_len, num_hidden_layers, top_k]`` per sample, zero rows where nothing was recorded,
stacked either left/right padded to a fixed width (dense, with an ``attention_mask``) or as a jagged tensor. A sample
of zero tokens is a sample with zero rows; more than 32768 experts do not fit int16 and are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from verl_stable.routing.checks import count
from verl_stable.routing.codecs.common import (
    LayerMapError,
    RoutedRows,
    RoutingFormatError,
    RowCountError,
    _check_wire_width,
    _empty_rows,
    _finish,
    _full_rows,
    _require_layout,
    _select_moe_layers,
    _wire_ids,
    validate_rows,
)
from verl_stable.routing.trace import RoutingLayout

_VERL_DTYPE = np.dtype(np.int16)


def encode_verl_sample(rows: RoutedRows, layout: RoutingLayout, total_length: int) -> torch.Tensor:
    """One sample in verl 0.9.1's layout: int16 ``[total_length, num_hidden_layers, top_k]``, zero where unrecorded.

    This is what verl's ``AgentLoopOutput.as_dict`` stores and its Megatron replay consumes. More than 32768 experts
    do not fit int16 and raise :class:`ExpertIdRangeError`.
    """
    layout = _require_layout(layout)
    total_length = count(total_length, "verl: total_length")
    _check_wire_width(_VERL_DTYPE, layout, "verl routed_experts")
    validate_rows(rows, layout, "encode_verl_sample")
    if rows.num_rows and rows.stop > total_length:
        raise RowCountError(f"routing covers positions up to {rows.stop}, the sequence has {total_length} tokens")
    out = torch.zeros(total_length, layout.num_hidden_layers, layout.top_k, dtype=torch.int16)
    if rows.num_rows:
        out[rows.start : rows.stop] = torch.from_numpy(_full_rows(rows, layout, _VERL_DTYPE))
    return out


def decode_verl_sample(routed_experts: Any, layout: RoutingLayout, *, num_tokens: int | None = None) -> RoutedRows:
    """Decode one sample of verl's layout ``[seq, num_hidden_layers, top_k]`` (token-aligned, zero = unrecorded).

    Leading and trailing positions whose MoE layers are all zero are unrecorded (verl zero-fills them); they are
    dropped so that ``start``/``stop`` bound the recorded rows. Zero rows in between are refused by validation.
    A sample of zero tokens (or with nothing recorded) decodes to zero rows.

    Args:
        routed_experts: the sample's tensor, positions aligned with its prompt + response tokens.
        layout: the model's layer layout.
        num_tokens: real tokens of the sample; rows past it must be zero (padding).
    """
    layout = _require_layout(layout)
    full = _wire_ids(routed_experts, layout, "verl routed_experts")
    if full.ndim != 3:
        raise LayerMapError(f"verl: expected [rows, num_hidden_layers, top_k], got shape {tuple(full.shape)}")
    if num_tokens is not None:
        num_tokens = count(num_tokens, "verl: num_tokens")
        if num_tokens > full.shape[0]:
            raise RowCountError(f"verl: {full.shape[0]} rows for a {num_tokens}-token sample")
        if full[num_tokens:].any():
            raise RowCountError(f"verl: routing found past the sample's {num_tokens} tokens (padding misaligned)")
        full = full[:num_tokens]
    moe = _select_moe_layers(full, layout, 0, "verl")
    recorded = np.flatnonzero(moe.any(axis=(1, 2)))
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
    layout = _require_layout(layout)
    _check_wire_width(_VERL_DTYPE, layout, "verl routed_experts")
    samples, lengths = list(samples), [count(n, f"verl: length of sample {i}") for i, n in enumerate(lengths)]
    if len(samples) != len(lengths):
        raise RowCountError(f"{len(samples)} samples but {len(lengths)} lengths")
    per_sample = [encode_verl_sample(s, layout, n) for s, n in zip(samples, lengths, strict=True)]
    if nested:
        if not per_sample:
            raise RowCountError("an empty batch has no nested (jagged) form; pass nested=False")
        return torch.nested.as_nested_tensor(per_sample, layout=torch.jagged)
    pads = [0] * len(samples) if left_pad is None else [count(p, f"verl: left pad {i}") for i, p in enumerate(left_pad)]
    if len(pads) != len(samples):
        raise RowCountError(f"{len(samples)} samples but {len(pads)} left pads")
    ends = [p + n for p, n in zip(pads, lengths, strict=True)]
    width = (max(ends) if ends else 0) if width is None else count(width, "verl: width")
    out = torch.zeros(len(samples), width, layout.num_hidden_layers, layout.top_k, dtype=torch.int16)
    for i, (tensor, pad) in enumerate(zip(per_sample, pads, strict=True)):
        if pad + tensor.shape[0] > width:
            raise RowCountError(f"sample {i}: left pad {pad} + {tensor.shape[0]} tokens exceed width {width}")
        out[i, pad : pad + tensor.shape[0]] = tensor
    return out


def _real_span(mask_row: torch.Tensor, i: int) -> tuple[int, int]:
    """``[first, last)`` of a 0/1 attention-mask row whose ones are contiguous (``(0, 0)`` when none)."""
    real = torch.nonzero(mask_row).flatten()
    if real.numel() == 0:
        return 0, 0
    first, last = int(real[0]), int(real[-1]) + 1
    if real.numel() != last - first:
        raise RowCountError(f"sample {i}: attention_mask has gaps between positions {first} and {last - 1}")
    return first, last


def decode_verl_batch(
    routed_experts: torch.Tensor,
    layout: RoutingLayout,
    *,
    attention_mask: torch.Tensor | None = None,
) -> list[RoutedRows]:
    """Decode verl's batch layout (nested, or dense with ``attention_mask`` marking the real tokens).

    A sample without real tokens (an all-zero mask row, an empty nested sample) decodes to zero rows.
    """
    layout = _require_layout(layout)
    if not isinstance(routed_experts, torch.Tensor):
        raise RoutingFormatError(f"verl routed_experts: expected a torch.Tensor, got {type(routed_experts).__name__}")
    if routed_experts.is_nested:
        return [decode_verl_sample(t, layout) for t in routed_experts.unbind()]
    if routed_experts.dim() != 4:
        raise LayerMapError(
            f"verl routed_experts: expected [batch, seq, num_hidden_layers, top_k], got {tuple(routed_experts.shape)}"
        )
    _wire_ids(routed_experts[:0], layout, "verl routed_experts")  # dtype before any position check
    if attention_mask is None:
        raise RowCountError("a dense verl routed_experts batch needs attention_mask to locate each sample's tokens")
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.is_nested:
        raise RowCountError(f"attention_mask must be a dense tensor, got {type(attention_mask).__name__}")
    if attention_mask.shape != routed_experts.shape[:2]:
        raise RowCountError(
            f"attention_mask {tuple(attention_mask.shape)} does not match routed_experts {tuple(routed_experts.shape)}"
        )
    if attention_mask.is_complex() or bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        raise RowCountError("attention_mask must hold only 0 and 1")
    out = []
    for i in range(routed_experts.shape[0]):
        first, last = _real_span(attention_mask[i], i)
        if routed_experts[i, :first].any() or routed_experts[i, last:].any():
            raise RowCountError(f"sample {i}: routing found on padding positions (misaligned padding)")
        out.append(decode_verl_sample(routed_experts[i, first:last], layout))
    return out
