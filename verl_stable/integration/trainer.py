"""Stability monitor and guard inside verl's V1 trainer, as registered trainers.

verl 0.9.1's ``main_ppo`` runs the V1 trainer by default (``trainer.use_v1: true``): ``TaskRunnerV1`` builds
``get_trainer_cls(trainer.v1.trainer_mode)`` from verl's public ``register_trainer`` registry. This module registers
one monitored trainer per built-in mode, so a recipe opts in with a single key::

    trainer.v1.trainer_mode: stable_sync        # or stable_colocate_async / stable_separate_async

Each class is ``StabilityMonitorMixin`` + verl's own trainer for that mode, built and registered when verl first
imports ``verl.trainer.ppo.v1`` (in the task runner), so the plugin does not import verl's trainer stack and engines
in every process. Everywhere verl branches on
``self.trainer_mode`` (replay buffer kind, checkpointing of TransferQueue state, refill policy), the class answers
the base mode (``sync`` ...), and reads its per-mode options from ``trainer.v1.<base mode>``; the registered name
only selects the class.

The hook is ``PPOTrainer._compute_metrics``: it runs once per step after the update and checkpoint, while the
step's samples are still in TransferQueue and before ``self.logger.log(metrics)``. There the mixin reads the
batch fields verl already has (``old_log_probs``, ``rollout_log_probs``, ``entropy``, ``rollout_is_weights``,
``loss_mask`` / ``response_mask``, ``routed_experts``), adds the ``stable/`` metrics of
:mod:`verl_stable.monitor.metrics` to the step's dict -- so verl's own tracking logs them -- and feeds the dict to
the :class:`~verl_stable.monitor.guard.Guard`. A stopping verdict ends the run through verl's exit path: the step is
logged, the training loop ends at its loop condition (no further step, no further checkpoint), ``on_train_end`` runs,
and ``fit`` raises :class:`~verl_stable.monitor.guard.GuardTripped` -- so ``TaskRunnerV1.run`` closes tracking with
exit code 1 and TransferQueue, and ``main_ppo`` exits non-zero with the verdict as the error message.

Configuration is a top-level ``stable`` key of the hydra config (verl's config dataclasses are frozen, the root is
not): in a recipe YAML next to ``defaults: [ppo_trainer, _self_]``, or ``+stable.guard.rules.train_inference_kl
.threshold=0.02`` on the command line::

    stable:
      monitor: {enable: true, taus: [2, 5], entropy_window: 5, routing_interval: 1,
                num_experts: null, train_routing_field: null, per_update: true}
      guard:   {enable: true, rules: {...}}        # see Guard.from_config

Metrics from inside the update. Staleness (pi_theta / pi_old) exists only inside the actor's mini-steps: the
``minirl`` / ``vespo`` losses return it (:mod:`verl_stable.integration.losses`) and the replay engine returns its
routing metrics (:mod:`verl_stable.integration.fsdp_engine`); verl logs both as ``actor/stable/...``, reduced over
the step's update mini-steps by verl's ``reduce_metrics`` (max for keys containing ``max``, min for ``min``, else
mean). The mixin *moves* every ``actor/stable/...`` key to ``stable/...`` (one name per quantity: all of ours live
under ``stable/``, and a guard rule or dashboard never has to know which process computed a metric). It also taps
verl's unreduced update output (one value per mini-step, see :func:`per_update_metrics`) and logs, for the
metrics of :data:`PER_UPDATE_METRICS`, ``stable/<group>/update_<i>/<name>`` for the i-th update mini-step of the
logged step (counted over ``ppo_epochs`` and, in the async modes, over the ``parameter_sync_step`` local updates).
``update_0`` of an on-policy step runs on the weights that computed pi_old, so its staleness is ~0 and its R2 drift
0; later updates show how far the policy and its routing moved. (``update`` rather than ``mini_step``: verl reduces
metrics by substring, and ``mini_step`` contains ``min``.)
"""

from __future__ import annotations

import importlib.abc
import logging
import os
import re
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDict

from verl_stable.monitor import metrics as M
from verl_stable.monitor.guard import Guard, GuardTripped, Verdict, last_good_checkpoint_step

logger = logging.getLogger("verl_stable")

