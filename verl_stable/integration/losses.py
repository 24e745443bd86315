"""verl policy losses ``minirl`` and ``vespo``: thin adapters from verl's registry to :mod:`verl_stable.algos`.

verl's ``ppo_loss`` calls a registered loss with ``old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode, config (ActorConfig), rollout_is_weights``. The adapters read their hyperparameters from the
actor config, run the pure-torch loss, aggregate with verl's own ``agg_loss`` and ``config.global_batch_info``
(so the loss is invariant to micro-batching and data parallelism exactly as verl's built-in losses are) and
return scalar metrics under verl's names (``actor/pg_clipfrac``, ``actor/ppo_kl``) and ours
(``actor/MiniRL/...``, ``actor/vespo/...``). verl's trainer reduces the per-mini-step values of a key by substring
(``"max"`` in the key: max, ``"min"``: min, otherwise mean), so no prefix may contain ``min`` or ``max``: a
``actor/minirl/`` prefix would log the minimum over mini-steps of every MiniRL metric, hence ``MiniRL``.

Staleness. Both losses also return the pi_theta / pi_old statistics of
:func:`verl_stable.monitor.metrics.staleness_statistics` as ``actor/stable/staleness/<name>``, with the trust region
``eps_low, eps_high = clip_ratio_low, clip_ratio_high`` (VESPO has no trust region of its own: verl's clip ratios
only define the fraction reported outside it). How verl 0.9.1 turns them into logged numbers:

1. ``ppo_loss`` wraps every loss metric in ``Metric(MEAN)``; within one update mini-step the engine collects the
   micro-batches' values, so a mini-step's value is the unweighted mean over its micro-batches and data-parallel
   ranks (``Metric.aggregate_dp``). The replay engine (:mod:`verl_stable.integration.fsdp_engine`) re-labels our
   ``*_max`` / ``*_min`` keys as ``Metric(MAX / MIN)`` (:func:`stable_metric_aggregation`), so those are true
   extremes over the mini-step; under another engine they stay micro-batch means.
2. ``train_mini_batch`` returns one value per mini-step (epochs x mini-batches, in order); the trainer reduces the
   list with ``reduce_metrics`` (max if the key contains ``max``, min if ``min``, else mean) and logs
   ``actor/stable/staleness/<name>``. The monitored trainers (:mod:`verl_stable.integration.trainer`) log the
   per-mini-step values too.

Where the extra hyperparameters live
------------------------------------
The trust region of ``minirl`` is verl's own ``actor.clip_ratio_low`` / ``actor.clip_ratio_high``. The other
knobs cannot go into verl's ``PolicyLossConfig``: it is a frozen dataclass that rejects unknown keys when
Hydra instantiates it (and no field of it is a free-form dict). So this module defines
:class:`StablePolicyLossConfig`, a subclass of ``PolicyLossConfig`` with two sections, selected through the
``_target_`` verl already uses for that node::

    actor_rollout_ref.actor.policy_loss._target_=verl_stable.integration.losses.StablePolicyLossConfig
    +actor_rollout_ref.actor.policy_loss.minirl.allow_missing_rollout_is_weights=true
    +actor_rollout_ref.actor.policy_loss.vespo.c1_pos=2.0   # also c2_pos, c1_neg, c2_neg

Without the subclass (plain ``PolicyLossConfig``) both losses run with the paper's defaults. Everything else in
verl keeps working, since the subclass only adds fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from verl.base_config import BaseConfig
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, agg_loss, register_policy_loss
from verl.utils.metric import AggregationType, Metric
from verl.workers.config import PolicyLossConfig

from verl_stable.algos.minirl import minirl_policy_loss
from verl_stable.algos.token_batch import PolicyLossTerms
from verl_stable.algos.vespo import VespoKernel, vespo_policy_loss
from verl_stable.metric_names import TRANSPORT
from verl_stable.monitor.metrics import STALENESS, staleness_statistics
from verl_stable.schema import MiniRLOptions, VespoOptions, parse, to_plain

#: Prefix of the staleness metrics the losses return (verl logs them as is; the monitor moves them to ``stable/``).
STALENESS_METRIC_PREFIX = f"actor/{STALENESS}/"

SECTION_KEY = "actor_rollout_ref.actor.policy_loss"

_AGG_KEYS = ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")

MISSING_IS_WEIGHTS_MESSAGE = (
    "policy loss 'minirl' needs per-token rollout importance weights w = min(pi_old/mu, C), and verl passed "
    "rollout_is_weights=None. Produce them with: algorithm.rollout_correction.rollout_is=token "
    "algorithm.rollout_correction.rollout_is_threshold=5.0 algorithm.rollout_correction.bypass_mode=false "
    "actor_rollout_ref.rollout.calculate_log_probs=true. If training and inference compute identical "
    "probabilities (single engine, so w = 1 exactly), opt out explicitly with "
    "actor_rollout_ref.actor.policy_loss._target_=verl_stable.integration.losses.StablePolicyLossConfig "
    "+actor_rollout_ref.actor.policy_loss.minirl.allow_missing_rollout_is_weights=true"
)


@dataclass
class MiniRLLossConfig(BaseConfig):
    """Options of the ``minirl`` policy loss beyond verl's clip ratios (schema: :class:`verl_stable.schema.MiniRLOptions`).

    Args:
        allow_missing_rollout_is_weights (bool): Accept ``rollout_is_weights=None`` and use ``w = 1``. Only right
            when the training engine reproduces the sampler's probabilities; the paper finds that dropping the
            weight otherwise collapses training. Default False (missing weights raise).
    """

    allow_missing_rollout_is_weights: bool = False

    def __post_init__(self) -> None:
        _check_section(self, MiniRLOptions, "minirl")


@dataclass
class VespoLossConfig(BaseConfig):
    """Constants of the VESPO kernel ``phi(W) = W^c1 * exp(c2 * (1 - W))``; defaults are the paper's.

    Schema: :class:`verl_stable.schema.VespoOptions` (finite numbers >= 0).

    Args:
        c1_pos (float): ``c1`` for ``A > 0``.
        c2_pos (float): ``c2`` for ``A > 0``.
        c1_neg (float): ``c1`` for ``A < 0``.
        c2_neg (float): ``c2`` for ``A < 0``.
    """

    c1_pos: float = 2.0
    c2_pos: float = 3.0
    c1_neg: float = 3.0
    c2_neg: float = 2.0

    def __post_init__(self) -> None:
        _check_section(self, VespoOptions, "vespo")


@dataclass
class StablePolicyLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus the ``minirl`` and ``vespo`` sections (see the module docstring).

    Args:
        minirl (MiniRLLossConfig): Options of the ``minirl`` loss.
        vespo (VespoLossConfig): Kernel constants of the ``vespo`` loss.
    """

    minirl: MiniRLLossConfig = field(default_factory=MiniRLLossConfig)
    vespo: VespoLossConfig = field(default_factory=VespoLossConfig)

    def __post_init__(self) -> None:
        # Hydra hands nested sections without their own _target_ over as mappings; make them typed (and frozen).
        for name, cls in (("minirl", MiniRLLossConfig), ("vespo", VespoLossConfig)):
            value = getattr(self, name)
            if not isinstance(value, cls):
                object.__setattr__(self, name, section_from_mapping(cls, value, name))


