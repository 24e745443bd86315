"""The regime table of the recipes, and the checks that a composed config still is its regime.

One recipe per regime of the paper (Qwen team, arXiv 2512.01374), with N the staleness: the number of policy updates
(mini-batches) per rollout batch, ``N = data.train_batch_size / actor.ppo_mini_batch_size`` with ``ppo_epochs = 1``.
The paper's mini-batch is 64 prompts x 16 samples = 1024 responses, so a recipe sets ``ppo_mini_batch_size = 64``,
``rollout.n = 16`` and ``train_batch_size = 64 N``::

    regime            N      loss     routing replay                 rollout routing export
    ----------------  -----  -------  -----------------------------  ----------------------
    minirl_onpolicy   1      minirl   disabled (nothing to replay)   off
    minirl_n2_r2      2      minirl   R2 (train-side, pi_old pass)   off
    minirl_n4_r3      >= 4   minirl   R3 (inference-side)            on
    vespo             8      vespo    disabled                       off

Every recipe: advantage ``A = R - mean_group(R)`` (estimator ``minirl``), token IS weight ``w = min(pi_old / mu, 5)``
from verl's decoupled rollout correction, trust region ``eps_low = 0.2``, ``eps_high = 0.27``, aggregation
``seq-mean-token-sum`` (sum over a response's tokens, mean over responses: no per-response length normalisation), no
KL term, entropy computed for the monitor, and the monitored trainer ``stable_sync`` with the ``stable`` block (see
:mod:`verl_stable.integration.trainer`).

This module is the single source of truth for that table (:data:`REGIMES`); :func:`regime_mismatches` checks a
composed config against it. It imports nothing of the project: composing a recipe is
:mod:`verl_stable.recipes.compose`, checking one against verl is :mod:`verl_stable.recipes.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BACKENDS: dict[str, str] = {"fsdp": "ppo_trainer", "megatron": "ppo_megatron_trainer"}
"""backend -> the verl trainer config its recipes compose on."""

VERL_CONFIG_SEARCHPATH = "pkg://verl.trainer.config"

MINI_BATCH_PROMPTS = 64  # paper: mini-batch of 1024 responses = 64 prompts x 16 samples
GROUP_SIZE = 16
IS_THRESHOLD = 5.0
CLIP_RATIO_LOW = 0.2
CLIP_RATIO_HIGH = 0.27
LOSS_AGG_MODE = "seq-mean-token-sum"
ADV_ESTIMATOR = "minirl"
TRAINER_MODE = "stable_sync"
POLICY_LOSS_CONFIG = "verl_stable.integration.losses.StablePolicyLossConfig"

ROUTER_REPLAY_KEY: dict[str, str] = {
    "fsdp": "actor_rollout_ref.actor.fsdp_config.router_replay.mode",
    "megatron": "actor_rollout_ref.actor.megatron.router_replay.mode",
}
ROLLOUT_ROUTING_KEY = "actor_rollout_ref.rollout.enable_rollout_routing_replay"


@dataclass(frozen=True)
class Regime:
    """One training regime of the paper, as the recipes set it.

    Attributes:
        name: the recipe's file stem (``recipes/<backend>/<name>.yaml``).
        loss_mode: ``actor.policy_loss.loss_mode`` (``minirl`` or ``vespo``).
        staleness: N of the shipped recipe (mini-batches per rollout batch).
        min_staleness: smallest N for which the regime is the paper's recommendation.
        max_staleness: largest such N (``None``: unbounded).
        router_replay: ``router_replay.mode`` of the actor engine (disabled, R2, R3).
        rollout_routing_export: ``rollout.enable_rollout_routing_replay`` (the rollout returns its routed experts).
        summary: one line for listings.
    """

    name: str
    loss_mode: str
    staleness: int
    min_staleness: int
    max_staleness: int | None
    router_replay: str
    rollout_routing_export: bool
    summary: str

    @property
    def train_batch_size(self) -> int:
        """``data.train_batch_size`` of the shipped recipe: ``64 N`` prompts."""
        return MINI_BATCH_PROMPTS * self.staleness

    def accepts_staleness(self, n: float) -> bool:
        """Whether ``n`` lies in the regime's range (an integer number of mini-batches)."""
        if n != int(n):
            return False
        return n >= self.min_staleness and (self.max_staleness is None or n <= self.max_staleness)


REGIMES: dict[str, Regime] = {
    r.name: r
    for r in (
        Regime("minirl_onpolicy", "minirl", 1, 1, 1, "disabled", False, "on-policy MiniRL with the train-inference IS"),
        Regime("minirl_n2_r2", "minirl", 2, 2, 3, "R2", False, "N = 2: MiniRL + clipping + R2 (train-side replay)"),
        Regime("minirl_n4_r3", "minirl", 4, 4, None, "R3", True, "N >= 4: MiniRL + clipping + R3 (rollout replay)"),
        Regime("vespo", "vespo", 8, 1, None, "disabled", False, "VESPO sequence-level reshaped IS, N = 8"),
    )
}


