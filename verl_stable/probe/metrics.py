"""The probe's numbers: the monitor's formulas, one per metric, on the probe's tensors, with their sampling errors.

Pure torch. Each metric is computed by the function the stability monitor (or the replay engine) uses in a run, and
keyed by the name verl logs it under at step 1, so a probe and a run compare name for name:

* train-inference mismatch (:func:`verl_stable.monitor.train_inference.train_inference_metrics`) on the sampled
  tokens, ``d = log mu - log pi``: ``stable/train_inf/kl_k3 = mean(exp(-d) - 1 + d)``, ``kl_k1 = mean(d)``,
  ``extreme_frac_tau{tau} = mean(1[|d| > log tau])`` (F(tau)), ``ratio_min / ratio_max`` of ``r = pi / mu = exp(-d)``
  (the IS-weight tail), ``log_ratio_abs_median``;
* ``probe/is_ess``: the normalised effective sample size of the raw token IS weights ``r``
  (:func:`~verl_stable.monitor.train_inference.effective_sample_size`), ``(sum r)^2 / (n sum r^2)``;
* routing (:func:`verl_stable.routing.disagreement.routing_disagreement`) over the (token, MoE layer) rows both sides
  route, positions ``[0, P + R - 1)`` of every sample (the rows verl compares: prompt and response, not the last
  sampled token): ``d[n, l] = 1[set(a[n, l]) != set(b[n, l])]``, ``stable/routing/disagreement = sum d / rows``,
  ``disagreement/layer_<l>`` per MoE layer, ``layer_max`` the worst, ``token_any_layer`` the share of tokens with a
  flip in any layer; ``probe/response_disagreement`` the same over the response rows ``[P, P + R - 1)`` only.

Sampling error (:func:`ratio_standard_error`): every metric above is a ratio ``Q = sum_s y_s / sum_s n_s`` over the
``S`` samples (``y_s`` the sample's sum of per-token terms or of differing rows, ``n_s`` its tokens or rows); tokens of
one sample are not independent, so the error is the cluster (linearised) one over samples,
``SE(Q) = sqrt(S / (S - 1) * sum_s (y_s - Q n_s)^2) / sum_s n_s``. A probe and a run of other samples agree within
sampling error when their difference is within a few ``sqrt(SE_a^2 + SE_b^2)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from verl_stable.metric_names import ROUTING, TRAIN_INF
from verl_stable.monitor.train_inference import (
    DEFAULT_TAUS,
    effective_sample_size,
    k3_terms,
    train_inference_metrics,
)
from verl_stable.routing.disagreement import routing_disagreement
from verl_stable.routing.trace import RoutingTrace

__all__ = [
    "DISAGREEMENT",
    "KL_K3",
    "ROUTER_DISAGREEMENT",
    "flip_metrics",
    "mismatch_metrics",
    "padded",
    "ratio_standard_error",
]

KL_K3 = f"{TRAIN_INF}/kl_k3"
DISAGREEMENT = f"{ROUTING}/disagreement"
ROUTER_DISAGREEMENT = f"{ROUTING}/router_disagreement"


def padded(rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample 1-D tensors -> ``[S, max_len]`` float64 (zeros past each end) and the bool mask of real entries."""
    if not rows:
        raise ValueError("need at least one sample")
    width = max(int(r.numel()) for r in rows)
    values = torch.zeros(len(rows), width, dtype=torch.float64)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        values[i, : r.numel()] = r.detach().double().reshape(-1)
        mask[i, : r.numel()] = True
    return values, mask


def ratio_standard_error(numerators: torch.Tensor, denominators: torch.Tensor) -> float:
    """Cluster standard error of ``Q = sum y / sum n`` over samples (module docstring); NaN below 2 samples.

    Args:
        numerators: ``[S]`` per-sample sums ``y_s``.
        denominators: ``[S]`` per-sample counts ``n_s`` (> 0 in total).
    """
    y, n = numerators.double().reshape(-1), denominators.double().reshape(-1)
    if y.shape != n.shape:
        raise ValueError(f"numerators {tuple(y.shape)} and denominators {tuple(n.shape)} differ in shape")
    samples, total = int(y.numel()), float(n.sum())
    if samples < 2 or total <= 0:
        return math.nan
    q = float(y.sum()) / total
    return math.sqrt(samples / (samples - 1) * float(((y - q * n) ** 2).sum())) / total


