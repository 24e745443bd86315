"""Train-inference mismatch metrics: KL(mu || pi_old), extreme-token fractions, what the IS correction did, IS ESS.

Inputs are per response token, ``[batch, response_len]``: ``logp_mu`` from the inference engine (verl's
``rollout_log_probs``), ``logp_old`` from the training engine with the same weights (``old_log_probs``), a 0/1
valid-token mask and, optionally, the IS weights verl applied. Symbols are defined in ``docs/reference/notation.md``;
input checks and the treatment of non-finite values are those of :mod:`verl_stable.monitor.common`.

A mismatch too large for float64 is reported as ``inf`` (and trips the guard's ``train_inference_kl`` rule), never
skipped: a token that one engine gives probability zero (log-prob ``-inf``) and the other does not has an infinite
log ratio. This module does not import verl.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from verl_stable.monitor.common import (
    IS_WEIGHTS,
    TRAIN_INF,
    check_bool,
    check_like,
    check_number_sequence,
    check_real,
    check_tensor,
    exp_or_inf,
    mean_from_logs,
    safe_mean,
    selection,
    to_float,
    usable_log_prob_pair,
    valid_mask,
)

DEFAULT_TAUS: tuple[float, ...] = (2.0, 5.0)


def _check_taus(taus: Sequence[float]) -> list[tuple[float, str]]:
    """Each tau as ``(value, key suffix)``; two taus whose keys would collide raise instead of overwriting."""
    keys: dict[str, float] = {}
    for raw in check_number_sequence("taus", taus):
        tau = check_real("tau", raw)
        if not (math.isfinite(tau) and tau > 1):
            raise ValueError(f"every tau must be a finite number > 1, got {tau!r}")
        key = f"extreme_frac_tau{tau:g}"
        if key in keys and keys[key] != tau:
            raise ValueError(f"taus {keys[key]:g} and {tau!r} share the metric name {key!r}: give distinct taus")
        keys[key] = tau
    return [(tau, key) for key, tau in keys.items()]


def _log_prob_pair(
    logp_mu: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, int, float] | None:
    check_tensor("logp_mu", logp_mu, floating=True)
    check_like("logp_old", logp_old, "logp_mu", logp_mu, floating=True)
    return selection(mask, "logp_mu", logp_mu, usable_log_prob_pair(logp_mu, logp_old))


def k3_terms(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``k3(d) = exp(-d) - 1 + d >= 0`` and its log, the log finite wherever ``d`` is.

    ``k3`` is evaluated as ``expm1(-d) + d``, which keeps its precision for ``|d| << 1`` (where ``exp(-d) - 1 + d``
    cancels to 0 at ``d ~ 1e-8``). Where it overflows (``-d > 709.78``), ``log k3 = -d + log(1 + (d - 1) e^d)``
    equals ``-d`` to float64 precision; at ``d = +inf``, ``k3 ~ d`` so its log is ``+inf``. ``k3 = 0`` has log
    ``-inf`` (a zero term).
    """
    k3 = (torch.expm1(-d) + d).clamp_min(0)  # >= 0 exactly; rounding can leave -1 ulp
    overflowed = torch.where(d < 0, -d, torch.log(d.abs()))
    return k3, torch.where(torch.isfinite(k3), torch.log(k3), overflowed)


def _mean_of_terms(terms: torch.Tensor, log_terms: torch.Tensor) -> float:
    """Mean of non-negative terms: the plain (:func:`safe_mean`) mean when every term is finite, else from logs."""
    return safe_mean(terms) if bool(torch.isfinite(terms).all()) else mean_from_logs(log_terms)


