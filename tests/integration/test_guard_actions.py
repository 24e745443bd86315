"""The guard's actions on verl's real V1 trainer class (built from verl's config, no workers): escalate changes what
verl's trainer reads, the run state goes beside the checkpoint verl resumes from, and verl's own ``_load_checkpoint``
brings it back on a restart (rollback counts, escalations re-applied, the action records) but not during a rollback.

The only stand-in is the actor's Ray worker group (a run's remote actors), whose ``load_checkpoint`` is recorded."""

from __future__ import annotations

import json

import pytest
from omegaconf import open_dict
from testkit.guard import stable_trainer

from verl_stable.integration import guard_actions as GA
from verl_stable.monitor.run_summary import SUMMARY_FILE

KL = "stable/train_inf/kl_k3"
RULES = (
    "+stable.guard.rules.kl_escalate.condition=above",
    f"+stable.guard.rules.kl_escalate.metric={KL}",
    "+stable.guard.rules.kl_escalate.threshold=0.001",
    "+stable.guard.rules.kl_escalate.action=escalate",
    "+stable.guard.rules.kl_escalate.escalate_to.rollout_rs=token_k3",
    "+stable.guard.rules.kl_escalate.escalate_to.rollout_rs_threshold=0.01",
    "+stable.guard.rules.train_inference_kl.action=warn",  # a default rule on the same metric, only warning
)


def _trainer(root, *overrides):
    return stable_trainer(root, *RULES, *overrides)


def _checkpoint(root, step):
    (root / f"global_step_{step}").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text(str(step))


def test_escalate_changes_verls_rollout_correction_and_persists_beside_the_latest_checkpoint(tmp_path):
    trainer = _trainer(tmp_path)
    assert trainer.config.algorithm.rollout_correction.rollout_rs is None
    _checkpoint(tmp_path, 2)
    trainer.global_steps = 3
    verdicts = trainer._stable_state().step(3, None, {KL: 0.5})
    assert sorted(v.action for v in verdicts) == ["escalate", "warn"]
    trainer._stable_handle(verdicts, 3)
    corr = trainer.config.algorithm.rollout_correction
    assert (corr.rollout_rs, corr.rollout_rs_threshold) == ("token_k3", 0.01)  # what verl reads at the next step
    state = json.loads((tmp_path / "global_step_2" / GA.STATE_FILE).read_text())
    assert state["guard"] == {"rollbacks": {}, "escalations": {"kl_escalate": 3}}
    (escalated,) = [r for r in state["records"] if r["action"] == "escalate"]
    assert (
        escalated["detail"]
        == "algorithm.rollout_correction: rollout_rs: None -> 'token_k3'; rollout_rs_threshold: None -> 0.01"
    )
    assert trainer.total_training_steps == 10 and trainer._stable_trip == []  # no stop
    # the next firing only warns, and the summary counts both
    trainer._stable_handle(trainer._stable_state().step(4, None, {KL: 0.5}), 4)
    report = trainer._stable_write_summary()
    assert report["actions"] == {"escalate": 1, "warn": 3} and report["last_step"] == 4
    assert json.loads((tmp_path / SUMMARY_FILE).read_text()) == report


def test_a_restart_resumes_the_guard_state_through_verls_load_checkpoint(tmp_path):
    first = _trainer(tmp_path)
    _checkpoint(tmp_path, 2)
    first.global_steps = 3
    first._stable_handle(first._stable_state().step(3, None, {KL: 0.5}), 3)

    restarted = _trainer(tmp_path, "trainer.resume_mode=auto")
    assert restarted.config.algorithm.rollout_correction.rollout_rs is None  # a fresh config
    restarted._load_checkpoint()  # verl's resume: the latest checkpoint, then ours
    assert restarted.global_steps == 2 and restarted.actor_rollout_wg.loaded == [
        str(tmp_path / "global_step_2" / "actor")
    ]
    assert restarted._stable_monitor.guard.escalations == {"kl_escalate": 3}
    assert restarted.config.algorithm.rollout_correction.rollout_rs == "token_k3"  # re-escalated before any step
    assert [r["action"] for r in restarted._stable_records] == ["warn", "escalate"]  # step 3, in rule order
    (again,) = [v for v in restarted._stable_state().step(3, None, {KL: 0.5}) if v.rule == "kl_escalate"]
    assert again.action == "warn"  # once per run, across the restart


