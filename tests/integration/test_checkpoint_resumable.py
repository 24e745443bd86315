"""Which checkpoint the guard may name as "last good": only one verl can resume from.

The checkpoints are written by verl's own code: ``FSDPCheckpointManager.save_checkpoint`` (the manager of verl's FSDP
engine) on a tiny model in a one-rank gloo group, called as ``PPOTrainer._save_checkpoint`` calls it
(``global_step_<n>/actor``, then the dataloader's ``data.pt``), with verl's rotation
(``trainer.max_actor_ckpt_to_keep``): an older ``global_step_<n>/`` keeps ``data.pt`` but loses ``actor/``. Each
verdict of :func:`~verl_stable.monitor.checkpoints.checkpoint_problem` is checked against verl's own loader
(``FSDPCheckpointManager.load_checkpoint``) on the same folder. Megatron's layout needs Megatron-Core, which is not
installed here: its folders are laid out as verl's ``MegatronCheckpointManager.save_checkpoint`` documents (schema
v2, ``ckpt_contents.json`` written last).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

from verl_stable.integration import trainer as T
from verl_stable.monitor import checkpoints as CK

# verl's checkpoint manager reads the rank and world size of the default process group
pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/integration/conftest.py


def _manager(seed: int = 0) -> FSDPCheckpointManager:
    config = Qwen3MoeConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=16,
        moe_intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    return FSDPCheckpointManager(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))


def _save(manager: FSDPCheckpointManager, root: Path, step: int, keep: int | None) -> Path:
    """What ``PPOTrainer._save_checkpoint`` does for the actor: its engine's checkpoint, then ``data.pt``."""
    folder = root / f"global_step_{step}"
    manager.save_checkpoint(str(folder / "actor"), None, step, max_ckpt_to_keep=keep)
    torch.save({"epoch": 0, "step": step}, folder / "data.pt")
    return folder


def _verl_loads(folder: Path) -> bool:
    try:
        _manager(seed=1).load_checkpoint(str(folder / "actor"))
    except (FileNotFoundError, AssertionError):
        return False
    return True


@pytest.fixture(scope="module")
def rotated(tmp_path_factory) -> Path:
    """Three saves with ``max_actor_ckpt_to_keep=2``: verl removes step 1's ``actor/`` and keeps its ``data.pt``."""
    root = tmp_path_factory.mktemp("checkpoints")
    manager = _manager()
    for step in (1, 2, 3):
        _save(manager, root, step, keep=2)
    return root


def test_verls_rotation_leaves_a_folder_without_weights(rotated):
    assert sorted(p.name for p in (rotated / "global_step_1").iterdir()) == ["data.pt"]
    assert (rotated / "global_step_3" / "actor" / "model_world_size_1_rank_0.pt").is_file()


def test_only_checkpoints_verl_can_load_are_resumable(rotated):
    for step in (1, 2, 3):
        folder = rotated / f"global_step_{step}"
        problem = CK.checkpoint_problem(folder)
        assert (problem is None) == _verl_loads(folder), (step, problem)
    assert CK.checkpoint_problem(rotated / "global_step_1") == (
        f"{rotated / 'global_step_1' / 'actor'} is missing (rotated away by max_actor_ckpt_to_keep, or never saved)"
    )
    assert CK.saved_checkpoint_steps(str(rotated)) == [1, 2, 3]
    assert CK.resumable_checkpoint_steps(str(rotated)) == [2, 3]


@pytest.mark.parametrize(
    ("remove", "contents", "expected"),
    [
        ("optim_world_size_1_rank_0.pt", ("model", "optimizer", "extra"), "lacks the optimizer shard of rank 0"),
        ("optim_world_size_1_rank_0.pt", ("model", "extra"), None),  # load_contents without the optimizer
        ("model_world_size_1_rank_0.pt", ("model",), "lacks the model shard of rank 0"),
        ("extra_state_world_size_1_rank_0.pt", ("model", "optimizer", "extra"), "lacks the extra shard of rank 0"),
        ("fsdp_config.json", ("model", "optimizer", "extra"), "has neither FSDP's fsdp_config.json"),
    ],
)
def test_a_checkpoint_missing_a_file_verl_loads_is_not_resumable(tmp_path, remove, contents, expected):
    folder = _save(_manager(), tmp_path, 4, keep=None)
    (folder / "actor" / remove).unlink()
    problem = CK.checkpoint_problem(folder, contents=contents)
    if expected is None:
        assert problem is None
    else:
        assert expected in problem
        if remove != "fsdp_config.json":  # verl's loader does not read that file: it names the world size itself
            assert not _verl_loads(folder)


