"""The lab never drops a value in silence: a run whose judged value is not finite (a step-1 KL logged as ``1e999``,
which JSON reads as inf; a NaN) is named in the report with its seed, and every comparison says which seeds it
leaves out. ``--only ''`` (an empty prefix, which matched every run) is refused.
"""

from __future__ import annotations

import json

import pytest

from verl_stable.lab import cli, sweep
from verl_stable.lab import report as R

KL = "stable/train_inf/kl_k3"


def _lines(kl: dict[str, list[str]], clip: str = "0.02") -> list[str]:
    """metrics.jsonl lines as verl's file logger and the sweep write them: two steps per run, step 1's KL as given
    (JSON text, so ``1e999`` stays what a logger wrote), a finite KL at step 2."""
    lines = []
    for variant, values in kl.items():
        for seed, first in enumerate(values):
            for step, value in ((1, first), (2, "1e-4")):
                lines.append(
                    f'{{"variant": "{variant}", "staleness": 4, "seed": {seed}, "step": {step}, '
                    f'"critic/score/mean": {0.3 + 0.01 * seed}, "actor/pg_clipfrac": {clip}, "{KL}": {value}}}'
                )
    return lines


def _rows(kl: dict[str, list[str]], clip: str = "0.02") -> list[dict]:
    return [json.loads(line) for line in _lines(kl, clip)]


KL_R3_SEED_2_INF = {"minirl": ["1e-3", "1.2e-3", "0.9e-3", "1.1e-3"], "minirl_r3": ["2e-5", "3e-5", "1e999", "2.2e-5"]}


def test_a_non_finite_step_one_kl_is_named_with_its_seed_and_the_paired_test_says_it_is_out():
    rows = _rows(KL_R3_SEED_2_INF)
    summary = R.summarize_run(R.group_runs(rows)[("minirl_r3", 4, 2)])
    assert summary.kl_k3_first is None and ("kl_k3_first", ((1, float("inf")),)) in summary.non_finite
    (r3,) = R.switch_results(R.summarize(rows))
    kl = next(c for c, _ in r3.comparisons if c.metric == "kl_k3_first")
    assert kl.paired.n == 3 and kl.left_out == ((2, "minirl_r3 logged inf at step 1"),)
    assert "paired over n = 3 seeds (log10; seed 2 out: minirl_r3 logged inf at step 1): ratio a/b" in kl.test_text()
    md = R.render_markdown(rows)
    answer = next(line for line in md.splitlines() if line.startswith("| off-policy N = 4: mismatch + staleness | R3"))
    assert "seed 2 out: minirl_r3 logged inf at step 1" in answer  # in the headline's evidence
    assert (
        "- minirl_r3 N=4 seed 2: step-1 KL(mu‖pi_old) k3 left out: logged inf at step 1 (not a finite number: no mean, "
        "median or test can use it)." in md
    )


def test_the_report_written_from_metrics_jsonl_names_the_seed(tmp_path):
    out = tmp_path / "lab"
    out.mkdir()
    (out / "metrics.jsonl").write_text("\n".join(_lines(KL_R3_SEED_2_INF)) + "\n")
    assert cli.main(["--out", str(out), "--report-only"], out=lambda _: None) == 0
    report = (out / "report.md").read_text()
    assert "minirl_r3 N=4 seed 2: step-1 KL(mu‖pi_old) k3 left out: logged inf at step 1" in report
    assert "paired over n = 3 seeds (log10; seed 2 out: minirl_r3 logged inf at step 1)" in report


def test_a_nan_among_a_runs_steps_leaves_the_mean_out_rather_than_averaging_the_other_steps():
    rows = _rows(KL_R3_SEED_2_INF)
    rows[2 * 4 + 1]["actor/pg_clipfrac"] = float("nan")  # minirl_r3 seed 0, step 2
    (r3,) = R.switch_results(R.summarize(rows))
    clip = next(c for c, _ in r3.comparisons if c.metric == "clip_frac")
    assert clip.left_out == ((0, "minirl_r3 logged nan at step 2"),) and clip.paired.n == 3
    assert "seed 0 out: minirl_r3 logged nan at step 2" in clip.test_text()


def test_minirls_masked_fractions_summing_to_inf_are_left_out_not_a_crash():
    rows = _rows(KL_R3_SEED_2_INF)
    for row in rows:
        del row["actor/pg_clipfrac"]
        row.update({"actor/MiniRL/masked_frac_low": 0.01, "actor/MiniRL/masked_frac_high": 0.02})
    rows[0]["actor/MiniRL/masked_frac_high"] = float("inf")  # minirl seed 0, step 1
    cell = next(c for c in R.summarize(rows) if c.variant == "minirl")
    assert 0 not in cell.per_seed["clip_frac"] and cell.left_out("clip_frac") == {0: "logged inf at step 1"}
    assert "minirl N=4 seed 0: clipped fraction left out: logged inf at step 1" in R.render_markdown(rows)


def test_a_metric_no_seed_of_a_side_has_a_finite_value_of_is_said_to_be_uncompared():
    rows = _rows({"minirl": ["1e-3", "1.2e-3", "0.9e-3"], "minirl_r3": ["NaN", "Infinity", "-Infinity"]})
    (r3,) = R.switch_results(R.summarize(rows))
    uncompared = dict(r3.uncompared)
    assert {"kl_k3_first", "kl_k3_median"} <= set(uncompared)  # the median step's too: step 1 is one of two
    assert not set(uncompared) & {c.metric for c, _ in r3.comparisons}
    assert uncompared["kl_k3_first"] == (
        "seed 0 out: minirl_r3 logged nan at step 1; seed 1 out: minirl_r3 logged inf at step 1; "
        "seed 2 out: minirl_r3 logged -inf at step 1"
    )
    assert "step-1 KL(mu‖pi_old) k3 not compared (seed 0 out: minirl_r3 logged nan at step 1;" in R.answer_table([r3])


def test_finite_runs_read_as_before():
    rows = _rows({"minirl": ["1e-3", "1.2e-3", "0.9e-3"], "minirl_r3": ["2e-5", "3e-5", "2.5e-5"]})
    (r3,) = R.switch_results(R.summarize(rows))
    assert all(c.left_out == () for c, _ in r3.comparisons) and r3.uncompared == ()
    assert "paired over n = 3 seeds (log10): ratio a/b" in R.answer_table([r3])
    assert "left out" not in R.render_markdown(rows)


# ------------------------------------------------------------------------------------------------ --only ''
def _fail(*args, **kwargs):
    raise AssertionError("work started although the input should have been refused")


@pytest.mark.parametrize("only", [[""], ["minirl_r3", " "]])
def test_an_empty_only_prefix_is_refused_before_any_work(tmp_path, monkeypatch, capsys, only):
    for work in ("prepare", "ensure_assets", "cold_start", "run_one"):
        monkeypatch.setattr(sweep, work, _fail)
    with pytest.raises(SystemExit) as info:
        cli.main(["--out", str(tmp_path / "lab"), "--only", *only], out=lambda _: None)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"--only {only} holds an empty prefix, which would select every run; expected a non-empty prefix" in err
    assert not (tmp_path / "lab").exists()
