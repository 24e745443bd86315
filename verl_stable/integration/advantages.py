"""verl advantage estimator ``minirl``: a thin adapter over :mod:`verl_stable.algos.advantages`.

Selected with ``algorithm.adv_estimator=minirl``. verl's trainer calls registered estimators with keyword
arguments ``token_level_rewards``, ``response_mask``, ``config`` (the algorithm config) and, when the batch has
them, ``index`` (the ``uid`` of each response's prompt) and ``reward_baselines``; it stores the two returned
tensors as ``advantages`` and ``returns``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, register_adv_est

from verl_stable.algos.advantages import group_mean_baseline_advantages


def compute_minirl_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray | None = None,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``A_i = R_i - mean(R over responses with the same uid)``, no std division, over valid tokens.

    A single-response group gets ``A = 0`` (see :mod:`verl_stable.algos.advantages`).

    Args:
        token_level_rewards: ``(batch, response_len)``; ``R_i`` is their sum over valid tokens.
        response_mask: ``(batch, response_len)``.
        index: ``uid`` per response (verl passes ``data.non_tensor_batch["uid"]``).
        config: verl's algorithm config (unused; accepted for the registry's calling convention).
        **kwargs: Further keywords verl may pass (ignored).

    Returns:
        ``(advantages, returns)``, both the broadcast advantage, ``(batch, response_len)``, as verl's outcome
        estimators return.

    Raises:
        ValueError: If ``index`` is missing or has the wrong length, on shape mismatches, or on non-finite rewards.
    """
    if index is None:
        raise ValueError("advantage estimator 'minirl' needs the prompt uid of each response (index=uid); got None")
    advantages, _ = group_mean_baseline_advantages(token_level_rewards, response_mask, index)
    return advantages, advantages


ADVANTAGE_ESTIMATORS = {"minirl": compute_minirl_outcome_advantage}


def register() -> list[str]:
    """Register ``minirl`` in verl's advantage-estimator registry (idempotent: same function object each time).

    Raises:
        ValueError: From verl, if a different function already holds the name.
    """
    for name, fn in ADVANTAGE_ESTIMATORS.items():
        if ADV_ESTIMATOR_REGISTRY.get(name) is not fn:
            register_adv_est(name)(fn)
    return list(ADVANTAGE_ESTIMATORS)
