"""Gate weights at given expert ids, recomputed from the live router output with each family's own formula.

Replay replaces only the *selection* (the top-k ids); the weights that mix the chosen experts are recomputed here
from the live, differentiable router tensor, so gradients reach the router, and replaying a model's own ids
reproduces its output bit for bit. ``gate_weights(site, live, ids)`` takes the routing site module (for the family's
flags: ``norm_topk_prob``, ``routed_scaling_factor``), the live tensor ``z`` (router logits) and ``ids [T, K]``:

* softmax families (Qwen, OLMoE): ``w = softmax(z)[ids]``, divided by ``sum_k w`` when the router renormalises.
* Mixtral: as above, always renormalised, left in fp32.
* GPT-OSS: ``w = softmax(z[ids])`` over the k selected logits.
* sigmoid families (DeepSeek-V3, GLM-4.5): ``w = sigmoid(z)[ids] / (sum_k sigmoid(z)[ids] + 1e-20) *
  routed_scaling_factor`` (the correction bias only affects which experts are chosen, never the weights).

Each :class:`~verl_stable.routing.families.FamilySpec` names one of these; they are importable from
:mod:`verl_stable.routing.families` too. Pure torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

GateWeights = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def softmax_gate_weights(site: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Qwen / OLMoE: ``p = softmax_fp32(z)``; ``w = p[ids]``, renormalised if ``norm_topk_prob``; cast to z's dtype."""
    w = F.softmax(logits, dtype=torch.float, dim=-1).gather(-1, ids)
    if getattr(site, "norm_topk_prob", True):
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype)


def mixtral_gate_weights(site: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mixtral: ``w = softmax(float(z))[ids] / sum_k``, kept in fp32."""
    w = F.softmax(logits.float(), dim=-1).gather(-1, ids)
    return w / w.sum(dim=-1, keepdim=True)


def gpt_oss_gate_weights(site: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """GPT-OSS: softmax over the selected logits only, ``w = softmax(z[ids])``."""
    selected = logits.gather(-1, ids)
    return F.softmax(selected, dim=1, dtype=selected.dtype)


def sigmoid_gate_weights(site: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 / GLM-4.5: ``s = sigmoid(z)``; ``w = s[ids] / (sum_k s[ids] + 1e-20) * routed_scaling_factor``."""
    w = logits.sigmoid().gather(1, ids)
    if site.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * site.routed_scaling_factor
