"""Random token batches for the policy-loss tests (MiniRL, VESPO and their verl registration)."""

from __future__ import annotations

import torch


def ragged_batch(
    seed: int,
    *,
    batch: int,
    length: int,
    spread: float,
    holes: float,
    token_adv: bool = False,
    weight_low: float = 0.0,
    weight_scale: float = 5.0,
):
    """``(log_prob, old, adv, mask, weights)``, float64 ``[batch, length]``: ragged right padding and holes inside
    responses (each token dropped with probability ``holes``; the first kept, so no row is empty), ``old`` off by
    ``spread`` standard normals, one advantage per row (per token with ``token_adv``), weights uniform in
    ``[weight_low, weight_low + weight_scale)``. The draws come from one generator seeded with ``seed``, in that order."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    mask = mask & ~(torch.rand(batch, length, generator=g) < holes)
    mask[:, 0] = True
    log_prob = -torch.rand(batch, length, generator=g, dtype=torch.float64) * 3
    old = log_prob + spread * torch.randn(batch, length, generator=g, dtype=torch.float64)
    if token_adv:
        adv = torch.randn(batch, length, generator=g, dtype=torch.float64)
    else:
        adv = torch.randn(batch, 1, generator=g, dtype=torch.float64).expand(batch, length).clone()
    weights = weight_low + torch.rand(batch, length, generator=g, dtype=torch.float64) * weight_scale
    return log_prob, old, adv, mask, weights
