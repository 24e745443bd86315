"""The probe's report: ``probe.md`` (the answer first, then the numbers under the names verl logs at step 1),
``probe.json`` (every number) and ``probe.png`` (one figure: flips per MoE layer, and the per-token log-prob gaps).

The figure is drawn on a matplotlib ``Figure`` with the Agg canvas directly: no pyplot, no global backend switch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from verl_stable.probe.advice import EVIDENCE_LIMITS, RECIPES
from verl_stable.probe.runner import ProbeResult

__all__ = ["FILES", "markdown", "plot", "summary_lines", "to_json", "write_report"]

FILES = ("probe.md", "probe.json", "probe.png")
GAP_FLOOR = 1e-10
"""``|log mu - log pi|`` values below this are drawn at it (a log axis has no 0)."""


def _pct(value: float | None, se: float | None = None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    text = f"{100 * value:.2f} %"
    return text + (f" ± {100 * se:.2f}" if se is not None and math.isfinite(se) else "")


def _sci(value: float | None, se: float | None = None) -> str:
    if value is None or not math.isfinite(value):
        return "-" if value is None else str(value)
    text = f"{value:.2e}"
    return text + (f" ± {se:.1e}" if se is not None and math.isfinite(se) else "")


def _rows(result: ProbeResult) -> list[tuple[str, str, str]]:
    """(label with verl's name, without replay, with R3) for the measured table."""
    none, r3 = result.metrics["none"], result.metrics.get("r3")
    moe = r3 is not None

    def both(fmt: Callable[[float | None, float | None], str], key: str, se: str | None = None) -> tuple[str, str]:
        a = fmt(none.get(key), none.get(se) if se else None)
        b = fmt(r3.get(key), r3.get(se) if se else None) if moe else "does not apply"
        return a, b

    rows: list[tuple[str, str, str]] = []
    if moe:
        d = "stable/routing/disagreement"
        rows += [
            (f"routing flips, (token, MoE layer) rows (`{d}`)", *both(_pct, d, "probe/disagreement_se")),
            ("... of the response rows only", *both(_pct, "probe/disagreement_response")),
            (f"worst MoE layer (`{d}/layer_max`)", *both(_pct, f"{d}/layer_max")),
            (f"tokens with a flip in any layer (`{d}/token_any_layer`)", *both(_pct, f"{d}/token_any_layer")),
            (
                "the router's own choice vs the rollout (`stable/routing/router_disagreement`)",
                _pct(none.get(d)),
                _pct(r3.get("stable/routing/router_disagreement"), r3.get("probe/router_disagreement_se")),
            ),
        ]
    t = "stable/train_inf"
    rows += [
        (f"KL(mu‖pi) k3 (`{t}/kl_k3`)", *both(_sci, f"{t}/kl_k3", "probe/kl_k3_se")),
        (f"KL(mu‖pi) k1 (`{t}/kl_k1`)", *both(_sci, f"{t}/kl_k1")),
    ]
    taus = sorted(k.rsplit("tau", 1)[1] for k in none if k.startswith(f"{t}/extreme_frac_tau"))
    rows += [(f"F({tau}): pi/mu outside [1/{tau}, {tau}] (`{t}/extreme_frac_tau{tau}`)",
              *both(_pct, f"{t}/extreme_frac_tau{tau}")) for tau in taus]  # fmt: skip
    rows += [
        (f"IS weight pi/mu, smallest (`{t}/ratio_min`)", *both(_sci, f"{t}/ratio_min")),
        (f"IS weight pi/mu, largest (`{t}/ratio_max`)", *both(_sci, f"{t}/ratio_max")),
        (f"median \\|log mu - log pi\\| (`{t}/log_ratio_abs_median`)", *both(_sci, f"{t}/log_ratio_abs_median")),
        (
            "IS effective sample size (raw weights)",
            *both(lambda v, _s: f"{v:.4f}" if v is not None else "-", "probe/is_ess"),
        ),
    ]
    return rows


def _layer_rows(result: ProbeResult) -> list[str]:
    r3 = result.metrics.get("r3")
    if r3 is None:
        return []
    none = result.metrics["none"]
    layers = result.routing.get("moe_layers", [])
    lines = ["| MoE layer (decoder layer) | flips without replay | with R3 |", "|---|---|---|"]
    for i, layer in enumerate(layers):
        key = f"stable/routing/disagreement/layer_{i}"
        lines.append(f"| {i} ({layer}) | {_pct(none.get(key))} | {_pct(r3.get(key))} |")
    return lines


def markdown(result: ProbeResult) -> str:
    """The report as markdown (module docstring)."""
    o, a, s = result.options, result.advice, result.samples
    data = f"`{o['data']}` (column `{o['prompt_key']}`)" if o.get("data") else "the built-in prompt set"
    lines = [
        f"# verl-stable probe: `{o['model']}`",
        "",
        f"**{a['summary']}**",
        "",
        "| regime | recipe | what this checkpoint needs |",
        "|---|---|---|",
        *[f"| {regime} | `{path}` | {a[regime]} |" for regime, path in RECIPES.items()],
        "",
        f"**The lab's evidence**: {a['lab']} (docs/explanation/lab.md).",
        "",
        f"**Where the evidence stops**: {EVIDENCE_LIMITS}",
        "",
        "## What was measured",
        "",
    ]
    if result.model_kind == "moe":
        r = result.routing
        lines.append(
            f"Model: `{result.model_type}`, {len(r['moe_layers'])} MoE layers of {r['num_hidden_layers']}, top-"
            f"{r['top_k']} of {r['num_experts']} experts."
        )
    else:
        lines.append(f"Model: `{result.model_type}`, dense (no routed experts): KL only, replay does not apply.")
    lines += [
        f"Inference: engine `{o['engine']}` at `{o['rollout_precision']}`; training forward (`--train-engine "
        f"{o['train_engine']}`): {result.training}.",
        f"Prompts: {data}; {s['samples']} samples over {s['prompts']} prompts ({o['per_prompt']} per prompt), at most "
        f"{o['max_tokens']} tokens each, seed {o['seed']}: {s['response_tokens']} sampled tokens, {s['stopped']} "
        "samples ended at an eos token.",
        "",
        "Each number under the name verl's run logs at step 1 (± one standard error over samples, docs/probe.md):",
        "",
        "| metric | without replay | with R3 |",
        "|---|---|---|",
        *[f"| {label} | {a_} | {b_} |" for label, a_, b_ in _rows(result)],
        "",
    ]
    layer_lines = _layer_rows(result)
    if layer_lines:
        lines += ["Routing flips per MoE layer:", "", *layer_lines, ""]
    lines += ["![flips per MoE layer and per-token log-prob gaps](probe.png)", ""]
    if result.notes:
        lines += ["Notes:", "", *[f"- {n}" for n in result.notes], ""]
    lines.append("Time: " + ", ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items()) + ".")
    return "\n".join(lines) + "\n"


def to_json(result: ProbeResult) -> dict[str, Any]:
    """Every number of the result (the per-token gaps left out), with ``NaN`` as ``null``."""
    raw = asdict(result)
    raw.pop("token_gaps")
    raw["figure"] = "probe.png"
    return _finite(raw)


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float (nested in dicts and lists) replaced by None, JSON's null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def plot(result: ProbeResult, path: Path) -> Path:
    """The one figure: flips per MoE layer without replay and with R3 (a MoE only), and the histogram of per-token
    ``|log mu - log pi|`` of both passes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    moe = "r3" in result.metrics
    fig = Figure(figsize=(10 if moe else 5.5, 3.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2 if moe else 1)
    axes = list(axes) if moe else [axes]
    if moe:
        ax = axes.pop(0)
        layers = list(range(len(result.routing["moe_layers"])))
        flips = {
            name: [100 * result.metrics[name].get(f"stable/routing/disagreement/layer_{i}", 0.0) for i in layers]
            for name in ("none", "r3")
        }
        ax.bar(layers, flips["none"], width=0.6, label="without replay")
        ax.plot(layers, flips["r3"], "x", color="C1", markersize=9, label="with R3")  # a marker: 0 stays visible
        ax.set_xticks(layers, [f"{i} ({layer})" for i, layer in zip(layers, result.routing["moe_layers"], strict=True)])
        ax.set_ylim(0, max([*flips["none"], 1.0]) * 1.15)
        ax.set_xlabel("MoE layer (decoder layer)")
        ax.set_ylabel("routing flips (%)")
        ax.set_title("rollout vs training routing, per MoE layer", fontsize=9)
        ax.legend(fontsize=7)
    ax = axes[0]
    drawn = {name: [max(g, GAP_FLOOR) for g in result.token_gaps.get(name, [])] for name in ("none", "r3")}
    every = [v for values in drawn.values() for v in values]
    if every:  # one set of log-spaced bins for both passes, so their bars compare
        lo, hi = math.log10(min(every)), math.log10(max(every)) + 1e-9
        bins = [10 ** (lo + (hi - lo) * i / 30) for i in range(31)] if hi > lo else 10
    for name, label, style in (("none", "without replay", "-"), ("r3", "with R3", "--")):
        if drawn[name]:
            ax.hist(drawn[name], bins=bins, histtype="step", linestyle=style, label=label)
    ax.set_xscale("log")
    ax.set_xlabel(f"|log mu - log pi| per sampled token (0 drawn at {GAP_FLOOR:g})")
    ax.set_ylabel("tokens")
    ax.set_title(f"{result.options['engine']} {result.options['rollout_precision']} vs training "
                 f"{result.options['train_engine']} {result.options['train_dtype']}", fontsize=9)  # fmt: skip
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    return path


def summary_lines(result: ProbeResult) -> list[str]:
    """The few lines the command prints: the answer and the regime lines."""
    return [result.advice["summary"], *[f"  {regime}: {result.advice[regime]}" for regime in RECIPES]]


def write_report(result: ProbeResult, out_dir: str | Path) -> list[Path]:
    """Write :data:`FILES` into ``out_dir`` (created); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md, js, png = (out / name for name in FILES)
    md.write_text(markdown(result))
    js.write_text(json.dumps(to_json(result), indent=1, allow_nan=False) + "\n")
    plot(result, png)
    return [md, js, png]
