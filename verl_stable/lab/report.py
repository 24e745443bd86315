"""The lab's report: per-step metric rows in, a markdown report and PNG curves out (pure: no verl, no runs).

Input rows are verl's logged metrics per step, tagged with ``variant``, ``staleness`` and ``seed`` (see
:func:`verl_stable.lab.sweep.tag_rows`). Every metric is read under the name verl / verl-stable logs it
(:data:`METRICS`, first key present wins). Per (variant, N) the table gives, averaged over seeds:

* reward: final (last step), best (max over steps) and late (mean over the last half of the steps, with its standard
  error over those steps and seeds) of the mean batch reward ``critic/score/mean``;
* entropy: final mean token entropy of the policy (``stable/entropy/mean``);
* KL(mu || pi_old), k3 estimator ``E_mu[r - 1 - log r]`` with ``r = pi_old / mu``: mean over steps;
* F(2): fraction of tokens with ``pi_old / mu`` outside ``[1/2, 2]``: mean over steps;
* routing disagreement: fraction of (token, MoE layer) rows whose used experts differ from the rollout's (or pi_old's
  under R2), and the router's own disagreement (what replay hides): means over steps;
* clip fraction (``actor/pg_clipfrac``, or MiniRL's masked fractions): mean over steps;
* guard: the rules of the monitor's guard that fired on any step.

The closing section compares the numbers against the paper's findings with explicit, printed criteria: a reward gap
counts only beyond two standard errors of the difference of the late means (and at least :data:`REWARD_MARGIN`);
nothing is concluded that the numbers do not show.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

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
PLOTTED = ("reward", "entropy", "kl_k3", "routing_disagreement")
REQUIRED_FIELDS = ("variant", "staleness", "seed", "step")
REWARD_MARGIN = 0.05  # floor of the gap called a difference (binary reward, small batches: noisy)
NOISE_Z = 2.0  # a gap counts when it exceeds NOISE_Z standard errors of the difference (and REWARD_MARGIN)


def metric(row: Mapping, name: str) -> float | None:
    """The value of summary metric ``name`` in a step row (first logged key of :data:`METRICS`), else None."""
    if name == "clip_frac" and METRICS["clip_frac"][0] not in row and any(k in row for k in MINIRL_MASKED):
        return sum(float(row.get(k) or 0.0) for k in MINIRL_MASKED)
    for key in METRICS[name]:
        value = row.get(key)
        if value is not None and isinstance(value, (int, float)) and math.isfinite(value):
            return float(value)
    return None


def check_rows(rows: Sequence[Mapping]) -> None:
    """Raise ``ValueError`` for rows missing the run identity or step, or duplicated steps within a run."""
    seen = set()
    for i, row in enumerate(rows):
        missing = [f for f in REQUIRED_FIELDS if f not in row]
        if missing:
            raise ValueError(f"metric row {i} lacks {missing}; rows need {REQUIRED_FIELDS}")
        key = (row["variant"], row["staleness"], row["seed"], row["step"])
        if key in seen:
            raise ValueError(f"duplicate step {row['step']} for {key[:3]}")
        seen.add(key)


def _mean_se(xs: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean and its standard error ``std / sqrt(k)`` (sample std, ``k - 1`` dof); se is None for fewer than 2 values."""
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, math.sqrt(var / len(xs))


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
    )


def group_runs(rows: Sequence[Mapping]) -> dict[tuple[str, int, int], list[Mapping]]:
    """Rows grouped by ``(variant, N, seed)``, in first-seen order."""
    check_rows(rows)
    runs: dict[tuple[str, int, int], list[Mapping]] = defaultdict(list)
    for r in rows:
        runs[(r["variant"], int(r["staleness"]), int(r["seed"]))].append(r)
    return dict(runs)


@dataclass(frozen=True)
class CellSummary:
    """A (variant, N) cell: run summaries averaged over seeds."""

    variant: str
    staleness: int
    seeds: int
    steps: int
    values: dict[str, float | None]
    guard_fired: tuple[str, ...]


SUMMARY_FIELDS = (
    "final_reward",
    "best_reward",
    "final_entropy",
    "kl_k3",
    "f2",
    "routing_disagreement",
    "router_disagreement",
    "clip_frac",
)


