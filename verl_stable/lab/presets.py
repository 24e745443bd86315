"""The lab's presets: which (variant, N) runs a sweep makes, with how many seeds and steps, at what scale.

A :class:`Preset` is checked when it is made (known variants and N, distinct runs and seeds, seeds numpy accepts, a
known precision); :data:`PRESETS` are the shipped ones (``verl-stable lab --list``). :class:`RunSpec` names one run
(``<variant>__N<n>__s<seed>``, its directory under ``runs/``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from verl_stable.lab import variants as V
from verl_stable.lab.coldstart import ColdStartConfig

MAX_SEED = 2**32 - 1  # numpy's seed range; verl seeds its data shuffling with data.seed


@dataclass(frozen=True)
class RunSpec:
    """One training run: a variant at staleness N with a seed."""

    variant: str
    staleness: int
    seed: int = 0

    @property
    def name(self) -> str:
        """``<variant>__N<n>__s<seed>``: the run's directory under ``runs/`` and its ``--only`` name."""
        return f"{self.variant}__N{self.staleness}__s{self.seed}"


LAB_TOP_K = 2
LAB_PRECISION = "int4"
"""The lab's routing-mismatch setting, found by measurement (docs/explanation/lab.md, "How the setting was chosen"):
top-2 routing and an int4-weight rollout flip ~10 % of routing decisions at the cold start, the rate the R3 paper
measures between FP8 inference and BF16 training on Qwen3-30B-A3B, with no artificial perturbation."""


