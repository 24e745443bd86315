"""Packed (THD) core attention for Megatron's local layer spec, so verl's Megatron engine runs on CPU.

verl's Megatron engine packs every micro-batch (``verl.models.mcore.util.preprocess_thd_engine``): the samples'
tokens are concatenated into one row and their boundaries travel as a ``PackedSeqParams`` with ``qkv_format="thd"``
and ``cu_seqlens_*``. Only Transformer Engine's attention implements that format; the local spec's
``megatron.core.transformer.dot_product_attention.DotProductAttention`` (the only core attention without TE, i.e.
on CPU) asserts ``packed_seq_params is None``.

:class:`PackedDotProductAttention` subclasses it (same constructor and ``forward`` signature, same attributes and
sharded state dict), so it drops into the local layer spec's ``core_attention`` slot:

* with ``packed_seq_params`` (THD) it attends causally within each packed sequence, per-sequence
  ``scaled_dot_product_attention`` (memory ``O(sum_i s_i^2)``, not ``O(T^2)`` as a dense block mask would be);
* without, it is megatron's own ``DotProductAttention.forward`` (which on CPU needs the CPU runtime's fixes for the
  global memory buffer's and ``get_default_causal_mask``'s hard-coded CUDA device).

What it does not implement it refuses with a ``ValueError`` naming the argument, never approximates.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from verl_stable.compat import contracts
from verl_stable.compat.contracts import Contract, ContractError, ContractResult

__all__ = ["CONTRACTS", "PackedDotProductAttention", "check_contracts", "packed_causal_attention"]

# Mask types whose THD meaning is "causal within each packed sequence": padding is already expressed by cu_seqlens.
_CAUSAL_MASK_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)


def _as_offsets(name: str, cu_seqlens: torch.Tensor) -> list[int]:
    """Validate a cumulative-length tensor and return it as Python ints (``[0, c_1, ..., c_B]``, non-decreasing)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"packed_seq_params.{name} must be 1-D with at least 2 entries, got {tuple(cu_seqlens.shape)}")
    offsets = [int(x) for x in cu_seqlens.tolist()]
    if offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:], strict=False)):
        raise ValueError(f"packed_seq_params.{name} must start at 0 and not decrease, got {offsets}")
    return offsets


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is None or b is None or torch.equal(a.cpu(), b.cpu())


def packed_segments(packed_seq_params: PackedSeqParams, num_tokens: int) -> list[tuple[int, int, int]]:
    """The packed sequences of a THD micro-batch as ``(start, length, padded_length)`` rows.

    Follows Transformer Engine's THD convention: sequence ``i`` has ``cu_seqlens_q[i+1] - cu_seqlens_q[i]`` real
    tokens starting at ``cu_seqlens_q_padded[i]`` (``cu_seqlens_q[i]`` when no padded offsets are given); the rest of
    its padded slot, up to ``cu_seqlens_q_padded[i+1]``, is padding. verl passes its padded offsets as both (so each
    slot's alignment padding is attended as the tail of its sequence, which causality keeps invisible to the real
    tokens).

    Args:
        packed_seq_params: the micro-batch's packing (self-attention: the key offsets must equal the query offsets).
        num_tokens: ``T``, the packed length of query/key/value; must equal the last (padded) offset.

    Returns:
        One ``(start, length, padded_length)`` per sequence, covering ``[0, T)`` in order.

    Raises:
        ValueError: missing or malformed offsets, key offsets different from query offsets, or offsets that do not
            cover exactly ``T`` tokens.
    """
    p = packed_seq_params
    if p.cu_seqlens_q is None:
        raise ValueError("packed_seq_params.cu_seqlens_q is required for qkv_format='thd'")
    if not (_same(p.cu_seqlens_q, p.cu_seqlens_kv) and _same(p.cu_seqlens_q_padded, p.cu_seqlens_kv_padded)):
        raise ValueError(
            "packed_seq_params.cu_seqlens_kv(_padded) differ from cu_seqlens_q(_padded): only self-attention over "
            "the same packed tokens is implemented"
        )
    offsets = _as_offsets("cu_seqlens_q", p.cu_seqlens_q)
    padded = offsets if p.cu_seqlens_q_padded is None else _as_offsets("cu_seqlens_q_padded", p.cu_seqlens_q_padded)
    if len(padded) != len(offsets):
        raise ValueError(
            f"packed_seq_params.cu_seqlens_q_padded has {len(padded)} entries, cu_seqlens_q {len(offsets)}"
        )
    if padded[-1] != num_tokens:
        name = "cu_seqlens_q" if p.cu_seqlens_q_padded is None else "cu_seqlens_q_padded"
        raise ValueError(f"packed_seq_params.{name} ends at {padded[-1]} but the packed query has {num_tokens} tokens")
    rows = []
    for i in range(len(offsets) - 1):
        length, slot = offsets[i + 1] - offsets[i], padded[i + 1] - padded[i]
        if length > slot:
            raise ValueError(
                f"packed_seq_params: sequence {i} has {length} tokens but a padded slot of {slot} (cu_seqlens_q_padded)"
            )
        rows.append((padded[i], length, slot))
    return rows