def mismatch_metrics(
    logp_mu: Sequence[torch.Tensor], logp_pi: Sequence[torch.Tensor], taus: Sequence[float] = DEFAULT_TAUS
) -> dict[str, float]:
    """Train-inference mismatch of the sampled tokens under the monitor's names (module docstring).

    Args:
        logp_mu: per sample, the engine's ``log mu`` of its ``R_s`` sampled tokens.
        logp_pi: per sample, the training forward's ``log pi`` of the same tokens.
        taus: thresholds of F(tau).

    Returns:
        :func:`train_inference_metrics`' ``stable/train_inf/...`` values, ``probe/is_ess``, ``probe/kl_k3_se`` (the
        cluster SE of ``kl_k3``) and ``probe/tokens``.
    """
    if len(logp_mu) != len(logp_pi):
        raise ValueError(f"{len(logp_mu)} inference samples but {len(logp_pi)} training samples")
    for s, (a, b) in enumerate(zip(logp_mu, logp_pi, strict=True)):
        if a.numel() != b.numel():
            raise ValueError(f"sample {s}: {a.numel()} inference log-probs but {b.numel()} training log-probs")
    mu, mask = padded(logp_mu)
    pi, _ = padded(logp_pi)
    out = train_inference_metrics(mu, pi, mask, taus)
    ess = effective_sample_size(torch.exp(pi - mu), mask)
    if ess is not None:
        out["probe/is_ess"] = ess
    k3, _ = k3_terms(mu - pi)
    out["probe/kl_k3_se"] = ratio_standard_error((k3 * mask).sum(dim=1), mask.sum(dim=1))
    out["probe/tokens"] = float(mask.sum())
    return out


def _trace(rows: Sequence[torch.Tensor], num_experts: int, layers: Sequence[int]) -> RoutingTrace:
    return RoutingTrace.from_tensor(
        torch.cat([r.to(torch.long) for r in rows]), num_experts, [int(r.shape[0]) for r in rows], list(layers)
    )


def _per_sample_flips(reference: Sequence[torch.Tensor], other: Sequence[torch.Tensor]) -> tuple[list, list]:
    """Per sample: differing (token, layer) rows with data on both sides, and such rows compared."""
    from verl_stable.routing.disagreement import expert_sets_differ

    differ, compared = [], []
    for a, b in zip(reference, other, strict=True):
        both = (a[..., 0] >= 0) & (b[..., 0] >= 0)
        differ.append(int((expert_sets_differ(a.to(torch.long), b.to(torch.long)) & both).sum()))
        compared.append(int(both.sum()))
    return differ, compared


def flip_metrics(
    reference: Sequence[torch.Tensor],
    other: Sequence[torch.Tensor],
    prompt_lengths: Sequence[int],
    num_experts: int,
    moe_layers: Sequence[int],
    name: str = "disagreement",
) -> dict[str, float]:
    """Routing disagreement of two routings of the same samples, as the replay engine logs it (module docstring).

    Args:
        reference: per sample, ``[rows_s, M, K]`` ids of the rollout (positions ``[0, P_s + R_s - 1)``).
        other: per sample, the training pass's ids of the same positions (extra trailing rows are ignored).
        prompt_lengths: ``P_s`` per sample (where the response rows start).
        num_experts: experts per MoE layer.
        moe_layers: the absolute decoder layer of each MoE-layer ordinal.
        name: ``disagreement`` (experts used) or ``router_disagreement`` (the router's own choice).

    Returns:
        ``stable/routing/{name}``, ``.../layer_<l>``, ``.../layer_max``, ``.../token_any_layer`` (``{name}`` =
        ``disagreement`` only: verl logs the others for it), ``probe/{name}_se``, ``probe/{name}_response`` and
        ``probe/{name}_rows``.
    """
    if not (len(reference) == len(other) == len(prompt_lengths)) or not reference:
        raise ValueError(
            f"need the same number (>= 1) of reference, other and prompt lengths, got {len(reference)}, "
            f"{len(other)}, {len(prompt_lengths)}"
        )
    other = [o[: r.shape[0]] for r, o in zip(reference, other, strict=True)]
    whole = routing_disagreement(_trace(reference, num_experts, moe_layers), _trace(other, num_experts, moe_layers))
    response = routing_disagreement(
        _trace([r[p:] for r, p in zip(reference, prompt_lengths, strict=True)], num_experts, moe_layers),
        _trace([o[p:] for o, p in zip(other, prompt_lengths, strict=True)], num_experts, moe_layers),
    )
    key = f"{ROUTING}/{name}"
    out = {key: whole["overall"]}
    if name == "disagreement":
        out.update({f"{key}/layer_{i}": v for i, v in enumerate(whole["per_layer"])})
        out[f"{key}/layer_max"] = whole["layer_max"]
        out[f"{key}/token_any_layer"] = whole["token_any_layer"]
    differ, compared = _per_sample_flips(reference, other)
    out[f"probe/{name}_se"] = ratio_standard_error(torch.tensor(differ), torch.tensor(compared))
    out[f"probe/{name}_response"] = response["overall"]
    out[f"probe/{name}_rows"] = float(whole["compared_rows"])
    return out
