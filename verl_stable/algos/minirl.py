"""MiniRL policy loss (Qwen team, arXiv 2512.01374), pure torch.

Notation per token t of a response: ``logp_theta`` (policy being updated), ``logp_old`` (same weights as the
sampler, evaluated by the training engine), ``w_t`` the truncated train/inference importance weight
``min(pi_old / mu_old, C)`` (verl's token-level rollout-correction weight), ``A`` the advantage.

- staleness ratio ``r_t = pi_theta / pi_old = exp(logp_theta - logp_old)``;
- trust-region mask ``M_t = 0`` if ``(A > 0 and r_t > 1 + eps_high)`` or ``(A < 0 and r_t < 1 - eps_low)``,
  else ``M_t = 1``;
- objective per token ``J_t = M_t * sg[w_t * r_t] * A * logp_theta``, loss ``-J_t``.

So ``d(loss_t) / d(logp_theta_t) = -M_t * w_t * r_t * A``: the gradient of the PPO-style surrogate
``w_t * r_t * A`` where it is not masked, and nothing where the ratio has left the trust region in the
direction the advantage pushes it. The per-token loss is returned unaggregated; the paper sums over the tokens
of a response and averages over responses (verl ``loss_agg_mode=seq-mean-token-sum``).
"""

from __future__ import annotations

import torch

from verl_stable.algos.token_batch import MaskedTokens, PolicyLossTerms, check_same_shape, compute_dtype
from verl_stable.metric_names import ACTOR, MINIRL

#: Paper defaults for the trust region (eps_low, eps_high).
DEFAULT_CLIP_RATIO_LOW = 0.2
DEFAULT_CLIP_RATIO_HIGH = 0.27

#: ``|logp_theta - logp_old|`` is clamped to this before ``exp`` (as verl's ``vanilla`` loss does) so that
#: ``r_t`` stays finite in float32; ``exp(20)`` is about 4.9e8.
LOG_RATIO_BOUND = 20.0


def minirl_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    *,
    clip_ratio_low: float = DEFAULT_CLIP_RATIO_LOW,
    clip_ratio_high: float = DEFAULT_CLIP_RATIO_HIGH,
) -> PolicyLossTerms:
    """Per-token MiniRL loss ``-M_t * sg[w_t * r_t] * A_t * logp_theta_t`` and its metrics.

    Args:
        log_prob: ``logp_theta``, ``(batch, response_len)``; the only input that carries gradient.
        old_log_prob: ``logp_old``, same shape (treated as a constant).
        advantages: ``A`` per token, same shape (constant).
        response_mask: 1 / True at valid response tokens, same shape.
        rollout_is_weights: ``w_t`` per token, same shape, or ``None`` for ``w_t = 1`` (valid only when training
            and inference engines compute identical probabilities). Treated as a constant.
        clip_ratio_low: ``eps_low >= 0``.
        clip_ratio_high: ``eps_high >= 0``.

    Returns:
        :class:`PolicyLossTerms` with the per-token loss (0 at masked positions) and metrics:
        ``actor/pg_clipfrac`` (fraction of valid tokens with ``M_t = 0``), ``actor/ppo_kl`` (mean of
        ``logp_old - logp_theta``), ``actor/MiniRL/masked_frac_high`` / ``masked_frac_low`` (each side of the
        trust region), ``actor/MiniRL/ratio_{mean,min,max}``, ``actor/MiniRL/is_weight_{mean,min,max}`` and
        ``actor/MiniRL/token_weight_mean`` (mean of ``M_t * w_t * r_t``). Call ``.scalars()`` on it to check the
        inputs and read the metrics.

    Raises:
        ValueError: On mismatched shapes or negative clip ratios (immediately), and from ``.scalars()`` on
            non-finite inputs at valid positions.
    """
    check_same_shape(
        "log_prob",
        log_prob,
        old_log_prob=old_log_prob,
        advantages=advantages,
        response_mask=response_mask,
        rollout_is_weights=rollout_is_weights,
    )
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(f"clip ratios must be >= 0, got clip_ratio_low={clip_ratio_low}, high={clip_ratio_high}")

    tokens = MaskedTokens(response_mask, compute_dtype(log_prob))
    zeroed, to_check = tokens.zero_masked(
        log_prob=log_prob,
        old_log_prob=old_log_prob,
        advantages=advantages,
        rollout_is_weights=rollout_is_weights,
    )
    logp = zeroed["log_prob"]
    with torch.no_grad():
        adv = zeroed["advantages"]
        # Every tensor below is 0 at masked positions (so adv > 0 and adv < 0 are False there), except `ratio`.
        log_ratio = (logp.detach() - zeroed["old_log_prob"]).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        ratio = torch.exp(log_ratio)
        above = (adv > 0) & (ratio > 1.0 + clip_ratio_high)
        below = (adv < 0) & (ratio < 1.0 - clip_ratio_low)
        clipped = above | below
        ratio_valid = ratio * tokens.maskf
        if rollout_is_weights is None:
            is_weights = None
            weight = ratio_valid
        else:
            is_weights = zeroed["rollout_is_weights"].detach()
            weight = is_weights * ratio
        token_weight = weight * (~clipped).to(weight.dtype)
        neg_coef = -(token_weight * adv)

    loss_mat = logp * neg_coef

    with torch.no_grad():
        ratio_mean, ratio_min, ratio_max = tokens.stats(ratio_valid)
        if is_weights is None:
            w_mean = w_min = w_max = tokens.any.to(ratio.dtype)
        else:
            w_mean, w_min, w_max = tokens.stats(is_weights)
        metrics = {
            f"{ACTOR}pg_clipfrac": tokens.fraction(clipped),
            f"{ACTOR}ppo_kl": -tokens.mean(log_ratio),
            f"{MINIRL}/masked_frac_high": tokens.fraction(above),
            f"{MINIRL}/masked_frac_low": tokens.fraction(below),
            f"{MINIRL}/ratio_mean": ratio_mean,
            f"{MINIRL}/ratio_min": ratio_min,
            f"{MINIRL}/ratio_max": ratio_max,
            f"{MINIRL}/is_weight_mean": w_mean,
            f"{MINIRL}/is_weight_min": w_min,
            f"{MINIRL}/is_weight_max": w_max,
            f"{MINIRL}/token_weight_mean": tokens.mean(token_weight),
        }
    return PolicyLossTerms(
        loss_mat=loss_mat,
        metrics=metrics,
        finite_checks=to_check,
        nonnegative_checks={} if is_weights is None else {"rollout_is_weights": is_weights},
    )
