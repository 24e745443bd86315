"""What a probe's numbers mean for the recipes: on-policy / N = 2 / N >= 4, next to the lab's measured finding at the
nearest routing-flip rate, and where that evidence stops.

Pure: the lab's findings are constants quoted from docs/explanation/lab.md ("Offline: how far each rollout setting moves
routing and tokens", on the lab's cold-started tiny MoE; "What the lab found" and "How the setting was chosen", in
verl's trainer). :func:`nearest_finding` picks the finding whose flip
rate is nearest on a log scale (``|log f - log f_lab|``: a 1 % and a 2 % flip rate are as far apart as 10 % and
20 %); :func:`advise` writes one line per regime.

The recipes (recipes/fsdp/): on-policy ``minirl_onpolicy`` (MiniRL loss, token IS ``w = min(pi_old / mu, 5)``);
N = 2 ``minirl_n2_r2`` (+ clipping 0.2 / 0.27, R2); N >= 4 ``minirl_n4_r3`` (+ clipping, R3, rollout routing export).
What each switch acts on: the IS weight corrects the train-inference mismatch KL(mu||pi_old) token by token; R2
replays pi_old's routing in the updates (staleness of routing, not the rollout's mismatch: it cannot change
KL(mu||pi_old), the lab measured equal step-1 KL); R3 replays the rollout's routing in pi_old and the updates, so the
part of KL(mu||pi_old) that routing flips cause goes -- what the probe's R3 column measures on the user's model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "EVIDENCE_LIMITS",
    "LAB_FINDINGS",
    "RECIPES",
    "LabFinding",
    "advise",
    "guard_kl_threshold",
    "nearest_finding",
]

RECIPES = {
    "on-policy (N = 1)": "recipes/fsdp/minirl_onpolicy.yaml",
    "N = 2": "recipes/fsdp/minirl_n2_r2.yaml",
    "N >= 4": "recipes/fsdp/minirl_n4_r3.yaml",
}


@dataclass(frozen=True)
class LabFinding:
    """One measured setting of the lab (docs/explanation/lab.md).

    Attributes:
        flips: share of (token, MoE layer) routing decisions the rollout flips against the training forward.
        setting: what was measured (model, rollout numerics).
        kl_k3: KL(mu||pi) k3 measured offline at that setting.
        in_verl: what verl's trainer measured at that setting, or None when it was measured offline only.
    """

    flips: float
    setting: str
    kl_k3: float
    in_verl: str | None


LAB_FINDINGS: tuple[LabFinding, ...] = (
    LabFinding(0.006, "top-2 tiny MoE, trained routers, fp8-weight rollout", 7.0e-5, None),
    LabFinding(0.053, "top-2 tiny MoE, frozen routers, fp8-weight rollout", 5.5e-4, None),
    LabFinding(
        0.105,
        "top-2 tiny MoE, frozen routers, int4-weight rollout vs fp32 training (the lab's setting; the rate the R3 "
        "paper measures between FP8 inference and BF16 training on Qwen3-30B-A3B)",
        1.5e-3,
        "R3 lowered step-1 KL(mu||pi_old) k3 ~10x at N = 4 (7.8e-5 vs 8.0e-4, lower on all 6 seeds, paired p = 0.0027); "
        "the monitor's KL alarm fired in 5 of 6 runs without replay, in none with R3; R2 left step-1 KL unchanged; "
        "no reward effect of any replay or IS switch separated within 8 steps",
    ),
    LabFinding(0.161, "top-4 tiny MoE, frozen routers, int4-weight rollout", 3.1e-3, None),
    LabFinding(
        0.325,
        "top-2 tiny MoE, fp8 rollout + an inference-only router perturbation 0.3 (a stand-in, not a format)",
        9.2e-3,
        "R3 lowered KL(mu||pi_old) ~110x at N = 4 (2 seeds: no interval worth the name)",
    ),
)
"""docs/explanation/lab.md: "Offline: how far each rollout setting moves routing and tokens" (3 seeds) and "What the lab
found" (verl's trainer)."""

EVIDENCE_LIMITS = (
    "The lab's evidence is a 4-layer, 16-expert Qwen3-MoE of hidden size 64 on a toy task, on CPU, 8 training steps, "
    "6 seeds: it measured what R3 does to KL(mu||pi_old) at step 1, not what any switch does to reward at scale (no "
    "reward effect separated there), and not N = 2 (R3 over R2 was measured at N = 4). This probe measures your "
    "checkpoint at its current weights with these engines and prompts, before any update: how routers drift as "
    "training moves them (what R2 and R3 also address at N >= 2) is not in it."
)


def nearest_finding(flips: float) -> LabFinding:
    """The lab finding whose flip rate is nearest ``flips`` on a log scale (0 flips: the smallest measured)."""
    if not math.isfinite(flips) or flips < 0:
        raise ValueError(f"flips must be a finite share >= 0, got {flips!r}")
    if flips == 0:
        return LAB_FINDINGS[0]
    return min(LAB_FINDINGS, key=lambda f: abs(math.log(flips) - math.log(f.flips)))


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def guard_kl_threshold() -> float:
    """The default guard's ``train_inference_kl`` threshold on KL(mu||pi_old) k3 (its default action: stop)."""
    from verl_stable.monitor.guard_rules import DEFAULT_RULES

    return next(rule.threshold for rule in DEFAULT_RULES if rule.name == "train_inference_kl")


NEGLIGIBLE_KL = 1e-9
"""KL(mu||pi) k3 below this is no measurable mismatch (fp32 on both sides gives ~1e-14)."""
SMALL_SHARE = 0.1
"""R3 removing less than this share of KL: the mismatch is numerics outside routing."""