_SCHEMAS: dict[type, type] = {MiniRLLossConfig: MiniRLOptions, VespoLossConfig: VespoOptions}


def _check_section(section: Any, schema: type, name: str) -> None:
    """Validate a loss section's fields with its schema (the same check whether built by hydra or in code)."""
    values = {f.name: getattr(section, f.name) for f in fields(section) if f.name != "_target_"}
    parse(schema, values, f"{SECTION_KEY}.{name}")


def section_from_mapping(cls: type, value: Any, name: str) -> Any:
    """``policy_loss.<name>`` (a mapping, an OmegaConf node or None) as ``cls``, read with its schema.

    Raises:
        verl_stable.schema.ConfigError: naming the offending key.
    """
    options = parse(_SCHEMAS[cls], _without_target(value), f"{SECTION_KEY}.{name}")
    return cls(**options.model_dump())


def _without_target(value: Any) -> Any:
    # a section written with its own _target_ (hydra's spelling) carries it as a key; it names the class, not an option
    value = to_plain(value)
    if isinstance(value, Mapping) and "_target_" in value:
        return {k: v for k, v in value.items() if k != "_target_"}
    return value


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if obj is None:
        return default
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _policy_loss_section(config: Any, name: str, cls: type) -> Any:
    """The ``policy_loss.<name>`` section of an actor config as ``cls``; defaults when absent."""
    section = _get(_get(config, "policy_loss"), name)
    return section if isinstance(section, cls) else section_from_mapping(cls, section, name)


