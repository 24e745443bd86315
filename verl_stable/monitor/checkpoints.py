"""Which checkpoint folders verl can resume from: what the guard may name as the last good checkpoint.

verl writes ``trainer.default_local_dir/global_step_<n>/`` with one folder per role (``actor/``, ``critic/``) in its
engine's checkpoint layout, and its rotation (``max_actor_ckpt_to_keep``) can remove a role's folder while the step's
folder stays. This module reads that layout from disk only (no verl import): :func:`checkpoint_problem` says why a
folder cannot be resumed from, :func:`resumable_checkpoint_steps` lists the ones that can.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence

__all__ = [
    "DEFAULT_LOAD_CONTENTS",
    "checkpoint_problem",
    "resumable_checkpoint_steps",
    "saved_checkpoint_steps",
]

_CKPT_DIR = re.compile(r"^global_step_(\d+)$")

DEFAULT_LOAD_CONTENTS = ("model", "optimizer", "extra")
"""verl's default ``actor.checkpoint.load_contents`` (``${.save_contents}``, whose default this is)."""
# the per-rank file of each content in verl's FSDPCheckpointManager: <prefix>_world_size_<w>_rank_<r>.pt
_FSDP_SHARD_PREFIX = {"model": "model", "optimizer": "optim", "extra": "extra_state"}


def saved_checkpoint_steps(default_local_dir: str) -> list[int]:
    """Steps of the ``global_step_<n>`` checkpoint folders verl wrote under ``trainer.default_local_dir``.

    A folder is listed whether or not it can still be resumed from (see :func:`resumable_checkpoint_steps`).
    """
    if not default_local_dir or not os.path.isdir(default_local_dir):
        return []
    steps = []
    for name in os.listdir(default_local_dir):
        match = _CKPT_DIR.match(name)
        if match and os.path.isdir(os.path.join(default_local_dir, name)):
            steps.append(int(match.group(1)))
    return sorted(steps)


def _engine_checkpoint_problem(path: str, contents: tuple[str, ...], rotation_key: str) -> str | None:
    """What keeps verl's checkpoint manager from loading the engine checkpoint ``path`` (``actor/``, ``critic/``)."""
    if not os.path.isdir(path):
        return f"{path} is missing (rotated away by {rotation_key}, or never saved)"
    # Megatron: rank 0 writes the manifest last, after every rank's (possibly asynchronous) writes; verl documents its
    # presence as the sign of a complete save, and rotation removes the whole folder with it
    if os.path.isfile(os.path.join(path, "ckpt_contents.json")):
        return None
    # FSDP (verl's FSDP and VeOmni engines): rank 0 writes fsdp_config.json with the world size, and the loader then
    # opens one file per rank for each content it loads; nothing marks a finished save, so the files themselves count
    config = os.path.join(path, "fsdp_config.json")
    if not os.path.isfile(config):
        return f"{path} has neither FSDP's fsdp_config.json nor Megatron's ckpt_contents.json: no complete save"
    try:
        with open(config) as f:
            world = json.load(f)["world_size"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{config} is unreadable ({type(exc).__name__}: {exc}); expected a JSON object with a world_size"
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        return f"{config}: world_size must be an integer >= 1, got {world!r}"
    for content in contents:
        prefix = _FSDP_SHARD_PREFIX.get(content)
        if prefix is None:  # e.g. hf_model: written for export, never read on resume
            continue
        missing = [
            rank
            for rank in range(world)
            if not os.path.isfile(os.path.join(path, f"{prefix}_world_size_{world}_rank_{rank}.pt"))
        ]
        if missing:
            ranks = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
            return f"{path} lacks the {content} shard of rank {ranks} (world size {world})"
    return None


def checkpoint_problem(
    path: str | os.PathLike, *, contents: Sequence[str] = DEFAULT_LOAD_CONTENTS, critic: bool = False
) -> str | None:
    """What keeps verl from resuming from the checkpoint folder ``path``; None when it can resume from it.

    verl's ``PPOTrainer._load_checkpoint`` reads the step from the folder name ``global_step_<n>``, then has the actor
    (and, in a run with a critic, the critic) load ``<path>/actor`` (``<path>/critic``) with its engine's checkpoint
    manager; ``data.pt`` (the dataloader) and ``transfer_queue/`` are optional there. verl's checkpoint rotation
    (``trainer.max_actor_ckpt_to_keep``, ``max_critic_ckpt_to_keep``) removes an older step's ``actor/`` (``critic/``)
    folder and leaves the rest, so a folder can outlive its weights. An engine folder counts when it is complete as
    its manager writes it: Megatron's ``ckpt_contents.json`` manifest, or FSDP's ``fsdp_config.json`` and, for every
    rank of the world size it records, the shard file of each content verl will load (``load_contents``). A layout of
    neither kind (e.g. TorchTitan's) is not recognised, so it is never named.

    Args:
        path: a ``global_step_<n>`` folder.
        contents: ``actor_rollout_ref.actor.checkpoint.load_contents`` of the run that would resume.
        critic: whether that run has a critic (verl's ``need_critic``).
    """
    path = os.fspath(path)
    if not _CKPT_DIR.match(os.path.basename(os.path.normpath(path))):
        return f"{path}: expected a folder named global_step_<n> (verl reads the step from the name)"
    roles = ("actor", "critic") if critic else ("actor",)
    for role in roles:
        problem = _engine_checkpoint_problem(os.path.join(path, role), tuple(contents), f"max_{role}_ckpt_to_keep")
        if problem is not None:
            return problem
    return None


def resumable_checkpoint_steps(
    default_local_dir: str, *, contents: Sequence[str] = DEFAULT_LOAD_CONTENTS, critic: bool = False
) -> list[int]:
    """Steps of the folders under ``default_local_dir`` that verl can resume from (:func:`checkpoint_problem`)."""
    return [
        step
        for step in saved_checkpoint_steps(default_local_dir)
        if checkpoint_problem(os.path.join(default_local_dir, f"global_step_{step}"), contents=contents, critic=critic)
        is None
    ]