CONFIG_KEY = "stable"
# Per-token fields, padded to [batch, response_len]; missing ones are simply absent from TransferQueue's answer.
TOKEN_FIELDS: tuple[str, ...] = (
    "response_mask",
    "loss_mask",
    "old_log_probs",
    "rollout_log_probs",
    "entropy",
    "rollout_is_weights",
)
ROLLOUT_ROUTING_FIELD = "routed_experts"


@dataclass(frozen=True)
class MonitorConfig:
    """``stable.monitor``.

    Attributes:
        enable: compute ``stable/`` metrics (the guard can still run on verl's own metrics without them).
        taus: thresholds of the extreme-token fraction F(tau).
        entropy_window: steps in the window of ``stable/entropy/slope``.
        routing_interval: fetch routed experts every N steps for routing metrics (0: never). The rollout's
            ``routed_experts`` is [tokens, layers, top_k] per sample; fetching it costs driver memory.
        num_experts: routed experts per MoE layer (inferred from the ids when ``None``: a lower bound).
        train_routing_field: TransferQueue field with the training engine's routing, laid out like
            ``routed_experts``; when present, rollout-vs-training disagreement is logged.
        per_update: log ``stable/<group>/update_<i>/<name>`` for each update mini-step (:data:`PER_UPDATE_METRICS`).
    """

    enable: bool = True
    taus: tuple[float, ...] = M.DEFAULT_TAUS
    entropy_window: int = 5
    routing_interval: int = 1
    num_experts: int | None = None
    train_routing_field: str | None = None
    per_update: bool = True

    def __post_init__(self) -> None:
        if self.entropy_window < 2:
            raise ValueError(f"stable.monitor.entropy_window must be >= 2, got {self.entropy_window}")
        if self.routing_interval < 0:
            raise ValueError(f"stable.monitor.routing_interval must be >= 0, got {self.routing_interval}")


@dataclass(frozen=True)
class StableConfig:
    """The ``stable`` block of the hydra config: monitor options and the guard's plain-dict config."""

    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    guard_enable: bool = True
    guard: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, block: Mapping[str, Any] | None) -> StableConfig:
        """Parse and validate a ``stable`` block (plain dict or DictConfig); unknown keys raise ``ValueError``."""
        if isinstance(block, DictConfig):
            block = OmegaConf.to_container(block, resolve=True)
        block = dict(block or {})
        unknown = set(block) - {"monitor", "guard"}
        if unknown:
            raise ValueError(f"unknown keys in '{CONFIG_KEY}': {sorted(unknown)} (allowed: monitor, guard)")
        mon = dict(block.get("monitor") or {})
        allowed = {f.name for f in fields(MonitorConfig)}
        if set(mon) - allowed:
            raise ValueError(f"unknown keys in '{CONFIG_KEY}.monitor': {sorted(set(mon) - allowed)}")
        if "taus" in mon:
            mon["taus"] = tuple(float(t) for t in mon["taus"])
        guard = dict(block.get("guard") or {})
        guard_enable = bool(guard.pop("enable", True))
        Guard.from_config(guard)  # validate now: a typo must fail at startup, not at the first trip
        return cls(monitor=MonitorConfig(**mon), guard_enable=guard_enable, guard=guard)

    @classmethod
    def from_trainer_config(cls, config: Mapping[str, Any]) -> StableConfig:
        """Read the top-level ``stable`` key of verl's trainer config (defaults when absent)."""
        return cls.from_dict(config.get(CONFIG_KEY, None))


