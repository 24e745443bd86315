"""The lab's report: per-step metric rows in, a markdown report and PNG figures out (pure: no verl, no runs).

Input rows are verl's logged metrics per step, tagged with ``variant``, ``staleness`` and ``seed`` (see
:func:`verl_stable.lab.results.tag_rows`). Every metric is read under the name verl / verl-stable logs it
(:data:`METRICS`, first key present wins).

Each run is summarised by one number per metric (:func:`summarize_run`): late reward (mean batch reward
``critic/score/mean`` over the last half of the steps), final entropy (``stable/entropy/mean``), and means over the
steps of KL(mu || pi_old) (k3, ``E_mu[r - 1 - log r]``, ``r = pi_old / mu``), F(2) (fraction of tokens with
``pi_old / mu`` outside ``[1/2, 2]``), the routing disagreement (rows whose used experts differ from the rollout's, or
pi_old's under R2), the router's own disagreement (what replay hides) and the clipped fraction. A (variant, N) cell
holds one such number per seed; the report gives their mean and 95 % interval.

The report starts with the answer: for each regime (a staleness N) and each switch of the paper (the IS weight, R2,
R3, VESPO), whether the switch changed what it should, by the rule of :mod:`verl_stable.lab.stats` (intervals
separated, every seed agreeing; Welch's test printed beside it). Then the table per cell, the comparisons in full,
and one figure per regime: reward, entropy, KL(mu||pi_old), clipped fraction and routing disagreement per step, the
mean over seeds with the band from the lowest to the highest seed.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from verl_stable.lab import stats
from verl_stable.lab.stats import Comparison, Interval

METRICS: dict[str, tuple[str, ...]] = {
    "reward": ("critic/score/mean", "critic/rewards/mean"),
    "entropy": ("stable/entropy/mean", "actor/entropy"),
    "kl_k3": ("stable/train_inf/kl_k3", "rollout_corr/k3_kl"),
    "f2": ("stable/train_inf/extreme_frac_tau2",),
    "routing_disagreement": ("actor/stable/routing/disagreement", "stable/routing/disagreement"),
    "router_disagreement": ("actor/stable/routing/router_disagreement", "stable/routing/router_disagreement"),
    "clip_frac": ("actor/pg_clipfrac",),
}
GUARD_PREFIX = "stable/guard/"
MINIRL_MASKED = ("actor/MiniRL/masked_frac_low", "actor/MiniRL/masked_frac_high")
PLOTTED = ("reward", "entropy", "kl_k3", "clip_frac", "routing_disagreement")
REQUIRED_FIELDS = ("variant", "staleness", "seed", "step")


def metric(row: Mapping, name: str) -> float | None:
    """The value of summary metric ``name`` in a step row (first logged key of :data:`METRICS`), else None."""
    if name == "clip_frac" and METRICS["clip_frac"][0] not in row and any(k in row for k in MINIRL_MASKED):
        return sum(float(row.get(k) or 0.0) for k in MINIRL_MASKED)
    for key in METRICS[name]:
        value = row.get(key)
        if value is not None and isinstance(value, (int, float)) and math.isfinite(value):
            return float(value)
    return None


_JSON_NAMES = {str: "string", dict: "object", list: "list", bool: "bool", int: "int", float: "float"}


def _described(value: object) -> str:
    return "None" if value is None else f"the {_JSON_NAMES.get(type(value), type(value).__name__)} {value!r}"


def row_problem(row: Mapping) -> str | None:
    """What is wrong with a row's run identity and step (:data:`REQUIRED_FIELDS`); None when nothing.

    ``variant`` must be a string, ``staleness``, ``seed`` and ``step`` integers (not bools, floats or numeric
    strings): rows are grouped and ordered by them, so a seed ``"0"`` would pass the duplicate check beside seed 0 and
    then be merged into that run, changing its numbers.
    """
    missing = [f for f in REQUIRED_FIELDS if f not in row]
    if missing:
        return f"lacks {missing}; rows need {list(REQUIRED_FIELDS)}"
    for key in REQUIRED_FIELDS:
        value = row[key]
        if key == "variant":
            if not isinstance(value, str):
                return f"key {key!r} must be a string, got {_described(value)}"
        elif isinstance(value, bool) or not isinstance(value, int):
            return f"key {key!r} must be an integer, got {_described(value)}"
    return None


def check_rows(rows: Sequence[Mapping]) -> None:
    """Raise ``ValueError`` for a row whose run identity or step is missing or mistyped (:func:`row_problem`), or
    a step repeated within a run."""
    seen = set()
    for i, row in enumerate(rows):
        problem = row_problem(row)
        if problem is not None:
            raise ValueError(f"metric row {i}: {problem}")
        key = (row["variant"], row["staleness"], row["seed"], row["step"])
        if key in seen:
            raise ValueError(f"duplicate step {row['step']} for {key[:3]}")
        seen.add(key)


def _mean(xs: Iterable[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


@dataclass(frozen=True)
class RunSummary:
    """Summary of one (variant, N, seed) run."""

    variant: str
    staleness: int
    seed: int
    steps: int
    final_reward: float | None
    best_reward: float | None
    final_entropy: float | None
    kl_k3: float | None
    f2: float | None
    routing_disagreement: float | None
    router_disagreement: float | None
    clip_frac: float | None
    guard_fired: tuple[str, ...]
    late_reward: float | None = None


def summarize_run(rows: Sequence[Mapping]) -> RunSummary:
    """Summary of one run's rows (all with the same variant, N and seed), sorted by step."""
    rows = sorted(rows, key=lambda r: r["step"])
    rewards = [metric(r, "reward") for r in rows]
    present = [x for x in rewards if x is not None]
    fired = sorted({k[len(GUARD_PREFIX) :] for r in rows for k, v in r.items() if k.startswith(GUARD_PREFIX) and v})
    return RunSummary(
        variant=rows[0]["variant"],
        staleness=int(rows[0]["staleness"]),
        seed=int(rows[0]["seed"]),
        steps=len(rows),
        final_reward=present[-1] if present else None,
        best_reward=max(present) if present else None,
        final_entropy=next((x for x in (metric(r, "entropy") for r in reversed(rows)) if x is not None), None),
        kl_k3=_mean(metric(r, "kl_k3") for r in rows),
        f2=_mean(metric(r, "f2") for r in rows),
        routing_disagreement=_mean(metric(r, "routing_disagreement") for r in rows),
        router_disagreement=_mean(metric(r, "router_disagreement") for r in rows),
        clip_frac=_mean(metric(r, "clip_frac") for r in rows),
        guard_fired=tuple(fired),
        late_reward=_mean(metric(r, "reward") for r in rows[len(rows) // 2 :]),
    )


def group_runs(rows: Sequence[Mapping]) -> dict[tuple[str, int, int], list[Mapping]]:
    """Rows grouped by ``(variant, N, seed)``, in first-seen order."""
    check_rows(rows)
    runs: dict[tuple[str, int, int], list[Mapping]] = defaultdict(list)
    for r in rows:
        runs[(r["variant"], int(r["staleness"]), int(r["seed"]))].append(r)
    return dict(runs)


SUMMARY_FIELDS = (
    "late_reward",
    "final_reward",
    "best_reward",
    "final_entropy",
    "kl_k3",
    "f2",
    "routing_disagreement",
    "router_disagreement",
    "clip_frac",
)
LABELS = {
    "late_reward": "late reward",
    "final_reward": "final reward",
    "best_reward": "best reward",
    "final_entropy": "final entropy",
    "kl_k3": "KL(mu‖pi_old) k3",
    "f2": "F(2)",
    "routing_disagreement": "routing disagreement",
    "router_disagreement": "router's own disagreement",
    "clip_frac": "clipped fraction",
}


@dataclass(frozen=True)
class CellSummary:
    """A (variant, N) cell: each metric's per-seed values (seed -> run summary value); guard rules fired, each as
    ``"<rule> (<k>/<n> seeds)"``."""

    variant: str
    staleness: int
    steps: int
    per_seed: dict[str, dict[int, float]]
    guard_fired: tuple[str, ...]
    run_seeds: tuple[int, ...] = ()  # the seeds whose runs logged at least one step in this cell

    @property
    def seeds(self) -> int:
        return max((len(v) for v in self.per_seed.values()), default=0)

    def interval(self, field: str) -> Interval | None:
        """Mean and 95 % interval of ``field`` over the seeds (None when no run logged it); log-scale for KL."""
        values = self.per_seed.get(field) or {}
        vals = [values[s] for s in sorted(values)]
        return stats.interval(vals, log=_log_scale(field, vals)) if values else None

    def mean(self, field: str) -> float | None:
        iv = self.interval(field)
        return iv.mean if iv else None


LOG_SCALE = ("kl_k3",)
"""Compared on log10: a run's mean KL spans decades across seeds (one routing flip can spike a step's KL 100x)."""


def _log_scale(field: str, *values: Sequence[float]) -> bool:
    return field in LOG_SCALE and all(v > 0 for vals in values for v in vals)


def summarize(rows: Sequence[Mapping]) -> list[CellSummary]:
    """One :class:`CellSummary` per (variant, N), ordered by N then first appearance."""
    by_cell: dict[tuple[str, int], list[RunSummary]] = defaultdict(list)
    for runs in group_runs(rows).values():
        s = summarize_run(runs)
        by_cell[(s.variant, s.staleness)].append(s)
    cells = []
    for (variant, n), runs in sorted(by_cell.items(), key=lambda kv: kv[0][1]):
        per_seed = {f: {r.seed: getattr(r, f) for r in runs if getattr(r, f) is not None} for f in SUMMARY_FIELDS}
        fired = tuple(
            f"{g} ({sum(g in r.guard_fired for r in runs)}/{len(runs)} seeds)"
            for g in sorted({g for r in runs for g in r.guard_fired})
        )
        seeds = tuple(sorted(r.seed for r in runs))
        cells.append(CellSummary(variant, n, min(r.steps for r in runs), per_seed, fired, seeds))
    return cells


def _fmt(x: float | None, digits: int = 3) -> str:
    """``x`` with ``digits`` decimals; ``digits = 0`` means two significant digits in scientific notation (KL)."""
    if x is None:
        return "-"
    if digits == 0:
        return f"{x:.1e}"
    if x != 0 and abs(x) < 10 ** (-digits):
        return f"{x:.1e}"
    return f"{x:.{digits}f}"


def _fmt_iv(iv: Interval | None, digits: int = 3) -> str:
    if iv is None:
        return "-"
    if iv.lo is None:
        return _fmt(iv.mean, digits)
    return f"{_fmt(iv.mean, digits)} [{_fmt(iv.lo, digits)}, {_fmt(iv.hi, digits)}]"


TABLE_FIELDS = (
    "late_reward",
    "final_entropy",
    "kl_k3",
    "f2",
    "clip_frac",
    "routing_disagreement",
    "router_disagreement",
)
DIGITS = {"kl_k3": 0, "f2": 4}  # 0: scientific (KL spans decades)


def table(cells: Sequence[CellSummary]) -> str:
    """The markdown table, one row per (variant, N): mean [95 % interval] over seeds of each run summary."""
    head = "| variant | N | seeds | steps | " + " | ".join(LABELS[f] for f in TABLE_FIELDS) + " | guard fired |"
    lines = [head, "|" + "---|" * (len(TABLE_FIELDS) + 5)]
    for c in cells:
        values = " | ".join(_fmt_iv(c.interval(f), DIGITS.get(f, 3)) for f in TABLE_FIELDS)
        lines.append(
            f"| {c.variant} | {c.staleness} | {c.seeds} | {c.steps} | {values} | {', '.join(c.guard_fired) or 'no'} |"
        )
    return "\n".join(lines)


def _cell(cells: Sequence[CellSummary], variant: str, n: int | None = None) -> list[CellSummary]:
    return [c for c in cells if c.variant == variant and (n is None or c.staleness == n)]


# the metric and the direction in which a switch helps (None: shown, not judged). Replay's claims (the paper): lower
# train-inference mismatch, fewer clipped tokens, higher reward.
JUDGED = (("kl_k3", "lower"), ("clip_frac", "lower"), ("late_reward", "higher"), ("final_entropy", None))
REWARD_JUDGED = (("late_reward", "higher"), ("final_entropy", None), ("kl_k3", None))


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
    Switch("R2", "minirl_r2", "minirl", "MiniRL + R2 (replay pi_old's routing) vs MiniRL"),
    Switch("R3 over R2", "minirl_r3", "minirl_r2", "R3 vs R2"),
    # the clipped fraction is what clipping does, not a cost: judged on reward only
    Switch("clipping", "minirl", "minirl_noclip", "MiniRL's clipping (trust region) vs none", REWARD_JUDGED),
    Switch("VESPO", "vespo", "minirl", "VESPO (sequence-level reshaping) vs MiniRL", REWARD_JUDGED),
)


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

    @property
    def lacking(self) -> bool:
        """Whether a seed is missing or a run's steps stop short on either side."""
        return bool(self.missing or self.partial)

    def helps(self) -> list[Comparison]:
        return [c for c, good in self.comparisons if good and c.verdict == good]

    def hurts(self) -> list[Comparison]:
        return [c for c, good in self.comparisons if good and c.is_finding and c.verdict != good]


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
    """Every switch of :data:`SWITCHES` at every N where both of its variants ran, with the seeds each side lacks.

    Args:
        cells: :func:`summarize`'s cells.
        runs: the sweep's run records (:func:`run_records`): a run recorded there that logged no step is a seed its
            side lacks, and a switch whose one side only failed is listed with no comparison.
    """
    out = []
    for n in sorted({c.staleness for c in cells} | {int(r["staleness"]) for r in runs}):
        for sw in SWITCHES:
            on, off = _cell(cells, sw.a, n), _cell(cells, sw.b, n)
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
            comps = []
            for field, good in sw.judged:
                a, b = on[0].per_seed.get(field) or {}, off[0].per_seed.get(field) or {}
                if a and b:
                    log = _log_scale(field, a.values(), b.values())
                    comps.append((stats.compare(field, sw.a, a, sw.b, b, log=log), good))
            if comps:
                paired = tuple(sorted(has[sw.a] & has[sw.b]))
                out.append(SwitchResult(sw, n, tuple(comps), missing, paired, partial))
    return out


def _seed_list(seeds: Iterable[int]) -> str:
    seeds = list(seeds)
    return ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(str(s) for s in seeds)


def missing_text(r: SwitchResult) -> str:
    """``""``, or what a comparison lacks: ``missing: minirl_r3 seed 13 (no step logged); paired on seeds 11, 12``,
    and runs that stopped short: ``incomplete: minirl seed 4 (3 of 8 steps)``."""
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
    return "; ".join(parts)


def regime_name(n: int) -> str:
    """``on-policy (N = 1)`` or ``off-policy N = n``: the staleness regime of a cell."""
    return "on-policy (N = 1): train-inference mismatch only" if n == 1 else f"off-policy N = {n}: mismatch + staleness"


def _effect(c: Comparison) -> str:
    iv = f"{_fmt_iv(c.ia, DIGITS.get(c.metric, 3))} vs {_fmt_iv(c.ib, DIGITS.get(c.metric, 3))}"
    ratio = c.ratio
    times = f", {ratio:.0f}x lower" if c.metric == "kl_k3" and c.verdict == "lower" and ratio and ratio >= 2 else ""
    return f"{LABELS[c.metric]} {iv}{times}"


def answer_table(results: Sequence[SwitchResult]) -> str:
    """The headline: regime -> switch -> needed? -> the evidence (separated findings, or why none)."""
    lines = ["| regime | switch | needed here? | evidence (mean [95 % interval] over seeds, switch on vs off) |"]
    lines.append("|---|---|---|---|")
    for r in results:
        if not r.comparisons:
            lines.append(f"| {regime_name(r.staleness)} | {r.switch.name} | not measured | {missing_text(r)} |")
            continue
        helps, hurts = r.helps(), r.hurts()
        if helps and not hurts:
            verdict = "**yes**"
        elif hurts and not helps:
            verdict = "no: it hurts"
        elif helps and hurts:
            verdict = "mixed"
        else:
            verdict = "no effect measured"
        shown = helps + hurts
        if shown:
            evidence = "; ".join(f"{_effect(c)} ({c.test_text()})" for c in shown)
        else:
            few = all(c.verdict == "too few seeds" for c, _ in r.comparisons)
            evidence = (
                "fewer than 2 seeds: no interval (rerun with --seeds 0 1 2)"
                if few
                else (
                    "no metric separated: "
                    + "; ".join(f"{LABELS[c.metric]}: {c.reason}" for c, g in r.comparisons if g)
                )
            )
        if r.lacking:
            evidence += f" ({missing_text(r)})"
        lines.append(f"| {regime_name(r.staleness)} | {r.switch.name} | {verdict} | {evidence} |")
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
            out.append(
                f"{r.switch.name}, N={r.staleness}, {LABELS[c.metric]}: {_effect(c)} -> **{verdict}**{role}: "
                f"{c.reason}; per-seed differences [{per_seed}]; {c.test_text()}"
                + (f"; {missing_text(r)}." if r.lacking else ".")
            )
    return out


def observations(cells: Sequence[CellSummary]) -> list[str]:
    """What the cells show that is true by construction or descriptive (replay exactness, mismatch size, guard)."""
    out = []
    for r3 in _cell(cells, "minirl_r3"):
        d, hidden = r3.mean("routing_disagreement"), r3.mean("router_disagreement")
        if d is not None:
            out.append(
                f"R3, N={r3.staleness}: routing disagreement with the rollout {_fmt(d)} (0 when the replay works: "
                f"{'yes' if d == 0 else 'NO'}); the router's own choice differs on {_fmt(hidden)} of the rows."
            )
    for c in cells:
        d = c.mean("routing_disagreement")
        if c.variant in ("minirl", "reinforce_no_is", "minirl_noclip", "vespo", "vanilla_grpo") and d is not None:
            out.append(
                f"Without replay ({c.variant}, N={c.staleness}) the updates routed {_fmt(d)} of the (token, MoE layer) "
                "rows to other experts than the rollout (observed, not replayed)."
            )
    fired = [f"{c.variant} N={c.staleness} ({', '.join(c.guard_fired)})" for c in cells if c.guard_fired]
    out.append("Guard fired in: " + ("; ".join(fired) if fired else "no run") + ".")
    return out


OUTCOME_NAME = "outcome.json"
_RECORD_KEYS = {"variant": str, "staleness": int, "seed": int, "name": str, "returncode": int, "steps": int}


def run_records(out_dir: str | Path) -> list[dict]:
    """The sweep's record of each run under ``out_dir/runs/*/outcome.json`` (written by the sweep), by run name.

    A record says how many attempts the run took, the first attempt's error line when a start-up failure was retried,
    and the error line of a run that failed. A record that cannot be read, or lacks or mistypes a key, is skipped:
    the report's numbers come from ``metrics.jsonl``, the records only name what is missing and why.
    """
    records = []
    for path in sorted(Path(out_dir).glob(f"runs/*/{OUTCOME_NAME}")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and all(
            isinstance(record.get(k), t) and not isinstance(record.get(k), bool) for k, t in _RECORD_KEYS.items()
        ):
            records.append(record)
    return records


def runs_section(runs: Sequence[Mapping]) -> list[str]:
    """The report's account of the runs: how many, which were retried after a start-up failure, which failed, why.

    Args:
        runs: :func:`run_records` (``expected_steps``, when a record has it, gives "k of n steps").
    """
    if not runs:
        return []
    retried = [r for r in runs if r.get("retried")]
    failed = [r for r in runs if r.get("error") or r["returncode"] != 0]
    lines = [
        f"{len(runs)} run(s) recorded: {len(runs) - len(failed)} finished, {len(retried)} retried once after a "
        f"start-up failure, {len(failed)} failed."
    ]
    for r in retried:
        after = "failed again" if r in failed else f"finished on attempt {r.get('attempts', 2)}"
        lines.append(f"Retried: `{r['name']}` -- the first attempt failed while starting: `{r['retried']}`; {after}.")
    for r in failed:
        of = f" of {r['expected_steps']}" if isinstance(r.get("expected_steps"), int) else ""
        error = r.get("error") or "no error line in its log"
        lines.append(
            f"Failed: `{r['name']}` (exit {r['returncode']}, {r['steps']}{of} steps, {r.get('attempts', 1)} "
            f"attempt(s)): `{error}` (log: runs/{r['name']}/main_ppo.log)."
        )
    return lines


def findings(cells: Sequence[CellSummary]) -> list[str]:
    """The comparisons in full, then the observations (kept for callers that want plain sentences)."""
    return comparison_lines(switch_results(cells)) + observations(cells)


LIMITS = (
    "The model is a 4-layer MoE with hidden size 64 on a one-digit toy task, batches are a few dozen responses and runs "
    "a few dozen steps: the paper's long-horizon effects (late collapse after hundreds of steps) cannot appear, and a "
    "switch called 'no effect' here may matter at scale. Each run is verl's own trainer with the project's recipe; "
    "the numbers are what it logged."
)


def _bands(rows: Sequence[Mapping], n: int, name: str) -> dict[str, dict[int, list[float]]]:
    out: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if int(r["staleness"]) != n:
            continue
        v = metric(r, name)
        if v is not None:
            out[r["variant"]][int(r["step"])].append(v)
    return out


def plot_regimes(rows: Sequence[Mapping], out_dir: str | Path, names: Sequence[str] = PLOTTED) -> list[Path]:
    """One PNG per regime (N): a panel per metric, each variant's mean over seeds with its min-max seed band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for n in sorted({int(r["staleness"]) for r in rows}):
        fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.4))
        axes = axes if len(names) > 1 else [axes]
        for ax, name in zip(axes, names, strict=True):
            bands = _bands(rows, n, name)
            for variant, by_step in bands.items():
                steps = sorted(by_step)
                mean = [sum(by_step[s]) / len(by_step[s]) for s in steps]
                (line,) = ax.plot(steps, mean, marker="o", markersize=3, label=variant)
                lo, hi = [min(by_step[s]) for s in steps], [max(by_step[s]) for s in steps]
                ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
            ax.set_xlabel("step")
            ax.set_title(LABELS.get(name, name.replace("_", " ")), fontsize=9)
            if name in ("kl_k3",) and any(v > 0 for b in bands.values() for vs in b.values() for v in vs):
                ax.set_yscale("log")
            if not bands:
                ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        axes[0].legend(fontsize=7)
        fig.suptitle(f"{regime_name(n)} -- mean over seeds, band: lowest to highest seed", fontsize=10)
        fig.tight_layout()
        path = out_dir / f"regime_N{n}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def render_markdown(
    rows: Sequence[Mapping],
    plots: Sequence[Path] = (),
    header: Mapping[str, str] | None = None,
    relative_to=None,
    runs: Sequence[Mapping] = (),
) -> str:
    """The report: the answer table first, the runs (retried, failed), setup, the table per cell, every comparison,
    limits, figures. ``runs``: :func:`run_records` (empty: the runs section is left out)."""
    cells = summarize(rows)
    results = switch_results(cells, runs)
    lines = ["# verl-stable CPU lab report", "", "## The answer: which switch does each regime need?", ""]
    lines += [answer_table(results) if results else "No switch has both of its variants at one N in these runs.", ""]
    lines += [
        "A switch is **needed** when, with it on, KL(mu‖pi_old) or the clipped fraction is lower, or the late reward "
        "higher, with the two 95 % t-intervals over seeds separated and every seed's difference of one sign "
        "(Welch's t-test printed beside it); a difference whose sign changes across seeds is 'no effect'. A "
        "comparison that lacks a seed (its run failed) says which.",
        "",
    ]
    if runs:
        lines += ["## Runs", ""] + [f"- {s}" for s in runs_section(runs)] + [""]
    if header:
        lines += ["## Setup", ""] + [f"- {k}: {v}" for k, v in header.items()] + [""]
    lines += ["## Results per variant and N (mean [95 % interval] over seeds)", "", table(cells), ""]
    lines += ["## Every comparison", ""] + [f"- {s}" for s in comparison_lines(results)]
    lines += ["", "## Observations", ""] + [f"- {s}" for s in observations(cells)]
    lines += ["", "## What this does not show", "", LIMITS, ""]
    if plots:
        lines += ["## Figures (one per regime)", ""]
        for p in plots:
            rel = Path(p).relative_to(relative_to) if relative_to else Path(p)
            lines.append(f"![{Path(p).stem}]({rel})")
        lines.append("")
    return "\n".join(lines)


def output_problem(out_dir: str | Path) -> str | None:
    """What keeps :func:`write_report` from writing under ``out_dir`` (``report.md`` or ``plots/`` in the way); None
    when nothing does."""
    out_dir = Path(out_dir)
    report, plots = out_dir / "report.md", out_dir / "plots"
    if report.exists() and not report.is_file():
        kind = "a directory" if report.is_dir() else "not a regular file"
        return f"{report} is {kind}; expected the report file (or nothing there)"
    if plots.exists() and not plots.is_dir():
        return f"{plots} is a file; expected the figures' directory (or nothing there)"
    return None


def write_report(rows: Sequence[Mapping], out_dir: str | Path, header: Mapping[str, str] | None = None) -> Path:
    """Write ``out_dir/report.md`` and ``out_dir/plots/regime_N<n>.png`` from the rows; returns the report path.

    The runs' records under ``out_dir/runs/*/outcome.json`` (:func:`run_records`) add the runs section and the seeds
    each comparison lacks.

    Raises:
        ValueError: A malformed row (:func:`check_rows`).
        OSError: The report or a figure cannot be written (:func:`output_problem`, or the file system's refusal).
    """
    out_dir = Path(out_dir)
    check_rows(rows)  # a message naming the bad row, before any figure is drawn
    problem = output_problem(out_dir)
    if problem is not None:
        raise OSError(problem)
    plots = plot_regimes(rows, out_dir / "plots")
    path = out_dir / "report.md"
    path.write_text(render_markdown(rows, plots, header, relative_to=out_dir, runs=run_records(out_dir)))
    return path
