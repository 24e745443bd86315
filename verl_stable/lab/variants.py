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
    minirl_noclip_guard  minirl_onpolicy  minirl_noclip's switches + an acting guard: rule entropy_blowup (the update's
                                       token entropy actor/entropy above 4.0 -> rollback, redone on new batches),
                                       a checkpoint every step
    vespo             vespo            (none)

verl's own answers to the same problem (the baselines a verl user would pick instead; each sets the algorithm's keys
to what verl ships, so the recipe's MiniRL settings do not leak into it):

    variant           recipe           switches
    ----------------  ---------------  ------------------------------------------------------------------------
    vanilla_grpo      minirl_onpolicy  plain GRPO: loss_mode = vanilla, adv_estimator = grpo, loss_agg_mode =
                                       token-mean, clip_ratio_high = 0.2, rollout_is = null, rollout_is_threshold = 2.0
    verl_tis          minirl_onpolicy  vanilla_grpo's switches with rollout_is = token kept (verl's token TIS,
                                       threshold 2.0, decoupled): plain GRPO plus the IS weight min(pi_old/mu, 2)
    dppo              minirl_onpolicy  DPPO-Binary-TV: loss_mode = dppo_tv, clip_ratio(_low/_high) = 0.15 (TV
                                       bound), clip_ratio_c = 10000, adv_estimator = grpo, norm_adv_by_std_in_grpo
                                       = false, loss_agg_mode = seq-mean-token-sum-norm, bypass_mode = true,
                                       rollout_is = null, rollout_is_threshold = 2.0