def check_backend_regime(backend: str, regime: str) -> None:
    """Refuse a backend or regime that the table does not have.

    Raises:
        ValueError: naming the unknown one and the known ones.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known: {sorted(BACKENDS)}")
    if regime not in REGIMES:
        raise ValueError(f"unknown regime {regime!r}; known: {list(REGIMES)}")


def config_value(cfg: Any, key: str) -> Any:
    """The value at a dotted ``key`` of a composed config; None where it is absent."""
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key, default=None)


def staleness(cfg: Any) -> float:
    """N = ``data.train_batch_size / actor.ppo_mini_batch_size`` times ``ppo_epochs`` (updates per rollout batch)."""
    counts = {}
    for key in (
        "data.train_batch_size",
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        "actor_rollout_ref.actor.ppo_epochs",
    ):
        value = config_value(cfg, key)
        if value is None and key.endswith("ppo_epochs"):
            value = 1
        # a quoted '512' would divide as a string (a traceback) or compare as text: refuse it by name
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive int, got {type(value).__name__} {value!r}")
        counts[key] = value
    train, mini, epochs = counts.values()
    return train / mini * epochs


def backend_of(cfg: Any) -> str:
    """``megatron`` when the actor strategy is Megatron, else ``fsdp``."""
    return "megatron" if config_value(cfg, "actor_rollout_ref.actor.strategy") == "megatron" else "fsdp"


def regime_mismatches(cfg: Any, regime: str | Regime, *, paper_geometry: bool = True) -> list[str]:
    """What in a composed config differs from ``regime``; empty when the config is the regime.

    Args:
        cfg: a composed config (a recipe with any overrides).
        regime: the regime (or its name).
        paper_geometry: also require the paper's mini-batch (64 prompts x 16 samples).

    Returns:
        One line per mismatch, ``"<key> = <found>, regime needs <wanted>"``.
    """
    regime = REGIMES[regime] if isinstance(regime, str) else regime
    backend = backend_of(cfg)
    wanted: dict[str, Any] = {
        "algorithm.adv_estimator": ADV_ESTIMATOR,
        "algorithm.use_kl_in_reward": False,
        "algorithm.rollout_correction.rollout_is": "token",
        "algorithm.rollout_correction.rollout_is_threshold": IS_THRESHOLD,
        "algorithm.rollout_correction.rollout_rs": None,
        "algorithm.rollout_correction.bypass_mode": False,
        "actor_rollout_ref.rollout.calculate_log_probs": True,
        "actor_rollout_ref.actor.policy_loss.loss_mode": regime.loss_mode,
        "actor_rollout_ref.actor.policy_loss._target_": POLICY_LOSS_CONFIG,
        "actor_rollout_ref.actor.clip_ratio_low": CLIP_RATIO_LOW,
        "actor_rollout_ref.actor.clip_ratio_high": CLIP_RATIO_HIGH,
        "actor_rollout_ref.actor.loss_agg_mode": LOSS_AGG_MODE,
        "actor_rollout_ref.actor.use_kl_loss": False,
        "actor_rollout_ref.actor.entropy_coeff": 0,
        "actor_rollout_ref.actor.calculate_entropy": True,
        "actor_rollout_ref.actor.ppo_epochs": 1,
        ROUTER_REPLAY_KEY[backend]: regime.router_replay,
        ROLLOUT_ROUTING_KEY: regime.rollout_routing_export,
        "trainer.v1.trainer_mode": TRAINER_MODE,
    }
    if regime.loss_mode == "minirl":
        wanted["actor_rollout_ref.actor.policy_loss.minirl.allow_missing_rollout_is_weights"] = False
    if paper_geometry:
        wanted["actor_rollout_ref.actor.ppo_mini_batch_size"] = MINI_BATCH_PROMPTS
        wanted["actor_rollout_ref.rollout.n"] = GROUP_SIZE
    problems = []
    for key, want in wanted.items():
        found = config_value(cfg, key)
        if isinstance(want, float):  # a number; a string such as 'abc' (or '5.0') is not the number the regime needs
            number = isinstance(found, (int, float)) and not isinstance(found, bool)
            same = number and abs(float(found) - want) < 1e-9
        else:
            same = found == want
        if not same or isinstance(found, bool) != isinstance(want, bool):
            problems.append(f"{key} = {found!r}, regime {regime.name} needs {want!r}")
    try:
        n = staleness(cfg)
    except ValueError as exc:
        problems.append(str(exc))
    else:
        if not regime.accepts_staleness(n):
            upper = "inf" if regime.max_staleness is None else regime.max_staleness
            problems.append(
                f"staleness N = train_batch_size / ppo_mini_batch_size * ppo_epochs = {n:g}, regime {regime.name} "
                f"needs an integer N in [{regime.min_staleness}, {upper}]"
            )
    return problems
