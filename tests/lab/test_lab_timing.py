"""The lab's time accounting: a run's wall time split into verl's steps and the rest, and the pre-start estimate."""

from __future__ import annotations

import pytest

from verl_stable.lab import timing as T


def _rows(variant, n, seed, times):
    return [{"variant": variant, "staleness": n, "seed": seed, "step": i + 1, "timing_s/step": t} for i, t in
            enumerate(times)]  # fmt: skip


def test_the_estimate_fills_the_job_queues_in_order():
    per_n4 = T.STARTUP_S + 8 * 4 * T.STEP_S_PER_MINI_BATCH
    assert T.estimate_seconds(6, 8, [4] * 6, jobs=2) == pytest.approx(3 * per_n4)
    assert T.estimate_seconds(3, 8, [4] * 3, jobs=2) == pytest.approx(2 * per_n4)  # the longer queue
    per_n8 = T.STARTUP_S + 8 * 8 * T.STEP_S_PER_MINI_BATCH
    per_n1 = T.STARTUP_S + 8 * 1 * T.STEP_S_PER_MINI_BATCH
    # queue 1: N=8; queue 2: N=4, then N=1 (it is the shorter queue): the sweep ends with the longer of the two
    assert per_n4 < per_n8 < per_n4 + per_n1
    assert T.estimate_seconds(3, 8, [8, 4, 1], jobs=2) == pytest.approx(per_n4 + per_n1)
    with pytest.raises(ValueError, match="2 runs but 1 staleness"):
        T.estimate_seconds(2, 8, [4], jobs=2)
    with pytest.raises(ValueError, match="jobs must be >= 1"):
        T.estimate_seconds(1, 8, [4], jobs=0)


def test_a_run_splits_into_steps_and_the_rest():
    record = {"started": 1000.0, "finished": 1240.0}
    rows = _rows("minirl", 4, 0, [50.0, 10.0, 10.0, 10.0])
    assert T.run_split(record, rows) == {
        "wall": 240.0, "steps": 80.0, "first_step": 50.0, "startup": 160.0, "startup_share": 160 / 240
    }  # fmt: skip
    # steps 1-2 redone after a guard rollback (logged again, 45 s and 12 s): the time spent twice counts twice, and
    # step 1's time is its first (the one that started verl's workers)
    redone = [{**rows[0], "timing_s/step": 45.0}, {**rows[1], "timing_s/step": 12.0}]
    split = T.run_split(record, rows + redone)
    assert split == {"wall": 240.0, "steps": 137.0, "first_step": 50.0, "startup": 103.0, "startup_share": 103 / 240}
    assert T.run_split({"started": 1000.0}, rows) is None
    assert T.run_split({"started": 1000.0, "finished": 900.0}, rows) is None
    assert T.run_split(record, [{"step": 1}]) is None


def test_the_report_line_gives_medians_over_the_timed_runs():
    records = [
        {"variant": "minirl", "staleness": 4, "seed": 0, "started": 0.0, "finished": 200.0},
        {"variant": "minirl_r3", "staleness": 4, "seed": 0, "started": 0.0, "finished": 300.0},
        {"variant": "minirl", "staleness": 4, "seed": 1},  # no times: not counted
    ]
    rows = _rows("minirl", 4, 0, [40.0, 10.0]) + _rows("minirl_r3", 4, 0, [60.0, 30.0]) + _rows("minirl", 4, 1, [5.0])
    (line,) = T.timing_lines(records, rows)
    # walls 200, 300 -> 250; steps 50, 90 -> 70; step 1: 40, 60 -> 50; rest 150, 210 -> 180; shares .75, .70 -> 72 %
    assert line.startswith("2 run(s) timed: median wall 250 s, of which verl's steps 70 s (step 1 alone 50 s")
    assert line.endswith("start-up and shutdown 180 s = 72 % of the run (median of the runs' shares).")
    assert T.timing_lines(records[2:], rows) == []
