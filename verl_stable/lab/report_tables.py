"""The report's text: the answer table (regime -> switch -> needed?), the table per cell, every comparison with the
rule that decided it, and the observations that hold by construction (replay exactness, guard)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from verl_stable.lab.stats import ALPHA, POWER, Comparison, Interval
from verl_stable.lab.summaries import LABELS, LOG_SCALE, CellSummary, cells_of, non_finite_text
from verl_stable.lab.switches import SwitchResult, regime_name

RULE = (
    "Each switch is judged on what it removes and what it costs, side by side. **Removes**: with it on, the step-1 "
    "KL(mu‖pi_old) (both runs of a seed on the same weights and samples), the routing disagreement with the rollout "
    "or the clipped fraction is lower; **costs** / **buys**: the late reward (second half of the steps) or the reward "
    "over all steps (how fast it learned) is lower / higher. Each by a paired t-test on the per-seed differences (the "
    f"runs of one seed share data order and sampling seeds; KL on log10) at p < {ALPHA}; by Welch's t-test when the "
    "two sides share no seed. Verdicts: **yes** (removes or buys, costs nothing measured), **trade-off** (removes the "
    "mismatch, costs reward), **hurts** (costs, removes and buys nothing), mixed, or 'no effect measured (none larger "
    f"than X)', X the smallest difference the design detects with {POWER:.0%} power. Beside each finding: the exact "
    "sign-flip p, the effect size (mean difference / sd of the differences) and the unpaired Welch p. A comparison "
    "that lacks a seed (its run failed) says which."
)
BASELINE_RULE = (
    "MiniRL + R3 is **ahead** of a baseline of verl's when its late reward is higher by the same test. KL(mu‖pi_old) "
    "is shown, not judged: R3 computes pi_old with the rollout's routing, so its KL is the mismatch left once routing "
    "is pinned, the baseline's the whole mismatch. DPPO runs in verl's bypass mode (pi_old is the rollout's "
    "log-probs): it has no KL(mu‖pi_old) or F(2) of its own, and no pi_old entropy (verl computes it in the pass that "
    "bypass mode skips)."
)


def fmt(x: float | None, digits: int = 3) -> str:
    """``x`` with ``digits`` decimals; ``digits = 0`` means two significant digits in scientific notation (KL)."""
    if x is None:
        return "-"
    if digits == 0:
        return f"{x:.1e}"
    if x != 0 and abs(x) < 10 ** (-digits):
        return f"{x:.1e}"
    return f"{x:.{digits}f}"


def fmt_iv(iv: Interval | None, digits: int = 3) -> str:
    """``mean [lo, hi]`` (the mean alone without an interval; ``-`` for None)."""
    if iv is None:
        return "-"
    if iv.lo is None:
        return fmt(iv.mean, digits)
    return f"{fmt(iv.mean, digits)} [{fmt(iv.lo, digits)}, {fmt(iv.hi, digits)}]"


TABLE_FIELDS = (
    "late_reward",
    "final_entropy",
    "kl_k3",
    "kl_k3_median",
    "kl_k3_first",
    "gap_median_first",
    "f2",
    "clip_frac",
    "routing_disagreement",
    "routing_layer_max",
    "router_disagreement",
)
DIGITS = {
    "kl_k3": 0,
    "kl_k3_median": 0,
    "kl_k3_first": 0,
    "gap_median_first": 0,
    "f2": 4,
}  # 0: scientific (KL spans decades)


def table(cells: Sequence[CellSummary]) -> str:
    """The markdown table, one row per (variant, N): mean [95 % interval] over seeds of each run summary."""
    head = "| variant | N | seeds | steps | " + " | ".join(LABELS[f] for f in TABLE_FIELDS) + " | guard fired |"
    lines = [head, "|" + "---|" * (len(TABLE_FIELDS) + 5)]
    for c in cells:
        values = " | ".join(fmt_iv(c.interval(f), DIGITS.get(f, 3)) for f in TABLE_FIELDS)
        lines.append(
            f"| {c.variant} | {c.staleness} | {c.seeds} | {c.steps} | {values} | {', '.join(c.guard_fired) or 'no'} |"
        )
    return "\n".join(lines)


def _seed_list(seeds: Iterable[int]) -> str:
    seeds = list(seeds)
    return ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(str(s) for s in seeds)


def missing_text(r: SwitchResult) -> str:
    """``""``, or what a comparison lacks: ``missing: minirl_r3 seed 13 (no step logged); paired on seeds 11, 12``,
    runs that stopped short: ``incomplete: minirl seed 4 (3 of 8 steps)``, and a judged metric no seed of a side has
    a finite value of: ``step-1 KL(mu‖pi_old) k3 not compared (seed 0 out: minirl_r3 logged inf at step 1)``."""
    parts = []
    if r.missing:
        parts.append(
            "missing: " + "; ".join(f"{v} {_seed_list(seeds)}" for v, seeds in r.missing) + " (no step logged)"
        )
    if r.partial:
        parts.append(
            "incomplete: "
            + "; ".join(f"{v} seed {seed} ({k}{f' of {n}' if n else ''} steps)" for v, seed, k, n in r.partial)
        )
    if r.missing and r.comparisons:
        parts.append(f"paired on {_seed_list(r.paired) if r.paired else 'no seed'}")
    parts += [f"{LABELS[field]} not compared ({why})" for field, why in r.uncompared]
    return "; ".join(parts)


def _effect(c: Comparison) -> str:
    iv = f"{fmt_iv(c.ia, DIGITS.get(c.metric, 3))} vs {fmt_iv(c.ib, DIGITS.get(c.metric, 3))}"
    ratio = c.ratio
    times = f", {ratio:.0f}x lower" if c.metric in LOG_SCALE and c.verdict == "lower" and ratio and ratio >= 2 else ""
    return f"{LABELS[c.metric]} {iv}{times}"


def answer_table(results: Sequence[SwitchResult], baselines: bool = False) -> str:
    """The headline: regime -> switch -> verdict -> what it removes -> what it costs (findings with their test, or why
    none).

    ``baselines``: the results are MiniRL + R3 against verl's own answers (``switches.BASELINES``); the verdict then
    reads "is MiniRL + R3 ahead?".
    """
    if baselines:
        lines = [
            "| regime | comparison | MiniRL + R3 ahead? | evidence (mean [95 % interval] over seeds, MiniRL + R3 vs "
            "the baseline) |"
        ]
    else:
        lines = ["| regime | switch | needed here? | evidence (mean [95 % interval] over seeds, switch on vs off) |"]
    if not baselines:
        return _switch_table(results)
    lines.append("|---|---|---|---|")
    for r in results:
        if not r.comparisons:
            lines.append(f"| {regime_name(r.staleness)} | {r.switch.name} | not measured | {missing_text(r)} |")
            continue
        helps, hurts = r.helps(), r.hurts()
        if helps and not hurts:
            verdict = "**yes**"
        elif hurts and not helps:
            verdict = "no: the baseline is ahead"
        elif helps and hurts:
            verdict = "mixed"
        else:
            verdict = "no effect measured"
        evidence = _evidence(r, [c for c, good in r.comparisons if good])
        lines.append(f"| {regime_name(r.staleness)} | {r.switch.name} | {verdict} | {evidence} |")
    return "\n".join(lines)


def _evidence(r: SwitchResult, shown: Sequence[Comparison]) -> str:
    """The findings among ``shown`` with their test, else why none (each "no effect" with the smallest effect the
    design could detect), plus what the comparison lacks."""
    if not shown:
        text = "not judged here"
    elif all(c.verdict == "too few seeds" for c in shown):
        text = "fewer than 2 seeds: no test (rerun with --seeds 0 1 2)" + "".join(
            f"; {c.left_out_text()}" for c in shown if c.left_out
        )
    else:
        text = "; ".join(
            f"{_effect(c)} ({c.test_text()})"
            if c.is_finding
            else f"{_effect(c)}: {c.reason}" + (f" ({c.left_out_text()})" if c.left_out else "")
            for c in shown
        )
    return text + (f" ({missing_text(r)})" if r.lacking else "")


def _switch_table(results: Sequence[SwitchResult]) -> str:
    """regime -> switch -> verdict -> what it removes -> what it costs or buys, each with its paired statistics."""
    from verl_stable.lab.switches import OUTCOMES, REMOVES

    lines = [
        "| regime | switch | verdict | removes (switch on vs off; mean [95 % interval] over seeds) | costs or buys "
        "(reward, switch on vs off) |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        if not r.comparisons:
            lines.append(f"| {regime_name(r.staleness)} | {r.switch.name} | not measured | {missing_text(r)} | |")
            continue
        verdict = r.verdict()
        verdict = f"**{verdict}**" if verdict in ("yes", "trade-off", "hurts") else verdict
        removes = [c for c, good in r.comparisons if good and c.metric in REMOVES]
        outcomes = [c for c, good in r.comparisons if good and c.metric in OUTCOMES]
        removed = _evidence(r, removes) if removes else "not judged (reward only)"
        lines.append(
            f"| {regime_name(r.staleness)} | {r.switch.name} | {verdict} | {removed} | {_evidence(r, outcomes)} |"
        )
    return "\n".join(lines)


def comparison_lines(results: Sequence[SwitchResult]) -> list[str]:
    """Every comparison in full: values, verdict, the rule that decided, the test."""
    out = []
    for r in results:
        if not r.comparisons:
            out.append(f"{r.switch.name}, N={r.staleness}: not compared; {missing_text(r)}.")
        for c, good in r.comparisons:
            verdict = {"lower": f"{r.switch.a} lower", "higher": f"{r.switch.a} higher"}.get(c.verdict, c.verdict)
            role = "" if good is None else (" (helps)" if c.verdict == good else " (hurts)" if c.is_finding else "")
            per_seed = ", ".join(f"{d:+.3g}" for d in c.diffs)
            kind = "log10 differences" if c.log else "differences"
            out.append(
                f"{r.switch.name}, N={r.staleness}, {LABELS[c.metric]}: {_effect(c)} -> **{verdict}**{role}: "
                f"{c.reason}; per-seed {kind} [{per_seed}]; {c.test_text()}{_seeds_text(c)}"
                + (f"; {missing_text(r)}." if r.lacking else ".")
            )
    return out


def _seeds_text(c: Comparison) -> str:
    """The seeds the paired test needs for :data:`POWER` at the effect size measured (the design's question for the
    next sweep); empty without a paired test or effect."""
    from verl_stable.lab.stats import seeds_needed

    effect = c.paired.effect if c.paired is not None else None
    if effect is None or not math.isfinite(effect) or effect == 0:
        return ""
    n = seeds_needed(effect)
    return f"; seeds for {POWER:.0%} power at this effect size: {n if n is not None else '> 64'}"


def observations(cells: Sequence[CellSummary]) -> list[str]:
    """What the cells show that is true by construction or descriptive (replay exactness, mismatch size, guard)."""
    out = []
    for r3 in cells_of(cells, "minirl_r3"):
        d, hidden = r3.mean("routing_disagreement"), r3.mean("router_disagreement")
        if d is not None:
            out.append(
                f"R3, N={r3.staleness}: routing disagreement with the rollout {fmt(d)} (0 when the replay works: "
                f"{'yes' if d == 0 else 'NO'}); the router's own choice differs on {fmt(hidden)} of the rows."
            )
    no_replay = (
        "minirl",
        "reinforce_no_is",
        "minirl_noclip",
        "minirl_noclip_guard",
        "vespo",
        "vanilla_grpo",
        "verl_tis",
        "dppo",
    )
    for c in cells:
        d = c.mean("routing_disagreement")
        if c.variant in no_replay and d is not None:
            out.append(
                f"Without replay ({c.variant}, N={c.staleness}) the updates routed {fmt(d)} of the (token, MoE layer) "
                "rows to other experts than the rollout (observed, not replayed)."
            )
    fired = [f"{c.variant} N={c.staleness} ({', '.join(c.guard_fired)})" for c in cells if c.guard_fired]
    out.append("Guard fired in: " + ("; ".join(fired) if fired else "no run") + ".")
    for c in cells:
        for seed, field, steps in c.non_finite:
            out.append(
                f"{c.variant} N={c.staleness} seed {seed}: {LABELS[field]} left out: {non_finite_text(steps)} "
                "(not a finite number: no mean, median or test can use it)."
            )
    for c in cells:
        if c.steps_redone:
            seeds = ", ".join(f"seed {seed}: {k} step(s) redone" for seed, k in c.steps_redone)
            out.append(
                f"The guard rolled back {c.variant} N={c.staleness} ({seeds}); its numbers are those of the steps "
                "the run kept, the abandoned rows stay in metrics.jsonl marked superseded."
            )
    return out
