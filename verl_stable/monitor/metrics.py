"""Stability metrics as pure functions: tensors in, ``{"stable/...": float}`` out.

Notation (``/work/shared/reference/algorithms.md``): per response token, ``logp_mu`` is the inference engine's
log-probability of the sampled token (verl's ``rollout_log_probs``), ``logp_old`` the training engine's with the
same weights (``old_log_probs``, pi_old) and ``logp_theta`` the policy being updated. All per-token inputs are
``[batch, response_len]`` tensors aligned with a 0/1 ``mask`` of valid tokens; every mean is over valid tokens only.

Conventions shared by every function here:

* An all-zero mask (no valid token) returns an empty dict: the metric is skipped for that step, never NaN.
* Valid tokens whose inputs are not finite are excluded from the statistics and counted in a
  ``.../nonfinite_frac`` entry, so a NaN in one token neither hides the others nor poisons the mean.
* Wrong shapes, dtypes or parameters raise ``ValueError`` naming what was expected and what was received.

This module does not import verl.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

PREFIX = "stable"
TRAIN_INF = f"{PREFIX}/train_inf"
IS_WEIGHTS = f"{PREFIX}/is"
STALENESS = f"{PREFIX}/staleness"
ENTROPY = f"{PREFIX}/entropy"
ROUTING = f"{PREFIX}/routing"

DEFAULT_TAUS: tuple[float, ...] = (2.0, 5.0)


def _check_pair(name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.shape != ref.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)} but {ref_name} has shape {tuple(ref.shape)}")


def _valid_mask(mask: torch.Tensor, ref_name: str, ref: torch.Tensor) -> torch.Tensor:
    _check_pair("mask", mask, ref_name, ref)
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point() or mask.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            raise ValueError("mask must contain only 0 and 1")
        return mask != 0
    raise ValueError(f"mask has unsupported dtype {mask.dtype}")


def _float(x: torch.Tensor) -> float:
    return float(x.detach().double().item())


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float | None:
    """Mean of ``values`` over the positions where ``mask`` is 1; ``None`` when no position is valid.

    Args:
        values: tensor of any shape.
        mask: 0/1 or bool tensor of the same shape.

    Returns:
        ``sum(values * mask) / sum(mask)`` as a float, or ``None`` for an all-zero mask.
    """
    valid = _valid_mask(mask, "values", values)
    n = int(valid.sum())
    if n == 0:
        return None
    return _float(values.double()[valid].sum() / n)


def _finite_selection(
    mask: torch.Tensor, named: Mapping[str, torch.Tensor], ref_name: str
) -> tuple[torch.Tensor, int, float] | None:
    """Valid positions where every named tensor is finite, the valid count and the non-finite fraction."""
    ref = named[ref_name]
    valid = _valid_mask(mask, ref_name, ref)
    finite = torch.ones_like(valid)
    for name, tensor in named.items():
        _check_pair(name, tensor, ref_name, ref)
        if not tensor.is_floating_point():
            raise ValueError(f"{name} must be a floating point tensor, got {tensor.dtype}")
        finite &= torch.isfinite(tensor)
    n_valid = int(valid.sum())
    if n_valid == 0:
        return None
    keep = valid & finite
    return keep, n_valid, (n_valid - int(keep.sum())) / n_valid


def train_inference_metrics(
    logp_mu: torch.Tensor,
    logp_old: torch.Tensor,
    mask: torch.Tensor,
    taus: Sequence[float] = DEFAULT_TAUS,
) -> dict[str, float]:
    """Train-inference mismatch on sampled tokens: KL(mu || pi_old), extreme-token fractions, raw ratio stats.

    With ``d = logp_mu - logp_old`` on each valid token (tokens are sampled from mu):

    * ``kl_k1 = mean(d)`` and ``kl_k3 = mean(exp(-d) - 1 + d)``; both are unbiased estimators of
      KL(mu || pi_old) (``E_mu[exp(-d)] = 1``); k3 is non-negative per token and has lower variance.
    * ``extreme_frac_tau{tau} = mean(1[max(r, 1/r) > tau])`` with the raw ratio ``r = pi_old/mu = exp(-d)``
      (F(tau) of the R3 paper), for each ``tau > 1``.
    * ``ratio_mean/min/max`` of the raw (untruncated) ``r`` and ``log_ratio_abs_mean = mean(|d|)``.

    Args:
        logp_mu: inference log-probs of the sampled tokens, ``[batch, len]``.
        logp_old: training-engine log-probs of the same tokens with the same weights, same shape.
        mask: valid-token mask, same shape.
        taus: thresholds for F(tau), each > 1.

    Returns:
        ``{"stable/train_inf/...": float}``; empty when no token is valid.
    """
    for tau in taus:
        if not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau > 1):
            raise ValueError(f"every tau must be a finite number > 1, got {tau!r}")
    sel = _finite_selection(mask, {"logp_mu": logp_mu, "logp_old": logp_old}, "logp_mu")
    if sel is None:
        return {}
    keep, _, nonfinite = sel
    out = {f"{TRAIN_INF}/nonfinite_frac": nonfinite}
    if not bool(keep.any()):
        return out
    d = (logp_mu.double() - logp_old.double())[keep]
    ratio = torch.exp(-d)
    out[f"{TRAIN_INF}/kl_k1"] = _float(d.mean())
    out[f"{TRAIN_INF}/kl_k3"] = _float((ratio - 1 + d).mean())
    out[f"{TRAIN_INF}/ratio_mean"] = _float(ratio.mean())
    out[f"{TRAIN_INF}/ratio_min"] = _float(ratio.min())
    out[f"{TRAIN_INF}/ratio_max"] = _float(ratio.max())
    out[f"{TRAIN_INF}/log_ratio_abs_mean"] = _float(d.abs().mean())
    for tau in taus:
        # max(r, 1/r) > tau  <=>  |log r| > log tau, which avoids overflow of 1/r
        out[f"{TRAIN_INF}/extreme_frac_tau{tau:g}"] = _float((d.abs() > math.log(tau)).double().mean())
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
      TIS cap acted. Skipped for sequence-level weights, which are not comparable with a token ratio.

    Args:
        logp_mu: inference log-probs, ``[batch, len]``.
        logp_old: training-engine log-probs, same shape.
        mask: valid tokens before any correction (verl's ``loss_mask``), same shape.
        is_weights: applied IS weights (verl's ``rollout_is_weights``) or ``None``.
        kept_mask: mask after rejection (verl's rewritten ``response_mask``) or ``None``.
        token_level: whether ``is_weights`` are per-token ratios (verl ``rollout_is=token``).
        rtol: relative tolerance separating a truncated weight from the raw ratio.

    Returns:
        ``{"stable/train_inf/frac_masked": .., "stable/train_inf/frac_truncated": ..}``; empty for an empty mask.
    """
    named = {"logp_mu": logp_mu, "logp_old": logp_old}
    if is_weights is not None:
        named["is_weights"] = is_weights
    sel = _finite_selection(mask, named, "logp_mu")
    if sel is None:
        return {}
    keep, n_valid, _ = sel
    valid = _valid_mask(mask, "logp_mu", logp_mu)
    removed = torch.zeros_like(valid)
    if kept_mask is not None:
        removed |= valid & ~_valid_mask(kept_mask, "logp_mu", logp_mu)
    if is_weights is not None:
        removed |= keep & (is_weights == 0)
    out = {f"{TRAIN_INF}/frac_masked": int(removed.sum()) / n_valid}
    if is_weights is not None and token_level:
        ratio = torch.exp(logp_old.double() - logp_mu.double())
        w = is_weights.double()
        truncated = keep & ~removed & (w > 0) & (w < ratio * (1 - rtol))
        out[f"{TRAIN_INF}/frac_truncated"] = int(truncated.sum()) / n_valid
    return out


