"""VESPO policy loss (arXiv 2602.10693), pure torch.

For a response y with valid tokens t:

- sequence log-weight ``log W = clamp(sum_t [logp_theta_t - logp_old_t + log w_t], -20, 20)`` where ``w_t`` are
  verl's rollout importance weights ``pi_old / mu`` when present (then ``W = pi_theta(y) / mu(y)``, the ratio to
  the sampler) and 1 otherwise (``W = pi_theta(y) / pi_old(y)``);
- reshaping kernel ``phi(W) = W^c1 * exp(c2 * (1 - W))`` with ``phi(1) = 1``; the maximum sits at
  ``W = c1 / c2``, and ``phi`` vanishes for ``W -> 0`` and ``W -> inf``, so stale or mismatched sequences
  are smoothly down-weighted instead of hard-clipped;
- sign-dependent constants: ``(c1, c2) = (2, 3)`` where ``A > 0`` and ``(3, 2)`` where ``A < 0`` (paper
  defaults);
- per-token loss ``-sg[phi(W)] * A_t * logp_theta_t``, so ``d loss_t / d logp_theta_t = -phi(W) * A_t``.

The constants are chosen per token from the sign of ``A_t``. With the usual outcome advantage, constant over a
response, this is the per-sequence choice of the paper; it also stays defined for token-level advantages.
``phi`` is evaluated in log space, ``exp(c1 * log W + c2 * (1 - W))``, which is finite for every clamped
``log W``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_stable.algos.token_batch import MaskedTokens, PolicyLossTerms, check_same_shape, compute_dtype
from verl_stable.metric_names import ACTOR, VESPO

#: ``log W`` is clamped to ``[-LOG_W_BOUND, LOG_W_BOUND]`` before ``exp``.
LOG_W_BOUND = 20.0


@dataclass(frozen=True)
class VespoKernel:
    """Constants of ``phi(W) = W^c1 * exp(c2 * (1 - W))`` for positive and negative advantages.

    Attributes:
        c1_pos: ``c1`` where ``A > 0`` (paper: 2).
        c2_pos: ``c2`` where ``A > 0`` (paper: 3).
        c1_neg: ``c1`` where ``A < 0`` (paper: 3).
        c2_neg: ``c2`` where ``A < 0`` (paper: 2).
    """

    c1_pos: float = 2.0
    c2_pos: float = 3.0
    c1_neg: float = 3.0
    c2_neg: float = 2.0

    def __post_init__(self) -> None:
        for name in ("c1_pos", "c2_pos", "c1_neg", "c2_neg"):
            value = float(getattr(self, name))
            if not value >= 0.0 or value == float("inf"):
                raise ValueError(f"VESPO kernel constant {name} must be finite and >= 0, got {value}")


def vespo_kernel(log_w: torch.Tensor, c1: float, c2: float) -> torch.Tensor:
    """``phi(W) = W^c1 * exp(c2 * (1 - W))`` evaluated from ``log W`` (finite for finite ``log W``)."""
    return torch.exp(c1 * log_w + c2 * (1.0 - torch.exp(log_w)))


def _sequence_log_weight(
    log_ratio: torch.Tensor, is_weights: torch.Tensor | None, maskf: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(sum_t log rho_t, sum_t log w_t)`` per sequence from tensors that are 0 at masked positions."""
    raw = log_ratio.sum(dim=-1)
    if is_weights is None:
        return raw, None
    tiny = torch.finfo(is_weights.dtype).tiny
    seq_log_is = (torch.log(is_weights.clamp(min=tiny)) * maskf).sum(dim=-1)
    return raw + seq_log_is, seq_log_is


