"""The lab report on synthetic rows: summaries against hand-computed values, the answer table, figures, bad input."""

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
    assert s.late_reward == pytest.approx(0.45)  # last half of 3 steps: steps 2 and 3
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


def test_a_rolled_back_run_is_summarised_on_its_trajectory_and_keeps_every_row():
    from verl_stable.lab.presets import RunSpec
    from verl_stable.lab.results import tag_rows

    # as verl logs a run whose guard fired at step 3 and rolled back to checkpoint 1: steps 2-3 logged twice
    logged = [{"step": s, "critic/score/mean": r} for s, r in [(1, 0.5), (2, 0.4), (3, 0.0), (2, 0.6), (3, 0.7)]]
    logged[2].update({"stable/guard/entropy_blowup": 1.0, "stable/guard/rollbacks": 1.0})
    logged[3]["stable/guard/rollbacks"] = logged[4]["stable/guard/rollbacks"] = 1.0
    rows = tag_rows(logged, RunSpec("minirl_noclip", 8, 5))
    assert [r.get("superseded", False) for r in rows] == [False, True, True, False, False]
    assert [r["critic/score/mean"] for r in rows] == [0.5, 0.4, 0.0, 0.6, 0.7]  # nothing measured is dropped
    R.check_rows(rows)  # a redone step is not a duplicate
    s = R.summarize_run(rows)
    assert (s.steps, s.steps_redone, s.final_reward, s.best_reward) == (3, 2, 0.7, 0.7)
    assert s.late_reward == pytest.approx(0.65)  # steps 2-3 of the trajectory: the redone rows
    assert s.guard_fired == ("entropy_blowup",)  # read from the superseded firing row; the counter is not a rule
    (cell,) = R.summarize(rows)
    assert cell.steps_redone == ((5, 2),) and cell.guard_fired == ("entropy_blowup (1/1 seeds)",)
    assert (
        "The guard rolled back minirl_noclip_guard N=8 (seed 5: 2 step(s) redone)"
        in R.observations(R.summarize([{**r, "variant": "minirl_noclip_guard"} for r in rows]))[-1]
    )
    with pytest.raises(ValueError, match="duplicate step 2"):
        R.check_rows([{**r, "superseded": False} for r in rows])
    with pytest.raises(ValueError, match="'superseded' must be a bool, got the string 'yes'"):
        R.check_rows([{**rows[1], "superseded": "yes"}])


def test_seeds_are_kept_per_cell_with_an_interval():
    rows = [_row("vespo", 8, 1, 0.2, seed=0), _row("vespo", 8, 2, 0.6, seed=0), _row("vespo", 8, 1, 0.4, seed=1)]
    (cell,) = R.summarize(rows)
    assert (cell.seeds, cell.steps) == (2, 1)
    assert cell.per_seed["final_reward"] == {0: 0.6, 1: 0.4}
    assert cell.per_seed["late_reward"] == {0: 0.6, 1: 0.4}  # last half of 2 steps: step 2; of 1 step: step 1
    iv = cell.interval("final_reward")
    # mean 0.5, sample sd 0.1414, t_{0.975, 1} = 12.706: half-width 12.706 * 0.1414 / sqrt(2) = 1.2706
    assert iv.mean == pytest.approx(0.5) and iv.hi - iv.mean == pytest.approx(1.2706, abs=1e-3)


def _seeded(variant, n, kl, reward, clip=0.02, seeds=(0, 1, 2), steps=2):
    """Rows of ``len(seeds)`` runs whose per-seed KL, reward and clip fraction are the given sequences."""
    rows = []
    for i, seed in enumerate(seeds):
        for step in range(1, steps + 1):
            extra = {"stable/train_inf/kl_k3": kl[i], "actor/pg_clipfrac": clip if isinstance(clip, float) else clip[i]}
            rows.append(_row(variant, n, step, reward[i], seed=seed, **extra))
    return rows


