"""End to end on CPU through verl's real trainer (``main_ppo``, V1 ``stable_sync``): a ``skip_update`` rule keeps the
actor update of each step it fires on from being applied, logs it, and escalates past its cap.

One short run (bf16 rollout against fp32 training, so KL(mu || pi_old) > 0 at every step; the rule's threshold 0
makes every step a firing): steps 1 and 2 are skipped (no ``actor/*`` update metric in their rows, the guard's count
logged), step 3 is the third in a row past ``max_skips=2`` and stops the run as ``stop_checkpoint``.
"""

import pytest

from verl_stable.toy import launch
from verl_stable.toy.assets import AssetSpec, ensure_assets

pytestmark = pytest.mark.e2e

RULE = "+stable.guard.rules.train_inference_kl"


@pytest.fixture(scope="module")
def skipped_run(tmp_path_factory):
    assets = ensure_assets(tmp_path_factory.mktemp("assets"), AssetSpec(task="copy"))
    workdir = tmp_path_factory.mktemp("skip")
    overrides = launch.cpu_overrides(assets, steps=4, precision="bf16")
    overrides += [
        f"trainer.default_local_dir={workdir / 'checkpoints'}",
        "trainer.v1.trainer_mode=stable_sync",
        f"{RULE}.action=skip_update",
        f"{RULE}.threshold=0.0",
        f"{RULE}.max_skips=2",
    ]
    proc = launch.run_main_ppo(overrides, workdir, timeout_s=1500)
    log = (workdir / "main_ppo.log").read_text()
    rows = launch.read_metrics(workdir / "metrics.jsonl") if (workdir / "metrics.jsonl").exists() else []
    return proc.returncode, log, rows


def test_skipped_steps_apply_no_update_and_are_logged(skipped_run):
    rc, log, rows = skipped_run
    assert [r["step"] for r in rows] == [1, 2, 3], log[-3000:]
    for row in rows[:2]:
        assert row["stable/train_inf/kl_k3"] > 0.0
        assert row["stable/guard/train_inference_kl"] == 1.0 and row["stable/guard/skipped_updates"] == 1.0
        # verl's actor update never ran: none of the metrics its update returns was logged
        assert not [k for k in row if k.startswith(("actor/pg_loss", "actor/grad_norm", "actor/lr"))], sorted(row)
    assert "verl-stable guard [train_inference_kl -> skip_update]" in log


def test_past_its_cap_the_rule_escalates_and_stops_the_run(skipped_run):
    rc, log, rows = skipped_run
    assert rc != 0
    last = rows[-1]
    assert last["step"] == 3 and last["stable/guard/train_inference_kl"] == 1.0
    assert last["stable/guard/skipped_updates"] == 0.0  # escalated: a stop, not a skip (and no update either)
    assert not [k for k in last if k.startswith("actor/pg_loss")]
    assert "GuardTripped" in log and "escalated to stop_checkpoint" in log and "max_skips 2" in log
