"""The lab's variants: each is a shipped recipe plus a short, named dict of switch overrides.

A variant never carries a loss, estimator or replay of its own: it selects a recipe of :mod:`verl_stable.recipes`
(``recipes/fsdp/<regime>.yaml``) and flips a few of verl's / verl-stable's config keys. The staleness
``N = data.train_batch_size / ppo_mini_batch_size`` is not part of a variant; the sweep sets it for every variant alike
(see :func:`run_overrides`), so "MiniRL at N = 4" and "MiniRL + R3 at N = 4" differ exactly by the R3 switches.

    variant           recipe           switches
    ----------------  ---------------  ------------------------------------------------------------------------
    reinforce_no_is   minirl_onpolicy  rollout_is = null, minirl.allow_missing_rollout_is_weights = true
    minirl            minirl_onpolicy  (none)
    minirl_r2         minirl_onpolicy  router_replay.mode = R2
    minirl_r3         minirl_onpolicy  router_replay.mode = R3 (rollout routing export is on for every run)
    minirl_noclip     minirl_onpolicy  clip_ratio_low = 0.99, clip_ratio_high = 100 (ratio bounds [0.01, 101]: ~no trust region)
    vespo             vespo            (none)
    vanilla_grpo      minirl_onpolicy  loss_mode = vanilla, adv_estimator = grpo, loss_agg_mode = seq-mean-token-mean

Measurement switches common to every run (:data:`COMMON_SWITCHES`): the rollout exports its routed experts, so runs
without replay *observe* the train-inference routing disagreement (the engine records and compares, and changes
nothing); the monitor's guard logs but does not stop a run, so every run yields all its steps ("guard fired" is read
from ``stable/guard/*`` in the report); the actor trains in fp32 (verl's FSDP engine defaults to bf16 autocast).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_stable import recipes
from verl_stable.backends.hf.options import PRECISIONS
from verl_stable.toy import launch

ROUTER_REPLAY = "actor_rollout_ref.actor.fsdp_config.router_replay.mode"
ROLLOUT_ROUTING = "actor_rollout_ref.rollout.enable_rollout_routing_replay"
ROLLOUT_IS = "algorithm.rollout_correction.rollout_is"
ALLOW_MISSING_IS = "actor_rollout_ref.actor.policy_loss.minirl.allow_missing_rollout_is_weights"
LOSS_MODE = "actor_rollout_ref.actor.policy_loss.loss_mode"
LOSS_AGG_MODE = "actor_rollout_ref.actor.loss_agg_mode"
ADV_ESTIMATOR = "algorithm.adv_estimator"
ROLLOUT_SEED = "actor_rollout_ref.rollout.seed"
CLIP_LOW = "actor_rollout_ref.actor.clip_ratio_low"
CLIP_HIGH = "actor_rollout_ref.actor.clip_ratio_high"
PRECISION = "+actor_rollout_ref.rollout.engine_kwargs.hf.precision"
ROUTER_NOISE = "+actor_rollout_ref.rollout.engine_kwargs.hf.router_noise"
REWARD_PATH = "reward.custom_reward_function.path"
REWARD_NAME = "reward.custom_reward_function.name"
GUARD_ACTIONS = (
    "stable.guard.rules.entropy_collapse.action",
    "stable.guard.rules.train_inference_kl.action",
)

# verl's FSDP engine defaults to bf16 autocast (``mixed_precision=None`` -> param_dtype bf16); fp32 everywhere makes
# the actor the fp32 "training engine" of the paper's fp8-inference / higher-precision-training setup.
TRAIN_PRECISION = "+actor_rollout_ref.actor.fsdp_config.mixed_precision"
FP32_TRAINING = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
# verl-stable's agent-loop manager: the rollout's routing travels validated and compact (uint8, ragged) to the actors
AGENT_LOOP_MANAGER = "+actor_rollout_ref.rollout.agent.agent_loop_manager_class"
COMPACT_ROUTING_MANAGER = "verl_stable.integration.rollout.CompactRoutingAgentLoopManagerTQ"

COMMON_SWITCHES: dict[str, Any] = {
    ROLLOUT_ROUTING: True,
    AGENT_LOOP_MANAGER: COMPACT_ROUTING_MANAGER,
    TRAIN_PRECISION: FP32_TRAINING,
    **{key: "warn" for key in GUARD_ACTIONS},
}
"""Applied to every run: routing export (observe or replay) through the compact transport, fp32 training, a guard
that warns instead of stopping."""

STALENESS_CHOICES = (1, 2, 4, 8)
# PRECISIONS (imported above): the rollout precisions of the hf backend, fp8 first (the lab's "inference engine")


@dataclass(frozen=True)
class Variant:
    """One algorithm of the comparison.

    Attributes:
        name: short id used in run directories and the report.
        recipe: the regime whose ``recipes/fsdp/<recipe>.yaml`` the run composes on.
        switches: hydra key -> value; the only difference from the recipe (apart from the lab's common settings).
        label: one line for the report.
    """

    name: str
    recipe: str
    switches: Mapping[str, Any] = field(default_factory=dict)
    label: str = ""


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant(
            "reinforce_no_is",
            "minirl_onpolicy",
            {ROLLOUT_IS: None, ALLOW_MISSING_IS: True},
            "REINFORCE / MiniRL without the train-inference IS weight",
        ),
        Variant("minirl", "minirl_onpolicy", {}, "MiniRL (token IS w = min(pi_old/mu, 5), clipping)"),
        Variant("minirl_r2", "minirl_onpolicy", {ROUTER_REPLAY: "R2"}, "MiniRL + R2 (replay pi_old's routing)"),
        Variant("minirl_r3", "minirl_onpolicy", {ROUTER_REPLAY: "R3"}, "MiniRL + R3 (replay the rollout's routing)"),
        Variant(
            "minirl_noclip",
            "minirl_onpolicy",
            # ratio bounds [0.01, 101]: MiniRL's mask (practically) never fires; the IS weight stays. The monitor's
            # staleness metrics need a finite trust region with eps_low < 1, so "none" is this wide one
            {CLIP_LOW: 0.99, CLIP_HIGH: 100.0},
            "MiniRL without clipping (trust region widened to [0.01, 101])",
        ),
        Variant("vespo", "vespo", {}, "VESPO (sequence-level reshaped IS)"),
        Variant(
            "vanilla_grpo",
            "minirl_onpolicy",
            {LOSS_MODE: "vanilla", ADV_ESTIMATOR: "grpo", LOSS_AGG_MODE: "seq-mean-token-mean"},
            "verl's GRPO baseline (vanilla PPO loss, std-normalised advantage, length-normalised)",
        ),
    )
}


def get_variant(name: str) -> Variant:
    """The variant called ``name``. Raises ``ValueError`` naming the known ones."""
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; known: {list(VARIANTS)}")
    return VARIANTS[name]


def format_value(value: Any) -> str:
    """A Python value as a hydra override value (``None`` -> ``null``, bools lower-case)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def override_key(item: str) -> str:
    """The config key of a ``key=value`` override, without hydra's ``+``/``++``/``~`` prefix."""
    return item.split("=", 1)[0].lstrip("+~")


def as_dict(overrides: Sequence[str]) -> dict[str, str]:
    """``["a=1", "+b=x"]`` -> ``{"a": "1", "b": "x"}`` (later items win, as in hydra).

    Raises:
        ValueError: An item without ``=``.
    """
    out: dict[str, str] = {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not key=value")
        out[override_key(item)] = item.split("=", 1)[1]
    return out


def run_overrides(
    variant: Variant | str,
    assets: Any,
    *,
    staleness: int,
    steps: int,
    mini_batch_prompts: int,
    group_size: int,
    precision: str = "fp8",
    seed: int = 0,
    max_response_length: int = 4,
    reward_path: str | Path | None = None,
    workdir: str | Path | None = None,
    engine: str = "hf",
    router_noise: float = 0.0,
) -> list[str]:
    """The full ``main_ppo`` argument list of one lab run: recipe, CPU runtime, geometry, common and variant switches.

    The staleness is set by ``data.train_batch_size = N * mini_batch_prompts`` with ``ppo_epochs = 1`` (the recipes'
    definition of N). The rollout runs ``engine`` at ``precision``: the ``hf`` backend with fp8 weights by default (the
    "inference engine"), or verl's own vLLM rollout on vLLM's CPU build (``engine="vllm"``, fp32 or bf16); the actor
    trains in fp32. ``router_noise`` > 0 perturbs the ``hf`` rollout's routers (inference only; a labelled stand-in for
    a large MoE's routing mismatch).

    Raises:
        ValueError: Unknown variant, N not in {1, 2, 4, 8}, an unknown precision, or one the engine does not offer.
    """
    variant = get_variant(variant) if isinstance(variant, str) else variant
    if staleness not in STALENESS_CHOICES:
        raise ValueError(f"staleness N must be one of {STALENESS_CHOICES}, got {staleness}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    path = recipes.recipe_path("fsdp", variant.recipe)
    args = [f"--config-path={path.parent}", f"--config-name={path.stem}"]
    base = launch.regime_overrides(
        variant.recipe,
        assets,
        steps=steps,
        mini_batch_prompts=mini_batch_prompts,
        group_size=group_size,
        engine=engine,
        precision=None if engine == "hf" else precision,
    )
    reward = str(reward_path or Path(__file__).with_name("reward.py"))
    lab = {
        "data.train_batch_size": mini_batch_prompts * staleness,
        "data.max_response_length": max_response_length,
        "data.seed": seed,
        "actor_rollout_ref.actor.data_loader_seed": seed,
        # the run seed of every sample's sampling seed (verl-stable's agent-loop worker; vLLM's engine seed too)
        ROLLOUT_SEED: seed,
        REWARD_PATH: reward,
        REWARD_NAME: "compute_score",
        "trainer.experiment_name": f"lab_{variant.name}_N{staleness}_s{seed}",
        **COMMON_SWITCHES,
        **dict(variant.switches),
    }
    if workdir is not None:
        lab["trainer.default_local_dir"] = str(Path(workdir) / "checkpoints")
    kept = [item for item in base if override_key(item) not in lab and override_key(item) != override_key(PRECISION)]
    engine_precision = [f"{PRECISION}={precision}"] if engine == "hf" else []  # vllm: rollout.dtype, set in base
    if router_noise:
        if engine != "hf":
            raise ValueError(f"router_noise is an option of the hf rollout backend, not of {engine!r}")
        engine_precision.append(f"{ROUTER_NOISE}={float(router_noise)}")
    return args + kept + [f"{k}={format_value(v)}" for k, v in lab.items()] + engine_precision