def test_a_rollback_does_not_restore_the_guard_state_it_counts(tmp_path):
    trainer = _trainer(tmp_path)
    _checkpoint(tmp_path, 1)
    (tmp_path / "global_step_1" / GA.STATE_FILE).write_text(
        json.dumps({"guard": {"rollbacks": {}, "escalations": {}}, "records": []})
    )
    guard = trainer._stable_state().guard
    guard.escalations["kl_escalate"] = 5  # the run's state now, newer than the checkpoint's
    trainer._stable_rolling_back = True
    try:
        with open_dict(trainer.config.trainer):
            trainer.config.trainer.resume_mode = "resume_path"
            trainer.config.trainer.resume_from_path = str(tmp_path / "global_step_1")
        trainer._load_checkpoint()
    finally:
        trainer._stable_rolling_back = False
    assert trainer.global_steps == 1 and guard.escalations == {"kl_escalate": 5}


def test_an_escalation_verl_would_refuse_fails_when_the_trainer_is_built(tmp_path):
    with pytest.raises(ValueError, match="verl's rollout correction refuses"):
        _trainer(tmp_path, "++stable.guard.rules.kl_escalate.escalate_to.rollout_rs_threshold=abc")


class _CheckpointManager:
    """Stands in for verl's checkpoint engine manager: records the weight syncs to the rollout."""

    def __init__(self) -> None:
        self.synced: list[int] = []

    def update_weights(self, global_steps):
        self.synced.append(global_steps)


@pytest.mark.parametrize(("rollback_data", "redone_on"), [("replay", [2, 3]), ("skip", [8, 9])])
def test_a_rollback_redoes_its_steps_on_the_checkpoints_batches_or_on_new_ones(tmp_path, rollback_data, redone_on):
    """Through verl's own _load_checkpoint and a real StatefulDataLoader: the run checkpointed after step 1, reached
    step 4 and fired; ``replay`` redoes step 2 on step 2's batch, ``skip`` on the batch after step 4's."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    rule = "+stable.guard.rules.entropy_blowup"
    trainer = _trainer(
        tmp_path,
        f"{rule}.condition=above",
        f"{rule}.metric=actor/entropy",
        f"{rule}.threshold=4.0",
        f"{rule}.action=rollback",
        f"{rule}.rollback_data={rollback_data}",
        "trainer.save_freq=1",  # a rollback needs checkpoints to go back to (refused without)
    )
    trainer.checkpoint_manager = _CheckpointManager()
    trainer.train_dataloader = StatefulDataLoader(list(range(20)), batch_size=2)
    batches = iter(trainer.train_dataloader)
    assert next(batches).tolist() == [0, 1]  # step 1, then its checkpoint
    _checkpoint(tmp_path, 1)
    (tmp_path / "global_step_1" / "actor").mkdir()
    (tmp_path / "global_step_1" / "actor" / "ckpt_contents.json").write_text("{}")  # a complete save (Megatron's mark)
    torch.save(trainer.train_dataloader.state_dict(), tmp_path / "global_step_1" / "data.pt")
    assert [next(batches).tolist() for _ in range(3)] == [[2, 3], [4, 5], [6, 7]]  # steps 2-4
    trainer.global_steps = 4
    verdicts = trainer._stable_state().step(4, None, {"actor/entropy": 6.8})
    trainer._stable_handle(verdicts, 4)
    (folder, to_step, _, skip) = trainer._stable_pending_rollback
    assert (folder, to_step, skip) == (str(tmp_path / "global_step_1"), 1, rollback_data == "skip")
    trainer._stable_rollback(*trainer._stable_pending_rollback)
    assert trainer.global_steps == 2 and trainer.checkpoint_manager.synced == [2]
    assert trainer.actor_rollout_wg.loaded == [str(tmp_path / "global_step_1" / "actor")]  # the weights: step 1's
    assert next(iter(trainer.train_dataloader)).tolist() == redone_on


def test_rollback_data_is_for_rollback_rules_only(tmp_path):
    with pytest.raises(ValueError, match="rollback_data 'skip' is for action 'rollback', not 'warn'"):
        _trainer(tmp_path, "+stable.guard.rules.train_inference_kl.rollback_data=skip")
    with pytest.raises(ValueError, match="rollback_data"):
        _trainer(tmp_path, "+stable.guard.rules.train_inference_kl.rollback_data=later")