def _kl_story(kl: float, kl_r3: float) -> tuple[str, float]:
    """The sentence about KL with and without replay, and the share of it routing explains (NaN: not measured)."""
    if not math.isfinite(kl) or kl < NEGLIGIBLE_KL:
        return "no measurable train-inference mismatch (the two sides compute the same numbers)", 0.0
    if not math.isfinite(kl_r3):
        return f"KL(mu||pi_old) k3 {kl:.2e}", math.nan
    share = max(0.0, 1 - kl_r3 / kl)
    text = f"KL(mu||pi_old) k3 {kl:.2e} without replay, {kl_r3:.2e} with R3 (x{kl_r3 / kl:.2f}): routing flips "
    return text + f"explain {_pct(share)} of it, the rest is numerics outside routing", share


def _guard_line(kl: float, kl_r3: float, moe: bool) -> str:
    threshold = guard_kl_threshold()
    fires = [name for name, value in (("without replay", kl), ("with R3", kl_r3)) if value > threshold]
    if not moe:
        fires = fires[:1]
    if not fires:
        return f"below the guard's train_inference_kl alarm ({threshold:g})"
    return f"ABOVE the guard's train_inference_kl alarm ({threshold:g}, default action: stop) {' and '.join(fires)}"


def advise(metrics: Mapping[str, Mapping[str, float]], moe: bool) -> dict[str, str]:
    """One line per regime (keys of :data:`RECIPES`) plus ``summary`` and ``lab`` (the nearest finding, cited).

    Args:
        metrics: ``{"none": {...}, "r3": {...}}``, the probe's metrics without replay and with R3 (``r3`` absent for a
            dense model), keyed as :mod:`verl_stable.probe.metrics` keys them.
        moe: whether the model routes (a dense model: replay does not apply).
    """
    none = metrics["none"]
    kl = none.get("stable/train_inf/kl_k3", math.nan)
    f5 = none.get("stable/train_inf/extreme_frac_tau5", math.nan)
    r3 = metrics.get("r3", {})
    kl_r3 = r3.get("stable/train_inf/kl_k3", math.nan)
    story, share = _kl_story(kl, kl_r3)
    tail = f"{_pct(f5)} of tokens have pi/mu outside [1/5, 5], where the MiniRL IS weight (threshold 5) truncates"
    guard = _guard_line(kl, kl_r3, moe)
    if not moe:
        return {
            "summary": f"Dense model: no routing to flip, so R2 / R3 do not apply; {story}; {tail}; {guard}.",
            "on-policy (N = 1)": "minirl_onpolicy: the token IS weight corrects this mismatch token by token.",
            "N = 2": "minirl_n2_r2 without R2 (no routing to replay): clipping + the IS weight.",
            "N >= 4": "minirl_n4_r3 without R3 and the routing export (no routing to replay): clipping + the IS weight.",
            "lab": "the lab measured MoE routing only; for a dense model it has no finding to cite",
        }
    flips = none.get("stable/routing/disagreement", math.nan)
    tokens = none.get("stable/routing/disagreement/token_any_layer", math.nan)
    finding = nearest_finding(flips)
    lab = f"nearest lab finding ({_pct(finding.flips)} flips): {finding.setting}, offline KL k3 {finding.kl_k3:.1e}"
    lab += f"; in verl: {finding.in_verl}" if finding.in_verl else "; measured offline only, not in verl's trainer"
    if kl >= NEGLIGIBLE_KL and math.isfinite(kl_r3):
        lab += f". Here R3 changed KL(mu||pi_old) x{kl_r3 / kl:.2f}: what this model's flips do to its tokens"
    if flips == 0:
        n2 = "minirl_n2_r2: no rollout flip for R2 or R3 to remove here; R2 pins pi_old's routing in the updates."
        n4 = (
            "minirl_n4_r3: this rollout flips no routing decision, so R3 removes nothing of KL(mu||pi_old) at these "
            "weights; keep it for the routing drift of the updates at N >= 4 (the lab: the updates' routing "
            "disagreement grows with N, 0.10 at N = 1 to 0.26 at N = 8)."
        )
    else:
        n2 = (
            "minirl_n2_r2: R2 replays pi_old's routing in the updates; it cannot remove these rollout flips (step-1 "
            "KL unchanged in the lab). "
        )
        if flips < LAB_FINDINGS[2].flips / 2:
            n2 += f"At {_pct(flips)}, well below the lab's 10 %, the recipe as it is."
        else:
            n2 += (
                f"At {_pct(flips)}, near the lab's 10 % or above, R3 at N = 2 is the switch that removes them -- an "
                "extrapolation: the lab compared R3 and R2 at N = 4 only."
            )
        if math.isfinite(share) and share < SMALL_SHARE:
            n4 = (
                f"minirl_n4_r3: R3 removes the flips (disagreement 0) but only {_pct(share)} of KL(mu||pi_old) here: "
                "the mismatch is numerics outside routing, which the IS weight corrects; R3 still pins the updates' "
                "routing at N >= 4."
            )
        else:
            n4 = f"minirl_n4_r3: R3 is the switch for these flips: it removes {_pct(share)} of KL(mu||pi_old) here."
    return {
        "summary": (
            f"{_pct(flips)} of (token, MoE layer) routing decisions flip ({_pct(tokens)} of tokens in some layer); "
            f"{story}; {tail}; {guard}."
        ),
        "on-policy (N = 1)": (
            "minirl_onpolicy: the token IS weight corrects the whole mismatch, flips included (the lab measured no "
            "reward effect of the IS weight on-policy at its scale)."
        ),
        "N = 2": n2,
        "N >= 4": n4,
        "lab": lab,
    }
