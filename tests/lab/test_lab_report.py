"""The lab report on synthetic rows: summaries against hand-computed values, findings, plots, bad input."""

from __future__ import annotations

import math

import pytest

from verl_stable.lab import report as R


def _row(variant, n, step, reward, seed=0, **extra):
    row = {"variant": variant, "staleness": n, "seed": seed, "step": step, "critic/score/mean": reward}
    row.update(extra)
    return row


def _rows():
    rows = []
    for step, (a, b) in enumerate([(0.3, 0.3), (0.5, 0.2), (0.4, 0.1)], start=1):
        rows.append(
            _row(
                "minirl",
                1,
                step,
                a,
                **{"stable/entropy/mean": 2.0 - step / 10, "stable/train_inf/kl_k3": 1e-3 * step},
                **{"stable/train_inf/extreme_frac_tau2": 0.01, "actor/pg_clipfrac": 0.1 * step},
            )
        )
        rows.append(
            _row(
                "reinforce_no_is",
                1,
                step,
                b,
                **{"stable/entropy/mean": 1.0, "stable/guard/entropy_collapse": float(step == 3)},
                **{"actor/MiniRL/masked_frac_low": 0.1, "actor/MiniRL/masked_frac_high": 0.05},
            )
        )
        rows.append(
            _row(
                "minirl_r3",
                4,
                step,
                0.3,
                **{"actor/stable/routing/disagreement": 0.0, "actor/stable/routing/router_disagreement": 0.06 * step},
                **{"rollout_corr/k3_kl": 1e-4},
            )
        )
        rows.append(_row("minirl", 4, step, 0.3, **{"stable/routing/disagreement": 0.1}))
    return rows


def test_run_summary_matches_hand_computation():
    runs = R.group_runs(_rows())
    s = R.summarize_run(runs[("minirl", 1, 0)])
    assert (s.final_reward, s.best_reward, s.steps) == (0.4, 0.5, 3)
    assert s.final_entropy == pytest.approx(1.7)
    assert s.kl_k3 == pytest.approx(2e-3)
    assert s.f2 == pytest.approx(0.01)
    assert s.clip_frac == pytest.approx(0.2)
    assert s.routing_disagreement is None and s.guard_fired == ()
    no_is = R.summarize_run(runs[("reinforce_no_is", 1, 0)])
    assert no_is.clip_frac == pytest.approx(0.15)  # MiniRL's masked fractions when pg_clipfrac is absent
    assert no_is.guard_fired == ("entropy_collapse",)
    r3 = R.summarize_run(runs[("minirl_r3", 4, 0)])
    assert r3.routing_disagreement == 0.0 and r3.router_disagreement == pytest.approx(0.12)


def test_seeds_are_averaged_per_cell():
    rows = [_row("vespo", 8, 1, 0.2, seed=0), _row("vespo", 8, 2, 0.6, seed=0), _row("vespo", 8, 1, 0.4, seed=1)]
    (cell,) = R.summarize(rows)
    assert (cell.seeds, cell.steps) == (2, 1)
    assert cell.values["final_reward"] == pytest.approx((0.6 + 0.4) / 2)
    assert cell.values["best_reward"] == pytest.approx((0.6 + 0.4) / 2)


def test_findings_follow_the_numbers():
    text = "\n".join(R.findings(R.summarize(_rows())))
    assert "late reward MiniRL 0.450 vs without IS 0.150" in text and "consistent with the paper" in text
    assert "MiniRL ahead by > 0.141" in text  # 2 * sqrt(0.05^2 + 0.05^2): two standard errors of the gap
    assert "routing disagreement with the rollout 0.000" in text and "replay works: yes" in text
    assert "Guard fired in: reinforce_no_is N=1 (entropy_collapse)" in text
    assert "Without replay (minirl, N=4) the policy updates routed 0.100 of the" in text
    assert "ranges from 0.00010 (minirl_r3 N=4) to 0.00200 (minirl N=1); F(2) is at most 0.0100" in text
    flipped = [dict(r, **{"critic/score/mean": 0.3}) for r in _rows()]
    text = "\n".join(R.findings(R.summarize(flipped)))
    assert "NOT reproduced" in text and "Guard fired" in text