def summarize(rows: Sequence[Mapping]) -> list[CellSummary]:
    """One :class:`CellSummary` per (variant, N), ordered by N then first appearance."""
    by_cell: dict[tuple[str, int], list[RunSummary]] = defaultdict(list)
    for runs in group_runs(rows).values():
        s = summarize_run(runs)
        by_cell[(s.variant, s.staleness)].append(s)
    late: dict[tuple[str, int], list[float]] = defaultdict(list)
    for (variant, n, _), run_rows in group_runs(rows).items():
        ordered = sorted(run_rows, key=lambda r: r["step"])
        rewards = [x for x in (metric(r, "reward") for r in ordered[len(ordered) // 2 :]) if x is not None]
        late[(variant, n)].extend(rewards)
    cells = []
    for (variant, n), runs in sorted(by_cell.items(), key=lambda kv: kv[0][1]):
        values = {f: _mean(getattr(r, f) for r in runs) for f in SUMMARY_FIELDS}
        values["late_reward"], values["late_reward_se"] = _mean_se(late[(variant, n)])
        fired = tuple(sorted({g for r in runs for g in r.guard_fired}))
        cells.append(CellSummary(variant, n, len(runs), min(r.steps for r in runs), values, fired))
    return cells


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    if x != 0 and abs(x) < 10 ** (-digits):
        return f"{x:.1e}"
    return f"{x:.{digits}f}"


def table(cells: Sequence[CellSummary]) -> str:
    """The markdown table, one row per (variant, N)."""
    head = (
        "| variant | N | seeds | steps | final reward | best reward | late reward ± se | entropy | KL(mu‖pi_old) k3 | F(2) "
        "| routing disagr. | router disagr. | clip frac | guard fired |"
    )
    lines = [head, "|" + "---|" * 14]
    for c in cells:
        v = c.values
        lines.append(
            f"| {c.variant} | {c.staleness} | {c.seeds} | {c.steps} | {_fmt(v['final_reward'])} "
            f"| {_fmt(v['best_reward'])} | {_fmt(v['late_reward'])} ± {_fmt(v['late_reward_se'])} "
            f"| {_fmt(v['final_entropy'])} | {_fmt(v['kl_k3'], 5)} | {_fmt(v['f2'], 4)} "
            f"| {_fmt(v['routing_disagreement'])} | {_fmt(v['router_disagreement'])} | {_fmt(v['clip_frac'])} "
            f"| {', '.join(c.guard_fired) or 'no'} |"
        )
    return "\n".join(lines)


def _cell(cells: Sequence[CellSummary], variant: str, n: int | None = None) -> list[CellSummary]:
    return [c for c in cells if c.variant == variant and (n is None or c.staleness == n)]


def compare_late_reward(a: CellSummary, b: CellSummary) -> tuple[float | None, float]:
    """``(late reward of a - late reward of b, margin)``: the gap counts when ``|gap| > margin``.

    ``margin = max(REWARD_MARGIN, NOISE_Z * sqrt(se_a^2 + se_b^2))`` with ``se`` the standard error of each late mean
    (mean over the last half of the steps, pooled over seeds); without an se only the floor applies.
    """
    ra, rb = a.values.get("late_reward"), b.values.get("late_reward")
    if ra is None or rb is None:
        return None, REWARD_MARGIN
    sa, sb = a.values.get("late_reward_se"), b.values.get("late_reward_se")
    noise = NOISE_Z * math.sqrt((sa or 0.0) ** 2 + (sb or 0.0) ** 2)
    return ra - rb, max(REWARD_MARGIN, noise)


ONE_SEED_CAVEAT = (
    "; but with one seed per variant this is not evidence: a rerun of the same seed repeats it exactly, and only other "
    "seeds show how much a result varies (before rollouts were seeded per sample, two runs of one seed differed by "
    "0.21 in late reward, docs/lab.md); rerun with --seeds 0 1 2"
)
"""Appended to a reward verdict that points a direction when either side has a single seed: the margin only covers
the noise within a run, not between runs."""


def _caveat(a: CellSummary, b: CellSummary) -> str:
    return ONE_SEED_CAVEAT if min(a.seeds, b.seeds) < 2 else ""


def findings(cells: Sequence[CellSummary]) -> list[str]:
    """Sentences comparing the measured numbers with the paper's findings; each states its criterion."""
    out = []
    for a in _cell(cells, "minirl"):
        for b in _cell(cells, "reinforce_no_is", a.staleness):
            gap, margin = compare_late_reward(a, b)
            if gap is None:
                continue
            verdict = (
                "consistent with the paper (dropping the IS weight hurts)" + _caveat(a, b)
                if gap > margin
                else "the paper's collapse without the IS weight is NOT reproduced at this scale"
            )
            out.append(
                f"Train-inference IS weight, N={a.staleness}: late reward MiniRL {_fmt(a.values['late_reward'])} vs "
                f"without IS {_fmt(b.values['late_reward'])} (final entropy {_fmt(a.values['final_entropy'])} vs "
                f"{_fmt(b.values['final_entropy'])}); criterion: MiniRL ahead by > {_fmt(margin)}: {verdict}."
            )
    for r3 in _cell(cells, "minirl_r3"):
        d = r3.values["routing_disagreement"]
        hidden = r3.values["router_disagreement"]
        if d is not None:
            out.append(
                f"R3, N={r3.staleness}: routing disagreement with the rollout {_fmt(d)} (0 by construction when the "
                f"replay works: {'yes' if d == 0 else 'NO'}); the router's own choice would differ on {_fmt(hidden)} "
                "of the rows (the train-inference routing mismatch the replay removes)."
            )
    for base in _cell(cells, "minirl"):
        if base.staleness < 2:
            continue
        for name in ("minirl_r2", "minirl_r3", "vespo"):
            for other in _cell(cells, name, base.staleness):
                gap, margin = compare_late_reward(other, base)
                ko, kb = other.values["kl_k3"], base.values["kl_k3"]
                if gap is None:
                    continue
                if gap > margin:
                    verdict = f"{name} ahead, as the paper finds for off-policy N" + _caveat(other, base)
                elif -gap > margin:
                    verdict = f"{name} behind: the paper's gain is NOT reproduced here" + _caveat(other, base)
                else:
                    verdict = f"no difference beyond {_fmt(margin)}: the paper's gain is not visible at this scale"
                out.append(
                    f"{name} vs MiniRL at N={base.staleness}: late reward {_fmt(other.values['late_reward'])} vs "
                    f"{_fmt(base.values['late_reward'])}, KL k3 {_fmt(ko, 5)} vs {_fmt(kb, 5)}: {verdict}."
                )
    for c in cells:
        d = c.values["routing_disagreement"]
        if c.variant in ("minirl", "reinforce_no_is", "vespo", "vanilla_grpo") and d is not None:
            out.append(
                f"Without replay ({c.variant}, N={c.staleness}) the policy updates routed {_fmt(d)} of the (token, "
                "MoE layer) rows to a different expert set than the rollout did (rollout vs training numerics, plus "
                "policy drift between mini-steps when N > 1; observed, not replayed)."
            )
    kls = [(c.values["kl_k3"], c) for c in cells if c.values["kl_k3"] is not None]
    if kls:
        lo, hi = min(kls, key=lambda t: t[0]), max(kls, key=lambda t: t[0])
        f2 = [c.values["f2"] for _, c in kls if c.values["f2"] is not None]
        out.append(
            f"Train-inference mismatch KL(mu||pi_old) (k3, mean over steps) ranges from {_fmt(lo[0], 5)} "
            f"({lo[1].variant} N={lo[1].staleness}) to {_fmt(hi[0], 5)} ({hi[1].variant} N={hi[1].staleness})"
            + (f"; F(2) is at most {_fmt(max(f2), 4)}." if f2 else ".")
        )
    fired = [f"{c.variant} N={c.staleness} ({', '.join(c.guard_fired)})" for c in cells if c.guard_fired]
    out.append("Guard fired in: " + ("; ".join(fired) if fired else "no run") + ".")
    return out


LIMITS = (
    "The model is a 4-layer MoE with hidden size 64 on a one-digit toy task, batches are a "
    "few dozen responses and runs a few steps, so reward differences below the stated margin are noise, and the "
    "paper's long-horizon effects (late collapse after hundreds of steps, large-scale fp8 drift) cannot appear. "
    "Each run is verl's own trainer with the project's recipe; the numbers are what it logged."
)


def plot_curves(rows: Sequence[Mapping], out_dir: str | Path, names: Sequence[str] = PLOTTED) -> list[Path]:
    """One PNG per metric: the per-step curve of every (variant, N), averaged over seeds. Returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    curves: dict[tuple[str, int], dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    paths = []
    for name in names:
        curves.clear()
        for r in rows:
            v = metric(r, name)
            if v is not None:
                curves[(r["variant"], int(r["staleness"]))][int(r["step"])].append(v)
        fig, ax = plt.subplots(figsize=(6, 4))
        for (variant, n), by_step in sorted(curves.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            steps = sorted(by_step)
            ax.plot(steps, [sum(by_step[s]) / len(by_step[s]) for s in steps], marker="o", label=f"{variant} N={n}")
        ax.set_xlabel("step")
        ax.set_ylabel(name.replace("_", " "))
        ax.set_title(name)
        if curves:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def render_markdown(
    rows: Sequence[Mapping], plots: Sequence[Path] = (), header: Mapping[str, str] | None = None, relative_to=None
) -> str:
    """The report: setup lines, the table, findings, limits, plot links."""
    cells = summarize(rows)
    lines = ["# verl-stable CPU lab report", ""]
    for k, v in (header or {}).items():
        lines.append(f"- {k}: {v}")
    lines += ["", "## Results per variant and N", "", table(cells), "", "## What this shows", ""]
    lines += [f"- {s}" for s in findings(cells)]
    lines += ["", "## What this does not show", "", LIMITS, ""]
    if plots:
        lines += ["## Curves", ""]
        for p in plots:
            rel = Path(p).relative_to(relative_to) if relative_to else Path(p)
            lines.append(f"![{Path(p).stem}]({rel})")
        lines.append("")
    return "\n".join(lines)


def write_report(rows: Sequence[Mapping], out_dir: str | Path, header: Mapping[str, str] | None = None) -> Path:
    """Write ``out_dir/report.md`` and ``out_dir/plots/*.png`` from the rows; returns the report path."""
    out_dir = Path(out_dir)
    plots = plot_curves(rows, out_dir / "plots")
    path = out_dir / "report.md"
    path.write_text(render_markdown(rows, plots, header, relative_to=out_dir))
    return path
