"""The paper's switches as the lab measures them: variant ``a`` (switch on) against ``b`` (off) at each staleness N;
and MiniRL + R3 against verl's own answers to the same problem (token TIS, DPPO, plain GRPO: :data:`BASELINES`).

For each switch and N where both variants ran, every judged metric is compared by :func:`verl_stable.lab.stats.compare`
(the paired test over the seeds both sides have; Welch's when they share none), and the seeds a side lacks or whose
run stopped short are named (from the sweep's records, :mod:`verl_stable.lab.outcomes`), as are the seeds a
comparison leaves out because their value is non-finite or was not logged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from verl_stable.lab import stats
from verl_stable.lab.stats import Comparison
from verl_stable.lab.summaries import CellSummary, cells_of, log_scale

# the metric and the direction in which a switch helps (None: shown, not judged). Replay's claims (the paper): lower
# train-inference mismatch, fewer clipped tokens, higher reward. KL is judged at step 1, where both arms of a seed
# share weights and samples, and the median step is shown (verl_stable.lab.summaries; docs/explanation/lab.md: the
# step-1 statistic was chosen on 14 seeds and confirmed on 4 fresh ones, stated before running; session 22's
# alternative, the step-1 median token gap, failed its stated test on 8 fresh seeds and is shown, not judged).
JUDGED = (
    ("kl_k3_first", "lower"),
    ("routing_disagreement", "lower"),
    ("clip_frac", "lower"),
    ("late_reward", "higher"),
    ("mean_reward", "higher"),
    ("gap_median_first", None),
    ("kl_k3_median", None),
    ("final_entropy", None),
)
REMOVES = ("kl_k3_first", "routing_disagreement", "clip_frac")
"""What a switch removes (its mechanism: the mismatch, the routing flips, the clipped tokens)."""
OUTCOMES = ("late_reward", "mean_reward")
"""What a switch costs or buys: the reward late in the run and over all its steps (how fast it learned). The paper
warns that R2 and R3 change the target policy (R3 the first mini-batch's), so removing the mismatch can cost reward:
both are judged, side by side."""
# R2 replays pi_old's routing: its engine measures the used experts against that target, not against the rollout's,
# so its 0 routing disagreement says "replayed exactly", not "the rollout's flips removed" (the step-1 KL says that):
# shown, not judged, for R2 and R3 over R2
NOT_ROLLOUT_ROUTING = tuple((m, None if m == "routing_disagreement" else d) for m, d in JUDGED)
REWARD_JUDGED = (
    ("late_reward", "higher"),
    ("mean_reward", "higher"),
    ("final_entropy", None),
    ("kl_k3_median", None),
)
# MiniRL + R3 against a baseline of verl's: judged on what a user adopts either for, the reward. Not on
# KL(mu||pi_old): R3 computes pi_old with the rollout's routing replayed, so its KL is the mismatch left once routing
# is pinned (numerics only), the baseline's the whole mismatch its IS weight (or nothing) must absorb; R3's is lower
# by design (the mechanism, judged by the R3 switch), so it is shown beside, not judged. Not on the clipped fraction:
# each loss clips against its own trust region (MiniRL's ratio mask [0.8, 1.27], PPO's [0.8, 1.2] with dual clip,
# DPPO's TV bound), so the fractions count different things.
BASELINE_JUDGED = REWARD_JUDGED
# DPPO runs in verl's bypass mode (pi_old := mu): it has no KL(mu||pi_old) to show (summaries.PI_OLD_IS_ROLLOUT)
DPPO_JUDGED = (("late_reward", "higher"), ("mean_reward", "higher"), ("final_entropy", None))


def regime_name(n: int) -> str:
    """``on-policy (N = 1)`` or ``off-policy N = n``: the staleness regime of a cell."""
    return "on-policy (N = 1): train-inference mismatch only" if n == 1 else f"off-policy N = {n}: mismatch + staleness"


@dataclass(frozen=True)
class Switch:
    """A switch of the paper, as the lab measures it: variant ``a`` (switch on) against ``b`` (off).

    ``judged``: (metric, the direction in which the switch helps, or None for a metric shown but not judged).
    """

    name: str
    a: str
    b: str
    question: str
    judged: tuple[tuple[str, str | None], ...] = JUDGED


SWITCHES = (
    Switch(
        "IS weight", "minirl", "reinforce_no_is", "MiniRL's truncated train-inference IS weight vs none", REWARD_JUDGED
    ),
    Switch("R3", "minirl_r3", "minirl", "MiniRL + R3 (replay the rollout's routing) vs MiniRL"),
    Switch("R2", "minirl_r2", "minirl", "MiniRL + R2 (replay pi_old's routing) vs MiniRL", NOT_ROLLOUT_ROUTING),
    Switch("R3 over R2", "minirl_r3", "minirl_r2", "R3 vs R2", NOT_ROLLOUT_ROUTING),
    # the clipped fraction is what clipping does, not a cost: judged on reward only
    Switch("clipping", "minirl", "minirl_noclip", "MiniRL's clipping (trust region) vs none", REWARD_JUDGED),
    Switch("VESPO", "vespo", "minirl", "VESPO (sequence-level reshaping) vs MiniRL", REWARD_JUDGED),
    # issue #29: does a guard that rolls back (then stops) rescue a run without a trust region? A run it stopped has
    # fewer steps: the comparison names it as stopping short, and the report's runs section says the guard stopped it
    Switch(
        "acting guard",
        "minirl_noclip_guard",
        "minirl_noclip",
        "without clipping: the guard (entropy blow-up -> rollback, then stop) vs none",
        REWARD_JUDGED,
    ),
)

BASELINES = (
    Switch(
        "MiniRL + R3 over verl TIS",
        "minirl_r3",
        "verl_tis",
        "MiniRL + R3 vs verl's token TIS (rollout_is=token, threshold 2, vanilla PPO loss, GRPO advantage)",
        BASELINE_JUDGED,
    ),
    Switch(
        "MiniRL + R3 over DPPO",
        "minirl_r3",
        "dppo",
        "MiniRL + R3 vs verl's DPPO-Binary-TV (TV bound 0.15 against the rollout policy, no replay)",
        DPPO_JUDGED,
    ),
    Switch(
        "MiniRL + R3 over GRPO",
        "minirl_r3",
        "vanilla_grpo",
        "MiniRL + R3 vs verl's plain GRPO (vanilla PPO loss, no IS correction)",
        BASELINE_JUDGED,
    ),
)
"""What a verl user would pick instead: does MiniRL + R3 beat what verl already has, at which N, on which measure."""


@dataclass(frozen=True)
class SwitchResult:
    """One switch at one N: a comparison per judged metric.

    ``missing``: for each side (variant) that lacks seeds the comparison should have had, the variant and those
    seeds (a seed is expected when the other side has it, or when the sweep recorded a run of it that logged no step);
    empty ``comparisons`` with a ``missing`` entry: one side has no run at all.
    """

    switch: Switch
    staleness: int
    comparisons: tuple[tuple[Comparison, str | None], ...]  # (comparison, the direction that helps)
    missing: tuple[tuple[str, tuple[int, ...]], ...] = ()
    paired: tuple[int, ...] = ()  # the seeds both sides have
    partial: tuple[tuple[str, int, int, int | None], ...] = ()  # (variant, seed, steps logged, steps expected)
    # (metric, why): a judged metric not compared because every value of a side was non-finite
    uncompared: tuple[tuple[str, str], ...] = ()

    @property
    def lacking(self) -> bool:
        """Whether a seed is missing, a run's steps stop short or a metric went uncompared on either side."""
        return bool(self.missing or self.partial or self.uncompared)

    def helps(self) -> list[Comparison]:
        return [c for c, good in self.comparisons if good and c.verdict == good]

    def hurts(self) -> list[Comparison]:
        return [c for c, good in self.comparisons if good and c.is_finding and c.verdict != good]

    def removes(self) -> list[Comparison]:
        """Findings that the switch removes what it is for (:data:`REMOVES`, in its helpful direction)."""
        return [c for c in self.helps() if c.metric in REMOVES]

    def buys(self) -> list[Comparison]:
        """Findings that the switch raises the reward (:data:`OUTCOMES`)."""
        return [c for c in self.helps() if c.metric in OUTCOMES]

    def costs(self) -> list[Comparison]:
        """Findings that the switch lowers the reward, or raises what it should remove."""
        return self.hurts()

    def verdict(self) -> str:
        """The answer, judging benefit and cost together.

        ``yes``: it removes what it is for or raises the reward, and costs nothing measured; ``trade-off``: it removes
        the mismatch (or the clipped tokens) but lowers the reward; ``hurts``: it costs and removes or buys nothing;
        ``mixed``: it raises the reward on one measure and lowers it on another, or removes one thing and raises
        another; ``no effect measured``: no finding either way.
        """
        removes, buys, costs = self.removes(), self.buys(), self.costs()
        reward_costs = [c for c in costs if c.metric in OUTCOMES]
        if not costs:
            return "yes" if removes or buys else "no effect measured"
        if not removes and not buys:
            return "hurts"
        if removes and not buys and len(reward_costs) == len(costs):
            return "trade-off"
        return "mixed"


def _recorded_seeds(runs: Sequence[Mapping], variant: str, n: int) -> set[int]:
    return {int(r["seed"]) for r in runs if r.get("variant") == variant and r.get("staleness") == n}


def _partial(runs: Sequence[Mapping], variants: Sequence[str], n: int) -> tuple[tuple[str, int, int, int | None], ...]:
    """Runs of ``variants`` at ``n`` that failed after logging some steps: their summaries use fewer steps."""
    return tuple(
        (r["variant"], r["seed"], r["steps"], r.get("expected_steps"))
        for r in runs
        if r["variant"] in variants and r["staleness"] == n and r["steps"] > 0 and (r.get("error") or r["returncode"])
    )


def switch_results(cells: Sequence[CellSummary], runs: Sequence[Mapping] = ()) -> list[SwitchResult]:
    """At every N, every switch of :data:`SWITCHES` and then every comparison of :data:`BASELINES` whose two variants
    both ran there, with the seeds each side lacks.

    Args:
        cells: :func:`verl_stable.lab.summaries.summarize`'s cells.
        runs: the sweep's run records (:func:`verl_stable.lab.outcomes.run_records`): a run recorded there that logged
            no step is a seed its side lacks, and a switch whose one side only failed is listed with no comparison.
    """
    out = []
    for n in sorted({c.staleness for c in cells} | {int(r["staleness"]) for r in runs}):
        for sw in SWITCHES + BASELINES:
            on, off = cells_of(cells, sw.a, n), cells_of(cells, sw.b, n)
            has = {v: set(c[0].run_seeds) if c else set() for v, c in ((sw.a, on), (sw.b, off))}
            tried = {v: has[v] | _recorded_seeds(runs, v, n) for v in (sw.a, sw.b)}
            if not tried[sw.a] or not tried[sw.b]:
                continue  # a variant this sweep did not run at this N: the switch is not part of it
            expected = tried[sw.a] | tried[sw.b]
            missing = tuple((v, tuple(sorted(expected - has[v]))) for v in (sw.a, sw.b) if expected - has[v])
            partial = _partial(runs, (sw.a, sw.b), n)
            if not on or not off:  # one side's runs all failed: said, not skipped
                out.append(SwitchResult(sw, n, (), missing, (), partial))
                continue
            comps, uncompared = [], []
            for field, good in sw.judged:
                a, b = on[0].per_seed.get(field) or {}, off[0].per_seed.get(field) or {}
                out_of_it = _left_out(on[0], off[0], field)
                if a and b:
                    log = log_scale(field, a.values(), b.values())
                    comps.append((stats.compare(field, sw.a, a, sw.b, b, log=log, left_out=out_of_it), good))
                elif any(f == field for c in (on[0], off[0]) for _, f, _ in c.non_finite):
                    # not a metric the variant does not log: its values were there and none was finite
                    uncompared.append((field, "; ".join(f"seed {s} out: {why}" for s, why in out_of_it.items())))
            if comps or uncompared:
                paired = tuple(sorted(has[sw.a] & has[sw.b]))
                out.append(SwitchResult(sw, n, tuple(comps), missing, paired, partial, tuple(uncompared)))
    return out


def _left_out(on: CellSummary, off: CellSummary, field: str) -> dict[int, str]:
    """Seed -> why, for each seed a side ran but has no ``field`` value for (naming the side), in seed order."""
    why: dict[int, list[str]] = {}
    for cell in (on, off):
        for seed, reason in cell.left_out(field).items():
            why.setdefault(seed, []).append(f"{cell.variant} {reason}")
    return {seed: "; ".join(why[seed]) for seed in sorted(why)}