@dataclass
class MonitorBatch:
    """One step's fields for the monitor, real samples only.

    Attributes:
        tokens: per-token fields padded to ``[batch, response_len]`` (keys from :data:`TOKEN_FIELDS`).
        rollout_routing: per sample ``[seq_len, layers, top_k]`` rollout expert ids, or ``None``.
        train_routing: the same for the training engine, or ``None``.
    """

    tokens: dict[str, torch.Tensor]
    rollout_routing: list[torch.Tensor] | None = None
    train_routing: list[torch.Tensor] | None = None

    @classmethod
    def from_tensordict(
        cls,
        data: TensorDict,
        keep_rows: np.ndarray | Sequence[bool] | None = None,
        train_routing_field: str | None = None,
    ) -> MonitorBatch:
        """Build from a TransferQueue answer (jagged or dense tensors per field).

        Args:
            data: the ``TensorDict`` returned by ``transfer_queue.kv_batch_get``.
            keep_rows: boolean row selector (verl marks padding samples in the batch tags).
            train_routing_field: name of the training-side routing field, if any.
        """
        if "response_mask" not in data.keys():
            raise ValueError("the batch has no 'response_mask': cannot tell valid tokens from padding")
        keep = None if keep_rows is None else torch.as_tensor(np.asarray(keep_rows, dtype=bool))
        if keep is not None and keep.shape != (data.batch_size[0],):
            raise ValueError(f"keep_rows has shape {tuple(keep.shape)}, expected ({data.batch_size[0]},)")
        names = [k for k in TOKEN_FIELDS if k in data.keys()]
        padded = data.select(*names).to_padded_tensor()
        tokens = {}
        for name in names:
            t = padded[name]
            tokens[name] = t if keep is None else t[keep]
        width = tokens["response_mask"].shape[1]
        for name, t in tokens.items():
            if t.shape[:2] != tokens["response_mask"].shape[:2]:
                raise ValueError(f"field {name!r} has shape {tuple(t.shape)}, response_mask has [*, {width}]")

        def _rows(name: str | None) -> list[torch.Tensor] | None:
            if name is None or name not in data.keys():
                return None
            rows = list(data[name].unbind(0))
            return rows if keep is None else [r for r, k in zip(rows, keep.tolist(), strict=True) if k]

        return cls(tokens, _rows(ROLLOUT_ROUTING_FIELD), _rows(train_routing_field))