@dataclass(frozen=True)
class Preset:
    """A sweep: which runs, how long, at what scale.

    Attributes:
        name: preset id.
        runs: (variant, N) pairs; each is run once per seed.
        steps: RL steps per run (``trainer.total_training_steps``).
        seeds: seeds per (variant, N).
        mini_batch_prompts: prompts per mini-batch; a step has N mini-batches.
        group_size: samples per prompt.
        task: toy task of :mod:`verl_stable.toy.tasks`.
        precision: rollout precision (the training engine is fp32; default: the lab's measured setting, int4): fp8,
            fp8_w8a8, int4, bf16, fp16, fp32 for the ``hf``
            backend, fp32 / bf16 for ``vllm``.
        max_response_length: response token budget (answers are one digit + end of turn).
        coldstart: cold-start settings.
        engine: rollout engine, ``hf`` (the project's backend) or ``vllm`` (verl's vLLM rollout on vLLM's CPU build).
        top_k: experts per token of the tiny MoE (its ``num_experts_per_tok``; 16 experts).
        router_noise: sigma of the ``hf`` rollout's inference-only router perturbation (0: off); a labelled stand-in
            for a large MoE's routing mismatch (:func:`verl_stable.backends.hf.precision.router_perturbation`).
        lr: the actor's learning rate (``actor.optim.lr``); None keeps the CPU runtime's 1e-3.
    """

    name: str
    runs: tuple[tuple[str, int], ...]
    steps: int
    seeds: tuple[int, ...] = (0,)
    mini_batch_prompts: int = 4
    group_size: int = 4
    task: str = "max"
    precision: str = LAB_PRECISION
    max_response_length: int = 4
    coldstart: ColdStartConfig = field(default_factory=ColdStartConfig)
    engine: str = "hf"
    top_k: int = LAB_TOP_K
    router_noise: float = 0.0
    lr: float | None = None

    def __post_init__(self) -> None:
        if self.steps < 1 or not self.seeds or not self.runs:
            raise ValueError(f"preset {self.name!r} needs steps >= 1, a seed and a run")
        bad_seeds = [s for s in self.seeds if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= MAX_SEED]
        if bad_seeds:
            raise ValueError(f"preset {self.name!r}: seeds must be integers in [0, {MAX_SEED}], got {bad_seeds}")
        # two runs of one name would share (and clobber) one run directory
        if len(set(self.seeds)) != len(self.seeds) or len(set(self.runs)) != len(self.runs):
            raise ValueError(
                f"preset {self.name!r}: seeds and (variant, N) runs must be distinct, got seeds={list(self.seeds)} "
                f"runs={list(self.runs)}"
            )
        for variant, n in self.runs:
            V.get_variant(variant)
            if n not in V.STALENESS_CHOICES:
                raise ValueError(f"preset {self.name!r}: N must be one of {V.STALENESS_CHOICES}, got {n}")
        if self.precision not in V.PRECISIONS:
            raise ValueError(f"precision must be one of {V.PRECISIONS}, got {self.precision!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 1 <= self.top_k <= 16:
            raise ValueError(f"preset {self.name!r}: top_k must be an int in [1, 16] (16 experts), got {self.top_k!r}")
        if not 0 <= self.router_noise < float("inf"):
            raise ValueError(
                f"preset {self.name!r}: router_noise must be a finite number >= 0, got {self.router_noise}"
            )
        if self.lr is not None and not (isinstance(self.lr, float) and 0 < self.lr < float("inf")):
            raise ValueError(f"preset {self.name!r}: lr must be a finite float > 0, got {self.lr!r}")
        if self.router_noise and self.engine != "hf":
            raise ValueError(f"preset {self.name!r}: router_noise is an hf-backend option, engine is {self.engine!r}")
        from verl_stable.toy import launch

        launch.engine_overrides(self.engine, self.precision, True)  # ValueError: unknown engine, precision it lacks

    def regrid(self, variants: Sequence[str] | None = None, staleness: Sequence[int] | None = None) -> Preset:
        """This preset with its runs replaced by every one of ``variants`` at every one of ``staleness``.

        Either left out (None or empty) keeps the preset's own: its variants, or the N it runs, in the order they
        first appear in its runs. ``verl-stable lab --variants minirl_r3 dppo`` is the default preset's question (its
        N, seeds, steps, scale) asked of those two variants.

        Raises:
            ValueError: An unknown variant, an N outside {1, 2, 4, 8}, or one given twice.
        """
        if not variants and not staleness:
            return self
        own_variants = tuple(dict.fromkeys(v for v, _ in self.runs))
        own_staleness = tuple(dict.fromkeys(n for _, n in self.runs))
        runs = tuple((v, n) for v in (variants or own_variants) for n in (staleness or own_staleness))
        return replace(self, runs=runs)  # __post_init__ checks the variants, the N and that no run repeats

    def run_specs(self) -> list[RunSpec]:
        return [RunSpec(v, n, s) for s in self.seeds for v, n in self.runs]

    def select(self, only: Sequence[str] | None = None) -> list[RunSpec]:
        """The runs whose name starts with one of the ``only`` prefixes (every run when ``only`` is None).

        Raises:
            ValueError: An empty prefix (it would select every run, as no ``--only`` does), or a prefix that names no
                run of this preset; the message lists the preset's run names.
        """
        specs = self.run_specs()
        if only is None:
            return specs
        if not only or any(not p.strip() for p in only):
            raise ValueError(
                f"--only {list(only)} holds an empty prefix, which would select every run; expected a non-empty "
                f"prefix of one of {[s.name for s in specs]} (or no --only for all of them)"
            )
        unmatched = [p for p in only if not any(s.name.startswith(p) for s in specs)]
        if unmatched:
            raise ValueError(
                f"--only {unmatched} names no run of preset {self.name!r}; expected a prefix of one of "
                f"{[s.name for s in specs]}"
            )
        return [s for s in specs if any(s.name.startswith(p) for p in only)]


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        # a quick look (<= 10 min on 2 cores, docs/explanation/lab.md): does R3 remove the routing mismatch at N = 4,
        # and what does it cost? Seeds by power on 14 fresh seeds (70-75, 80-87): step 1's KL needs 6 (power 0.98);
        # R3's late-reward cost, -0.059 on 70-75 and +0.019 on 80-87, pools to effect size 0.13, which no CPU preset
        # can power (> 64 seeds: benchmarks/lab_seed_power.py --scale linear): 6 seeds, the cost shown beside the KL
        # with the smallest effect the design detects; 4 steps keep 12 runs inside the budget
        Preset(
            "default",
            runs=(("minirl", 4), ("minirl_r3", 4)),
            steps=4,
            seeds=(0, 1, 2, 3, 4, 5),
        ),
        # the full comparison (<= 60 min on 2 cores): the IS weight on-policy, R2 / R3 / VESPO and verl's own answers
        # (token TIS, DPPO, plain GRPO) at N = 4, clipping at N = 8; 6 seeds each, the default's: its R3 rows ask the
        # default's question (power 0.68 at 4 seeds, 0.94 at 6 on the step-1 spread of 16 seeds,
        # docs/explanation/lab.md)
        Preset(
            "evidence",
            runs=(
                ("reinforce_no_is", 1),
                ("minirl", 1),
                ("minirl", 4),
                ("minirl_r2", 4),
                ("minirl_r3", 4),
                ("vespo", 4),
                ("verl_tis", 4),
                ("dppo", 4),
                ("vanilla_grpo", 4),
                ("minirl", 8),
                ("minirl_noclip", 8),
            ),
            steps=8,
            seeds=(0, 1, 2, 3, 4, 5),
        ),
        # MiniRL + R3 against verl's own answers at each staleness regime (<= 60 min on 2 cores): on-policy (mismatch
        # only), N = 4 and N = 8 (mismatch + staleness); 3 seeds each
        Preset(
            "baselines",
            runs=tuple((v, n) for n in (1, 4, 8) for v in ("minirl_r3", "verl_tis", "dppo", "vanilla_grpo")),
            steps=8,
            seeds=(0, 1, 2),
        ),
        # the regime where training fails without the practices (docs/explanation/lab.md, "Where training fails
        # without a trust region"; <= 2 h on 2 cores): 24 steps at N = 8, where MiniRL without clipping lagged or
        # collapsed on the search's seeds 0-3; beside it the acting guard, each switch (clipping, the IS weight, R3,
        # VESPO) and verl's answers with a trust region of their own (DPPO, plain GRPO's PPO clip), on seeds the
        # search did not use. Left out for the budget
        # (a run here takes ~4 min of a 2-core host): R2 (what it replays, R3 replays more exactly) and verl's token
        # TIS (plain GRPO's trust region with an IS weight; the IS weight has its own switch)
        Preset(
            "stability",
            runs=tuple(
                (v, 8)
                for v in (
                    "minirl_noclip",
                    "minirl_noclip_guard",
                    "minirl",
                    "reinforce_no_is",
                    "minirl_r3",
                    "vespo",
                    "dppo",
                    "vanilla_grpo",
                )
            ),
            steps=24,
            seeds=(5, 6, 7),
        ),
        # every variant at every N, 3 seeds, longer runs and bigger batches: hours on 2 cores
        Preset(
            "full",
            runs=tuple((v, n) for n in V.STALENESS_CHOICES for v in V.VARIANTS),
            steps=40,
            seeds=(0, 1, 2),
            mini_batch_prompts=8,
            group_size=8,
        ),
        # the CI smoke test: one R3 run of two steps in the lab's setting
        Preset(
            "mini",
            runs=(("minirl_r3", 2),),
            steps=2,
            mini_batch_prompts=2,
            group_size=4,
        ),
    )
}