def _clip_ratios(config: Any) -> tuple[float, float]:
    """verl's reading of the trust region: ``clip_ratio_low/high``, each falling back to ``clip_ratio``."""
    clip_ratio = _get(config, "clip_ratio")
    low = _get(config, "clip_ratio_low")
    high = _get(config, "clip_ratio_high")
    low = clip_ratio if low is None else low
    high = clip_ratio if high is None else high
    if low is None or high is None:
        raise ValueError("actor config must set clip_ratio_low and clip_ratio_high (or clip_ratio)")
    return float(low), float(high)


def with_staleness(
    terms: PolicyLossTerms,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    trust_region: tuple[float, float],
) -> PolicyLossTerms:
    """``terms`` with the staleness statistics of this micro-batch added as ``actor/stable/staleness/<name>``.

    They stay 0-d tensors, read back with the loss's own metrics in one transfer by ``terms.scalars()``.
    """
    stats = staleness_statistics(log_prob, old_log_prob, response_mask, *trust_region)
    metrics = {**terms.metrics, **{STALENESS_METRIC_PREFIX + name: value for name, value in stats.items()}}
    return replace(terms, metrics=metrics)


def stable_metric_aggregation(key: str) -> AggregationType | None:
    """How a verl-stable metric should combine over micro-batches; ``None`` for keys that are not ours.

    Keys under ``stable/`` (after an optional ``actor/``) ending in ``_max`` combine with MAX, ``_min`` with MIN,
    anything else with MEAN -- consistent with verl's ``reduce_metrics``, which reduces the per-mini-step list by
    the same names.
    """
    name = key.removeprefix("actor/")
    if not name.startswith("stable/"):
        return None
    if name.endswith("_max"):
        return AggregationType.MAX
    if name.endswith("_min"):
        return AggregationType.MIN
    return AggregationType.MEAN