def _stack_routing(rows: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-sample ids to ``[tokens, layers, top_k]``, dropping rows with no routing data (all zero)."""
    ids = torch.cat(rows, dim=0)
    has_data = ids.reshape(ids.shape[0], -1).any(dim=1)
    return ids[has_data]


def _routing_disagreement(a_ids: torch.Tensor, b_ids: torch.Tensor, num_experts: int) -> dict[str, Any] | None:
    """The routing issue's ``routing_disagreement`` on two ``[tokens, moe_layers, top_k]`` id tensors.

    Returns ``None`` when :mod:`verl_stable.routing` is not importable.
    """
    try:
        from verl_stable.routing.disagreement import routing_disagreement
        from verl_stable.routing.trace import RoutingTrace
    except ImportError:
        return None
    a = RoutingTrace.from_tensor(a_ids, num_experts)
    b = RoutingTrace.from_tensor(b_ids, num_experts)
    return routing_disagreement(a, b)


class StepMonitor:
    """Turns one step's batch into ``stable/`` metrics and guard verdicts; holds the cross-step state."""

    def __init__(self, config: StableConfig, token_level_is: bool = True):
        self.config = config
        self.token_level_is = token_level_is
        self.guard = Guard.from_config(config.guard) if config.guard_enable else None
        self._entropy: deque[float] = deque(maxlen=config.monitor.entropy_window)
        self._warned: set[str] = set()

    def wants_routing(self, step: int) -> bool:
        """Whether this step's routing fields should be fetched."""
        interval = self.config.monitor.routing_interval
        return self.config.monitor.enable and interval > 0 and step % interval == 0

    def batch_metrics(self, batch: MonitorBatch) -> dict[str, float]:
        """The ``stable/`` metrics of one step's batch (each group skipped when its fields are absent)."""
        cfg = self.config.monitor
        t = batch.tokens
        valid = t.get("loss_mask", t["response_mask"])
        out: dict[str, float] = {"stable/valid_tokens": float(valid.sum())}
        if "old_log_probs" in t and "rollout_log_probs" in t:
            out.update(M.train_inference_metrics(t["rollout_log_probs"], t["old_log_probs"], valid, cfg.taus))
            out.update(
                M.correction_metrics(
                    t["rollout_log_probs"],
                    t["old_log_probs"],
                    valid,
                    is_weights=t.get("rollout_is_weights"),
                    kept_mask=t["response_mask"] if "loss_mask" in t else None,
                    token_level=self.token_level_is,
                )
            )
        if "rollout_is_weights" in t:
            out.update(M.is_weight_metrics(t["rollout_is_weights"], t["response_mask"]))
        if "entropy" in t:
            ent = M.entropy_metrics(t["entropy"], valid)
            out.update(ent)
            if "stable/entropy/mean" in ent:
                self._entropy.append(ent["stable/entropy/mean"])
                slope = M.window_slope(list(self._entropy))
                if slope is not None:
                    out["stable/entropy/slope"] = slope
        if batch.rollout_routing:
            rollout_ids = _stack_routing(batch.rollout_routing)
            if rollout_ids.shape[0] > 0:
                out.update(M.expert_load_balance(rollout_ids, cfg.num_experts))
        if batch.rollout_routing and batch.train_routing:
            out.update(self._disagreement(batch.rollout_routing, batch.train_routing))
        return out

    def _disagreement(self, rollout: list[torch.Tensor], train: list[torch.Tensor]) -> dict[str, float]:
        """Rollout-vs-training routing disagreement on the rows and MoE layers both traces cover."""
        if len(rollout) != len(train):
            raise ValueError(f"rollout routing has {len(rollout)} samples, training routing {len(train)}")
        a_rows, b_rows = [], []
        for a, b in zip(rollout, train, strict=True):
            n = min(a.shape[0], b.shape[0])
            if a.shape[1:] != b.shape[1:]:
                raise ValueError(f"rollout routing rows {tuple(a.shape[1:])} differ from training {tuple(b.shape[1:])}")
            a, b = a[:n], b[:n]
            both = a.reshape(n, -1).any(dim=1) & b.reshape(n, -1).any(dim=1)  # rows where both recorded routing
            a_rows.append(a[both])
            b_rows.append(b[both])
        a_ids, b_ids = torch.cat(a_rows), torch.cat(b_rows)
        moe = a_ids.any(dim=(0, 2)) | b_ids.any(dim=(0, 2))  # dense layers are all-zero in verl's traces
        if a_ids.shape[0] == 0 or not bool(moe.any()):
            return {}
        a_ids, b_ids = a_ids[:, moe].long(), b_ids[:, moe].long()
        num_experts = self.config.monitor.num_experts or int(max(a_ids.max(), b_ids.max())) + 1
        result = _routing_disagreement(a_ids, b_ids, num_experts)
        if result is None:
            self._warn_once("disagreement", "verl_stable.routing is unavailable: no routing disagreement metrics")
            return {}
        return M.routing_disagreement_metrics(result, "rollout_vs_train")

    def step(self, step: int, batch: MonitorBatch | None, metrics: dict[str, Any]) -> list[Verdict]:
        """Add this step's ``stable/`` metrics to ``metrics`` in place and return the guard's verdicts."""
        for key in [k for k in metrics if k.startswith("actor/stable/")]:
            metrics[key[len("actor/") :]] = metrics.pop(key)
        if self.config.monitor.enable and batch is not None:
            metrics.update(self.batch_metrics(batch))
        if self.guard is None:
            return []
        verdicts = self.guard.observe(step, metrics)
        metrics.update(self.guard.metrics(verdicts))
        for rule, names in self.guard.missing.items():
            self._warn_once(f"missing:{rule}", f"guard rule {rule!r} has none of its metrics {list(names)}")
        return verdicts

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("verl-stable: %s", message)


#: Metrics logged once per update mini-step (their verl key is ``actor/<name>``, or ``<name>`` from the engine).
PER_UPDATE_METRICS: tuple[str, ...] = (
    *(f"{M.STALENESS}/{name}" for name in M.STALENESS_NAMES),
    f"{M.ROUTING}/r2_drift",
    f"{M.ROUTING}/router_disagreement",
    f"{M.ROUTING}/disagreement",
)


def per_update_metrics(
    raw: Mapping[str, Any], first_update: int = 0, names: Sequence[str] = PER_UPDATE_METRICS
) -> tuple[dict[str, float], int]:
    """Split verl's unreduced ``update_actor`` metrics into one value per update mini-step.

    verl 0.9.1's ``TrainingWorker.train_mini_batch`` returns, for every metric that reached it as a ``Metric``
    (all loss metrics, and the replay engine's), a list with one value per mini-step (``ppo_epochs`` x mini-batches,
    in order), each the aggregate over that mini-step's micro-batches and data-parallel ranks. For each metric
    ``<group>/<name>`` in ``names`` present as such a list, this returns ``<group>/update_<first_update + i>/<name>``.

    Args:
        raw: the ``metrics`` of ``update_actor``'s output, keys as the worker wrote them (``actor/`` prefix or not).
        first_update: index of the first of these mini-steps within the logged step.
        names: the metrics to split, without the ``actor/`` prefix.

    Returns:
        The per-update metrics and the number of mini-steps seen (0 when none of ``names`` is present).

    Raises:
        ValueError: If the metrics disagree on the number of mini-steps, or a value is not a number.
    """
    wanted = set(names)
    out: dict[str, float] = {}
    lengths: dict[str, int] = {}
    for key, values in raw.items():
        name = key.removeprefix("actor/")
        if name not in wanted or not isinstance(values, (list, tuple)):
            continue
        group, leaf = name.rsplit("/", 1)
        lengths[name] = len(values)
        for i, value in enumerate(values):
            if not isinstance(value, (int, float, np.number)):
                raise ValueError(f"update metric {key!r} holds a {type(value).__name__} at mini-step {i}, not a number")
            out[f"{group}/update_{first_update + i}/{leaf}"] = float(value)
    if len(set(lengths.values())) > 1:
        raise ValueError(f"update metrics disagree on the number of mini-steps: {lengths}")
    return out, next(iter(lengths.values()), 0)


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


_CKPT_DIR = re.compile(r"^global_step_(\d+)$")


def saved_checkpoint_steps(default_local_dir: str) -> list[int]:
    """Steps of the ``global_step_<n>`` checkpoint folders verl wrote under ``trainer.default_local_dir``."""
    if not default_local_dir or not os.path.isdir(default_local_dir):
        return []
    steps = []
    for name in os.listdir(default_local_dir):
        match = _CKPT_DIR.match(name)
        if match and os.path.isdir(os.path.join(default_local_dir, name)):
            steps.append(int(match.group(1)))
    return sorted(steps)


class StabilityMonitorMixin:
    """Adds the monitor and guard to a verl V1 ``PPOTrainer`` subclass (put it first in the bases)."""

    _stable_base_mode: str = "sync"

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self._stable_state()  # parse the ``stable`` block now: a config error fails before any worker starts

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
            monitor = StepMonitor(StableConfig.from_trainer_config(self.config), token_level_is=token_level)
            self._stable_monitor = monitor
            self._stable_trip: list[Verdict] = []
        return monitor

    def _stable_compact_layout(self) -> Any:
        """The routing layout when the rollout stores compact routing (:mod:`verl_stable.integration.rollout`).

        ``None`` when verl's own agent-loop manager runs (TransferQueue then holds verl's ``routed_experts``).
        """
        if not hasattr(self, "_stable_layout"):
            from verl_stable.integration.rollout import uses_compact_routing

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

    def _stable_fetch(self, batch, step: int, monitor: StepMonitor) -> MonitorBatch | None:
        import transfer_queue as tq

        from verl_stable.integration.rollout import PROMPT_REF_FIELD, RolloutRoutingOptions, expand_compact_routing
        from verl_stable.routing.transport import IDS_FIELD, SPAN_FIELD

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
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=select)
        if layout is not None:
            expand_compact_routing(data, layout)
        keep = np.array([not tag.get("is_padding", False) for tag in batch.tags], dtype=bool)
        return MonitorBatch.from_tensordict(data, keep if keep.any() else None, train_field)

    def on_step_begin(self):
        """verl's hook, after the previous step's ``kv_clear``: clear the shared prompt rows of finished groups."""
        super().on_step_begin()
        self._stable_clear_prompt_rows()

    def _stable_clear_prompt_rows(self) -> None:
        if self._stable_compact_layout() is None:
            return
        from verl_stable.integration.rollout import RolloutRoutingOptions, clear_stale_prompt_rows

        if RolloutRoutingOptions.from_config(self.config).share_prompt_rows:
            clear_stale_prompt_rows()

    def step(self, metrics, timing_raw):
        """verl's step; numbers the update mini-steps of this logged step from 0."""
        self._stable_updates_in_step = 0
        return super().step(metrics, timing_raw)

    def _update_actor(self, batch, metrics):
        """verl's actor update, plus the per-mini-step metrics of its unreduced output (:func:`per_update_metrics`)."""
        monitor = self._stable_state()
        if not (monitor.config.monitor.enable and monitor.config.monitor.per_update):
            return super()._update_actor(batch, metrics)
        tap = _UpdateOutputTap(self.actor_rollout_wg)
        self.actor_rollout_wg = tap
        try:
            result = super()._update_actor(batch, metrics)
        finally:
            self.actor_rollout_wg = tap.worker_group
        if tap.raw is not None:
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
        super()._compute_metrics(batch, metrics, timing_raw, global_steps=global_steps, epoch=epoch)
        monitor = self._stable_state()
        fetched = self._stable_fetch(batch, global_steps, monitor) if monitor.config.monitor.enable else None
        if monitor.config.monitor.enable and self._stable_compact_layout() is not None:
            from verl_stable.integration.rollout import fetch_transport_metrics

            metrics.update(fetch_transport_metrics(batch))
        verdicts = monitor.step(global_steps, fetched, metrics)
        self._stable_handle(verdicts, global_steps)

    def _stable_handle(self, verdicts: list[Verdict], step: int) -> None:
        """Warn, or end the loop after this step is logged; ``fit`` then raises :class:`GuardTripped`."""
        stopping = []
        for verdict in verdicts:
            if verdict.action == "stop_checkpoint":
                verdict = self._stable_with_checkpoint(verdict, step)
            if verdict.stops:
                stopping.append(verdict)
            logger.warning("verl-stable guard [%s -> %s] %s", verdict.rule, verdict.action, verdict.describe())
        if stopping:
            self._stable_trip = stopping
            # verl's loop runs while global_steps <= total_training_steps and increments after logging: this
            # ends it at the loop condition, after this step's metrics are logged, with no further checkpoint.
            self.total_training_steps = min(self.total_training_steps, self.global_steps)

    def _stable_with_checkpoint(self, verdict: Verdict, step: int) -> Verdict:
        root = self.config.trainer.default_local_dir
        good = last_good_checkpoint_step(saved_checkpoint_steps(root), step, self._stable_monitor.guard.flagged_steps)
        path = None if good is None else os.path.join(root, f"global_step_{good}")
        return Verdict(verdict.rule, verdict.action, verdict.step, verdict.values, verdict.message, path)

    def fit(self, agent_loop_manager):
        """verl's ``fit``; raises :class:`GuardTripped` after the loop when a stopping rule fired."""
        result = super().fit(agent_loop_manager)
        self._stable_clear_prompt_rows()  # verl's last step returns without another on_step_begin
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


