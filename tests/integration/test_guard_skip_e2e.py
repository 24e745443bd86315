"""End to end on CPU through verl's real trainer (``main_ppo``, V1 ``stable_sync``): a ``skip_update`` rule keeps the
actor update of each step it fires on from being applied, logs it, and escalates past its cap; an ``escalate`` rule
moves the run to verl's rejection sampling from the next step on; the run summary lists every action.

One short run (bf16 rollout against fp32 training, so KL(mu || pi_old) > 0 at every step; both rules' threshold 0
makes every step a firing): steps 1 and 2 are skipped (no ``actor/*`` update metric in their rows, the guard's count
logged), step 3 is the third in a row past ``max_skips=2`` and stops the run as ``stop_checkpoint``. The escalate rule
fires at step 1 and sets ``algorithm.rollout_correction.rollout_rs=token_k3`` with a threshold that masks the tokens
whose per-token k3 exceeds 1e-5: verl's trainer masks none at step 1 and some from step 2 on; the rule's later
firings only warn.
"""

import json

import pytest

from verl_stable.toy import launch
from verl_stable.toy.assets import AssetSpec, ensure_assets

pytestmark = pytest.mark.e2e

RULE = "+stable.guard.rules.train_inference_kl"
ESCALATE = "+stable.guard.rules.kl_escalate"
MASKED = "rollout_corr/rollout_rs_masked_fraction"


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
        f"{ESCALATE}.condition=above",
        f"{ESCALATE}.metric=stable/train_inf/kl_k3",
        f"{ESCALATE}.threshold=0.0",
        f"{ESCALATE}.action=escalate",
        f"{ESCALATE}.escalate_to.rollout_rs=token_k3",
        f"{ESCALATE}.escalate_to.rollout_rs_threshold=1e-5",
    ]
    proc = launch.run_main_ppo(overrides, workdir, timeout_s=1500)
    log = (workdir / "main_ppo.log").read_text()
    rows = launch.read_metrics(workdir / "metrics.jsonl") if (workdir / "metrics.jsonl").exists() else []
    summary = workdir / "checkpoints" / "verl_stable_summary.json"
    return proc.returncode, log, rows, json.loads(summary.read_text()) if summary.exists() else None


def test_skipped_steps_apply_no_update_and_are_logged(skipped_run):
    rc, log, rows, _ = skipped_run
    assert [r["step"] for r in rows] == [1, 2, 3], log[-3000:]
    for row in rows[:2]:
        assert row["stable/train_inf/kl_k3"] > 0.0
        assert row["stable/guard/train_inference_kl"] == 1.0 and row["stable/guard/skipped_updates"] == 1.0
        # verl's actor update never ran: none of the metrics its update returns was logged
        assert not [k for k in row if k.startswith(("actor/pg_loss", "actor/grad_norm", "actor/lr"))], sorted(row)
    assert "verl-stable guard [train_inference_kl -> skip_update]" in log


def test_past_its_cap_the_rule_escalates_and_stops_the_run(skipped_run):
    rc, log, rows, _ = skipped_run
    assert rc != 0
    last = rows[-1]
    assert last["step"] == 3 and last["stable/guard/train_inference_kl"] == 1.0
    assert last["stable/guard/skipped_updates"] == 0.0  # escalated: a stop, not a skip (and no update either)
    assert not [k for k in last if k.startswith("actor/pg_loss")]
    assert "GuardTripped" in log and "escalated to stop_checkpoint" in log and "max_skips 2" in log


def test_the_escalated_regime_acts_from_the_next_step_and_the_rule_then_only_warns(skipped_run):
    _, log, rows, _ = skipped_run
    assert rows[0]["stable/guard/kl_escalate"] == 1.0 and rows[0]["stable/guard/escalations"] == 1.0
    assert rows[0].get(MASKED, 0.0) == 0.0  # step 1 ran under the recipe's correction
    for row in rows[1:]:  # verl's trainer read the escalated config: rejection sampling masked tokens
        assert 0.0 < row[MASKED] < 1.0, row.get(MASKED)
        assert row["stable/guard/escalations"] == 1.0
    assert "verl-stable guard: escalated at step 1, algorithm.rollout_correction: rollout_rs: None -> 'token_k3'" in log
    assert "[kl_escalate -> warn]" in log and "the run already escalated at step 1" in log


def test_the_run_summary_lists_every_action_in_step_order(skipped_run):
    _, log, _, summary = skipped_run
    assert summary is not None
    assert (summary["ended"], summary["last_step"]) == ("stopped by the guard", 3)
    assert "max_skips 2" in summary["stop_reason"]
    actions = [(r["step"], r["rule"], r["action"]) for r in summary["records"]]
    assert actions == [
        (1, "train_inference_kl", "skip_update"),
        (1, "kl_escalate", "escalate"),
        (2, "train_inference_kl", "skip_update"),
        (2, "kl_escalate", "warn"),
        (3, "train_inference_kl", "stop_checkpoint"),
        (3, "kl_escalate", "warn"),
    ]
    assert summary["actions"] == {"escalate": 1, "skip_update": 2, "stop_checkpoint": 1, "warn": 2}
    assert "verl-stable run summary: stopped by the guard at step 3" in log