def test_offpolicy_comparison_names_the_direction():
    rows = [_row("minirl", 4, 1, 0.2), _row("minirl_r2", 4, 1, 0.5), _row("vespo", 4, 1, 0.21)]
    text = "\n".join(R.findings(R.summarize(rows)))
    assert "minirl_r2 vs MiniRL at N=4: late reward 0.500 vs 0.200" in text and "minirl_r2 ahead" in text
    assert "vespo vs MiniRL at N=4" in text and "not visible at this scale" in text


def test_a_direction_from_one_seed_is_flagged_as_not_evidence():
    one = [_row("minirl", 4, 1, 0.2), _row("minirl_r3", 4, 1, 0.6)]
    text = "\n".join(R.findings(R.summarize(one)))
    assert "minirl_r3 ahead" in text and "with one seed per variant this is not evidence" in text
    two = one + [_row("minirl", 4, 1, 0.2, seed=1), _row("minirl_r3", 4, 1, 0.6, seed=1)]
    text = "\n".join(R.findings(R.summarize(two)))
    assert "minirl_r3 ahead" in text and "not evidence" not in text
    # no direction claimed: nothing to qualify
    flat = [_row("minirl", 4, 1, 0.2), _row("minirl_r3", 4, 1, 0.21)]
    assert "not evidence" not in "\n".join(R.findings(R.summarize(flat)))


def test_noise_margin_comes_from_the_standard_errors():
    rows = [_row("minirl", 4, s, r) for s, r in enumerate([0.0, 0.0, 0.2, 0.6], start=1)]
    rows += [_row("minirl_r3", 4, s, r) for s, r in enumerate([0.0, 0.0, 0.5, 0.7], start=1)]
    cells = {c.variant: c for c in R.summarize(rows)}
    assert cells["minirl"].values["late_reward"] == pytest.approx(0.4)
    assert cells["minirl"].values["late_reward_se"] == pytest.approx(0.2)  # sample std 0.2828 / sqrt(2)
    gap, margin = R.compare_late_reward(cells["minirl_r3"], cells["minirl"])
    assert gap == pytest.approx(0.2) and margin == pytest.approx(2 * (0.2**2 + 0.1**2) ** 0.5)
    text = "\n".join(R.findings(list(cells.values())))
    assert "minirl_r3 vs MiniRL at N=4: late reward 0.600 vs 0.400" in text and "not visible at this scale" in text
    assert "| minirl | 4 | 1 | 4 | 0.600 | 0.600 | 0.400 ± 0.200 |" in R.table(list(cells.values()))


def test_report_and_plots_are_written(tmp_path):
    rows = _rows()
    path = R.write_report(rows, tmp_path, {"preset": "synthetic"})
    text = path.read_text()
    assert "- preset: synthetic" in text
    assert text.count("\n| ") == 1 + 4  # header + one row per (variant, N)
    for name in R.PLOTTED:
        png = tmp_path / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"(plots/{name}.png)" in text


def test_metric_ignores_missing_and_nonfinite():
    assert R.metric({"stable/train_inf/kl_k3": float("nan"), "rollout_corr/k3_kl": 0.5}, "kl_k3") == 0.5
    assert R.metric({"stable/entropy/mean": None}, "entropy") is None
    assert R.metric({}, "clip_frac") is None
    assert not math.isnan(R.metric({"actor/pg_clipfrac": 0.0}, "clip_frac"))


def test_bad_rows_raise():
    with pytest.raises(ValueError, match="lacks"):
        R.summarize([{"variant": "minirl", "step": 1}])
    with pytest.raises(ValueError, match="duplicate step"):
        R.summarize([_row("minirl", 1, 1, 0.1), _row("minirl", 1, 1, 0.2)])