Measurement switches common to every run (:data:`COMMON_SWITCHES`): the rollout exports its routed experts, so runs
without replay *observe* the train-inference routing disagreement (the engine records and compares, and changes
nothing); the monitor's guard logs but does not stop a run, so every run yields all its steps ("guard fired" is read
from ``stable/guard/*`` in the report); the actor trains in fp32 (verl's FSDP engine defaults to bf16 autocast).
The rollout's log-probs (mu) are computed for every run (the recipe's ``rollout.calculate_log_probs = true``; verl's
default is false), so plain GRPO too has its train-inference mismatch measured; no run has a reference model or a KL
loss (``use_kl_loss = false``, as verl's DPPO example and Dr. GRPO run; verl's GRPO docs suggest one for GRPO).
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
LR = "actor_rollout_ref.actor.optim.lr"
ROLLOUT_IS = "algorithm.rollout_correction.rollout_is"
ALLOW_MISSING_IS = "actor_rollout_ref.actor.policy_loss.minirl.allow_missing_rollout_is_weights"
LOSS_MODE = "actor_rollout_ref.actor.policy_loss.loss_mode"
LOSS_AGG_MODE = "actor_rollout_ref.actor.loss_agg_mode"
ADV_ESTIMATOR = "algorithm.adv_estimator"
ROLLOUT_SEED = "actor_rollout_ref.rollout.seed"
CLIP_LOW = "actor_rollout_ref.actor.clip_ratio_low"
CLIP_HIGH = "actor_rollout_ref.actor.clip_ratio_high"
CLIP_RATIO = "actor_rollout_ref.actor.clip_ratio"
CLIP_RATIO_C = "actor_rollout_ref.actor.clip_ratio_c"
ROLLOUT_IS_THRESHOLD = "algorithm.rollout_correction.rollout_is_threshold"
BYPASS_MODE = "algorithm.rollout_correction.bypass_mode"
NORM_ADV_BY_STD = "algorithm.norm_adv_by_std_in_grpo"
PRECISION = "+actor_rollout_ref.rollout.engine_kwargs.hf.precision"
ROUTER_NOISE = "+actor_rollout_ref.rollout.engine_kwargs.hf.router_noise"
REWARD_PATH = "reward.custom_reward_function.path"
REWARD_NAME = "reward.custom_reward_function.name"
GUARD_ACTIONS = (
    "stable.guard.rules.entropy_collapse.action",
    "stable.guard.rules.train_inference_kl.action",
)

NO_CLIP: dict[str, Any] = {CLIP_LOW: 0.99, CLIP_HIGH: 100.0}
"""Ratio bounds [0.01, 101]: MiniRL's mask (practically) never fires; the IS weight stays. The monitor's staleness
metrics need a finite trust region with eps_low < 1, so "none" is this wide one."""

ENTROPY_BLOWUP = "+stable.guard.rules.entropy_blowup"
ENTROPY_BLOWUP_THRESHOLD = 4.0
"""The acting guard's line (``actor/entropy``, the token entropy of the policy being updated, nats): set from the runs
that found the stability regime (docs/explanation/lab.md, "Where training fails without a trust region": seeds 0-3 at
N = 8, 24 steps): every run with clipping stayed at or below 2.5, the runs without clipping that lost the task rose to
6.8-11.8 within a few steps of leaving it; judged on the `stability` preset's other seeds."""
GUARDED: dict[str, Any] = {
    f"{ENTROPY_BLOWUP}.condition": "above",
    f"{ENTROPY_BLOWUP}.metric": "actor/entropy",
    f"{ENTROPY_BLOWUP}.threshold": ENTROPY_BLOWUP_THRESHOLD,
    f"{ENTROPY_BLOWUP}.action": "rollback",  # max_rollbacks: the schema's default (2), then stop_checkpoint
    # the lab's runs are deterministic: redone on the same batches and sampling seeds they would blow up again
    f"{ENTROPY_BLOWUP}.rollback_data": "skip",
    # the train-inference alarm (warn here) measures the rollout engine against the trainer, not the weights: without
    # replay it fires on most steps at N = 8, and as a mark it left seed 2 with no good checkpoint (session 20)
    "+stable.guard.rules.train_inference_kl.marks_checkpoints": False,
    # a rollback needs a checkpoint two steps before the trip, and each redone step's save rotates the oldest away:
    # with 4 kept, the second of two rollbacks found its checkpoint gone (session 20, seed 3); 8 cover both
    "trainer.save_freq": 1,
    "trainer.max_actor_ckpt_to_keep": 8,
}
"""An acting guard (issue #29): the run goes back to its last good checkpoint when the policy's entropy blows up and
redoes the steps after it on new batches; it stops (naming that checkpoint) when the blow-up comes back after two
rollbacks, or when no checkpoint before it is known good."""

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

# verl 0.9.1's own values, restored where the MiniRL recipe sets its own (the baselines run verl's setup, not MiniRL's)
VERL_TIS_THRESHOLD = 2.0
"""``rollout_is_threshold``: verl's default (``trainer/config/algorithm/rollout_correction.yaml``) and that of its
token-TIS preset ``RolloutCorrectionConfig.decoupled_token_is()``; the MiniRL recipe sets the paper's 5.0."""
VERL_CLIP = 0.2
"""PPO's epsilon as verl ships it (``actor.clip_ratio`` / ``_low`` / ``_high``); the MiniRL recipe widens the upper
bound to 0.27."""
VERL_LOSS_AGG_MODE = "token-mean"
"""verl's default aggregation, which its GRPO docs say every verl GRPO example uses (the GRPO paper's is
seq-mean-token-mean; the MiniRL recipe's seq-mean-token-sum)."""

PLAIN_GRPO: dict[str, Any] = {
    LOSS_MODE: "vanilla",
    ADV_ESTIMATOR: "grpo",
    LOSS_AGG_MODE: VERL_LOSS_AGG_MODE,
    CLIP_HIGH: VERL_CLIP,
    # verl's default rollout_correction block: no IS weight (the recipe's threshold is set back too, so the block is
    # verl's own; without rollout_is it weights nothing)
    ROLLOUT_IS: None,
    ROLLOUT_IS_THRESHOLD: VERL_TIS_THRESHOLD,
}
"""verl's plain GRPO (``docs/algo/grpo.md``): PPO's clipped loss, group-normalised advantages ``(R - mean) / std``,
verl's default clip range and aggregation, no rollout correction."""

# verl's token TIS as a verl user turns it on: plain GRPO + algorithm.rollout_correction.rollout_is=token at verl's
# default threshold, decoupled (pi_old recomputed by the training engine, w = min(pi_old / mu, 2) per token multiplies
# the PPO loss). The recipe already has rollout_is=token and bypass_mode=false, so only the threshold differs from it.
VERL_TIS: dict[str, Any] = {k: v for k, v in PLAIN_GRPO.items() if k != ROLLOUT_IS}

# DPPO (arXiv 2602.04879) as verl ships it: verl's examples/dppo_trainer/run_qwen30b_dppo.sh with its defaults
DPPO_TV_BOUND = 0.15
"""The TV-divergence bound of DPPO-Binary-TV in verl's DPPO example (both sides; its Binary-KL bound is 0.05)."""
DPPO_TRUNCATION = 10000.0
"""``clip_ratio_c`` in verl's DPPO example ("disable dual-clip PPO and TIS"): DPPO's loss truncates its
stop-gradient ratio at ``clip_ratio_c``, whose verl default (3.0, from the actor config) would truncate hard."""
DPPO: dict[str, Any] = {
    LOSS_MODE: "dppo_tv",
    CLIP_RATIO: DPPO_TV_BOUND,
    CLIP_LOW: DPPO_TV_BOUND,
    CLIP_HIGH: DPPO_TV_BOUND,
    CLIP_RATIO_C: DPPO_TRUNCATION,
    ADV_ESTIMATOR: "grpo",
    # the example's Dr. GRPO settings: no std division; each response's token sum divided by one length for all
    NORM_ADV_BY_STD: False,
    LOSS_AGG_MODE: "seq-mean-token-sum-norm",
    # the example's recommendation (its Section 5.2): the trust region is measured against the rollout policy mu,
    # so it bounds the train-inference mismatch too; pi_old is not recomputed (pi_old := mu)
    BYPASS_MODE: True,
    # verl's default block otherwise (in bypass mode verl's v1 trainer computes no rollout correction at all)
    ROLLOUT_IS: None,
    ROLLOUT_IS_THRESHOLD: VERL_TIS_THRESHOLD,
    # pi_old := mu: KL(mu || pi_old) is not measured, so the train-inference alarm could never fire (refused if kept)
    "+stable.guard.rules.train_inference_kl.enabled": False,
}
"""verl's DPPO with the Binary-TV loss: the loss verl's DPPO example runs when no ``LOSS_MODE`` is given, and the one
verl's DPPO page sets against PPO in its headline comparison ("the proposed DPPO (the Binary-TV variant)",
docs/algo/dppo.md); Binary-KL (``dppo_kl``) is the paper's other binary approximation, offered beside it, not its
default."""


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
            NO_CLIP,
            "MiniRL without clipping (trust region widened to [0.01, 101])",
        ),
        Variant(
            "minirl_noclip_guard",
            "minirl_onpolicy",
            {**NO_CLIP, **GUARDED},
            "MiniRL without clipping, with the acting guard (entropy blow-up -> rollback, then stop)",
        ),
        Variant("vespo", "vespo", {}, "VESPO (sequence-level reshaped IS)"),
        # the baselines: verl's own answers, run through verl's trainer like the rest
        Variant(
            "vanilla_grpo",
            "minirl_onpolicy",
            PLAIN_GRPO,
            "verl's plain GRPO (PPO clip 0.2, (R - mean) / std advantage, token-mean, no IS correction)",
        ),
        Variant("verl_tis", "minirl_onpolicy", VERL_TIS, "verl's token TIS (plain GRPO + w = min(pi_old/mu, 2))"),
        Variant(
            "dppo",
            "minirl_onpolicy",
            DPPO,
            "verl's DPPO-Binary-TV (TV bound 0.15 against the rollout policy, bypass mode, Dr. GRPO advantage)",
        ),
    )
}


def get_variant(name: str) -> Variant:
    """The variant called ``name``. Raises ``ValueError`` naming the known ones."""
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; known: {list(VARIANTS)}")
    return VARIANTS[name]


def pi_old_is_rollout(variant: Variant | str) -> bool:
    """Whether the variant runs verl's bypass mode, which takes the rollout's log-probs as pi_old.

    Such a run never computes the training engine's log-probs before its update, so KL(mu || pi_old) and F(tau) are
    0 by construction there, not a measurement (the report leaves them out: ``summaries.PI_OLD_IS_ROLLOUT``).
    """
    variant = get_variant(variant) if isinstance(variant, str) else variant
    return variant.switches.get(BYPASS_MODE) is True


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
    lr: float | None = None,
) -> list[str]:
    """The full ``main_ppo`` argument list of one lab run: recipe, CPU runtime, geometry, common and variant switches.

    The staleness is set by ``data.train_batch_size = N * mini_batch_prompts`` with ``ppo_epochs = 1`` (the recipes'
    definition of N). The rollout runs ``engine`` at ``precision``: the ``hf`` backend with fp8 weights by default (the
    "inference engine"), or verl's own vLLM rollout on vLLM's CPU build (``engine="vllm"``, fp32 or bf16); the actor
    trains in fp32. ``router_noise`` > 0 perturbs the ``hf`` rollout's routers (inference only; a labelled stand-in for
    a large MoE's routing mismatch). ``lr`` replaces the actor's learning rate (None: the CPU runtime's).

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
    if lr is not None:
        lab[LR] = float(lr)
    if workdir is not None:
        lab["trainer.default_local_dir"] = str(Path(workdir) / "checkpoints")
    kept = [item for item in base if override_key(item) not in lab and override_key(item) != override_key(PRECISION)]
    engine_precision = [f"{PRECISION}={precision}"] if engine == "hf" else []  # vllm: rollout.dtype, set in base
    if router_noise:
        if engine != "hf":
            raise ValueError(f"router_noise is an option of the hf rollout backend, not of {engine!r}")
        engine_precision.append(f"{ROUTER_NOISE}={float(router_noise)}")
    return args + kept + [f"{k}={format_value(v)}" for k, v in lab.items()] + engine_precision