def test_answer_table_states_a_switch_only_where_the_paired_test_finds_it():
    rows = _seeded("minirl", 4, kl=[1e-3, 1.2e-3, 0.9e-3], reward=[0.3, 0.5, 0.4], clip=[0.03, 0.035, 0.032])
    rows += _seeded("minirl_r3", 4, kl=[2e-5, 3e-5, 2.5e-5], reward=[0.35, 0.45, 0.5], clip=[0.02, 0.021, 0.019])
    results = R.switch_results(R.summarize(rows))
    (r3,) = results
    verdicts = {c.metric: c.verdict for c, _ in r3.comparisons}
    # KL judged at step 1 (here every step's KL is the run's), the median step shown; no entropy logged
    assert verdicts == {
        "kl_k3_first": "lower",
        "clip_frac": "lower",
        "late_reward": "no effect",
        "mean_reward": "no effect",
        "kl_k3_median": "lower",
    }
    judged = {m for m, d in r3.switch.judged if d}
    assert judged == {"kl_k3_first", "routing_disagreement", "clip_frac", "late_reward", "mean_reward"}
    table = R.answer_table(results)
    assert "| off-policy N = 4: mismatch + staleness | R3 | **yes** |" in table
    assert "KL(mu‖pi_old) k3 2.5e-05 [1.5e-05, 4.1e-05] vs 1.0e-03" in table  # geometric means, log-scale intervals
    # per-seed log10 differences -1.699, -1.602, -1.556: mean -1.6191, sd 0.07285, t = -1.6191 / (0.07285 / sqrt 3)
    assert "42x lower" in table and "paired over n = 3 seeds (log10): ratio a/b x0.024 [" in table
    assert "t = -38.50, p = 0.00067; sign-flip p = 0.25 (8 flips)" in table
    lines = "\n".join(R.comparison_lines(results))
    # reward: per-seed differences +0.05, -0.05, +0.10 change sign and p = 0.53: no effect, with what it could see
    assert "late reward" in lines and "the per-seed difference changes sign across seeds" in lines
    assert "p = 0.53 >= 0.05 (the per-seed difference changes sign across seeds): no effect measured (none " in lines
    assert "per-seed log10 differences [-1.7, -1.6, -1.56]" in lines


def test_the_judged_kl_is_step_one_where_both_arms_share_weights_and_a_later_spike_does_not_decide():
    rows = []
    for seed, kl in enumerate([1e-3, 2e-3, 1.5e-3]):  # step 1, then 5e-4 on every later step
        rows += [
            _row("minirl", 4, step, 0.3, seed=seed, **{"stable/train_inf/kl_k3": kl if step == 1 else 5e-4})
            for step in (1, 2, 3, 4)
        ]
    for seed in range(3):  # R3: 1e-4, but seed 2's trajectory spikes to 0.1 once and then sits at 2e-3, above minirl
        for step in (1, 2, 3, 4):
            kl = {(2, 2): 2e-3, (2, 3): 0.1, (2, 4): 2e-3}.get((seed, step), 1e-4)
            rows.append(_row("minirl_r3", 4, step, 0.3, seed=seed, **{"stable/train_inf/kl_k3": kl}))
    spiky = R.summarize_run(R.group_runs(rows)[("minirl_r3", 4, 2)])
    assert spiky.kl_k3 == pytest.approx((1e-4 + 4e-3 + 0.1) / 4)  # the mean: the spike over the step count
    assert spiky.kl_k3_median == pytest.approx(2e-3)  # the median: not the spike, but the trajectory's own level
    assert spiky.kl_k3_first == pytest.approx(1e-4)  # step 1: both arms still on the same weights
    (r3,) = R.switch_results(R.summarize(rows))
    kl = {c.metric: c for c, _ in r3.comparisons}
    # step 1: log10 differences -1, -1.301, -1.176: mean -1.159, sd 0.1512, t = -13.28, p = 0.0056
    assert kl["kl_k3_first"].diffs == pytest.approx((-1.0, -math.log10(20), -math.log10(15)))
    assert kl["kl_k3_first"].verdict == "lower" and kl["kl_k3_first"].paired.p == pytest.approx(0.0056, abs=1e-4)
    # the median step, shown: seed 2's trajectory above minirl's reverses its sign, nothing is found there
    assert kl["kl_k3_median"].diffs == pytest.approx((math.log10(0.2), math.log10(0.2), math.log10(4)))
    assert kl["kl_k3_median"].verdict == "no effect"
    assert "| R3 | **yes** | step-1 KL(mu‖pi_old) k3" in R.answer_table([r3])
    table = R.table(R.summarize(rows))
    assert "median-step KL(mu‖pi_old) k3 | step-1 KL(mu‖pi_old) k3" in table.splitlines()[0]