class _RegisterOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Registers the monitored trainers right after ``verl.trainer.ppo.v1`` is executed, then removes itself.

    The plugin runs in every process verl starts, but only the task runner builds a trainer. Importing verl's V1
    stack in the plugin would import verl's engines (which fix the device at import time) in every process and
    before other plugins chose the platform; deferring to the first import of the registry avoids both.
    """

    def __init__(self) -> None:
        self._loader: importlib.abc.Loader | None = None

    def find_spec(self, fullname, path, target=None):
        if fullname != V1_MODULE or self._loader is not None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                self._loader = spec.loader
                spec.loader = self
                return spec
        return None

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        try:
            self._loader.exec_module(module)
        finally:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
        try:
            done = _register_now()
            logger.info("verl-stable: registered %s", done)
        except Exception as exc:  # noqa: BLE001 - a failure here must not break verl's own trainers
            logger.warning("verl-stable: registering the monitored trainers failed: %s", exc)


def register() -> list[str]:
    """Register ``stable_sync``, ``stable_colocate_async``, ``stable_separate_async`` in verl's trainer registry.

    Idempotent. If verl's V1 trainer package is already imported, registers now; otherwise registers right after
    its first import (see :class:`_RegisterOnImport`), so the plugin stays cheap in processes that never train.
    """
    if V1_MODULE in sys.modules:
        return _register_now()
    if not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
    return [f"trainer:stable_{mode} (on import of {V1_MODULE})" for mode in BASE_TRAINERS]
