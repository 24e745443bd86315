"""Rollout-model numerics: fp32, bf16, fp16, fp8 weights, fp8 weights + activations, int4 weights; router perturbation.

The CPU stand-in for "FP8 inference, BF16 training": the rollout model is a copy of the policy at a chosen precision,
so sampling and training differ numerically in a real way (and MoE routing decisions flip).

* ``fp8`` (weight-only, W8A16): every 2-D (or fused 3-D expert) weight of the decoder layers is quantised to float8
  e4m3 with one scale per output row, ``s_r = max_j |W_rj| / 448`` (448 = largest finite e4m3),
  ``Q = cast_e4m3(W / s_r)``, and dequantised to ``W_hat = Q * s_r`` in bf16 for compute -- numerically what a
  weight-only fp8 kernel computes.
* ``fp8_w8a8``: ``fp8`` weights, and the activations entering those matmuls fake-quantised to e4m3 with one scale per
  token (``s_t = max_j |x_tj| / 448``), as FP8 inference engines run dense and MoE layers (W8A8). Quantised inputs:
  every decoder ``nn.Linear`` with an fp8 weight, and the hidden states entering each routed-experts block (its
  gate/up matmul); the experts' intermediate activation (the down projection's input) stays bf16, and the router
  sees unquantised activations, as vLLM keeps the gate in high precision.
* ``int4`` (W4A16, the "int4/fp4-style" weight quantisation of weight-only 4-bit engines): the same weights,
  symmetric per output row with 16 levels, ``s_r = max_j |W_rj| / 7``, ``Q = clamp(round(W / s_r), -8, 7)``, bf16
  compute.

Embeddings, norms, the LM head and MoE routers stay in bf16 (as vLLM's fp8 path keeps them unquantised).

Router perturbation (:func:`router_perturbation`), separate from the precision and **not a numeric format**: an
inference-only, fixed Gaussian perturbation of every MoE router weight, ``W_g + sigma * rms(W_g) * E`` with ``E`` a
standard-normal matrix drawn once per router (seeded by its name, so every weight sync adds the same ``E`` and runs
reproduce). It stands in for the larger routing mismatch of a big MoE (the R3 paper measures ~10 % of router
decisions differing between FP8 inference and BF16 training on Qwen3-30B-A3B, where tiny models flip 0.5-4 %), and
is labelled as such wherever it is used.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "fp8_w8a8", "int4")
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
    "fp8_w8a8": "fp8_w8a8",
    "w8a8": "fp8_w8a8",
    "int4": "int4",
    "w4a16": "int4",
}
COMPUTE_DTYPE = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.bfloat16,
    "fp8_w8a8": torch.bfloat16,
    "int4": torch.bfloat16,
}
QUANTISED = ("fp8", "fp8_w8a8", "int4")
"""Precisions that quantise the decoder's matmul weights (:func:`quantized_weight_names`)."""
INT4_MAX = 7  # symmetric int4: levels -8..7, scale from the largest magnitude mapped to 7
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