def test_the_step_one_median_token_gap_is_shown_beside_the_kl_one_outlier_token_decides():
    # seeds 40-43 of session 22 at step 1 (KL k3 and median |log mu - log pi_old|, rounded): on seed 41 one int4
    # outlier token is the whole KL in both arms, so the KL ties there while the typical token's gap does not
    kl = {"minirl": [1.1e-3, 7.88e-3, 2.5e-4, 9.9e-4], "minirl_r3": [3.5e-5, 7.93e-3, 1.3e-4, 4.4e-5]}
    gap = {"minirl": [8e-3, 1e-2, 6e-3, 9e-3], "minirl_r3": [2e-3, 4e-3, 2e-3, 3e-3]}
    rows = []
    for variant in kl:
        for seed in range(4):
            extra = {
                "stable/train_inf/kl_k3": kl[variant][seed],
                "stable/train_inf/log_ratio_abs_median": gap[variant][seed],
            }
            rows += [_row(variant, 4, step, 0.3, seed=seed, **extra) for step in (1, 2)]
    bypass = [_row("dppo", 4, 1, 0.3, **{"stable/train_inf/log_ratio_abs_median": 0.0})]  # mu against mu
    assert R.summarize_run(bypass).gap_median_first is None
    cells = R.summarize(rows)
    (r3,) = R.switch_results(cells)
    found = {c.metric: c for c, _ in r3.comparisons}
    # judged KL: log10 differences -1.497, +0.0027, -0.283, -1.352 change sign: nothing found
    assert found["kl_k3_first"].verdict == "no effect"
    assert found["kl_k3_first"].diffs[1] == pytest.approx(math.log10(7.93 / 7.88))
    # the gap, shown: log10 differences -0.602, -0.398, -0.477, -0.477: mean -0.4886, sd 0.0844, t = -11.58
    g = found["gap_median_first"]
    assert g.diffs == pytest.approx(
        tuple(math.log10(a / b) for a, b in zip(gap["minirl_r3"], gap["minirl"], strict=True))
    )
    assert g.verdict == "lower" and g.paired.t == pytest.approx(-11.58, abs=0.01)
    assert ("gap_median_first", None) in r3.switch.judged  # shown, not judged: no verdict of the switch rests on it
    assert "| R3 | no effect measured |" in R.answer_table([r3])
    assert "step-1 median token gap |log mu - log pi_old|" in R.table(cells).splitlines()[0]


def test_a_run_without_a_logged_step_one_has_no_step_one_kl():
    rows = [_row("minirl", 4, step, 0.3, seed=0, **{"stable/train_inf/kl_k3": 1e-3}) for step in (2, 3)]
    rows.append(_row("minirl", 4, 1, 0.3, seed=1))  # step 1 logged without the KL, steps 2-3 with it
    rows += [_row("minirl", 4, step, 0.3, seed=1, **{"stable/train_inf/kl_k3": 2e-3}) for step in (2, 3)]
    runs = R.group_runs(rows)
    for key in (("minirl", 4, 0), ("minirl", 4, 1)):
        s = R.summarize_run(runs[key])
        assert s.kl_k3_first is None and s.kl_k3_median is not None


def test_disjoint_seeds_are_compared_unpaired_and_no_seed_is_said_to_agree():
    rows = _seeded("minirl", 4, kl=[1e-3, 1.2e-3, 0.9e-3], reward=[0.3, 0.5, 0.4], seeds=(0, 1, 2))
    rows += _seeded("minirl_r3", 4, kl=[2e-5, 3e-5, 2.5e-5], reward=[0.35, 0.45, 0.5], seeds=(3, 4, 5))
    results = R.switch_results(R.summarize(rows))
    (r3,) = results
    assert all(c.paired is None and c.diffs == () for c, _ in r3.comparisons)
    kl = next(c for c, _ in r3.comparisons if c.metric == "kl_k3_first")
    assert kl.verdict == "lower" and kl.reason.startswith("seeds not paired (no seed in common): Welch t-test")
    text = R.answer_table(results) + "\n".join(R.comparison_lines(results))
    assert "every seed" not in text and "agree" not in text and "unpaired (seeds not shared)" in text
    assert "missing: minirl_r3 seeds 0, 1, 2; minirl seeds 3, 4, 5 (no step logged); paired on no seed" in text


