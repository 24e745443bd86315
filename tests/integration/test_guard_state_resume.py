"""On a restart, verl's own ``_load_checkpoint`` (the real V1 trainer class, built from verl's config, no workers)
refuses a damaged guard state file beside the checkpoint, naming it, before any step: a negative rollback count
would otherwise give a rule more rollbacks than its ``max_rollbacks``, a truncated file ended the resume with a bare
``JSONDecodeError``. The only stand-in is the actor's Ray worker group, whose ``load_checkpoint`` is recorded."""

from __future__ import annotations

import json

import pytest
from testkit.guard import stable_trainer

from verl_stable.integration import guard_actions as GA
from verl_stable.monitor.guard_state import GuardStateError

RULES = (
    "+stable.guard.rules.entropy_blowup.condition=above",
    "+stable.guard.rules.entropy_blowup.metric=stable/entropy/mean",
    "+stable.guard.rules.entropy_blowup.threshold=5.0",
    "+stable.guard.rules.entropy_blowup.action=rollback",
    "+stable.guard.rules.entropy_blowup.max_rollbacks=1",
)


def _restarted_trainer(root):
    return stable_trainer(root, "trainer.resume_mode=auto", "trainer.save_freq=1", *RULES)  # save_freq: rollbacks


def _checkpoint_with_state(root, state) -> str:
    (root / "global_step_2").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("2")
    path = root / "global_step_2" / GA.STATE_FILE
    path.write_text(state if isinstance(state, str) else json.dumps(state))
    return str(path)


@pytest.mark.parametrize(
    ("state", "problem"),
    [
        ({"guard": {"rollbacks": {"entropy_blowup": -5}, "escalations": {}}, "records": []}, "is -5, not an integer"),
        ('{"guard": {"rollbacks": {"entropy_blowup": 1}, "escal', "not complete JSON"),
        ({"guard": {"rollback": {"entropy_blowup": 1}, "escalations": {}}, "records": []}, "'guard' has the keys"),
        ([], "holds a JSON list, not an object"),
    ],
    ids=["negative count", "truncated", "misspelt section", "wrong type"],
)
def test_a_restart_refuses_a_damaged_guard_state_naming_the_file(tmp_path, state, problem):
    path = _checkpoint_with_state(tmp_path, state)
    trainer = _restarted_trainer(tmp_path)
    with pytest.raises(GuardStateError, match=f"guard state file {path}: .*{problem}"):
        trainer._load_checkpoint()
    assert trainer._stable_monitor.guard.rollbacks == {}  # nothing of the damaged file was taken


def test_a_sound_guard_state_still_resumes(tmp_path):
    state = {"guard": {"rollbacks": {"entropy_blowup": 1}, "escalations": {}}, "records": []}
    _checkpoint_with_state(tmp_path, state)
    trainer = _restarted_trainer(tmp_path)
    trainer._load_checkpoint()
    assert trainer.global_steps == 2 and trainer._stable_monitor.guard.rollbacks == {"entropy_blowup": 1}
