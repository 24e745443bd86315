"""End to end on CPU through verl's real trainer (``main_ppo``, V1 ``stable_sync``): a ``skip_update`` rule keeps the
actor update of each step a rollout fault hits from being applied, logs it, lets the run go on with the next step, and
escalates past its cap; an ``escalate`` rule moves the run to verl's rejection sampling from the next step on; the run
summary lists every action.

One short run (MiniRL loss; bf16 rollout against fp32 training, so KL(mu || pi_old) > 0 at every step) with a fault:
the ``hf`` rollout returns NaN log-probs for the rollouts of steps 2, 4 and 5 (``nan_logprobs_at_versions``, as a
broken inference kernel would). The default rule ``train_inference_kl`` with ``action: skip_update``,
``max_skips: 1`` (as docs/how-to/guard.md recommends it) sees KL(mu || pi_old) undefined there -- a watched value that
is not finite fires a rule -- before the update, and the update is not applied. Step 2 is skipped and step 3 trains as
before the fault; step 4 is skipped, and step 5, the second in a row, stops the run as ``stop_checkpoint``. Without
the rule the same run stops at step 2 with MiniRL's refusal of the non-finite importance weights (measured:
``verl-stable recipe run-cpu fsdp/minirl_onpolicy --steps 3
'+actor_rollout_ref.rollout.engine_kwargs.hf.nan_logprobs_at_versions=[1]'`` exits 1 with "invalid values at valid
(response_mask=1) positions -> rollout_is_weights"). The escalate rule fires at step 1 and sets
``algorithm.rollout_correction.rollout_rs=token_k3`` with a threshold that masks the tokens whose per-token k3
exceeds 1e-5: verl's trainer masks none at step 1 and some at step 3; its later firings only warn.
"""

import json
import math

import pytest

from verl_stable.toy import launch
from verl_stable.toy.assets import AssetSpec, ensure_assets

pytestmark = pytest.mark.e2e

RULE = "+stable.guard.rules.train_inference_kl"  # a default rule: its metrics and threshold 0.01 kept
ESCALATE = "+stable.guard.rules.kl_escalate"
MASKED = "rollout_corr/rollout_rs_masked_fraction"
FAULTED_STEPS = (2, 4, 5)  # weight version k - 1 serves step k of the sync trainer
UPDATE_KEYS = ("actor/pg_loss", "actor/grad_norm", "actor/lr")


@pytest.fixture(scope="module")
def skipped_run(tmp_path_factory):
    assets = ensure_assets(tmp_path_factory.mktemp("assets"), AssetSpec(task="copy"))
    workdir = tmp_path_factory.mktemp("skip")
    versions = ",".join(str(step - 1) for step in FAULTED_STEPS)
    overrides = launch.cpu_overrides(assets, steps=5, precision="bf16")
    overrides += [
        f"trainer.default_local_dir={workdir / 'checkpoints'}",
        "trainer.v1.trainer_mode=stable_sync",
        "actor_rollout_ref.actor.policy_loss.loss_mode=minirl",
        f"+actor_rollout_ref.rollout.engine_kwargs.hf.nan_logprobs_at_versions=[{versions}]",
        f"{RULE}.action=skip_update",
        f"{RULE}.max_skips=1",
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


def _updated(row: dict) -> bool:
    return bool([k for k in row if k.startswith(UPDATE_KEYS)])


def test_a_faulted_steps_update_is_skipped_and_logged_and_the_next_step_trains_as_before(skipped_run):
    rc, log, rows, _ = skipped_run
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5], log[-3000:]
    by_step = {r["step"]: r for r in rows}
    for step in (2, 4):
        row = by_step[step]
        assert row["stable/train_inf/nonfinite_frac"] == 1.0  # every rollout log-prob of the step was NaN
        assert row["stable/guard/train_inference_kl"] == 1.0 and row["stable/guard/skipped_updates"] == 1.0
        # verl's actor update never ran: none of the metrics its update returns was logged
        assert not _updated(row), sorted(row)
    for step in (1, 3):  # before and after the fault: updates applied, the rollout's log-probs finite
        row = by_step[step]
        assert _updated(row) and math.isfinite(row["actor/grad_norm"]) and row["actor/grad_norm"] > 0
        assert row["stable/train_inf/nonfinite_frac"] == 0.0 and row["stable/guard/train_inference_kl"] == 0.0
        assert row["stable/guard/skipped_updates"] == 0.0
    # after the skipped step the run is where it was: the rollout still matches the trainer (KL at step 1's scale)
    # and the policy's entropy within 5 % of step 1's (one applied update apart)
    first, after = by_step[1], by_step[3]
    assert 0.0 < after["stable/train_inf/kl_k3"] < 10 * first["stable/train_inf/kl_k3"] + 1e-4
    assert abs(after["stable/entropy/mean"] - first["stable/entropy/mean"]) < 0.05 * first["stable/entropy/mean"]
    assert "verl-stable guard [train_inference_kl -> skip_update]" in log


def test_past_its_cap_the_rule_escalates_and_stops_the_run(skipped_run):
    rc, log, rows, _ = skipped_run
    assert rc != 0
    last = rows[-1]
    assert last["step"] == 5 and last["stable/guard/train_inference_kl"] == 1.0
    assert last["stable/guard/skipped_updates"] == 0.0  # escalated: a stop, not a skip (and no update either)
    assert not _updated(last)
    assert "GuardTripped" in log and "escalated to stop_checkpoint" in log and "max_skips 1" in log


def test_the_escalated_regime_acts_from_the_next_step_and_the_rule_then_only_warns(skipped_run):
    _, log, rows, _ = skipped_run
    assert rows[0]["stable/guard/kl_escalate"] == 1.0 and rows[0]["stable/guard/escalations"] == 1.0
    assert rows[0].get(MASKED, 0.0) == 0.0  # step 1 ran under the recipe's correction
    # verl's trainer read the escalated config: rejection sampling masked tokens at the next step with finite log-probs
    assert 0.0 < rows[2][MASKED] < 1.0, rows[2].get(MASKED)
    assert all(row["stable/guard/escalations"] == 1.0 for row in rows[1:])
    assert "verl-stable guard: escalated at step 1, algorithm.rollout_correction: rollout_rs: None -> 'token_k3'" in log
    assert "[kl_escalate -> warn]" in log and "the run already escalated at step 1" in log


def test_the_run_summary_lists_every_action_in_step_order(skipped_run):
    _, log, _, summary = skipped_run
    assert summary is not None
    assert (summary["ended"], summary["last_step"]) == ("stopped by the guard", 5)
    assert "max_skips 1" in summary["stop_reason"]
    actions = [(r["step"], r["rule"], r["action"]) for r in summary["records"]]
    # the KL rule watches kl_k3, which a step whose log-probs are all NaN does not have: it fires at steps 1 and 3
    assert actions == [
        (1, "kl_escalate", "escalate"),
        (2, "train_inference_kl", "skip_update"),
        (3, "kl_escalate", "warn"),
        (4, "train_inference_kl", "skip_update"),
        (5, "train_inference_kl", "stop_checkpoint"),
    ]
    assert summary["actions"] == {"escalate": 1, "skip_update": 2, "stop_checkpoint": 1, "warn": 1}
    assert "verl-stable run summary: stopped by the guard at step 5" in log