def test_a_switch_that_moves_nothing_is_no_effect_and_one_seed_gives_no_finding():
    rows = _seeded("minirl", 1, kl=[1e-3, 2e-3, 3e-3], reward=[0.3, 0.5, 0.4])
    rows += _seeded("reinforce_no_is", 1, kl=[1.1e-3, 1.9e-3, 3.2e-3], reward=[0.31, 0.45, 0.42])
    table = R.answer_table(R.switch_results(R.summarize(rows)))
    assert "| on-policy (N = 1): train-inference mismatch only | IS weight | no effect measured |" in table
    one = _seeded("minirl", 4, kl=[1e-3], reward=[0.3], seeds=(0,)) + _seeded(
        "minirl_r3", 4, kl=[1e-5], reward=[0.9], seeds=(0,)
    )
    table = R.answer_table(R.switch_results(R.summarize(one)))
    assert "no effect measured" in table and "fewer than 2 seeds" in table and "**yes**" not in table


def test_a_no_effect_says_the_smallest_effect_it_could_have_seen():
    rows = _seeded("minirl", 1, kl=[1e-3, 2e-3, 3e-3], reward=[0.3, 0.5, 0.4])
    rows += _seeded("reinforce_no_is", 1, kl=[1.1e-3, 1.9e-3, 3.2e-3], reward=[0.31, 0.45, 0.42])
    (result,) = R.switch_results(R.summarize(rows))
    reward = next(c for c, good in result.comparisons if c.metric == "late_reward")
    # differences -0.01, +0.05, -0.02: sd 0.037859; MDE = 5.6535 * 0.037859 / sqrt(3) = 0.1236
    assert reward.mde == pytest.approx(5.6534893 * 0.0378594 / math.sqrt(3), rel=1e-5)
    assert "late reward 0.400 [0.152, 0.648] vs 0.393 [0.210, 0.576]: paired t-test over 3 seeds: p = 0.79" in (
        R.answer_table([result])
    )
    assert "no effect measured (none larger than 0.12)" in R.answer_table([result])


def test_a_switch_that_hurts_is_reported_as_such():
    rows = _seeded("minirl", 4, kl=[1e-3] * 3, reward=[0.6, 0.62, 0.61])
    rows += _seeded("vespo", 4, kl=[1e-3] * 3, reward=[0.2, 0.21, 0.25])
    table = R.answer_table(R.switch_results(R.summarize(rows)))
    assert "| VESPO | **hurts** | not judged (reward only) | late reward" in table


def test_observations_follow_the_numbers():
    text = "\n".join(R.observations(R.summarize(_rows())))
    assert "routing disagreement with the rollout 0.000" in text and "replay works: yes" in text
    assert "Guard fired in: reinforce_no_is N=1 (entropy_collapse (1/1 seeds))" in text
    assert "Without replay (minirl, N=4) the updates routed 0.100 of the" in text


def test_report_starts_with_the_answer_and_has_one_figure_per_regime(tmp_path):
    rows = _rows()
    path = R.write_report(rows, tmp_path, {"preset": "synthetic"})
    text = path.read_text()
    assert text.index("## The answer") < text.index("## Setup") < text.index("## Results per variant")
    assert "- preset: synthetic" in text
    for n in (1, 4):
        png = tmp_path / "plots" / f"regime_N{n}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"(plots/regime_N{n}.png)" in text
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["regime_N1.png", "regime_N4.png"]


def test_report_keeps_the_names_its_callers_import():
    from verl_stable.lab import outcomes, report_tables, summaries, switches

    # lab/cli.py (write_report), lab/sweep.py (output_problem), lab/results.py (row_problem), the lab's tests
    assert R.row_problem is summaries.row_problem and R.metric is summaries.metric
    assert R.run_records is outcomes.run_records and R.switch_results is switches.switch_results
    assert R.answer_table is report_tables.answer_table
    assert {"write_report", "output_problem", "render_markdown"} <= set(R.__all__)
    assert all(hasattr(R, name) for name in R.__all__)


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
    # a seed "0" would pass the duplicate check beside seed 0, then be merged into that run (int("0") == 0)
    with pytest.raises(ValueError, match=r"metric row 1: key 'seed' must be an integer, got the string '0'"):
        R.summarize([_row("minirl", 1, 1, 0.1), {**_row("minirl", 1, 1, 0.9), "seed": "0"}])
    with pytest.raises(ValueError, match=r"metric row 0: key 'variant' must be a string, got None"):
        R.summarize([{**_row("minirl", 1, 1, 0.1), "variant": None}])


