"""Stability metrics as pure functions: tensors in, ``{"stable/...": float}`` out. The monitor's public entry point.

Notation (see ``docs/reference/notation.md``): per response token, ``logp_mu`` is the inference engine's log-probability
of the sampled token (verl's ``rollout_log_probs``), ``logp_old`` the training engine's with the same weights
(``old_log_probs``, pi_old) and ``logp_theta`` the policy being updated. All per-token inputs are
``[batch, response_len]`` tensors aligned with a 0/1 ``mask`` of valid tokens; every mean is over valid tokens only.

This module owns the entropy metrics and the window slope, and gathers every metric of the package under one import
path (callers use ``verl_stable.monitor.metrics``):

* :mod:`~verl_stable.monitor.train_inference`: KL(mu || pi_old), F(tau), what the IS correction did, IS ESS;
* :mod:`~verl_stable.monitor.staleness`: pi_theta / pi_old inside an update;
* :mod:`~verl_stable.monitor.routing_metrics`: routing disagreement naming, expert load balance;
* :mod:`~verl_stable.monitor.common`: name prefixes, input checks, overflow-safe means, :func:`masked_mean`.

Conventions shared by every function (details in :mod:`~verl_stable.monitor.common`):

* An all-zero mask (no valid token) returns an empty dict: the metric is skipped for that step, never NaN.
* Valid tokens whose inputs are unusable (NaN; an infinity that means nothing for that input) are excluded from the
  statistics and counted in a ``.../nonfinite_frac`` entry, so one broken token neither hides the others nor
  poisons the mean. An infinity that does mean something (a log-prob of ``-inf`` is probability zero) is a value:
  a train-inference KL that is truly beyond float64 reads ``inf``, and the guard stops on it.
* Wrong types or dtypes raise ``TypeError``, wrong shapes, devices, mask values or parameter values ``ValueError``,
  naming what was expected and what was received.

This module does not import verl.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from verl_stable.monitor.common import (
    ENTROPY,
    IS_WEIGHTS,
    PREFIX,
    ROUTING,
    STALENESS,
    TRAIN_INF,
    check_number_sequence,
    check_tensor,
    masked_mean,
    safe_mean,
    selection,
    type_name,
)
from verl_stable.monitor.routing_metrics import expert_load_balance, routing_disagreement_metrics
from verl_stable.monitor.staleness import (
    STALENESS_LOG_RATIO_BOUND,
    STALENESS_NAMES,
    staleness_metrics,
    staleness_statistics,
)
from verl_stable.monitor.train_inference import (
    DEFAULT_TAUS,
    correction_metrics,
    effective_sample_size,
    is_weight_metrics,
    train_inference_metrics,
)

__all__ = [
    "DEFAULT_TAUS",
    "ENTROPY",
    "IS_WEIGHTS",
    "PREFIX",
    "ROUTING",
    "STALENESS",
    "STALENESS_LOG_RATIO_BOUND",
    "STALENESS_NAMES",
    "TRAIN_INF",
    "correction_metrics",
    "effective_sample_size",
    "entropy_metrics",
    "expert_load_balance",
    "is_weight_metrics",
    "masked_mean",
    "routing_disagreement_metrics",
    "staleness_metrics",
    "staleness_statistics",
    "train_inference_metrics",
    "window_slope",
]


def entropy_metrics(entropy: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Token entropy of pi_theta: ``stable/entropy/mean`` = mean over valid finite tokens (no length weighting).

    An entropy is finite and non-negative, so every non-finite entry (NaN, ``+-inf``) is unusable: excluded and
    counted in ``stable/entropy/nonfinite_frac``. Small negative values (rounding in low precision) are kept.

    Args:
        entropy: floating point per-token entropies, ``[batch, len]``.
        mask: 0/1 or bool valid-token mask, same shape.

    Returns:
        Empty for an empty mask; only ``nonfinite_frac`` when no valid entry is finite.
    """
    check_tensor("entropy", entropy, floating=True)
    sel = selection(mask, "entropy", entropy, torch.isfinite(entropy))
    if sel is None:
        return {}
    keep, _, unusable = sel
    out = {f"{ENTROPY}/nonfinite_frac": unusable}
    if bool(keep.any()):
        out[f"{ENTROPY}/mean"] = safe_mean(entropy.double()[keep])
    return out


def _real_or_none(name: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and not value.is_complex():
            return float(value)
    elif not isinstance(value, (str, bytes, bool)) and hasattr(value, "__float__"):
        return float(value)
    raise TypeError(f"{name} must be a real number or None, got {type_name(value)} {value!r}")


def window_slope(values: Sequence[float | None], steps: Sequence[float] | None = None) -> float | None:
    """Least-squares slope of ``values`` per step.

    ``slope = sum((t - t_bar) * (y - y_bar)) / sum((t - t_bar)^2)`` over the points ``(t, y)``, where ``t`` is the
    step of each value: ``steps`` when given, else ``0, 1, ..., n-1`` (consecutive steps). ``None`` and non-finite
    values are dropped (their steps are kept for the others). The ``y`` are scaled by a power of two ``>= max|y|``
    before the sums, so the slope overflows only if it is itself beyond float64.

    Args:
        values: real numbers (numpy scalars and one-element tensors included) or ``None``.
        steps: finite step of each value, same length as ``values``; ``None`` for consecutive steps.

    Returns:
        The slope, or ``None`` when fewer than two finite values, or only one distinct step among them, remain.
    """
    check_number_sequence("values", values)
    ys = [_real_or_none(f"values[{i}]", v) for i, v in enumerate(values)]
    if steps is None:
        ts = [float(t) for t in range(len(ys))]
    else:
        check_number_sequence("steps", steps)
        if len(steps) != len(ys):
            raise ValueError(f"steps has {len(steps)} entries but values has {len(ys)}: give one step per value")
        ts = [_real_or_none(f"steps[{i}]", t) for i, t in enumerate(steps)]
        if any(t is None or not math.isfinite(t) for t in ts):
            raise ValueError(f"steps must be finite numbers, got {list(steps)!r}")
    points = [(t, y) for t, y in zip(ts, ys, strict=True) if y is not None and math.isfinite(y)]
    if len(points) < 2:
        return None
    # scale y by a power of two (exact) so |y| < 2; 2.0 ** (exponent - 1) <= 2^1023 stays representable
    _, exponent = math.frexp(max(abs(y) for _, y in points))
    scale = 2.0 ** max(exponent - 1, 0)
    t_bar = sum(t for t, _ in points) / len(points)
    y_bar = sum(y / scale for _, y in points) / len(points)
    num = sum((t - t_bar) * (y / scale - y_bar) for t, y in points)
    den = sum((t - t_bar) ** 2 for t, _ in points)
    if den == 0:
        return None
    return num / den * scale