def train_inference_metrics(
    logp_mu: torch.Tensor,
    logp_old: torch.Tensor,
    mask: torch.Tensor,
    taus: Sequence[float] = DEFAULT_TAUS,
) -> dict[str, float]:
    """Train-inference mismatch on sampled tokens: KL(mu || pi_old), extreme-token fractions, raw ratio stats.

    With ``d = logp_mu - logp_old`` on each valid usable token (tokens are sampled from mu), ``n`` of them:

    * ``kl_k1 = mean(d)`` and ``kl_k3 = mean(exp(-d) - 1 + d)``; both are unbiased estimators of
      KL(mu || pi_old) (``E_mu[exp(-d)] = 1``); k3 is non-negative per token and has lower variance. k3 is
      averaged from the terms' logs when a term overflows (:func:`k3_terms`), so it is ``inf`` only when the mean
      itself exceeds float64, not when a sum or one token's term does; ``ratio_mean`` likewise.
    * ``extreme_frac_tau{tau} = mean(1[max(r, 1/r) > tau])`` with the raw ratio ``r = pi_old/mu = exp(-d)``
      (F(tau) of the R3 paper), for each ``tau > 1``, evaluated as ``|d| > log tau``.
    * ``ratio_mean/min/max`` of the raw (untruncated) ``r`` and ``log_ratio_abs_mean = mean(|d|)``.
    * ``log_ratio_abs_median``: the lower median of ``|d|`` over the step's tokens (the ``ceil(n/2)``-th smallest),
      the typical token's log-probability gap. The means above are sums over tokens, so one token the two engines
      disagree on by a factor of 7 (``|d| = 1.9``) among a hundred moves them as much as every other token together;
      the median moves only when half the tokens do.
    * ``nonfinite_frac``: fraction of valid tokens left out because their log ratio is undefined (NaN or
      ``+inf`` in either input, ``-inf`` in both).

    A ``-inf`` log-prob on one side is probability zero: ``d = +-inf``, so ``kl_k3``, ``log_ratio_abs_mean`` (the
    median only when half the tokens are such) and one of ``ratio_max = inf`` / ``ratio_min = 0`` follow. ``kl_k1``
    is omitted when ``d`` holds both ``+inf`` and ``-inf`` (its mean has no value). Log-probs above 0 are not
    rejected: the estimators are defined for any ``d``.

    Args:
        logp_mu: inference log-probs of the sampled tokens, ``[batch, len]``, floating point.
        logp_old: training-engine log-probs of the same tokens with the same weights, same shape.
        mask: valid-token mask, same shape.
        taus: thresholds for F(tau), each a finite number > 1.

    Returns:
        ``{"stable/train_inf/...": float}``; empty when no token is valid, only ``nonfinite_frac`` when no valid
        token is usable.
    """
    keyed_taus = _check_taus(taus)
    sel = _log_prob_pair(logp_mu, logp_old, mask)
    if sel is None:
        return {}
    keep, _, unusable = sel
    out = {f"{TRAIN_INF}/nonfinite_frac": unusable}
    if not bool(keep.any()):
        return out
    d = (logp_mu.detach().double() - logp_old.detach().double())[keep]
    k1 = safe_mean(d)
    if not math.isnan(k1):
        out[f"{TRAIN_INF}/kl_k1"] = k1
    out[f"{TRAIN_INF}/kl_k3"] = _mean_of_terms(*k3_terms(d))
    out[f"{TRAIN_INF}/ratio_mean"] = _mean_of_terms(torch.exp(-d), -d)
    out[f"{TRAIN_INF}/ratio_min"] = exp_or_inf(-float(d.max()))
    out[f"{TRAIN_INF}/ratio_max"] = exp_or_inf(-float(d.min()))
    gap = d.abs()
    out[f"{TRAIN_INF}/log_ratio_abs_mean"] = safe_mean(gap)
    out[f"{TRAIN_INF}/log_ratio_abs_median"] = to_float(gap.median())  # torch's median is the lower one
    for tau, key in keyed_taus:
        # max(r, 1/r) > tau  <=>  |log r| > log tau, which avoids overflow of r and 1/r
        out[f"{TRAIN_INF}/{key}"] = to_float((gap > math.log(tau)).double().mean())
    return out