def test_clipping_is_judged_on_reward_not_on_the_fraction_it_clips():
    rows = _seeded("minirl", 8, kl=[1e-3] * 3, reward=[0.5, 0.52, 0.55], clip=[0.05, 0.06, 0.055])
    rows += _seeded("minirl_noclip", 8, kl=[1e-3] * 3, reward=[0.1, 0.12, 0.08], clip=0.0)
    (result,) = R.switch_results(R.summarize(rows))
    assert result.switch.name == "clipping" and "clip_frac" not in {c.metric for c, _ in result.comparisons}
    row = "| off-policy N = 8: mismatch + staleness | clipping | **yes** | not judged (reward only) | late reward 0.523"
    assert row in R.answer_table([result])


# ------------------------------------------------------------------------------------------- verl's own answers
def test_baselines_are_judged_on_reward_with_r3s_kl_shown_not_judged():
    # R3's KL 40x lower on every seed (a finding for the R3 switch), the reward the same: against verl's TIS that is
    # no effect, since R3's pi_old (rollout routing) and the baseline's (its own routing) are not the same quantity
    rows = _seeded("minirl_r3", 4, kl=[2e-5, 3e-5, 2.5e-5], reward=[0.35, 0.45, 0.5])
    rows += _seeded("verl_tis", 4, kl=[1e-3, 1.2e-3, 0.9e-3], reward=[0.3, 0.5, 0.46])
    (result,) = R.switch_results(R.summarize(rows))
    assert result.switch.name == "MiniRL + R3 over verl TIS" and result.switch in R.BASELINES
    judged = {c.metric: good for c, good in result.comparisons}
    # no entropy logged; no clipped fraction
    assert judged == {"late_reward": "higher", "mean_reward": "higher", "kl_k3_median": None}
    kl = next(c for c, _ in result.comparisons if c.metric == "kl_k3_median")
    assert kl.verdict == "lower"  # found, and still not what decides
    table = R.answer_table([result], baselines=True)
    assert "| regime | comparison | MiniRL + R3 ahead? |" in table.splitlines()[0]
    assert "| off-policy N = 4: mismatch + staleness | MiniRL + R3 over verl TIS | no effect measured |" in table


def test_a_baseline_ahead_on_reward_is_said_so():
    rows = _seeded("minirl_r3", 8, kl=[2e-5] * 3, reward=[0.2, 0.21, 0.25])
    rows += _seeded("vanilla_grpo", 8, kl=[1e-3] * 3, reward=[0.6, 0.62, 0.61])
    table = R.answer_table(R.switch_results(R.summarize(rows)), baselines=True)
    assert "| MiniRL + R3 over GRPO | no: the baseline is ahead | late reward 0.220" in table


def test_dppo_has_no_train_inference_kl_and_is_judged_on_reward_alone(tmp_path):
    # verl's bypass mode: pi_old is the rollout's log-probs, so the monitor logs KL(mu||pi_old) = 0 and F(2) = 0
    rows = _seeded("minirl_r3", 4, kl=[2e-5, 3e-5, 2.5e-5], reward=[0.5, 0.52, 0.55])
    dppo = _seeded("dppo", 4, kl=[0.0] * 3, reward=[0.3, 0.33, 0.31])
    for row in dppo:
        row["stable/train_inf/extreme_frac_tau2"] = 0.0
    rows += dppo
    assert R.metric(dppo[0], "kl_k3") is None and R.metric(dppo[0], "f2") is None
    assert R.metric({**dppo[0], "variant": "verl_tis"}, "kl_k3") == 0.0  # a measured 0 elsewhere stays a 0
    cells = R.summarize(rows)
    cell = next(c for c in cells if c.variant == "dppo")
    assert cell.interval("kl_k3_median") is None and cell.interval("f2") is None
    dppo_line = next(line for line in R.table(cells).splitlines() if line.startswith("| dppo |"))
    assert "0.0e+00" not in dppo_line and "| - | - | - |" in dppo_line  # mean KL, median-step KL, F(2)
    (result,) = R.switch_results(cells)
    assert [c.metric for c, _ in result.comparisons] == ["late_reward", "mean_reward"]
    assert "| MiniRL + R3 over DPPO | **yes** | late reward 0.523" in R.answer_table([result], baselines=True)
    text = R.render_markdown(rows)
    own, _, against = text.partition("## Against verl's own answers: is MiniRL + R3 ahead?")
    assert "No switch has both of its variants at one N in these runs." in own and "MiniRL + R3 over DPPO" in against
    assert "bypass mode" in against


