"""What the stability monitor computes per step, without verl's trainer: the ``stable`` config and the step's metrics.

This module owns the per-step computation behind the monitored trainers (:mod:`verl_stable.integration.trainer`,
which feeds it from verl's ``PPOTrainer`` hooks): parsing the ``stable`` block (:class:`StableConfig`), the step's
batch as TransferQueue returns it (:class:`MonitorBatch`), the ``stable/`` metrics of :mod:`verl_stable.monitor.metrics`
with the guard's verdicts and the cross-step state (:class:`StepMonitor`). The split of verl's unreduced update
output into one value per update mini-step is :mod:`verl_stable.monitor.update_metrics`. Nothing here imports verl.

Configuration is a top-level ``stable`` key of the hydra config (verl's config dataclasses are frozen, the root is
not): in a recipe YAML next to ``defaults: [ppo_trainer, _self_]``, or ``+stable.guard.rules.train_inference_kl
.threshold=0.02`` on the command line::

    stable:
      monitor: {enable: true, taus: [2, 5], entropy_window: 5, routing_interval: 1, replay_metrics_interval: 1,
                num_experts: null, train_routing_field: null, per_update: true}
      guard:   {enable: true, rules: {...}}        # see Guard.from_config

Metrics from inside the update. Staleness (pi_theta / pi_old) exists only inside the actor's mini-steps: the ``minirl``
/ ``vespo`` losses return it (:mod:`verl_stable.integration.losses`) and the replay engine returns its routing metrics
(:mod:`verl_stable.integration.fsdp_engine`); verl logs both as ``actor/stable/...``, reduced over the step's update
mini-steps by verl's ``reduce_metrics`` (max for keys containing ``max``, min for ``min``, else mean).
:meth:`StepMonitor.step` *moves* every ``actor/stable/...`` key to ``stable/...`` (one name per quantity: all of ours
live under ``stable/``, and a guard rule or dashboard never has to know which process computed a metric). The trainer
also taps verl's unreduced update output (one value per mini-step, see
:func:`~verl_stable.monitor.update_metrics.per_update_metrics`) and logs, for the metrics of
:data:`~verl_stable.monitor.update_metrics.PER_UPDATE_METRICS`, ``stable/<group>/update_<i>/<name>`` for the i-th
update mini-step of the logged step (counted over ``ppo_epochs`` and, in the async modes, over the
``parameter_sync_step`` local updates). ``update_0`` of an on-policy step runs on the weights that computed pi_old, so
its staleness is ~0 and its R2 drift 0; later updates show how far the policy and its routing moved. (``update`` rather
than ``mini_step``: verl reduces metrics by substring, and ``mini_step`` contains ``min``.)

Replay coverage. Under R2 / R3 the replay engine returns row counts per update mini-step, already summed over
micro-batches and data-parallel ranks; verl's ``reduce_metrics`` would average them over mini-steps. The trainer sums
them instead (:func:`~verl_stable.monitor.update_metrics.coverage_totals` on the same unreduced output, added up over
the local updates of a step) and :meth:`StepMonitor.step` logs those totals as ``stable/routing/coverage/<count>`` and
the fractions of :func:`verl_stable.monitor.routing_metrics.replay_coverage_metrics`, which the guard's
``replay_coverage`` rule watches. The actors' reads of shared prompt rows (``stable/routing/transport/side_*``, see
:class:`verl_stable.transport.side_rows.SharedRowReader`) are summed the same way
(:data:`~verl_stable.monitor.update_metrics.SUMMED_UPDATE_COUNTS`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from verl_stable.metric_names import COVERAGE, COVERAGE_COUNTS, GUARD
from verl_stable.monitor import metrics as M
from verl_stable.monitor.guard import Guard, Verdict
from verl_stable.monitor.routing_metrics import replay_coverage_metrics
from verl_stable.schema import MonitorOptions, StableOptions, parse

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
        replay_metrics_interval: the Megatron actor measures its routing-replay metrics (``stable/routing/...``:
            disagreement, the router's own choice, coverage) at step 1 and every N-th step after it, 1 + kN (1: every
            step; 0: never). The other steps replay exactly as verl does and log none of them, so the guard's rules on
            them (``replay_coverage``) judge the measured steps only. Measuring costs ~2 % of a pass on the CPU
            runtime's tiny model (docs/explanation/benchmarks.md); the FSDP engine measures as part of its replay
            and refuses any value but 1.
        num_experts: routed experts per MoE layer (inferred from the ids when ``None``: a lower bound).
        train_routing_field: TransferQueue field with the training engine's routing, laid out like
            ``routed_experts``; when present, rollout-vs-training disagreement is logged.
        per_update: log ``stable/<group>/update_<i>/<name>`` for each update mini-step
            (:data:`~verl_stable.monitor.update_metrics.PER_UPDATE_METRICS`).
    """

    enable: bool = True
    taus: tuple[float, ...] = M.DEFAULT_TAUS
    entropy_window: int = 5
    routing_interval: int = 1
    replay_metrics_interval: int = 1
    num_experts: int | None = None
    train_routing_field: str | None = None
    per_update: bool = True

    def __post_init__(self) -> None:
        # the schema's check whether built from the YAML or in code; frozen: the normalised taus go through setattr
        options = parse(MonitorOptions, {f.name: getattr(self, f.name) for f in fields(self)}, f"{CONFIG_KEY}.monitor")
        object.__setattr__(self, "taus", options.taus)