def test_a_run_with_a_critic_needs_the_critics_checkpoint_too(tmp_path):
    folder = _save(_manager(), tmp_path, 2, keep=None)
    assert CK.checkpoint_problem(folder) is None
    assert CK.checkpoint_problem(folder, critic=True) == (
        f"{folder / 'critic'} is missing (rotated away by max_critic_ckpt_to_keep, or never saved)"
    )
    _manager().save_checkpoint(str(folder / "critic"), None, 2)
    assert CK.checkpoint_problem(folder, critic=True) is None


def test_shards_of_every_rank_are_needed(tmp_path):
    folder = _save(_manager(), tmp_path, 2, keep=None)
    config = folder / "actor" / "fsdp_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "world_size": 2}))  # as saved by 2 ranks
    assert "lacks the model shard of rank 0, 1 (world size 2)" in CK.checkpoint_problem(folder)
    for rank in (0, 1):
        for content in ("model", "optim", "extra_state"):
            actor = folder / "actor"
            os.link(actor / f"{content}_world_size_1_rank_0.pt", actor / f"{content}_world_size_2_rank_{rank}.pt")
        if rank == 0:
            assert "lacks the model shard of rank 1 (world size 2)" in CK.checkpoint_problem(folder)
    assert CK.checkpoint_problem(folder) is None


def _megatron(folder: Path, manifest: bool = True) -> Path:
    """``global_step_<n>/actor`` as verl's MegatronCheckpointManager lays it out (schema v2)."""
    actor = folder / "actor"
    for sub in ("model/dist_ckpt", "optimizer/dist_ckpt", "extra/dist_ckpt", "model/huggingface"):
        (actor / sub).mkdir(parents=True)
        (actor / sub / "metadata.json").write_text("{}")
    (actor / "transformer_config.json").write_text("{}")
    if manifest:  # rank 0 writes it last: "its presence signals a fully-complete save"
        (actor / "ckpt_contents.json").write_text(
            json.dumps({"schema_version": 2, "framework": "megatron", "save_contents": ["model", "optimizer", "extra"]})
        )
    torch.save({}, folder / "data.pt")
    return folder


def test_megatron_checkpoints_are_resumable_once_their_manifest_is_written(tmp_path):
    assert CK.checkpoint_problem(_megatron(tmp_path / "global_step_3")) is None
    unfinished = _megatron(tmp_path / "global_step_4", manifest=False)  # an async save still running, or cut short
    assert "has neither FSDP's fsdp_config.json nor Megatron's ckpt_contents.json" in CK.checkpoint_problem(unfinished)


def test_a_folder_not_named_by_step_is_not_a_checkpoint(tmp_path):
    assert "expected a folder named global_step_<n>" in CK.checkpoint_problem(tmp_path / "latest")


def test_the_guard_names_the_last_resumable_checkpoint(rotated):
    """Step 1 would be the last good one by the metrics, but its weights were rotated away: none is named."""
    from verl_stable.monitor.guard import last_good_checkpoint_step

    steps = CK.resumable_checkpoint_steps(str(rotated))
    assert last_good_checkpoint_step(CK.saved_checkpoint_steps(str(rotated)), 4, {3}) == 1  # by the metrics alone
    assert last_good_checkpoint_step(steps, 4, {3}) is None
    assert last_good_checkpoint_step(steps, 5, {4}) == 2


@pytest.mark.parametrize(("keep", "named"), [(2, "global_step_4"), (1, None)])
def test_a_stopping_verdict_names_only_a_checkpoint_with_its_weights(tmp_path, keep, named):
    """The monitored trainer on verl's config: saves at steps 2, 4, 6, the guard trips at step 7 (step 6's weights
    made the tripping rollout). Step 4 is the last good one; with ``max_actor_ckpt_to_keep=1`` verl has removed its
    weights, so nothing may be named."""
    import verl
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.v1 import get_trainer_cls

    T.register()
    with initialize_config_dir(
        config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"), version_base=None
    ):
        cfg = compose(
            config_name="ppo_trainer",
            overrides=[
                "trainer.v1.trainer_mode=stable_sync",
                "algorithm.adv_estimator=grpo",  # no critic (verl's default, gae, has one: see the test above)
                f"trainer.default_local_dir={tmp_path}",
                f"trainer.max_actor_ckpt_to_keep={keep}",
            ],
        )
    trainer = get_trainer_cls("stable_sync")(cfg)
    trainer.global_steps, trainer.total_training_steps = 7, 100
    manager = _manager()
    for step in (2, 4, 6):
        _save(manager, tmp_path, step, keep=cfg.trainer.max_actor_ckpt_to_keep)
    verdicts = trainer._stable_state().step(7, None, {"actor/grad_norm": float("inf")})
    trainer._stable_handle(verdicts, 7)
    (trip,) = trainer._stable_trip
    assert trip.last_good_checkpoint == (None if named is None else str(tmp_path / named))
