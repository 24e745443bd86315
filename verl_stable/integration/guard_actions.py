"""What the guard's verdicts do to a running verl V1 trainer: stop, roll back, escalate, and the record of it.

:class:`GuardActionsMixin` is a base of :class:`~verl_stable.integration.trainer.StabilityMonitorMixin`; it carries
out the verdicts the monitor returns at each step (:meth:`GuardActionsMixin._stable_handle`):

* ``stop`` / ``stop_checkpoint``: the loop ends after the step is logged, ``fit`` raises ``GuardTripped``;
* ``rollback``: at the start of the next step verl's own ``_load_checkpoint`` restores the last good checkpoint
  (weights, optimizer, LR schedule, data position) as a resume from it would, and the loop continues after it;
* ``escalate``: the trainer's ``algorithm.rollout_correction`` takes the rule's ``escalate_to`` values
  (:mod:`verl_stable.integration.escalation`), read by verl from the next step on;
* ``skip_update`` is decided before the update (``StabilityMonitorMixin._update_actor``) and only recorded here.

Every action is recorded (:mod:`verl_stable.monitor.run_summary`). The guard's run state (rollbacks per rule,
escalations) and the records are written beside verl's checkpoint (``global_step_<n>/verl_stable_guard.json``) when
verl saves one and again whenever the guard acts (into the checkpoint verl would resume from), and read back when
verl resumes from that folder: ``max_rollbacks`` holds per run across restarts and an escalated run stays escalated.
At the end of ``fit`` the summary goes to the log and to ``trainer.default_local_dir/verl_stable_summary.json``.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from verl_stable.integration import escalation
from verl_stable.monitor.checkpoints import DEFAULT_LOAD_CONTENTS, resumable_checkpoint_steps
from verl_stable.monitor.guard import Rule, Verdict, last_good_checkpoint_step
from verl_stable.monitor.guard_state import read_guard_state
from verl_stable.monitor.run_summary import SUMMARY_FILE, action_record, summary, summary_text

logger = logging.getLogger("verl_stable")

STATE_FILE = "verl_stable_guard.json"
"""The guard's run state and action records, beside each verl checkpoint (``global_step_<n>/``)."""