def vespo_sequence_log_weight(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unclamped and clamped ``log W`` per sequence, ``(batch,)`` each, without gradient.

    ``log W = sum over valid t of (logp_theta_t - logp_old_t + log w_t)``; a zero importance weight (rejected
    token) gives ``log w_t = log(tiny)``, which drives ``log W`` to the lower clamp. A sequence with no valid
    token has ``log W = 0`` (``W = 1``).
    """
    check_same_shape(
        "log_prob",
        log_prob,
        old_log_prob=old_log_prob,
        response_mask=response_mask,
        rollout_is_weights=rollout_is_weights,
    )
    tokens = MaskedTokens(response_mask, compute_dtype(log_prob))
    with torch.no_grad():
        zeroed, _ = tokens.zero_masked(
            log_prob=log_prob.detach(), old_log_prob=old_log_prob, rollout_is_weights=rollout_is_weights
        )
        raw, _ = _sequence_log_weight(
            zeroed["log_prob"] - zeroed["old_log_prob"], zeroed.get("rollout_is_weights"), tokens.maskf
        )
    return raw, raw.clamp(-LOG_W_BOUND, LOG_W_BOUND)


def vespo_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    *,
    kernel: VespoKernel | None = None,
) -> PolicyLossTerms:
    """Per-token VESPO loss ``-sg[phi(W)] * A_t * logp_theta_t`` and its metrics.

    Args:
        log_prob: ``logp_theta``, ``(batch, response_len)``; the only input that carries gradient.
        old_log_prob: ``logp_old``, same shape (constant).
        advantages: ``A`` per token, same shape (constant).
        response_mask: 1 / True at valid response tokens, same shape.
        rollout_is_weights: verl's rollout IS weights ``pi_old / mu`` per token, folded into ``W``; ``None``
            leaves them out.
        kernel: Kernel constants; paper defaults when ``None``.

    Returns:
        :class:`PolicyLossTerms` with the per-token loss (0 at masked positions) and metrics over sequences with
        at least one valid token: ``actor/ppo_kl`` (token mean of ``logp_old - logp_theta``),
        ``actor/vespo/log_w_{mean,min,max}``, ``actor/vespo/w_{mean,min,max}``,
        ``actor/vespo/phi_{mean,min,max}`` (with the constants of the sequence's advantage sign),
        ``actor/vespo/clamped_frac`` (sequences whose ``|log W|`` reached the clamp), ``actor/vespo/pos_adv_frac``
        and, with IS weights, ``actor/vespo/seq_log_is_mean`` (mean of ``sum_t log w_t``).

    Raises:
        ValueError: On mismatched shapes (immediately), and from ``.scalars()`` on non-finite inputs at valid
            positions.
    """
    check_same_shape(
        "log_prob",
        log_prob,
        old_log_prob=old_log_prob,
        advantages=advantages,
        response_mask=response_mask,
        rollout_is_weights=rollout_is_weights,
    )
    kernel = kernel or VespoKernel()
    tokens = MaskedTokens(response_mask, compute_dtype(log_prob))
    zeroed, to_check = tokens.zero_masked(
        log_prob=log_prob,
        old_log_prob=old_log_prob,
        advantages=advantages,
        rollout_is_weights=rollout_is_weights,
    )
    logp = zeroed["log_prob"]
    with torch.no_grad():
        # All token tensors here are 0 at masked positions.
        adv = zeroed["advantages"]
        is_weights = zeroed.get("rollout_is_weights")
        log_ratio = logp.detach() - zeroed["old_log_prob"]
        raw_log_w, seq_log_is = _sequence_log_weight(
            log_ratio, None if is_weights is None else is_weights.detach(), tokens.maskf
        )
        log_w = raw_log_w.clamp(-LOG_W_BOUND, LOG_W_BOUND)
        phi_pos = vespo_kernel(log_w, kernel.c1_pos, kernel.c2_pos)
        phi_neg = vespo_kernel(log_w, kernel.c1_neg, kernel.c2_neg)
        # phi per token: phi_pos where A > 0, else phi_neg (A = 0 contributes nothing either way).
        positive = (adv > 0).to(adv.dtype)
        phi_tok = phi_neg.unsqueeze(-1) + positive * (phi_pos - phi_neg).unsqueeze(-1)
        neg_coef = -(phi_tok * adv)

    loss_mat = logp * neg_coef

    with torch.no_grad():
        sequences = MaskedTokens(tokens.mask.any(dim=-1), log_w.dtype)
        seq_adv = adv.sum(dim=-1)
        phi_seq = torch.where(seq_adv >= 0, phi_pos, phi_neg) * sequences.maskf
        log_w_stats = sequences.stats(log_w)
        w_stats = sequences.stats(torch.exp(log_w) * sequences.maskf)
        phi_stats = sequences.stats(phi_seq)
        metrics = {
            f"{ACTOR}ppo_kl": -tokens.mean(log_ratio),
            f"{VESPO}/log_w_mean": log_w_stats[0],
            f"{VESPO}/log_w_min": log_w_stats[1],
            f"{VESPO}/log_w_max": log_w_stats[2],
            f"{VESPO}/w_mean": w_stats[0],
            f"{VESPO}/w_min": w_stats[1],
            f"{VESPO}/w_max": w_stats[2],
            f"{VESPO}/phi_mean": phi_stats[0],
            f"{VESPO}/phi_min": phi_stats[1],
            f"{VESPO}/phi_max": phi_stats[2],
            f"{VESPO}/clamped_frac": sequences.fraction(raw_log_w.abs() >= LOG_W_BOUND),
            f"{VESPO}/pos_adv_frac": sequences.fraction(seq_adv > 0),
        }
        if seq_log_is is not None:
            metrics[f"{VESPO}/seq_log_is_mean"] = sequences.mean(seq_log_is)
    return PolicyLossTerms(
        loss_mat=loss_mat,
        metrics=metrics,
        finite_checks=to_check,
        nonnegative_checks={} if is_weights is None else {"rollout_is_weights": is_weights.detach()},
    )
