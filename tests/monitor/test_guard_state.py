"""The guard's state file beside a checkpoint (``verl_stable_guard.json``) is read strictly on resume: a truncated
file, a wrong type or a negative count is refused naming the file, never read as a bigger budget (before, a negative
rollback count gave a rule more rollbacks than ``max_rollbacks``, and a misspelt section read as no rollbacks yet)."""

from __future__ import annotations

import json

import pytest

from verl_stable.monitor.guard_state import EXPECTED, GuardStateError, read_guard_state

GOOD = {
    "guard": {"rollbacks": {"entropy_blowup": 1}, "escalations": {"kl_escalate": 3}},
    "records": [{"step": 3, "rule": "kl_escalate", "action": "escalate", "message": "m", "detail": "d"}],
}


def _write(tmp_path, content) -> str:
    path = tmp_path / "verl_stable_guard.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def test_the_file_the_trainer_writes_reads_back(tmp_path):
    assert read_guard_state(_write(tmp_path, GOOD)) == GOOD
    empty = {"guard": {"rollbacks": {}, "escalations": {}}, "records": []}
    assert read_guard_state(_write(tmp_path, empty)) == empty


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (json.dumps(GOOD)[:40], "not complete JSON (Unterminated string"),
        ("", "not complete JSON (Expecting value: line 1 column 1"),
        (json.dumps(GOOD).replace('"entropy_blowup": 1', '"entropy_blowup": NaN'), "not complete JSON (NaN is not a"),
        ([GOOD], "holds a JSON list, not an object"),
        ({"guard": GOOD["guard"]}, "has the keys ['guard'], not ['guard', 'records']"),
        ({**GOOD, "guard": [1]}, "'guard' is a JSON list, not an object"),
        (
            {**GOOD, "guard": {"rollback": {"entropy_blowup": 1}, "escalations": {}}},
            "'guard' has the keys ['escalations', 'rollback'], not ['rollbacks', 'escalations']",
        ),
        ({**GOOD, "guard": {"rollbacks": [1], "escalations": {}}}, "'guard.rollbacks' is a JSON list, not an object"),
        (
            {**GOOD, "guard": {"rollbacks": {"entropy_blowup": -5}, "escalations": {}}},
            "'guard.rollbacks.entropy_blowup' is -5, not an integer >= 0",
        ),
        (
            {**GOOD, "guard": {"rollbacks": {"entropy_blowup": 0.5}, "escalations": {}}},
            "'guard.rollbacks.entropy_blowup' is 0.5, not an integer >= 0",
        ),
        (
            {**GOOD, "guard": {"rollbacks": {"entropy_blowup": "1"}, "escalations": {}}},
            "'guard.rollbacks.entropy_blowup' is '1', not an integer >= 0",
        ),
        (
            {**GOOD, "guard": {"rollbacks": {}, "escalations": {"kl_escalate": True}}},
            "'guard.escalations.kl_escalate' is True, not an integer >= 0",
        ),
        ({**GOOD, "records": {"step": 1}}, "'records': guard action records must be a list, got dict"),
        ({**GOOD, "records": [{"step": 1}]}, "'records': a guard action record needs the keys"),
        ({**GOOD, "records": [{**GOOD["records"][0], "step": "three"}]}, "'records': invalid literal for int()"),
    ],
)
def test_a_damaged_file_is_refused_naming_it(tmp_path, content, problem):
    path = _write(tmp_path, content)
    with pytest.raises(GuardStateError) as info:
        read_guard_state(path)
    message = str(info.value)
    assert message.startswith(f"guard state file {path}: {problem}") and message.endswith(f"; expected {EXPECTED}")


def test_a_file_that_cannot_be_read_is_refused_naming_it(tmp_path):
    (tmp_path / "verl_stable_guard.json").mkdir()
    with pytest.raises(GuardStateError, match=r"guard state file .*verl_stable_guard.json: cannot be read"):
        read_guard_state(tmp_path / "verl_stable_guard.json")
    (tmp_path / "bin.json").write_bytes(b'{"guard": "\xff"}')
    with pytest.raises(GuardStateError, match=r"bin.json: cannot be read \('utf-8' codec"):
        read_guard_state(tmp_path / "bin.json")
