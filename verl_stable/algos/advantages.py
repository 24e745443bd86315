"""Group-mean-baseline outcome advantage (MiniRL / VESPO), pure torch.

For the responses ``i`` to one prompt (one group, identified by verl's ``uid``), with outcome reward
``R_i = sum over valid tokens of token_level_rewards``:

    ``A_i = R_i - mean_{j in group(i)} R_j``

with no division by the group's standard deviation (unlike GRPO), broadcast to every valid response token
(0 at masked positions).

A group with a single response has ``A = R - R = 0``: a group-mean baseline carries no learning signal
without a second sample of the same prompt. This is the literal formula, and deliberately not GRPO's
convention (verl's ``grpo`` uses a baseline of 0 for a singleton, giving ``A = R``). A warning is issued
when a batch contains singleton groups, since ``rollout.n = 1`` with this estimator learns nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from verl_stable.algos.token_batch import check_same_shape


def group_ids_to_index(group_ids: Sequence | np.ndarray | torch.Tensor, batch_size: int) -> np.ndarray:
    """Map arbitrary hashable group ids (verl's ``uid`` strings) to dense integers ``0..G-1``.

    Args:
        group_ids: One id per response.
        batch_size: Expected number of responses.

    Returns:
        int64 array of shape ``(batch_size,)``.

    Raises:
        ValueError: If the number of ids differs from ``batch_size``.
    """
    ids = group_ids.cpu().numpy() if isinstance(group_ids, torch.Tensor) else np.asarray(group_ids, dtype=object)
    ids = ids.reshape(-1)
    if ids.shape[0] != batch_size:
        raise ValueError(f"got {ids.shape[0]} group ids (uid) for {batch_size} responses; need one per response")
    lookup: dict = {}
    return np.fromiter((lookup.setdefault(g, len(lookup)) for g in ids.tolist()), dtype=np.int64, count=batch_size)


def group_mean_baseline_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: Sequence | np.ndarray | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``A_i = R_i - mean(R over group(i))`` broadcast over valid tokens.

    Args:
        token_level_rewards: ``(batch, response_len)``; rewards at masked positions are ignored.
        response_mask: ``(batch, response_len)``, 1 / True at valid tokens.
        group_ids: One group id per response (verl's ``uid``).

    Returns:
        ``(advantages, scores)``: ``(batch, response_len)`` advantages in the rewards' dtype, 0 at masked
        positions, and the per-response outcome rewards ``R``, ``(batch,)``.

    Raises:
        ValueError: On shape mismatches, a wrong number of group ids, or a non-finite reward at a valid position.
    """
    check_same_shape("token_level_rewards", token_level_rewards, response_mask=response_mask)
    mask = response_mask.bool()
    batch_size = token_level_rewards.shape[0]
    index = torch.as_tensor(group_ids_to_index(group_ids, batch_size), device=token_level_rewards.device)

    with torch.no_grad():
        rewards = torch.where(mask, token_level_rewards.double(), 0.0)
        n_bad = int((~torch.isfinite(rewards)).sum().item())
        if n_bad:
            raise ValueError(f"token_level_rewards: {n_bad} non-finite value(s) at valid (response_mask=1) positions")
        scores = rewards.sum(dim=-1)
        n_groups = int(index.max().item()) + 1 if batch_size else 0
        group_sum = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, index, scores)
        group_size = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(
            0, index, torch.ones_like(scores)
        )
        if bool((group_size == 1).any()):
            warnings.warn(
                "minirl advantage: some groups hold a single response, whose advantage R - mean(R) is 0; "
                "use rollout.n >= 2 for a group-mean baseline to carry signal",
                stacklevel=2,
            )
        seq_adv = scores - (group_sum / group_size)[index]
        advantages = torch.where(mask, seq_adv.unsqueeze(-1), 0.0).to(token_level_rewards.dtype)
    return advantages, scores.to(token_level_rewards.dtype)