def test_benefit_and_cost_are_judged_together_a_switch_that_removes_the_mismatch_and_costs_reward_is_a_trade_off():
    """The shape seen on fresh seeds: R3 lowers step-1 KL on every seed and lowers the late reward on every seed."""
    seeds = (0, 1, 2, 3)
    rows = _seeded("minirl", 4, kl=[1e-3, 2e-3, 1.5e-3, 1e-3], reward=[0.37, 0.40, 0.35, 0.38], seeds=seeds)
    rows += _seeded("minirl_r3", 4, kl=[1e-4, 1e-4, 2e-4, 1e-4], reward=[0.29, 0.31, 0.28, 0.30], seeds=seeds)
    (r3,) = R.switch_results(R.summarize(rows))
    # reward differences -0.08, -0.09, -0.07, -0.08: mean -0.08, sd 0.008165, t = -19.6, p = 2.9e-4
    late = next(c for c, _ in r3.comparisons if c.metric == "late_reward")
    assert late.verdict == "lower" and late.paired.p == pytest.approx(2.9e-4, rel=0.05)
    assert [c.metric for c in r3.removes()] == ["kl_k3_first"]
    assert {c.metric for c in r3.costs()} == {"late_reward", "mean_reward"}
    assert r3.verdict() == "trade-off"
    table = R.answer_table([r3])
    row = next(line for line in table.splitlines() if "| R3 |" in line)
    removes, costs = row.split(" | ")[3], row.split(" | ")[4]
    assert "| **trade-off** |" in row
    assert removes.startswith("step-1 KL(mu‖pi_old) k3") and "late reward" not in removes
    assert costs.startswith("late reward 0.295") and "vs 0.375" in costs and "p = 0.00029" in costs
    lines = "\n".join(R.comparison_lines([r3]))
    # effect size -0.08 / 0.008165 = -9.8: 3 seeds give 80 % power (2 seeds leave one degree of freedom: 0.72)
    late_line = next(line for line in lines.splitlines() if ", late reward:" in line)
    assert late_line.endswith("seeds for 80% power at this effect size: 3.")


def test_a_switch_that_only_costs_hurts_and_one_without_findings_is_no_effect():
    seeds = (0, 1, 2)
    rows = _seeded("minirl", 4, kl=[1e-3, 1e-3, 1e-3], reward=[0.4, 0.5, 0.45], seeds=seeds)
    rows += _seeded("minirl_r2", 4, kl=[1.1e-3, 0.9e-3, 1e-3], reward=[0.3, 0.41, 0.34], seeds=seeds)
    (r2,) = R.switch_results(R.summarize(rows))
    assert r2.verdict() == "hurts" and r2.removes() == [] and r2.costs()
    assert "| R2 | **hurts** |" in R.answer_table([r2])
    same = _seeded("minirl", 4, kl=[1e-3, 2e-3, 3e-3], reward=[0.4, 0.5, 0.45], seeds=seeds)
    same += _seeded("minirl_r2", 4, kl=[2e-3, 1e-3, 3.5e-3], reward=[0.45, 0.4, 0.47], seeds=seeds)
    (flat,) = R.switch_results(R.summarize(same))
    assert flat.verdict() == "no effect measured"


def test_seeds_needed_is_the_smallest_count_with_the_power():
    from verl_stable.lab.stats import POWER, paired_power, seeds_needed

    for effect in (0.5, 1.0, 1.53, 3.0):
        n = seeds_needed(effect)
        assert paired_power(effect, n) >= POWER and (n == 2 or paired_power(effect, n - 1) < POWER)
    assert seeds_needed(0.0) is None and seeds_needed(0.05) is None  # beyond 64 seeds


def test_r2s_routing_disagreement_is_shown_not_judged_its_target_is_pi_olds_routing():
    """Under R2 the engine compares the used experts with pi_old's recorded routing, not the rollout's: its 0 is
    replay exactness, not flips removed. Judged on it, R2 would read 'yes' on every seed set (measured on seeds 70-75)."""
    seeds = (0, 1, 2)
    rows = _seeded("minirl", 4, kl=[1e-3, 2e-3, 3e-3], reward=[0.4, 0.5, 0.45], seeds=seeds)
    rows += _seeded("minirl_r2", 4, kl=[1e-3, 2e-3, 3e-3], reward=[0.41, 0.48, 0.46], seeds=seeds)
    for r in rows:
        r["stable/routing/disagreement"] = 0.0 if r["variant"] == "minirl_r2" else 0.24 + 0.01 * r["seed"]
    (r2,) = R.switch_results(R.summarize(rows))
    judged = {c.metric: good for c, good in r2.comparisons}
    assert judged["routing_disagreement"] is None and r2.verdict() == "no effect measured"