def quantize_int4_rows(weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Fake-quantise ``weight`` [..., out, in] to symmetric int4 per output row, returned dequantised in ``dtype``.

    ``s_r = max_j |W_rj| / 7``, ``W_hat = clamp(round(W / s_r), -8, 7) * s_r``; all-zero rows stay zero.
    """
    if weight.dim() < 2:
        raise ValueError(f"int4 row quantisation needs a [..., out, in] weight, got shape {tuple(weight.shape)}")
    w = weight.detach().float()
    amax = w.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / INT4_MAX, torch.ones_like(amax))
    return ((w / scale).round().clamp(-INT4_MAX - 1, INT4_MAX) * scale).to(dtype)


def fake_quant_fp8_tokens(x: torch.Tensor) -> torch.Tensor:
    """Fake-quantise activations ``x`` [..., features] to e4m3 with one scale per token (row), in ``x``'s dtype."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return ((xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale).to(x.dtype)


def quantize_weight(weight: torch.Tensor, precision: str, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` as the rollout computes with it under ``precision`` (fp8 / fp8_w8a8 / int4), in ``dtype``."""
    if precision in ("fp8", "fp8_w8a8"):
        return dequantize_fp8_rows(*quantize_fp8_rows(weight), dtype=dtype)
    if precision == "int4":
        return quantize_int4_rows(weight, dtype)
    raise ValueError(f"precision {precision!r} does not quantise weights; quantising ones: {QUANTISED}")


def fp8_weight_names(model: nn.Module) -> list[str]:
    """Names of the parameters weight quantisation applies to: decoder-layer matmul weights except routers and norms.

    (The name is historical: fp8, fp8_w8a8 and int4 quantise the same weights.)
    """
    names = []
    for name, param in model.named_parameters():
        if ".layers." not in name or param.dim() < 2:
            continue
        if "norm" in name or is_router_weight(name) or name.endswith("shared_expert_gate.weight"):
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
    if precision in QUANTISED:
        params = dict(model.named_parameters())
        quantised = {n: quantize_weight(params[n], precision, dtype) for n in fp8_weight_names(model)}
    model.to(dtype)
    params = dict(model.named_parameters())
    for name, value in quantised.items():
        params[name].copy_(value)
    if precision == "fp8_w8a8":
        install_activation_quant(model)
    return model


ACT_QUANT_ATTR = "_verl_stable_fp8_act_quant"


def install_activation_quant(model: nn.Module) -> int:
    """Fake-quantise to fp8 (per token) the inputs of the decoder's quantised matmuls; returns the hooks added.

    Forward pre-hooks on every decoder ``nn.Linear`` whose weight is quantised and on every routed-experts block (its
    first positional input, the hidden states the gate/up projection multiplies). Idempotent: a module already hooked
    is skipped. Routers and the LM head keep unquantised inputs.
    """
    quantised = set(fp8_weight_names(model))
    added = 0

    def hook(_module: nn.Module, args: tuple) -> tuple:
        return (fake_quant_fp8_tokens(args[0]), *args[1:]) if args else args

    for name, module in model.named_modules():
        if getattr(module, ACT_QUANT_ATTR, False):
            continue
        is_linear = isinstance(module, nn.Linear) and f"{name}.weight" in quantised
        is_experts = name.endswith(".experts") and any(
            p.dim() == 3 and f"{name}.{pn}" in quantised for pn, p in module.named_parameters(recurse=False)
        )
        if is_linear or is_experts:
            module.register_forward_pre_hook(hook)
            setattr(module, ACT_QUANT_ATTR, True)
            added += 1
    return added


ROUTER_SUFFIXES = ("mlp.gate.weight", "mlp.router.weight", "block_sparse_moe.gate.weight")
"""MoE router weights of the HF families the project supports (none of them is quantised or activation-quantised)."""


def is_router_weight(name: str) -> bool:
    """Whether ``name`` is an MoE router's weight (Qwen-MoE ``mlp.gate``, Mixtral ``block_sparse_moe.gate``)."""
    return ".layers." in name and name.endswith(ROUTER_SUFFIXES)


def router_perturbation(name: str, weight: torch.Tensor, sigma: float) -> torch.Tensor:
    """The fixed inference-only perturbation of router weight ``name``: ``sigma * rms(W) * E`` (see module docstring).

    ``E`` is standard normal, drawn from a generator seeded by a hash of ``name`` (stable across processes and
    weight syncs); ``rms(W)`` is the weight's own root mean square, so ``sigma`` is relative to the weight's size.
    """
    import zlib

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    noise = torch.randn(tuple(weight.shape), generator=g, dtype=torch.float32)
    rms = weight.detach().float().pow(2).mean().sqrt()
    return (sigma * rms * noise).to(weight.dtype)


@torch.no_grad()
def perturb_routers_(model: nn.Module, sigma: float) -> list[str]:
    """Add :func:`router_perturbation` to every MoE router weight of ``model`` in place; returns their names."""
    if sigma < 0:
        raise ValueError(f"router perturbation sigma must be >= 0, got {sigma}")
    names = [n for n, _ in model.named_parameters() if is_router_weight(n)]
    if sigma == 0:
        return names
    params = dict(model.named_parameters())
    for name in names:
        w = params[name].float()
        params[name].copy_((w + router_perturbation(name, w, sigma).float()).to(params[name].dtype))
    return names


def precision_copy(model: nn.Module, precision: str, router_noise: float = 0.0) -> nn.Module:
    """A deep copy of ``model`` at ``precision`` (the original is untouched), routers perturbed by ``router_noise``."""
    out = apply_precision_(copy.deepcopy(model), precision)
    perturb_routers_(out, router_noise)
    return out
