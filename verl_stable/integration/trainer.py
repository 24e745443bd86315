"""Stability monitor and guard inside verl's V1 trainer, as registered trainers: the hooks and their registration.

verl 0.9.1's ``main_ppo`` runs the V1 trainer by default (``trainer.use_v1: true``): ``TaskRunnerV1`` builds
``get_trainer_cls(trainer.v1.trainer_mode)`` from verl's public ``register_trainer`` registry. This module registers
one monitored trainer per built-in mode, so a recipe opts in with a single key::

    trainer.v1.trainer_mode: stable_sync        # or stable_colocate_async / stable_separate_async

It owns the trainer side: :class:`StabilityMonitorMixin` (verl's hooks, the fetch from TransferQueue, the tap on the
update output, the guard's exit path) and the registration of the classes. What the monitor computes per step, and
the ``stable`` config block, live in :mod:`verl_stable.monitor.step` (re-exported here).

Each class is ``StabilityMonitorMixin`` + verl's own trainer for that mode, built and registered when verl first
imports ``verl.trainer.ppo.v1`` (in the task runner, through
:func:`~verl_stable.compat.import_hooks.when_imported`), so the plugin does not import verl's trainer stack and
engines in every process. Everywhere verl branches on ``self.trainer_mode`` (replay buffer kind, checkpointing of
TransferQueue state, refill policy), the class answers the base mode (``sync`` ...), and reads its per-mode options
from ``trainer.v1.<base mode>``; the registered name only selects the class.

The hook is ``PPOTrainer._compute_metrics``: it runs once per step after the update and checkpoint, while the
step's samples are still in TransferQueue and before ``self.logger.log(metrics)``. There the mixin reads the
batch fields verl already has (``old_log_probs``, ``rollout_log_probs``, ``entropy``, ``rollout_is_weights``,
``loss_mask`` / ``response_mask``, ``routed_experts``) in the same TransferQueue request as verl's own metric fields
(:mod:`verl_stable.integration.metrics_read`), adds the ``stable/`` metrics of
:mod:`verl_stable.monitor.metrics` to the step's dict -- so verl's own tracking logs them -- and feeds the dict to
the :class:`~verl_stable.monitor.guard.Guard`. A stopping verdict ends the run through verl's exit path: the step is
logged, the training loop ends at its loop condition (no further step, no further checkpoint), ``on_train_end`` runs,
and ``fit`` raises :class:`~verl_stable.monitor.guard.GuardTripped` -- so ``TaskRunnerV1.run`` closes tracking with
exit code 1 and TransferQueue, and ``main_ppo`` exits non-zero with the verdict as the error message.
``PPOTrainer._update_actor`` is tapped for verl's unreduced per-mini-step metrics
(:func:`~verl_stable.monitor.update_metrics.per_update_metrics`).

What each verdict does (stop, roll back, escalate, the records and the run summary) is
:mod:`verl_stable.integration.guard_actions`, a base of the mixin. A ``rollback`` verdict is carried out at the start
of the next step: verl's own ``_load_checkpoint`` restores the last good checkpoint's weights, optimizer, LR schedule
and data position exactly as a resume from it would, the rollout gets the restored weights, and the loop continues at
the step after the checkpoint, so the redone steps carry the numbers (and sampling seeds) a plain resume gives them.
Only the ``sync`` base mode rolls back (the async modes keep samples of the abandoned weights in flight).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import numpy as np

from verl_stable.compat.import_hooks import when_imported
from verl_stable.integration.guard_actions import GuardActionsMixin
from verl_stable.integration.metrics_read import MonitorRead, joint_metrics_read
from verl_stable.monitor.guard import GuardTripped, Verdict
from verl_stable.monitor.step import (
    ROLLOUT_ROUTING_FIELD,
    TOKEN_FIELDS,
    MonitorBatch,
    StableConfig,
    StepMonitor,
)
from verl_stable.monitor.update_metrics import coverage_totals, per_update_metrics

__all__ = [
    # the registered classes are module attributes too, built on first access
    "BASE_TRAINERS",
    "CLASS_NAMES",
    "V1_MODULE",
    "StabilityMonitorMixin",
    "register",
    "stable_trainer_classes",
]

logger = logging.getLogger("verl_stable")


class _UpdateOutputTap:
    """Stands in for the actor worker group during one ``_update_actor`` call and keeps verl's raw update metrics.

    Every attribute but ``update_actor`` is the worker group's own.
    """

    def __init__(self, worker_group: Any) -> None:
        self.worker_group = worker_group
        self.raw: dict[str, Any] | None = None

    def update_actor(self, *args: Any, **kwargs: Any) -> Any:
        output = self.worker_group.update_actor(*args, **kwargs)
        metrics = output["metrics"]
        # verl reduces a renamed copy; snapshot the lists anyway, so nothing downstream can change what we read
        self.raw = {k: list(v) if isinstance(v, list) else v for k, v in metrics.items()}
        return output

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker_group, name)


class StabilityMonitorMixin(GuardActionsMixin):
    """Adds the monitor and guard to a verl V1 ``PPOTrainer`` subclass (put it first in the bases)."""

    _stable_base_mode: str = "sync"

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self._stable_state()  # parse the ``stable`` block now: a config error fails before any worker starts
        self._stable_check_actions()

    # patch: base_trainer_mode (verl_stable.compat.catalogue)
    @property
    def trainer_mode(self) -> str:
        """verl branches on this: answer the base mode, whatever name selected the class."""
        return self._stable_base_mode

    @trainer_mode.setter
    def trainer_mode(self, value: str) -> None:
        self._stable_registered_mode = value

    def _stable_state(self) -> StepMonitor:
        monitor = getattr(self, "_stable_monitor", None)
        if monitor is None:
            corr = self.config.algorithm.get("rollout_correction", None)
            token_level = corr is None or corr.get("rollout_is", None) in (None, "token")
            bypass = corr is not None and bool(corr.get("bypass_mode", False))
            monitor = StepMonitor(
                StableConfig.from_trainer_config(self.config), token_level_is=token_level, pi_old_is_rollout=bypass
            )
            self._stable_monitor = monitor
            self._stable_trip: list[Verdict] = []
        return monitor

    def _stable_compact_layout(self) -> Any:
        """The routing layout when the rollout stores compact routing (:mod:`verl_stable.integration.rollout`).

        ``None`` when verl's own agent-loop manager runs (TransferQueue then holds verl's ``routed_experts``).
        """
        if not hasattr(self, "_stable_layout"):
            from verl_stable.transport.options import uses_compact_routing

            layout = None
            if uses_compact_routing(self.config):
                from transformers import AutoConfig

                from verl_stable.routing.families import layout_from_config

                model = self.config.actor_rollout_ref.model
                hf_config = AutoConfig.from_pretrained(
                    model.path, trust_remote_code=bool(model.get("trust_remote_code", False))
                )
                layout = layout_from_config(hf_config)
            self._stable_layout = layout
        return self._stable_layout

    def _stable_read_fields(self, step: int, monitor: StepMonitor) -> tuple[list[str], Any, bool]:
        """The fields the monitor reads at ``step``: ``(fields, compact layout or None, with transport counters)``."""
        from verl_stable.transport.boundary import BOUNDARY_FIELD
        from verl_stable.transport.fields import IDS_FIELD, SPAN_FIELD
        from verl_stable.transport.options import RolloutRoutingOptions
        from verl_stable.transport.sharing import PROMPT_REF_FIELD

        select = list(TOKEN_FIELDS)
        train_field = monitor.config.monitor.train_routing_field
        layout = None
        if monitor.wants_routing(step):
            layout = self._stable_compact_layout()
            # compact rollout routing is expanded here, on the driver, only for the steps that log routing metrics
            select += ["input_ids", IDS_FIELD, SPAN_FIELD] if layout is not None else [ROLLOUT_ROUTING_FIELD]
            if layout is not None and RolloutRoutingOptions.from_config(self.config).share_prompt_rows:
                select.append(PROMPT_REF_FIELD)  # expand_compact_routing re-attaches the group's prompt rows
            if train_field:
                select.append(train_field)
        counters = self._stable_compact_layout() is not None
        return select + [BOUNDARY_FIELD] * counters, layout, counters

    def _stable_fetch(
        self, batch, step: int, monitor: StepMonitor, data: Any = None, fields: tuple | None = None
    ) -> tuple[MonitorBatch, dict]:
        """The step's monitor inputs and, with the compact transport, its transport metrics.

        ``data``: the ``fields`` (:meth:`_stable_read_fields`'s answer for ``step``, computed here when None) already
        read with verl's metric fields (:func:`~verl_stable.integration.metrics_read.joint_metrics_read`); ``None``:
        one TransferQueue read here.
        The per-sample boundary counters (:data:`~verl_stable.transport.boundary.BOUNDARY_FIELD`) come with the
        token fields; a batch without them (routing export off) is read again without, and has no transport metrics.
        """
        import transfer_queue as tq

        from verl_stable.transport.boundary import BOUNDARY_FIELD, transport_metrics
        from verl_stable.transport.expansion import expand_compact_routing

        select, layout, counters = fields if fields is not None else self._stable_read_fields(step, monitor)
        select = list(select)
        if data is None:
            try:
                data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=select)
            except ValueError as exc:  # TransferQueue refuses a field no sample has (routing export off)
                if not counters or BOUNDARY_FIELD not in str(exc):
                    raise
                counters = False
                select.remove(BOUNDARY_FIELD)
                data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=select)
        if layout is not None:
            expand_compact_routing(data, layout)
        keep = np.array([not tag.get("is_padding", False) for tag in batch.tags], dtype=bool)
        keep = keep if keep.any() else None
        transport = transport_metrics(data[BOUNDARY_FIELD], keep) if counters else {}
        return MonitorBatch.from_tensordict(data, keep, monitor.config.monitor.train_routing_field), transport

    def _stable_clear_prompt_rows(self) -> None:
        """Clear every stale side entry (the shared prompt rows of groups verl has finished with) after training.

        While training, the agent-loop workers that put side entries sweep them at each dispatch, alongside the
        rollout (:class:`~verl_stable.integration.rollout.CompactRoutingAgentLoopWorkerTQ`); a sweep here at each
        step start, on the step's critical path, would repeat theirs. verl's last step has no dispatch after it.
        """
        if self._stable_compact_layout() is None:
            return
        from verl_stable.transport.options import RolloutRoutingOptions
        from verl_stable.transport.side_rows import clear_stale_prompt_rows

        if RolloutRoutingOptions.from_config(self.config).share_prompt_rows:
            clear_stale_prompt_rows()

    def step(self, metrics, timing_raw):
        """verl's step; numbers the update mini-steps of this logged step from 0 and restarts the coverage sums.

        A rollback the guard asked for at the previous step is carried out first (:meth:`_stable_rollback`)."""
        pending = getattr(self, "_stable_pending_rollback", None)
        if pending is not None:
            self._stable_pending_rollback = None
            self._stable_rollback(*pending)
        self._stable_updates_in_step = 0
        self._stable_coverage: dict[str, float] = {}
        return super().step(metrics, timing_raw)

    def _stable_mark_replay_metrics(self, batch) -> None:
        """Tell the actor whether this step's passes measure their routing-replay metrics
        (``stable.monitor.replay_metrics_interval``; :data:`~verl_stable.integration.megatron_replay.REPLAY_METRICS_FLAG`,
        which verl hands the engine with the batch's other ``extra_info``)."""
        from verl_stable.integration.megatron_replay import REPLAY_METRICS_FLAG

        batch.extra_info[REPLAY_METRICS_FLAG] = self._stable_state().wants_replay_metrics(self.global_steps)

    def _compute_old_log_prob(self, batch, metrics):
        self._stable_mark_replay_metrics(batch)
        return super()._compute_old_log_prob(batch, metrics)

    def _compute_ref_log_prob(self, batch, metrics):
        self._stable_mark_replay_metrics(batch)
        return super()._compute_ref_log_prob(batch, metrics)

    def _update_actor(self, batch, metrics):
        """verl's actor update, plus from its unreduced output the replay-coverage totals (:func:`coverage_totals`)
        and the per-mini-step metrics (:func:`per_update_metrics`).

        With a ``skip_update`` rule, the guard first judges what is known before the update (the rollout's and
        pi_old's log-probs, routing, verl's rollout-correction metrics); when it fires, the update is not applied:
        weights and optimizer state stay as they are, and the rollout's next weight sync sends them unchanged.
        """
        monitor = self._stable_state()
        self._stable_mark_replay_metrics(batch)
        if monitor.skips_updates:
            fetched, known = None, dict(metrics)
            if monitor.config.monitor.enable:
                fetched, transport = self._stable_fetch(batch, self.global_steps, monitor)
                known.update(transport)
                # the same samples' fields do not change in the update: _compute_metrics reuses this read
                self._stable_prefetched = (self.global_steps, list(batch.keys), fetched, transport)
            if monitor.before_update(self.global_steps, fetched, known):
                return batch  # skip_update (or a skip escalated to a stop): verl's update is not applied
        tap = _UpdateOutputTap(self.actor_rollout_wg)
        # patch: update_output_tap (verl_stable.compat.catalogue)
        self.actor_rollout_wg = tap
        try:
            result = super()._update_actor(batch, metrics)
        finally:
            self.actor_rollout_wg = tap.worker_group
        if tap.raw is None:
            return result
        # summed over the local updates of a step: verl's MetricsAggregator would average them by sample count
        totals = getattr(self, "_stable_coverage", None)
        if totals is None:
            totals = self._stable_coverage = {}
        try:
            coverage = coverage_totals(tap.raw)
        except ValueError as exc:  # verl changed its layout: keep training, say so once
            monitor._warn_once("coverage_totals", f"no replay-coverage totals: {exc}")
            coverage = {}
        for key, value in coverage.items():
            totals[key] = totals.get(key, 0.0) + value
        if monitor.config.monitor.enable and monitor.config.monitor.per_update:
            first = getattr(self, "_stable_updates_in_step", 0)
            try:
                per_update, count = per_update_metrics(tap.raw, first)
            except ValueError as exc:  # verl changed its layout: keep training, say so once
                monitor._warn_once("per_update", f"no per-update metrics: {exc}")
            else:
                metrics.update(per_update)
                self._stable_updates_in_step = first + count
        return result

    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        monitor = self._stable_state()
        fetched = None
        prefetched, self._stable_prefetched = getattr(self, "_stable_prefetched", None), None
        if prefetched is not None and prefetched[:2] != (global_steps, list(batch.keys)):
            prefetched = None  # a step of several sub-batches: each is judged on its own read
        read = fields = None
        if monitor.config.monitor.enable and prefetched is None:
            fields = self._stable_read_fields(global_steps, monitor)
            read = MonitorRead(keys=list(batch.keys), partition_id=batch.partition_id, fields=fields[0])
        with joint_metrics_read(read):  # verl's read of its metric fields brings the monitor's along
            super()._compute_metrics(batch, metrics, timing_raw, global_steps=global_steps, epoch=epoch)
        if monitor.config.monitor.enable:
            if prefetched is not None:  # a skip rule judged this step before the update, on the same samples
                fetched, transport = prefetched[2:]
            else:
                fetched, transport = self._stable_fetch(batch, global_steps, monitor, data=read.data, fields=fields)
            metrics.update(transport)
        verdicts = monitor.step(global_steps, fetched, metrics, coverage=getattr(self, "_stable_coverage", None))
        self._stable_coverage = {}
        self._stable_handle(verdicts, global_steps)

    def _build_replay_buffer(self):
        """verl's replay buffer; under ``stable_sync`` its batches come in dispatch order (:meth:`_stable_in_order`)."""
        buffer = super()._build_replay_buffer()
        if getattr(self, "_stable_base_mode", None) == "sync":
            sample = buffer.sample

            def sample_in_dispatch_order(*args: Any, **kwargs: Any) -> Any:
                batch, metrics = sample(*args, **kwargs)
                return self._stable_in_order(batch), metrics

            # patch: dispatch_order_sample (verl_stable.compat.catalogue)
            buffer.sample = sample_in_dispatch_order
        return buffer

    def _stable_in_order(self, batch):
        """The sampled ``batch`` sorted into the order its prompts were dispatched in (in place).

        verl's replay buffer lists samples in put order, i.e. as they finished; the order decides the mini-batches and
        every summation order, so runs would differ. The compact-routing manager records the dispatch order
        (:class:`~verl_stable.transport.seeding.DispatchLedger`), so its workers put samples as they finish
        and the order is restored here. With another manager the batch stays as verl sampled it.
        """
        ledger = getattr(getattr(self, "agent_loop_manager", None), "stable_dispatch", None)
        if ledger is not None and len(batch):
            batch.reorder(ledger.order(list(batch.keys)))
        return batch

    def fit(self, agent_loop_manager):
        """verl's ``fit``, then the run summary (:meth:`_stable_write_summary`); raises :class:`GuardTripped` after the
        loop when a stopping rule fired."""
        result = super().fit(agent_loop_manager)
        self._stable_clear_prompt_rows()
        self._stable_write_summary()
        trip = getattr(self, "_stable_trip", None)
        if trip:
            raise GuardTripped(trip)
        return result


V1_MODULE = "verl.trainer.ppo.v1"
# registered name -> (module, class) of verl's trainer for that mode
BASE_TRAINERS: dict[str, tuple[str, str]] = {
    "sync": (f"{V1_MODULE}.trainer_sync", "PPOTrainerSync"),
    "colocate_async": (f"{V1_MODULE}.trainer_colocate_async", "PPOTrainerColocateAsync"),
    "separate_async": (f"{V1_MODULE}.trainer_separate_async", "PPOTrainerSeparateAsync"),
}
CLASS_NAMES: dict[str, str] = {
    "sync": "StablePPOTrainerSync",
    "colocate_async": "StablePPOTrainerColocateAsync",
    "separate_async": "StablePPOTrainerSeparateAsync",
}
_classes: dict[str, type] = {}  # base mode -> monitored class, built once on first use


def stable_trainer_classes() -> dict[str, type]:
    """``{"stable_<mode>": class}``: ``StabilityMonitorMixin`` + verl's trainer of each mode (imports verl's V1)."""
    if not _classes:
        for mode, (module_name, class_name) in BASE_TRAINERS.items():
            base = getattr(importlib.import_module(module_name), class_name)
            doc = f"verl's ``{class_name}`` with the verl-stable monitor and guard (``trainer_mode=stable_{mode}``)."
            attrs = {"_stable_base_mode": mode, "__doc__": doc, "__module__": __name__}
            _classes[mode] = type(CLASS_NAMES[mode], (StabilityMonitorMixin, base), attrs)
    return {f"stable_{mode}": cls for mode, cls in _classes.items()}


def __getattr__(name: str) -> type:
    # the classes subclass verl's trainers: build them (and import verl's V1 stack) only when asked for
    for mode, class_name in CLASS_NAMES.items():
        if name == class_name:
            stable_trainer_classes()
            return _classes[mode]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _register_now() -> list[str]:
    from verl.trainer.ppo.v1 import trainer_base

    done = []
    for name, cls in stable_trainer_classes().items():
        trainer_base.register_trainer(name)(cls)
        done.append(f"trainer:{name}")
    return done


def register() -> list[str]:
    """Register ``stable_sync``, ``stable_colocate_async``, ``stable_separate_async`` in verl's trainer registry.

    Idempotent. If verl's V1 trainer package is already imported, registers now; otherwise registers right after
    its first import, so the plugin stays cheap in processes that never train. The plugin runs in every process, but
    only the task runner builds a trainer: importing verl's V1 stack here would import verl's engines (which fix the
    device at import time) in every process and before other plugins chose the platform. A failure of the deferred
    registration is logged and does not fail that import: verl's own trainers must keep working.
    """
    hook = when_imported(V1_MODULE, _register_now, deferred_errors="log")
    if hook.fired:
        return hook.result
    return [f"trainer:stable_{mode} (on import of {V1_MODULE})" for mode in BASE_TRAINERS]