def correction_metrics(
    logp_mu: torch.Tensor,
    logp_old: torch.Tensor,
    mask: torch.Tensor,
    is_weights: torch.Tensor | None = None,
    kept_mask: torch.Tensor | None = None,
    token_level: bool = True,
    rtol: float = 1e-4,
) -> dict[str, float]:
    """What the rollout correction did to the valid tokens: fraction truncated and fraction masked.

    Compares the applied IS weight ``w`` with the raw token ratio ``r = exp(logp_old - logp_mu)``:

    * ``frac_masked``: valid tokens removed from the loss, i.e. ``kept_mask == 0`` (rejection sampling) or
      ``w == 0`` (IcePop-style masking).
    * ``frac_truncated`` (``token_level`` only): kept tokens with ``0 < w < r * (1 - rtol)``, i.e. a token-level
      TIS cap acted (an infinite ``r``, ``logp_mu = -inf``, with a finite ``w`` counts). Skipped for
      sequence-level weights, which are not comparable with a token ratio.

    Both fractions are over all valid tokens; tokens whose log ratio is undefined or whose weight is not finite
    cannot be classified and count in neither numerator.

    Args:
        logp_mu: inference log-probs, ``[batch, len]``.
        logp_old: training-engine log-probs, same shape.
        mask: valid tokens before any correction (verl's ``loss_mask``), same shape.
        is_weights: applied IS weights (verl's ``rollout_is_weights``), non-negative, or ``None``.
        kept_mask: mask after rejection (verl's rewritten ``response_mask``) or ``None``.
        token_level: whether ``is_weights`` are per-token ratios (verl ``rollout_is=token``).
        rtol: relative tolerance separating a truncated weight from the raw ratio, in ``[0, 1)``.

    Returns:
        ``{"stable/train_inf/frac_masked": .., "stable/train_inf/frac_truncated": ..}``; empty for an empty mask.
    """
    check_bool("token_level", token_level)
    rtol = check_real("rtol", rtol)
    if not (math.isfinite(rtol) and 0 <= rtol < 1):
        raise ValueError(f"rtol must be a finite number in [0, 1), got {rtol!r}")
    sel = _log_prob_pair(logp_mu, logp_old, mask)
    if is_weights is not None:
        check_like("is_weights", is_weights, "logp_mu", logp_mu, floating=True)
    kept = None if kept_mask is None else valid_mask(kept_mask, "logp_mu", logp_mu, name="kept_mask")
    if sel is None:
        return {}
    keep, n_valid, _ = sel
    valid = valid_mask(mask, "logp_mu", logp_mu)
    removed = torch.zeros_like(valid)
    if kept is not None:
        removed |= valid & ~kept
    if is_weights is not None:
        negative = valid & (is_weights < 0)
        if bool(negative.any()):
            raise ValueError(f"is_weights must be non-negative, got {is_weights[negative].reshape(-1)[0].item():g}")
        keep = keep & torch.isfinite(is_weights)
        removed |= keep & (is_weights == 0)
    out = {f"{TRAIN_INF}/frac_masked": int(removed.sum()) / n_valid}
    if is_weights is not None and token_level:
        ratio = torch.exp(logp_old.detach().double() - logp_mu.detach().double())
        w = is_weights.detach().double()
        truncated = keep & ~removed & (w > 0) & (w < ratio * (1 - rtol))
        out[f"{TRAIN_INF}/frac_truncated"] = int(truncated.sum()) / n_valid
    return out


def _weight_selection(name: str, weights: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, float] | None:
    """Valid non-NaN weights (checked non-negative) and the NaN fraction; ``None`` for an empty mask."""
    check_tensor(name, weights, floating=True)
    sel = selection(mask, name, weights, ~torch.isnan(weights))
    if sel is None:
        return None
    keep, _, unusable = sel
    w = weights.detach().double()[keep]
    if bool((w < 0).any()):
        raise ValueError(f"importance weights must be non-negative, got {float(w[w < 0][0]):g}")
    return w, unusable


def _ess(w: torch.Tensor) -> float:
    n = w.numel()
    infinite = torch.isposinf(w)
    if bool(infinite.any()):
        return int(infinite.sum()) / n  # the k infinite weights carry everything: the limit k / n
    peak = float(w.max())
    if peak == 0.0:
        return 0.0
    w = w / peak  # ESS is scale-invariant; this keeps w^2 from overflowing
    return to_float(w.sum() ** 2 / (n * (w * w).sum()))


def effective_sample_size(weights: torch.Tensor, mask: torch.Tensor) -> float | None:
    """Normalised effective sample size of importance weights over the valid positions.

    ``ESS = (sum_i w_i)^2 / (n * sum_i w_i^2)`` with ``n`` the number of valid non-NaN weights, evaluated on
    ``w / max(w)`` (the ratio is scale-invariant) so that no square overflows. It lies in ``(0, 1]``: 1 for
    uniform weights, ``1/n`` when a single weight carries everything. All-zero weights give 0 (nothing effective);
    ``k`` infinite weights give ``k / n``, the limit as they grow together. NaN weights are left out.

    Args:
        weights: non-negative floating point weights, any shape (a negative weight raises ``ValueError``).
        mask: 0/1 mask of the same shape.

    Returns:
        The ESS, or ``None`` when no valid position holds a non-NaN weight.
    """
    sel = _weight_selection("weights", weights, mask)
    if sel is None or sel[0].numel() == 0:
        return None
    return _ess(sel[0])


def is_weight_metrics(is_weights: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Statistics of the applied IS weights: ``stable/is/{ess,weight_mean,weight_max,nonfinite_frac}``.

    ``ess`` is :func:`effective_sample_size` (normalised, token level); ``weight_mean`` (:func:`safe_mean`) and
    ``weight_max`` are over the valid non-NaN weights, ``inf`` when one is infinite; ``nonfinite_frac`` is the
    fraction of valid weights that are NaN. Empty for an empty mask, only ``nonfinite_frac`` when every valid
    weight is NaN.
    """
    sel = _weight_selection("is_weights", is_weights, mask)
    if sel is None:
        return {}
    w, unusable = sel
    out = {f"{IS_WEIGHTS}/nonfinite_frac": unusable}
    if w.numel():
        out[f"{IS_WEIGHTS}/ess"] = _ess(w)
        out[f"{IS_WEIGHTS}/weight_mean"] = safe_mean(w)
        out[f"{IS_WEIGHTS}/weight_max"] = float(w.max())
    return out
