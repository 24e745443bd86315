"""The report's figures: one PNG per regime (staleness N), a panel per metric, each variant's mean over seeds per step
with the band from the lowest to the highest seed."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

from verl_stable.lab.summaries import LABELS, SUPERSEDED, metric
from verl_stable.lab.switches import regime_name

PLOTTED = ("reward", "entropy", "kl_k3", "clip_frac", "routing_disagreement", "routing_layer_max")


def _bands(rows: Sequence[Mapping], n: int, name: str) -> dict[str, dict[int, list[float]]]:
    out: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if int(r["staleness"]) != n or r.get(SUPERSEDED):  # a step a guard rollback redid: its redone row is drawn
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
