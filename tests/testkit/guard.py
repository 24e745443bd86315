"""A monitored trainer (verl's ``stable_sync`` class) built from verl's own config, without Ray or workers: what the
guard-action tests drive by hand."""

from __future__ import annotations

import os


class RecordingActorGroup:
    """Stands in for the run's actor worker group (remote Ray actors): records what verl asks it to load."""

    def __init__(self) -> None:
        self.loaded: list[str] = []

    def load_checkpoint(self, local_path, del_local_after_load=False):
        self.loaded.append(local_path)


def stable_trainer(root, *overrides):
    """verl's ``ppo_trainer`` config in ``stable_sync`` mode (GRPO: no critic), checkpoints under ``root``, with
    ``overrides``; 10 steps and a :class:`RecordingActorGroup` as the actor."""
    import verl
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.v1 import get_trainer_cls

    from verl_stable.integration import trainer as T

    T.register()
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(
            config_name="ppo_trainer",
            overrides=[
                "trainer.v1.trainer_mode=stable_sync",
                "algorithm.adv_estimator=grpo",  # no critic
                f"trainer.default_local_dir={root}",
                *overrides,
            ],
        )
    trainer = get_trainer_cls("stable_sync")(cfg)
    trainer.total_training_steps = 10
    trainer.actor_rollout_wg = RecordingActorGroup()
    return trainer