def relabel_stable_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Give our metrics of one micro-batch the aggregation of :func:`stable_metric_aggregation`, in place.

    verl's ``ppo_loss`` wraps every loss metric in ``Metric(MEAN)`` (a loss cannot choose); a micro-batch holds
    one value per key, so re-labelling it is exact. Plain numbers become :class:`Metric` too, so that verl's
    ``train_mini_batch`` reduces them to one value per mini-step (plain lists are only concatenated).

    Raises:
        ValueError: If one of our keys holds a metric with several values (already aggregated elsewhere).
    """
    for key, value in list(metrics.items()):
        aggregation = stable_metric_aggregation(key)
        if aggregation is None:
            continue
        values = value.values if isinstance(value, Metric) else [value]
        if len(values) != 1:
            raise ValueError(f"metric {key!r} holds {len(values)} values; expected one per micro-batch")
        if not (isinstance(value, Metric) and value.aggregation is aggregation):
            metrics[key] = Metric(aggregation=aggregation, value=values[0])
    return metrics


def summed_count_metrics(counts: Mapping[str, Any], dp_size: int, prefix: str) -> dict[str, Metric]:
    """One rank's counts of a micro-batch as verl ``Metric(SUM)`` values that add up over ranks and micro-batches.

    verl's ``Metric.aggregate_dp`` averages a SUM metric over the data-parallel ranks and sums it over micro-batches,
    so each rank reports its count times ``dp_size``: the aggregate is the count of the whole update mini-step.
    """
    return {
        prefix + name: Metric(aggregation=AggregationType.SUM, value=count * dp_size) for name, count in counts.items()
    }


def side_read_metrics(side_reads: Mapping[str, Any], dp_size: int) -> dict[str, Metric]:
    """A rank's TransferQueue reads of shared prompt rows as ``stable/routing/transport/...`` metrics.

    The counts of :data:`~verl_stable.metric_names.SIDE_READ_COUNTS` summed over ranks
    (:func:`summed_count_metrics`), and ``side_reads_per_rank``: the read count averaged over ranks (a SUM left
    unscaled).
    """
    metrics = summed_count_metrics(side_reads, dp_size, TRANSPORT)
    metrics[f"{TRANSPORT}side_reads_per_rank"] = Metric(aggregation=AggregationType.SUM, value=side_reads["side_reads"])
    return metrics


def aggregate_token_loss(
    loss_mat: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str, global_batch_info: Mapping | None
) -> torch.Tensor:
    """verl's ``agg_loss`` with ``global_batch_info``, and a defined result for an empty micro-batch.

    When verl gives no global denominator (single process, ``global_batch_info`` unset), ``agg_loss`` divides by
    the local token / sequence count, which is 0 for an all-masked micro-batch and yields NaN (and NaN
    gradients). Here that local count is clamped to at least 1, so such a batch has loss 0 and zero gradients;
    every other case is verl's ``agg_loss`` unchanged.
    """
    info = {key: value for key, value in (global_batch_info or {}).items() if key in _AGG_KEYS}
    mask = response_mask.bool()
    dp_size = info.get("dp_size") or 1
    if dp_size == 1:
        if loss_agg_mode == "token-mean" and info.get("batch_num_tokens") is None:
            info["batch_num_tokens"] = mask.sum().clamp(min=1)
        elif loss_agg_mode.startswith("seq-mean") and info.get("global_batch_size") is None:
            info["global_batch_size"] = mask.any(dim=-1).sum().clamp(min=1)
    return agg_loss(loss_mat=loss_mat, loss_mask=mask, loss_agg_mode=loss_agg_mode, **info)


def _require_config(config: Any, name: str) -> None:
    if config is None:
        raise ValueError(f"policy loss {name!r} needs the actor config (verl passes config=ActorConfig)")


def compute_policy_loss_minirl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-sum",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """MiniRL loss ``-M_t * sg[w_t * r_t] * A * logp_theta_t`` aggregated by verl's ``agg_loss``.

    See :func:`verl_stable.algos.minirl.minirl_policy_loss` for the math. ``eps_low`` / ``eps_high`` are
    ``config.clip_ratio_low`` / ``config.clip_ratio_high``; ``w_t`` are verl's ``rollout_is_weights``
    (``algorithm.rollout_correction.rollout_is=token``, ``rollout_is_threshold=5.0`` in the paper).

    Raises:
        ValueError: If ``rollout_is_weights`` is None and ``policy_loss.minirl.allow_missing_rollout_is_weights``
            is not set (the message names the settings that produce the weights), and on bad input (see
            :mod:`verl_stable.algos.token_batch`).
    """
    _require_config(config, "minirl")
    options = _policy_loss_section(config, "minirl", MiniRLLossConfig)
    if rollout_is_weights is None and not options.allow_missing_rollout_is_weights:
        raise ValueError(MISSING_IS_WEIGHTS_MESSAGE)
    clip_low, clip_high = _clip_ratios(config)
    terms = minirl_policy_loss(
        log_prob,
        old_log_prob,
        advantages,
        response_mask,
        rollout_is_weights,
        clip_ratio_low=clip_low,
        clip_ratio_high=clip_high,
    )
    terms = with_staleness(terms, log_prob, old_log_prob, response_mask, (clip_low, clip_high))
    loss = aggregate_token_loss(terms.loss_mat, response_mask, loss_agg_mode, _get(config, "global_batch_info"))
    return loss, terms.scalars()


def compute_policy_loss_vespo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """VESPO loss ``-sg[phi(W)] * A_t * logp_theta_t`` aggregated by verl's ``agg_loss``.

    See :mod:`verl_stable.algos.vespo` for the math. Kernel constants come from ``policy_loss.vespo``
    (:class:`VespoLossConfig`, paper defaults). ``rollout_is_weights``, when present, are folded into ``W``.

    Raises:
        ValueError: On bad input (see :mod:`verl_stable.algos.token_batch`).
    """
    _require_config(config, "vespo")
    options = _policy_loss_section(config, "vespo", VespoLossConfig)
    kernel = VespoKernel(
        c1_pos=float(options.c1_pos),
        c2_pos=float(options.c2_pos),
        c1_neg=float(options.c1_neg),
        c2_neg=float(options.c2_neg),
    )
    terms = vespo_policy_loss(log_prob, old_log_prob, advantages, response_mask, rollout_is_weights, kernel=kernel)
    terms = with_staleness(terms, log_prob, old_log_prob, response_mask, _clip_ratios(config))
    loss = aggregate_token_loss(terms.loss_mat, response_mask, loss_agg_mode, _get(config, "global_batch_info"))
    return loss, terms.scalars()


POLICY_LOSSES = {"minirl": compute_policy_loss_minirl, "vespo": compute_policy_loss_vespo}


def register() -> list[str]:
    """Register ``minirl`` and ``vespo`` in verl's policy-loss registry (idempotent).

    Raises:
        RuntimeError: If one of the names is already taken by a function that is not ours (verl's registry
            would silently overwrite it).
    """
    for name, fn in POLICY_LOSSES.items():
        existing = POLICY_LOSS_REGISTRY.get(name)
        if existing is not None and existing is not fn and getattr(existing, "__module__", None) != __name__:
            raise RuntimeError(f"policy loss {name!r} is already registered by {existing.__module__}.{existing}")
        register_policy_loss(name)(fn)
    return list(POLICY_LOSSES)