def effective_sample_size(weights: torch.Tensor, mask: torch.Tensor) -> float | None:
    """Normalised effective sample size of importance weights over the valid positions.

    ``ESS = (sum_i w_i)^2 / (n * sum_i w_i^2)`` with ``n`` the number of valid finite weights. It lies in
    ``(0, 1]``: 1 for uniform weights, ``1/n`` when a single weight carries everything. All-zero weights give
    0 (nothing effective); an empty mask gives ``None``.

    Args:
        weights: non-negative weights, any shape.
        mask: 0/1 mask of the same shape.
    """
    sel = _finite_selection(mask, {"weights": weights}, "weights")
    if sel is None:
        return None
    keep, _, _ = sel
    w = weights.double()[keep]
    if w.numel() == 0:
        return None
    if bool((w < 0).any()):
        raise ValueError("importance weights must be non-negative")
    sq = (w * w).sum()
    if float(sq) == 0.0:
        return 0.0
    return _float(w.sum() ** 2 / (w.numel() * sq))


def is_weight_metrics(is_weights: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Statistics of the applied IS weights: ``stable/is/{ess,weight_mean,weight_max}``; empty for an empty mask.

    ``ess`` is :func:`effective_sample_size` (normalised, token level).
    """
    ess = effective_sample_size(is_weights, mask)
    if ess is None:
        return {}
    keep = _valid_mask(mask, "is_weights", is_weights) & torch.isfinite(is_weights)
    w = is_weights.double()[keep]
    return {
        f"{IS_WEIGHTS}/ess": ess,
        f"{IS_WEIGHTS}/weight_mean": _float(w.mean()),
        f"{IS_WEIGHTS}/weight_max": _float(w.max()),
    }


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


def _check_trust_region(eps_low: float, eps_high: float) -> None:
    if not (0 <= eps_low < 1 and eps_high >= 0):
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got eps_low={eps_low}, eps_high={eps_high}")


def staleness_statistics(
    logp_theta: torch.Tensor,
    logp_old: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.27,
) -> dict[str, torch.Tensor]:
    """Policy staleness of one (micro-)batch as 0-d tensors, without reading anything back to the host.

    With ``d = clamp(logp_theta - logp_old, +-STALENESS_LOG_RATIO_BOUND)`` and ``r = pi_theta / pi_old = exp(d)``
    on the valid tokens (mean over valid tokens):

    * ``ratio_mean``, ``ratio_min``, ``ratio_max`` of ``r``; ``ratio_dev_max = max |r - 1|``;
    * ``log_ratio_abs_mean = mean |d|`` and ``kl_k3 = mean(r - 1 - d)``, the k3 estimator of
      KL(pi_old || pi_theta) on tokens drawn from the sampler (non-negative per token, 0 iff ``r = 1``);
    * ``frac_above = mean(1[r > 1 + eps_high])``, ``frac_below = mean(1[r < 1 - eps_low])`` and
      ``frac_outside_trust_region`` (their sum). The trust region is sign-agnostic: MiniRL masks only the side
      the advantage pushes towards, so the fraction it masks is at most ``frac_outside_trust_region``.

    Made to run inside a policy loss on every micro-batch: no host sync, and a value for every name whatever the
    input (verl averages loss metrics over micro-batches and requires the same keys on every rank). A mask with no
    valid token gives the on-policy values (ratios 1, deviations and fractions 0). Inputs must be finite at valid
    positions (the losses check that); values at masked positions are ignored, NaN included.

    Args:
        logp_theta: log-probs of the policy being updated, ``[batch, len]``.
        logp_old: pi_old log-probs of the same tokens, same shape.
        mask: 0/1 or bool valid-token mask, same shape.
        eps_low: lower trust-region width, ``0 <= eps_low < 1``.
        eps_high: upper trust-region width, ``>= 0``.

    Returns:
        ``{name: 0-d float64 tensor}`` for each name of :data:`STALENESS_NAMES`, on the inputs' device.
    """
    _check_trust_region(eps_low, eps_high)
    _check_pair("logp_old", logp_old, "logp_theta", logp_theta)
    for name, t in (("logp_theta", logp_theta), ("logp_old", logp_old)):
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating point tensor, got {t.dtype}")
    valid = _valid_mask(mask, "logp_theta", logp_theta)
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
    """:func:`staleness_statistics` as ``{"stable/staleness/<name>": float}``, with this module's conventions.

    Non-finite tokens are excluded and counted in ``stable/staleness/nonfinite_frac``; an empty mask gives an
    empty dict. Defaults are MiniRL's ``eps_low = 0.2, eps_high = 0.27``.
    """
    _check_trust_region(eps_low, eps_high)
    sel = _finite_selection(mask, {"logp_theta": logp_theta, "logp_old": logp_old}, "logp_theta")
    if sel is None:
        return {}
    keep, _, nonfinite = sel
    out = {f"{STALENESS}/nonfinite_frac": nonfinite}
    if not bool(keep.any()):
        return out
    stats = staleness_statistics(logp_theta, logp_old, keep, eps_low, eps_high)
    values = torch.stack(list(stats.values())).tolist()
    out.update({f"{STALENESS}/{name}": v for name, v in zip(stats, values, strict=True)})
    return out


def entropy_metrics(entropy: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Token entropy of pi_theta: ``stable/entropy/mean`` = mean over valid finite tokens (no length weighting).

    Returns an empty dict for an empty mask; non-finite entries are counted in ``stable/entropy/nonfinite_frac``.
    """
    sel = _finite_selection(mask, {"entropy": entropy}, "entropy")
    if sel is None:
        return {}
    keep, _, nonfinite = sel
    out = {f"{ENTROPY}/nonfinite_frac": nonfinite}
    if bool(keep.any()):
        out[f"{ENTROPY}/mean"] = _float(entropy.double()[keep].mean())
    return out


def window_slope(values: Sequence[float]) -> float | None:
    """Least-squares slope per step of ``values`` observed at consecutive steps ``0, 1, ..., n-1``.

    ``slope = sum((t - t_bar) * (y - y_bar)) / sum((t - t_bar)^2)``. Non-finite values are dropped (their step
    index is kept); fewer than two finite values give ``None``.
    """
    points = [(t, float(y)) for t, y in enumerate(values) if y is not None and math.isfinite(float(y))]
    if len(points) < 2:
        return None
    t_bar = sum(t for t, _ in points) / len(points)
    y_bar = sum(y for _, y in points) / len(points)
    num = sum((t - t_bar) * (y - y_bar) for t, y in points)
    den = sum((t - t_bar) ** 2 for t, _ in points)
    return num / den


def routing_disagreement_metrics(disagreement: Mapping[str, object], name: str) -> dict[str, float]:
    """Name the result of :func:`verl_stable.routing.disagreement.routing_disagreement` under ``stable/routing``.

    Scalars ``key`` become ``stable/routing/{name}/{key}``; the per-layer sequence ``per_layer`` becomes
    ``stable/routing/{name}/layer_{i}`` (i = MoE-layer ordinal); other 1-D sequences become
    ``stable/routing/{name}/{key}/{i}``. ``name`` says which pair was compared, e.g. ``rollout_vs_train`` (R3's
    signal) or ``r2_drift`` (old-logprob pass vs a later mini-step).

    Args:
        disagreement: mapping of metric name to a number, 0-d tensor or 1-D sequence / tensor.
        name: a path segment without ``/``.
    """
    if not name or "/" in name:
        raise ValueError(f"name must be a non-empty path segment without '/', got {name!r}")
    out: dict[str, float] = {}
    for key, value in disagreement.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().double().reshape(-1).tolist() if value.dim() > 0 else float(value)
        if isinstance(value, (int, float)):
            out[f"{ROUTING}/{name}/{key}"] = float(value)
        elif isinstance(value, Sequence) and not isinstance(value, str):
            fmt = "layer_{i}" if key == "per_layer" else f"{key}/{{i}}"
            for i, v in enumerate(value):
                out[f"{ROUTING}/{name}/{fmt.format(i=i)}"] = float(v)
        else:
            raise ValueError(f"routing disagreement entry {key!r} is neither a number nor a sequence: {value!r}")
    return out


def expert_load_balance(
    ids: torch.Tensor,
    num_experts: int | None = None,
    row_mask: torch.Tensor | None = None,
    skip_all_zero_layers: bool = True,
) -> dict[str, float]:
    """Per-layer expert load balance of routed expert ids ``[tokens, layers, top_k]``.

    For each layer, ``load_e`` counts the (token, slot) assignments to expert ``e`` over the rows kept by
    ``row_mask``; with ``mean = tokens * top_k / num_experts``:

    * ``stable/routing/load/layer_{l}/max_over_mean = max_e load_e / mean`` (1 = perfectly balanced, up to
      ``num_experts`` when one expert takes everything);
    * ``stable/routing/load/layer_{l}/cv = std_e(load_e) / mean`` (population std);
    * ``stable/routing/load/max_over_mean`` and ``.../cv``: the worst layer.

    Layers whose ids are all zero are dense layers in verl's rollout traces (zero rows) and are skipped when
    ``skip_all_zero_layers``; the layer index ``l`` is the position in ``ids``.

    Args:
        ids: integer expert ids, ``[tokens, layers, top_k]``.
        num_experts: number of routed experts; inferred as ``max(ids) + 1`` when ``None`` (a lower bound).
        row_mask: ``[tokens]`` 0/1 mask of rows to count (e.g. rows that carry routing data).
        skip_all_zero_layers: skip layers with no non-zero id.

    Returns:
        The metrics above; empty when no row is kept or every layer is skipped.
    """
    if not isinstance(ids, torch.Tensor) or ids.dim() != 3:
        raise ValueError(f"ids must be a [tokens, layers, top_k] tensor, got {getattr(ids, 'shape', type(ids))}")
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"ids must be an integer tensor, got {ids.dtype}")
    if row_mask is not None:
        if row_mask.shape != ids.shape[:1]:
            raise ValueError(f"row_mask has shape {tuple(row_mask.shape)}, expected ({ids.shape[0]},)")
        ids = ids[row_mask.bool()]
    if ids.shape[0] == 0:
        return {}
    ids = ids.long()
    lo, hi = int(ids.min()), int(ids.max())
    if num_experts is None:
        num_experts = hi + 1
    if num_experts < 1 or lo < 0 or hi >= num_experts:
        raise ValueError(f"expert ids must lie in [0, {num_experts}), got range [{lo}, {hi}]")
    tokens, layers, top_k = ids.shape
    mean_load = tokens * top_k / num_experts
    out: dict[str, float] = {}
    worst_mom, worst_cv = None, None
    for layer in range(layers):
        layer_ids = ids[:, layer, :].reshape(-1)
        if skip_all_zero_layers and not bool(layer_ids.any()):
            continue
        load = torch.bincount(layer_ids, minlength=num_experts).double()
        mom = float(load.max()) / mean_load
        cv = float(load.std(unbiased=False)) / mean_load
        out[f"{ROUTING}/load/layer_{layer}/max_over_mean"] = mom
        out[f"{ROUTING}/load/layer_{layer}/cv"] = cv
        worst_mom = mom if worst_mom is None else max(worst_mom, mom)
        worst_cv = cv if worst_cv is None else max(worst_cv, cv)
    if worst_mom is not None:
        out[f"{ROUTING}/load/max_over_mean"] = worst_mom
        out[f"{ROUTING}/load/cv"] = worst_cv
    return out
