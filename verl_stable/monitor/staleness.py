"""Policy staleness metrics: how far pi_theta has moved from pi_old inside an update (the ratio MiniRL clips).

:func:`staleness_statistics` runs inside the policy loss on every micro-batch (0-d tensors, no host read of the
statistics); :func:`staleness_metrics` is its float version with the conventions of
:mod:`verl_stable.monitor.common`. Symbols are defined in ``docs/reference/notation.md``. This module does not import
verl.
"""

from __future__ import annotations

import math

import torch

from verl_stable.monitor.common import (
    STALENESS,
    check_like,
    check_real,
    check_tensor,
    selection,
    usable_log_prob_pair,
    valid_mask,
)

#: ``|logp_theta - logp_old|`` is clamped to this before ``exp`` so every staleness statistic stays finite.
STALENESS_LOG_RATIO_BOUND = 50.0

#: Names of :func:`staleness_statistics` (under ``stable/staleness/``), in order.
STALENESS_NAMES: tuple[str, ...] = (
    "ratio_mean",
    "ratio_min",
    "ratio_max",
    "ratio_dev_max",
    "log_ratio_abs_mean",
    "kl_k3",
    "frac_above",
    "frac_below",
    "frac_outside_trust_region",
)


def check_trust_region(eps_low: object, eps_high: object) -> tuple[float, float]:
    """``(eps_low, eps_high)`` as floats when ``0 <= eps_low < 1`` and ``0 <= eps_high < inf``, else ``ValueError``."""
    low, high = check_real("eps_low", eps_low), check_real("eps_high", eps_high)
    if not (0 <= low < 1 and 0 <= high < math.inf):
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0 (finite), got eps_low={low}, eps_high={high}")
    return low, high


def _check_log_probs(logp_theta: torch.Tensor, logp_old: torch.Tensor) -> None:
    check_tensor("logp_theta", logp_theta, floating=True)
    check_like("logp_old", logp_old, "logp_theta", logp_theta, floating=True)


def staleness_statistics(
    logp_theta: torch.Tensor,
    logp_old: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.27,
) -> dict[str, torch.Tensor]:
    """Policy staleness of one (micro-)batch as 0-d tensors, without reading the statistics back to the host.

    With ``d = clamp(logp_theta - logp_old, +-STALENESS_LOG_RATIO_BOUND)`` and ``r = pi_theta / pi_old = exp(d)``
    on the valid tokens (mean over valid tokens):

    * ``ratio_mean``, ``ratio_min``, ``ratio_max`` of ``r``; ``ratio_dev_max = max |r - 1|``;
    * ``log_ratio_abs_mean = mean |d|`` and ``kl_k3 = mean(r - 1 - d)``, the k3 estimator of
      KL(pi_old || pi_theta) on tokens drawn from the sampler (non-negative per token, 0 iff ``r = 1``);
    * ``frac_above = mean(1[r > 1 + eps_high])``, ``frac_below = mean(1[r < 1 - eps_low])`` and
      ``frac_outside_trust_region`` (their sum). The trust region is sign-agnostic: MiniRL masks only the side
      the advantage pushes towards, so the fraction it masks is at most ``frac_outside_trust_region``.

    Made to run inside a policy loss on every micro-batch: a value for every name whatever the input (verl averages
    loss metrics over micro-batches and requires the same keys on every rank). A mask with no valid token gives the
    on-policy values (ratios 1, deviations and fractions 0). Values at masked positions are ignored, NaN included;
    at valid positions an infinite log ratio is clamped like any large one, and a NaN gives NaN statistics (the
    losses reject NaN log-probs before). A bool mask is used as is; a float or integer mask is checked to hold only
    0 and 1, which reads one flag back to the host.

    Args:
        logp_theta: log-probs of the policy being updated, ``[batch, len]``, floating point.
        logp_old: pi_old log-probs of the same tokens, same shape and device.
        mask: 0/1 or bool valid-token mask, same shape.
        eps_low: lower trust-region width, ``0 <= eps_low < 1``.
        eps_high: upper trust-region width, finite and ``>= 0``.

    Returns:
        ``{name: 0-d float64 tensor}`` for each name of :data:`STALENESS_NAMES`, on the inputs' device.
    """
    eps_low, eps_high = check_trust_region(eps_low, eps_high)
    _check_log_probs(logp_theta, logp_old)
    valid = valid_mask(mask, "logp_theta", logp_theta)
    zero = torch.zeros((), dtype=torch.float64, device=logp_theta.device)
    d = torch.where(valid, logp_theta.detach().double() - logp_old.detach().double(), zero)
    d = d.clamp(-STALENESS_LOG_RATIO_BOUND, STALENESS_LOG_RATIO_BOUND)
    ratio = torch.exp(d)
    n = valid.sum().clamp(min=1).double()

    def mean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, x, zero).sum() / n

    above = (ratio > 1 + eps_high) & valid
    below = (ratio < 1 - eps_low) & valid
    any_valid = valid.any()
    one = zero + 1
    if ratio.numel():
        ratio_min = torch.where(any_valid, torch.where(valid, ratio, math.inf).amin(), one)
        ratio_max = torch.where(any_valid, torch.where(valid, ratio, -math.inf).amax(), one)
    else:
        ratio_min = ratio_max = one
    stats = {
        "ratio_mean": torch.where(any_valid, mean(ratio), one),
        "ratio_min": ratio_min,
        "ratio_max": ratio_max,
        "ratio_dev_max": torch.maximum(ratio_max - 1, 1 - ratio_min),
        "log_ratio_abs_mean": mean(d.abs()),
        "kl_k3": mean(ratio - 1 - d),
        "frac_above": mean(above.double()),
        "frac_below": mean(below.double()),
        "frac_outside_trust_region": mean((above | below).double()),
    }
    return {name: stats[name] for name in STALENESS_NAMES}


def staleness_metrics(
    logp_theta: torch.Tensor,
    logp_old: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.27,
) -> dict[str, float]:
    """:func:`staleness_statistics` as ``{"stable/staleness/<name>": float}``, with this package's conventions.

    Tokens whose log ratio is undefined (NaN or ``+inf`` in either input, ``-inf`` in both) are excluded and
    counted in ``stable/staleness/nonfinite_frac``; a ``-inf`` on one side is probability zero and enters clamped
    to ``+-STALENESS_LOG_RATIO_BOUND``. An empty mask gives an empty dict. Defaults are MiniRL's
    ``eps_low = 0.2, eps_high = 0.27``.
    """
    check_trust_region(eps_low, eps_high)
    _check_log_probs(logp_theta, logp_old)
    sel = selection(mask, "logp_theta", logp_theta, usable_log_prob_pair(logp_theta, logp_old))
    if sel is None:
        return {}
    keep, _, unusable = sel
    out = {f"{STALENESS}/nonfinite_frac": unusable}
    if not bool(keep.any()):
        return out
    stats = staleness_statistics(logp_theta, logp_old, keep, eps_low, eps_high)
    values = torch.stack(list(stats.values())).tolist()
    out.update({f"{STALENESS}/{name}": v for name, v in zip(stats, values, strict=True)})
    return out