def packed_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: list[tuple[int, int, int]],
    scale: float,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal softmax attention within each packed sequence of a THD batch.

    For sequence ``(start, n, slot)``, token ``start + t`` (``t < n``) attends to ``start .. start + t``::

        out_t = sum_{s <= t} softmax_s(scale * q_t . k_s) v_s

    with query head ``h`` reading key/value group ``h // (H / G)`` (megatron's ``repeat_interleave`` GQA layout).
    The ``slot - n`` padding tokens after each sequence get zero output (and so no gradient), as in Transformer
    Engine's padded THD format.

    Args:
        query: ``[T, H, D]``.
        key: ``[T, G, D]``, ``G`` dividing ``H``.
        value: ``[T, G, D]``.
        segments: :func:`packed_segments`.
        scale: the softmax scale applied to ``q . k``.
        dropout_p: attention-probability dropout (0 outside training).

    Returns:
        ``[T, H, D]`` in ``query``'s dtype.
    """
    heads, groups = query.shape[1], key.shape[1]
    if groups != heads:
        key = key.repeat_interleave(heads // groups, dim=1)
        value = value.repeat_interleave(heads // groups, dim=1)
    pieces = []
    for start, length, slot in segments:
        if length:
            q, k, v = (t[start : start + length].transpose(0, 1) for t in (query, key, value))  # [H, n, D]
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale
            )
            pieces.append(out.transpose(0, 1))
        if slot > length:
            pieces.append(query.new_zeros(slot - length, heads, query.shape[2]))
    if not pieces:
        return query.new_zeros(query.shape)
    return torch.cat(pieces, dim=0)


class PackedDotProductAttention(DotProductAttention):
    """megatron's local ``DotProductAttention`` plus the packed (THD) format verl's Megatron engine uses.

    Constructed exactly like the original (the layer spec passes the same arguments), so every attribute the rest of
    megatron reads (per-partition heads under tensor parallelism, ``softmax_scale``, ``attention_dropout``,
    ``softmax_offset``, the sharded state dict) is the original's.

    Raises:
        ValueError: ``config.context_parallel_size > 1`` (the original asserts the same; THD under context
            parallelism would need a ring / all-gather attention this class does not have).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any | None = None,
    ) -> None:
        if config.context_parallel_size != 1:
            raise ValueError(
                f"PackedDotProductAttention: context_parallel_size={config.context_parallel_size} is not implemented "
                "(only 1)"
            )
        super().__init__(
            config=config,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type=attention_type,
            attention_dropout=attention_dropout,
            softmax_scale=softmax_scale,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )

    @property
    def effective_softmax_scale(self) -> float:
        """The factor on ``q . k`` before the softmax: megatron divides ``softmax_scale`` by the layer number under
        ``apply_query_key_layer_scaling`` and multiplies it back inside its softmax; the product is what counts."""
        return self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Core attention, packed or not.

        Args:
            query: THD ``[T, H/p, D]`` (``SelfAttention`` squeezes the dummy batch dimension); otherwise ``[s, b,
                H/p, D]``.
            key: ``[T, G/p, D]`` / ``[s, b, G/p, D]``.
            value: like ``key``.
            attention_mask: must be None for THD (the packing is the mask); the original's mask otherwise.
            attn_mask_type: overrides the layer's mask type for THD (causal or padding_causal); the original ignores
                it.
            attention_bias: not implemented (neither does the original).
            packed_seq_params: THD packing, or None for the original's path.

        Returns:
            THD: ``[T, H/p * D]`` (what Transformer Engine returns; ``SelfAttention`` reshapes it to ``[T, 1, -1]``).
            Otherwise the original's ``[s, b, H/p * D]``.

        Raises:
            ValueError: an argument or configuration this class does not implement, named in the message.
        """
        if attention_bias is not None:
            raise ValueError("PackedDotProductAttention: attention_bias is not implemented")
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type)
        self._refuse_thd_unsupported(query, key, value, attention_mask, attn_mask_type, packed_seq_params)
        segments = packed_segments(packed_seq_params, query.shape[0])
        dropout_p = self.attention_dropout.p if self.training else 0.0
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            # As the original: attention dropout under tensor parallelism draws from the model-parallel RNG stream.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = packed_causal_attention(query, key, value, segments, self.effective_softmax_scale, dropout_p)
        else:
            out = packed_causal_attention(query, key, value, segments, self.effective_softmax_scale, dropout_p)
        return out.reshape(out.shape[0], -1)

    def _refuse_thd_unsupported(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None,
        p: PackedSeqParams,
    ) -> None:
        """Raise ValueError for every THD input or setting whose result this class would not compute exactly."""
        if p.qkv_format != "thd":
            raise ValueError(
                f"PackedDotProductAttention: packed_seq_params.qkv_format={p.qkv_format!r} is not implemented (only "
                "'thd')"
            )
        if (p.local_cp_size or 1) > 1:
            raise ValueError(f"PackedDotProductAttention: packed_seq_params.local_cp_size={p.local_cp_size} (only 1)")
        if attention_mask is not None:
            raise ValueError("PackedDotProductAttention: attention_mask with qkv_format='thd' is not implemented")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type not in _CAUSAL_MASK_TYPES:
            raise ValueError(
                f"PackedDotProductAttention: attn_mask_type={mask_type} is not implemented for THD (only causal, "
                "padding_causal)"
            )
        if self.scale_mask_softmax.window_size is not None:
            raise ValueError(
                f"PackedDotProductAttention: window_size={self.scale_mask_softmax.window_size} (sliding window) is "
                "not implemented for THD"
            )
        if self.softmax_offset is not None:
            raise ValueError(
                f"PackedDotProductAttention: softmax_type={self.config.softmax_type!r} is not implemented for THD "
                "(only 'vanilla')"
            )
        if query.dim() != 3 or key.dim() != 3 or value.shape != key.shape:
            raise ValueError(
                "PackedDotProductAttention: THD query/key/value must be [T, heads, dim] with value shaped like key, "
                f"got query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
            )
        heads, groups = query.shape[1], key.shape[1]
        if heads != self.num_attention_heads_per_partition or heads % groups or key.shape[0] != query.shape[0]:
            raise ValueError(
                f"PackedDotProductAttention: query {tuple(query.shape)} / key {tuple(key.shape)} do not fit "
                f"{self.num_attention_heads_per_partition} heads per partition with whole key/value groups"
            )


# ---------------------------------------------------------------------------------------------------------------------
# Contracts: what this class relies on in megatron-core beyond DotProductAttention's public signature.


def _self_attention_thd_layout() -> str:
    from megatron.core.transformer.attention import Attention

    src = inspect.getsource(Attention.forward)
    for needle in ("query.squeeze(1)", "core_attn_out.reshape(core_attn_out.size(0), 1, -1)"):
        if needle not in src:
            raise ContractError(f"Attention.forward no longer contains {needle!r} (THD layout around core attention)")
    return "Attention.forward squeezes THD q/k/v to [T, H, D] and reshapes core attention's output to [T, 1, -1]"


def _dot_product_attention_interface() -> str:
    params = list(inspect.signature(DotProductAttention.forward).parameters)
    expected = ["self", "query", "key", "value", "attention_mask", "attn_mask_type", "attention_bias"]
    if params != [*expected, "packed_seq_params"]:
        raise ContractError(f"DotProductAttention.forward parameters changed: {params}")
    src = inspect.getsource(DotProductAttention.__init__)
    for attr in ("self.softmax_scale", "self.scale_mask_softmax", "self.attention_dropout", "self.softmax_offset"):
        if attr not in src:
            raise ContractError(f"DotProductAttention.__init__ no longer sets {attr}")
    fields = set(getattr(PackedSeqParams, "__dataclass_fields__", {}))
    missing = {"qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "local_cp_size"} - fields
    if missing:
        raise ContractError(f"PackedSeqParams lacks {sorted(missing)}")
    return "DotProductAttention.forward signature, its scale/softmax/dropout attributes and PackedSeqParams fields"


CONTRACTS: tuple[Contract, ...] = (
    Contract(
        "megatron_thd_layout", "megatron SelfAttention's THD shapes around core attention", _self_attention_thd_layout
    ),
    Contract(
        "megatron_dot_product_attention",
        "megatron DotProductAttention / PackedSeqParams interface",
        _dot_product_attention_interface,
    ),
)


def check_contracts(names: tuple[str, ...] | list[str] | None = None) -> list[ContractResult]:
    """Run this module's contracts (all by default); never raises."""
    return contracts.check(CONTRACTS, names)