class GuardActionsMixin:
    """Carries out the guard's verdicts in a verl V1 ``PPOTrainer`` (see the module docstring)."""

    def _stable_check_actions(self) -> None:
        """Refuse, before any worker starts, settings this run could not act on: the cross-field rules preflight
        and verl's ``validate_config`` in the driver also apply (:mod:`verl_stable.recipes.cross_checks`: rules on
        metrics never logged, actions this trainer cannot carry out, ...), and every escalation verl would refuse."""
        from verl_stable.recipes.cross_checks import cross_field_problems

        problems = cross_field_problems(self.config)
        if problems:
            raise ValueError("; ".join(problems))
        guard = self._stable_monitor.guard
        for rule in guard.rules if guard is not None else ():
            if rule.action == "escalate":
                escalation.check(self.config, rule.escalate_to, f"stable.guard.rules.{rule.name}")

    @property
    def _stable_records(self) -> list[dict[str, Any]]:
        records = getattr(self, "_stable_action_records", None)
        if records is None:
            records = self._stable_action_records = []
        return records

    def _stable_handle(self, verdicts: list[Verdict], step: int) -> None:
        """Warn, record, escalate now, roll back at the next step's start, or end the loop after this step is logged
        (``fit`` then raises :class:`~verl_stable.monitor.guard.GuardTripped`)."""
        self._stable_last_step = step
        stopping = []
        rollback = None
        for verdict in verdicts:
            detail = ""
            if verdict.rolls_back:
                verdict = self._stable_with_checkpoint(verdict, step)
                reason = None
                if stopping or rollback is not None:
                    reason = "another rule already acted on this step"
                elif verdict.last_good_checkpoint is None:
                    reason = "no resumable checkpoint before the trip that no rule flagged"
                elif self.global_steps >= self.total_training_steps:
                    reason = "the last step: verl's loop ends after it"
                if reason is not None:
                    verdict = self._stable_monitor.guard.escalate(verdict, reason)
                else:
                    rollback = verdict  # describe() names the checkpoint
            if verdict.escalates:
                detail = self._stable_escalate(verdict)
            if verdict.action == "stop_checkpoint":
                verdict = self._stable_with_checkpoint(verdict, step)
            if verdict.stops:
                stopping.append(verdict)
            logger.warning("verl-stable guard [%s -> %s] %s", verdict.rule, verdict.action, verdict.describe())
            self._stable_records.append(action_record(step, verdict.rule, verdict.action, verdict.describe(), detail))
        if rollback is not None and not stopping:  # a stop on the same step wins
            to_step = int(os.path.basename(rollback.last_good_checkpoint).removeprefix("global_step_"))
            # verl decides "last step" before calling step(): keep it false for the step that is redone instead
            self._stable_pending_rollback = (
                rollback.last_good_checkpoint,
                to_step,
                self.total_training_steps,
                self._stable_rule(rollback.rule).rollback_data == "skip",
            )
            self.total_training_steps += step - to_step
        if stopping:
            self._stable_trip = stopping
            # verl's loop runs while global_steps <= total_training_steps and increments after logging: this
            # ends it at the loop condition, after this step's metrics are logged, with no further checkpoint.
            self.total_training_steps = min(self.total_training_steps, self.global_steps)
        if verdicts:
            self._stable_persist()

    def _stable_rule(self, name: str) -> Rule:
        """The guard's rule called ``name`` (a verdict names the rule that fired it)."""
        return next(r for r in self._stable_monitor.guard.rules if r.name == name)

    def _stable_escalate(self, verdict: Verdict) -> str:
        """Apply the firing rule's ``escalate_to`` to the trainer's config; what changed, as one line."""
        changes = escalation.apply(self.config, self._stable_rule(verdict.rule).escalate_to)
        detail = f"{escalation.SECTION}: " + ("; ".join(changes) if changes else "no change, already in force")
        logger.warning("verl-stable guard: escalated at step %d, %s", verdict.step, detail)
        return detail

    def _stable_with_checkpoint(self, verdict: Verdict, step: int) -> Verdict:
        root = self.config.trainer.default_local_dir
        # only a folder verl can resume from: rotation leaves older folders without their weights
        checkpoint = self.config.actor_rollout_ref.actor.get("checkpoint") or {}
        contents = tuple(checkpoint.get("load_contents") or DEFAULT_LOAD_CONTENTS)
        resumable = resumable_checkpoint_steps(root, contents=contents, critic=bool(getattr(self, "use_critic", False)))
        good = last_good_checkpoint_step(resumable, step, self._stable_monitor.guard.flagged_steps)
        path = None if good is None else os.path.join(root, f"global_step_{good}")
        return Verdict(verdict.rule, verdict.action, verdict.step, verdict.values, verdict.message, path)

    def _stable_rollback(self, folder: str, to_step: int, total_training_steps: int, skip_data: bool = False) -> None:
        """Go back to the checkpoint ``folder`` (of step ``to_step``) and continue with step ``to_step + 1``.

        verl's ``_load_checkpoint`` does the restoring, as for a resume from that folder: actor (and critic) weights,
        optimizer and LR scheduler, the dataloader's position. With ``skip_data`` (a rule's ``rollback_data:
        skip``) the dataloader then takes back the position it had reached before the rollback, so the redone steps
        train on the batches after the abandoned ones. Then the dataloader's iterator is rebuilt from its
        position, the rollout receives the restored weights (as the sync trainer does after loading at start-up), the
        resume pointer verl writes (``latest_checkpointed_iteration.txt``) is set back to ``to_step`` so an automatic
        resume after a crash also starts from the good checkpoint (with this run's guard state), and the monitor
        forgets the abandoned steps. The guard's own state is not restored from the folder: the rollback counts.
        """
        from omegaconf import open_dict
        from verl.utils.checkpoint.checkpoint_manager import get_checkpoint_tracker_filename
        from verl.utils.skip import SkipManager

        trainer_config = self.config.trainer
        keys = ("resume_mode", "resume_from_path", "del_local_ckpt_after_load")
        saved = {key: trainer_config.get(key) for key in keys}
        with open_dict(trainer_config):
            # a rollback keeps the checkpoint it loads: a later rollback (max_rollbacks > 1) may need it again
            trainer_config.update(resume_mode="resume_path", resume_from_path=folder, del_local_ckpt_after_load=False)
        # the position the abandoned steps reached (torchdata's StatefulDataLoader, as verl's checkpoint saves it)
        reached = self.train_dataloader.state_dict() if skip_data else None
        self._stable_rolling_back = True
        try:
            self._load_checkpoint()
            if reached is not None:
                self.train_dataloader.load_state_dict(reached)
        finally:
            self._stable_rolling_back = False
            with open_dict(trainer_config):
                trainer_config.update(saved)
        if self.global_steps != to_step:
            raise RuntimeError(f"rollback to {folder}: verl resumed at step {self.global_steps}, expected {to_step}")
        self.train_dataloader_it = None
        self.global_steps = to_step + 1
        self.total_training_steps = total_training_steps
        SkipManager.set_step(self.global_steps)
        self.checkpoint_manager.update_weights(self.global_steps)
        root = trainer_config.default_local_dir
        with open(get_checkpoint_tracker_filename(root), "w") as f:
            f.write(str(to_step))
        self._stable_monitor.rolled_back(to_step)
        self._stable_persist()
        logger.warning(
            "verl-stable guard: rolled back to %s; continuing at step %d on %s",
            folder,
            self.global_steps,
            "the batches after the abandoned steps' (rollback_data: skip)" if skip_data else "the checkpoint's batches",
        )

    # ------------------------------------------------------------------------------------------------ run state
    def _stable_state_path(self, step: int | None = None) -> str | None:
        """The state file in the folder of checkpoint ``step`` (default: the one verl's resume pointer names)."""
        root = self.config.trainer.default_local_dir
        if step is None:
            from verl.utils.checkpoint.checkpoint_manager import get_checkpoint_tracker_filename

            try:
                with open(get_checkpoint_tracker_filename(root)) as f:
                    step = int(f.read().strip())
            except (OSError, ValueError):
                return None
        folder = os.path.join(root, f"global_step_{step}")
        return os.path.join(folder, STATE_FILE) if os.path.isdir(folder) else None

    def _stable_persist(self, step: int | None = None) -> None:
        """Write the guard's run state and the action records into a checkpoint folder (atomically)."""
        guard = self._stable_monitor.guard
        path = self._stable_state_path(step)
        if guard is None or path is None:
            return
        state = {"guard": guard.state_dict(), "records": self._stable_records}
        with open(f"{path}.tmp", "w") as f:
            json.dump(state, f, indent=1)
        os.replace(f"{path}.tmp", path)

    def _save_checkpoint(self):
        """verl's checkpoint, plus the guard's run state beside it."""
        result = super()._save_checkpoint()
        self._stable_persist(self.global_steps)
        return result

    def _load_checkpoint(self):
        """verl's resume; then, unless a rollback is loading, the guard's run state saved with that checkpoint: the
        rollbacks counted so far, the escalations (re-applied to the config) and the action records.

        Raises:
            GuardStateError: the state file is there but damaged (:func:`verl_stable.monitor.guard_state
                .read_guard_state`: truncated, a wrong type, a negative count), naming it.
        """
        result = super()._load_checkpoint()
        if getattr(self, "_stable_rolling_back", False) or not self.global_steps:
            return result
        guard = self._stable_state().guard
        trainer_config = self.config.trainer
        if trainer_config.resume_mode == "resume_path":
            folder = str(trainer_config.resume_from_path)
        else:
            folder = os.path.join(trainer_config.default_local_dir, f"global_step_{self.global_steps}")
        path = os.path.join(folder, STATE_FILE)
        if guard is None or not os.path.lexists(path):
            return result
        state = read_guard_state(path)  # a damaged file is refused, naming it: never read as a bigger budget
        guard.load_state_dict(state["guard"])
        self._stable_action_records = state["records"]
        for rule in guard.rules:
            if rule.action == "escalate" and rule.name in guard.escalations:
                changes = escalation.apply(self.config, rule.escalate_to)
                logger.warning(
                    "verl-stable guard: resumed escalated (rule %s, step %d): %s",
                    rule.name,
                    guard.escalations[rule.name],
                    "; ".join(changes) or "no change",
                )
        logger.warning("verl-stable guard: state restored from %s (%s)", path, guard.state_dict())
        return result

    def _stable_write_summary(self) -> dict[str, Any]:
        """The run summary: to the log and to ``trainer.default_local_dir/verl_stable_summary.json``."""
        trip = getattr(self, "_stable_trip", None)
        stopped = "; ".join(f"[{v.rule}] {v.describe()}" for v in trip) if trip else None
        report = summary(self._stable_records, getattr(self, "_stable_last_step", 0), stopped)
        logger.warning("%s", summary_text(report))
        root = self.config.trainer.default_local_dir
        if root:
            os.makedirs(root, exist_ok=True)
            with open(os.path.join(root, SUMMARY_FILE), "w") as f:
                json.dump(report, f, indent=1)
        return report