@dataclass(frozen=True)
class StableConfig:
    """The ``stable`` block of the hydra config: monitor options and the guard's plain-dict config."""

    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    guard_enable: bool = True
    guard: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, block: Mapping[str, Any] | bool | None) -> StableConfig:
        """Parse and validate a ``stable`` block (plain dict, DictConfig, a bool or None) with the schema.

        The schema is :class:`verl_stable.schema.StableOptions` (strict types, bounds, unknown keys refused):
        ``stable: false`` turns the monitor and the guard off, ``monitor: false`` / ``guard: false`` one of them.
        ``guard.enable`` becomes :attr:`guard_enable` and leaves the guard's dict; the rules are validated even when
        the guard is off, so a typo fails at startup whichever way it is switched.

        Raises:
            verl_stable.schema.ConfigError: (a ``ValueError`` and ``TypeError``) naming the offending key.
        """
        options = parse(StableOptions, block, CONFIG_KEY)
        # the guard's dict holds what the user set, so an unconfigured block equals the default one
        guard = options.guard.model_dump(exclude={"enable", "rules"}, exclude_unset=True)
        if options.guard.rules:
            guard["rules"] = {
                name: None if spec is None else spec.model_dump(exclude_unset=True)
                for name, spec in options.guard.rules.items()
            }
        Guard.from_config(guard, f"{CONFIG_KEY}.guard")  # validate now: a typo must fail at startup, not at a trip
        return cls(
            monitor=MonitorConfig(**options.monitor.model_dump()), guard_enable=options.guard.enable, guard=guard
        )

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

    def __init__(self, config: StableConfig, token_level_is: bool = True, pi_old_is_rollout: bool = False):
        """
        Args:
            config: the ``stable`` block.
            token_level_is: verl's rollout correction weights tokens (not sequences).
            pi_old_is_rollout: verl's bypass mode (``algorithm.rollout_correction.bypass_mode``): pi_old is not
                recomputed but *is* the rollout's log-prob, so KL(mu || pi_old) and F(tau) would be 0 by construction.
                They are then not logged (a 0 would read as "no mismatch"), and a rule watching them stays silent.
        """
        self.config = config
        self.token_level_is = token_level_is
        self.pi_old_is_rollout = pi_old_is_rollout
        self.guard = Guard.from_config(config.guard) if config.guard_enable else None
        self._entropy: deque[tuple[int, float]] = deque(maxlen=config.monitor.entropy_window)  # (step, mean)
        self._step = 0  # the step :meth:`step` is measuring
        self._warned: set[str] = set()
        self._pending: list[Verdict] = []  # this step's verdicts from before the actor update

    @property
    def skips_updates(self) -> bool:
        """Whether a guard rule decides before the actor update (``skip_update``)."""
        return self.guard is not None and self.guard.skips_updates

    def before_update(self, step: int, batch: MonitorBatch | None, metrics: Mapping[str, Any]) -> list[Verdict]:
        """The ``skip_update`` rules' verdicts on what is known before the actor update; any verdict means the update
        is not applied (a skip, or a skip escalated to ``stop_checkpoint``). :meth:`step` logs them with the step.

        Args:
            step: verl's ``global_steps``.
            batch: the step's fields for the monitor (old and rollout log-probs, routing), or ``None``.
            metrics: what verl and the transport measured so far this step (``rollout_corr/*``,
                ``stable/routing/transport/*``).
        """
        if not self.skips_updates:
            return []
        known = dict(metrics)
        if self.config.monitor.enable and batch is not None:
            known.update(self.batch_metrics(batch, record=False))
        verdicts = self.guard.observe(step, known, phase="before_update")
        self._pending.extend(verdicts)
        return verdicts

    def wants_routing(self, step: int) -> bool:
        """Whether this step's routing fields should be fetched."""
        interval = self.config.monitor.routing_interval
        return self.config.monitor.enable and interval > 0 and step % interval == 0

    def wants_replay_metrics(self, step: int) -> bool:
        """Whether the actor measures its routing-replay metrics at ``step`` (1-based): step 1, then every
        ``replay_metrics_interval``-th step (the monitor switch does not matter: the actor's metrics are its own)."""
        interval = self.config.monitor.replay_metrics_interval
        return interval > 0 and (step - 1) % interval == 0

    def batch_metrics(self, batch: MonitorBatch, record: bool = True) -> dict[str, float]:
        """The ``stable/`` metrics of one step's batch (each group skipped when its fields are absent).

        ``record=False`` leaves the cross-step state (the entropy window) as it is: a look before the update.
        """
        cfg = self.config.monitor
        t = batch.tokens
        valid = t.get("loss_mask", t["response_mask"])
        out: dict[str, float] = {"stable/valid_tokens": float(valid.sum())}
        if self.pi_old_is_rollout and record:
            self._warn_once(
                "bypass",
                "verl's bypass mode takes the rollout's log-probs as pi_old: no stable/train_inf/* metrics are logged "
                "(they would be 0 by construction) and guard rules on them cannot fire",
            )
        if "old_log_probs" in t and "rollout_log_probs" in t and not self.pi_old_is_rollout:
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
            if "stable/entropy/mean" in ent and record:
                self._entropy.append((self._step, ent["stable/entropy/mean"]))
                slope = M.window_slope([value for _, value in self._entropy])
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

    def step(
        self,
        step: int,
        batch: MonitorBatch | None,
        metrics: dict[str, Any],
        coverage: Mapping[str, float] | None = None,
    ) -> list[Verdict]:
        """Add this step's ``stable/`` metrics to ``metrics`` in place and return the guard's verdicts.

        Args:
            step: verl's ``global_steps``.
            batch: the step's fields for the monitor, or ``None``.
            metrics: the step's metrics as verl collected them; updated in place.
            coverage: the step's replay-coverage counts summed over its update mini-steps
                (:func:`~verl_stable.monitor.update_metrics.coverage_totals`,
                full ``stable/routing/coverage/<count>`` keys); they replace the per-mini-step means verl logged.
        """
        self._step = step
        for key in [k for k in metrics if k.startswith("actor/stable/")]:
            metrics[key[len("actor/") :]] = metrics.pop(key)
        if coverage:
            metrics.update(coverage)
        metrics.update(self._coverage(metrics))
        if self.config.monitor.enable and batch is not None:
            metrics.update(self.batch_metrics(batch))
        if self.guard is None:
            return []
        pending, self._pending = self._pending, []
        verdicts = pending + self.guard.observe(step, metrics)
        metrics.update(self.guard.metrics(verdicts))
        if self.guard.skips_updates:
            metrics[f"{GUARD}skipped_updates"] = float(sum(v.skips for v in pending))
        for rule, names in self.guard.missing.items():
            self._warn_once(f"missing:{rule}", f"guard rule {rule!r} has none of its metrics {list(names)}")
        return verdicts

    def rolled_back(self, to_step: int) -> None:
        """The run went back to the checkpoint of ``to_step``: the cross-step state forgets the abandoned steps (the
        entropy window here, the guard's flags and windows in :meth:`Guard.rolled_back`)."""
        kept = [(s, v) for s, v in self._entropy if s <= to_step]
        self._entropy.clear()
        self._entropy.extend(kept)
        self._pending = []
        if self.guard is not None:
            self.guard.rolled_back(to_step)

    def _coverage(self, metrics: Mapping[str, Any]) -> dict[str, float]:
        """The replay-coverage fractions of the step's counts; empty when replay did not run."""
        present = {name: metrics[f"{COVERAGE}/{name}"] for name in COVERAGE_COUNTS if f"{COVERAGE}/{name}" in metrics}
        if not present:
            return {}
        if len(present) < len(COVERAGE_COUNTS):
            missing = sorted(set(COVERAGE_COUNTS) - set(present))
            self._warn_once("coverage", f"replay coverage counts {missing} are missing: no coverage fractions")
            return {}
        return replay_coverage_metrics(present)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("verl-stable: %s", message)
