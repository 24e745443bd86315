"""Rollout-model precision: fp32, bf16, fp16, and fp8 weights computed in bf16.

The CPU stand-in for "FP8 inference, BF16 training": the rollout model is a copy of the policy at a chosen precision,
so sampling and training differ numerically in a real way (and MoE routing decisions flip).

fp8 weights: every 2-D (or fused 3-D expert) weight of the decoder layers is quantised to float8 e4m3 with one scale
per output row, ``s_r = max_j |W_rj| / 448`` (448 = largest finite e4m3), ``Q = cast_e4m3(W / s_r)``, and dequantised
to ``W_hat = Q * s_r`` in bf16 for compute -- numerically what a weight-only fp8 kernel computes. Embeddings, norms,
the LM head and MoE routers stay in bf16 (as vLLM's fp8 path keeps them unquantised).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
_ALIASES = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp8": "fp8",
    "float8": "fp8",
    "fp8_e4m3": "fp8",
}
COMPUTE_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)


def canonical_precision(name: str) -> str:
    """Map a precision name or alias (``bfloat16``, ``float8`` ...) to one of :data:`PRECISIONS`.

    Raises:
        ValueError: naming the unknown precision and the accepted ones.
    """
    key = str(name).strip().lower()
    if key not in _ALIASES:
        raise ValueError(
            f"unknown rollout precision {name!r}; expected one of {PRECISIONS} (or aliases {sorted(_ALIASES)})"
        )
    return _ALIASES[key]


def quantize_fp8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``weight`` [..., out, in] to float8 e4m3 with one fp32 scale per output row.

    Returns:
        ``(q, scale)``: ``q`` float8_e4m3fn with ``weight``'s shape, ``scale`` fp32 [..., out, 1], such that
        ``q.float() * scale`` approximates ``weight``. All-zero rows get scale 1.
    """
    if weight.dim() < 2:
        raise ValueError(f"fp8 row quantisation needs a [..., out, in] weight, got shape {tuple(weight.shape)}")
    w = weight.detach().float()
    amax = w.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_rows`: ``q * scale`` in ``dtype``."""
    return (q.float() * scale).to(dtype)


def fp8_weight_names(model: nn.Module) -> list[str]:
    """Names of the parameters fp8 applies to: decoder-layer matmul weights except routers and norms."""
    names = []
    for name, param in model.named_parameters():
        if ".layers." not in name or param.dim() < 2:
            continue
        if "norm" in name or name.endswith(("mlp.gate.weight", "mlp.router.weight", "shared_expert_gate.weight")):
            continue
        names.append(name)
    return names


@torch.no_grad()
def apply_precision_(model: nn.Module, precision: str) -> nn.Module:
    """Cast ``model`` in place to ``precision`` (fp8: fake-quantised weights in bf16). Returns the model."""
    precision = canonical_precision(precision)
    dtype = COMPUTE_DTYPE[precision]
    # Quantise from the incoming (full-precision) values, then cast: no bf16 rounding before fp8 rounding.
    quantised = {}
    if precision == "fp8":
        params = dict(model.named_parameters())
        quantised = {
            n: dequantize_fp8_rows(*quantize_fp8_rows(params[n]), dtype=dtype) for n in fp8_weight_names(model)
        }
    model.to(dtype)
    params = dict(model.named_parameters())
    for name, value in quantised.items():
        params[name].copy_(value)
    return model


def precision_copy(model: nn.Module, precision: str) -> nn.Module:
    """A deep copy of ``model`` at ``precision`` (the original is untouched)."""
    return apply_precision_(copy.deepcopy(model), precision)
