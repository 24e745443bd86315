"""MoE router replay (R2 / R3) inside verl's FSDP engine, for Hugging Face MoE models (FSDP and FSDP2): the mixin.

``actor_rollout_ref.actor.fsdp_config.router_replay.mode`` (verl's ``EngineRouterReplayConfig``) selects:

* ``disabled``: verl's engine, unchanged. If the batch happens to carry the rollout's ``routed_experts`` (the
  rollout was asked to export routing), the engine only *observes*: it records the routing it used and logs the
  disagreement with the rollout's routing; outputs are bit-identical to verl's engine.
* ``R2``: ``compute_log_prob`` (pi_old, forward only) records the routing of every token and returns it as
  ``routed_experts`` next to ``log_probs``; verl carries it per sample (TransferQueue in the V1 trainer, the
  DataProto batch in the legacy one) into ``update_actor``, where every update mini-step replays it. Because the
  routing travels *with its sample*, the trainer's shuffling and mini-batch split cannot detach it from its tokens.
* ``R3``: ``compute_log_prob`` and every update mini-step replay the rollout's ``routed_experts``
  (``actor_rollout_ref.rollout.enable_rollout_routing_replay=True``).

The reference policy never replays: a forward-only engine (verl builds the reference engine with
``forward_only=True``) never records or replays, and neither does a pass run under ``disable_adapter()`` (the
reference computed by the LoRA actor).

Alignment. The reference routing is per sample, one row per valid token (prompt + response), in the order of
``input_ids``: verl's ``routed_experts`` (indexed by absolute decoder layer; verl's agent loop, R2's recording) or,
with the project's compact transport, :data:`~verl_stable.transport.expansion.MOE_ROUTING_FIELD` (MoE layers only,
gathered and checked on this actor by :func:`~verl_stable.transport.expansion.attach_moe_routing`, never widened to
all decoder layers). Each micro-batch's rows are laid out exactly as verl lays out
``input_ids`` for the model (padded, packed + ``pad_to_length`` pad, Ulysses pad + per-rank slice) by
:mod:`verl_stable.routing.alignment`; pad rows and rows without data (zero rows, e.g. the last sampled token) keep
the model's own routing and are counted. verl's rows are checked there, once per micro-batch (every id in
``[0, num_experts)``; a row holds data only if its top-k ids are distinct); the compact transport's were checked
where they were gathered. Either way they reach the replayer as checked rows, not as a trace that would check them
again: one check per hop.

Replay replaces only the expert selection; gate weights are recomputed by the family's formula from the live router
output (:mod:`verl_stable.routing`), so the router is trained. The replay context stays open across the
micro-batch's backward, so gradient-checkpointing recompute routes the same way.

Metrics, per micro-batch (logged as ``actor/stable/routing/...`` by verl's update; the monitored trainers move them
to ``stable/routing/...`` and add one value per update mini-step):

* ``stable/routing/disagreement``: fraction of (token, MoE layer) rows with routing data whose *used* expert set
  differs from the reference routing (rollout in R3 / observe, pi_old in R2). 0 under replay by construction.
  ``disagreement/layer_{i}`` the same per MoE layer (i = MoE-layer ordinal), ``disagreement/layer_max`` their
  maximum, ``disagreement/token_any_layer`` the share of tokens with at least one differing layer.
* ``stable/routing/router_disagreement``: the same for the experts the router *would* have chosen: the numeric
  mismatch replay is hiding (rollout vs training precision in R3, policy drift since pi_old in R2).
* ``stable/routing/r2_drift`` (R2 update passes only): ``router_disagreement`` under its R2 meaning, the fraction of
  compared rows where the live router's top-k set differs from the pi_old routing recorded by ``compute_log_prob``
  and replayed in this mini-step; ``stable/routing/r2_drift/layer_{i}`` per MoE layer (i = MoE-layer ordinal).
  0 in the first mini-step of an on-policy step (same weights as pi_old), growing as the update moves the policy.
* ``stable/routing/compared_rows``, ``replayed_rows``, ``missing_rows``, ``padding_rows``, ``recorded_rows``: row
  counts.
* ``stable/routing/coverage/<count>`` (replaying passes only: R3, and R2's update): the replay coverage of the
  micro-batch in (token, MoE layer) rows, :data:`~verl_stable.metric_names.COVERAGE_COUNTS` (classes
  in :mod:`verl_stable.routing.replay_pass`), counted on the whole micro-batch before any Ulysses slicing.
* ``stable/routing/transport/<count>`` for :data:`~verl_stable.transport.side_rows.SIDE_READ_COUNTS` (batches
  carrying the rollout's compact routing): the rank's TransferQueue reads of shared prompt rows since its last
  update mini-step (so including its ``compute_log_prob``), on the first micro-batch of each update mini-step;
  ``stable/routing/transport/side_reads_per_rank`` the same read count averaged over ranks. verl reduces metrics over
  data-parallel ranks: the Ulysses peers of a rank, which read the same entries, are not counted again.

Aggregation. ``forward_step`` hands every ``stable/...`` metric (ours and the staleness metrics of the
``minirl`` / ``vespo`` losses) to verl as a :class:`verl.utils.metric.Metric` (see
:func:`verl_stable.integration.losses.relabel_stable_metrics`): verl then reduces them to one value per update
mini-step (the unweighted mean over micro-batches and data-parallel ranks; ``*_max`` / ``*_min`` keys the true
extreme), where plain numbers would only be concatenated across mini-steps. The coverage counts are
``Metric(SUM)`` scaled by the data-parallel size instead: verl's ``aggregate_dp`` averages a SUM metric over ranks
and sums it over micro-batches, so each rank's count times ``dp_size`` arrives as the sum over ranks and
micro-batches of the mini-step; the monitored trainers sum the mini-steps (and local updates) of a step and form
the ``stable/routing/coverage/*`` fractions from those totals. The side-read counts travel the same way.

This module owns :class:`RouterReplayMixin`, the state machine driven by verl's engine hooks (``initialize``,
``disable_adapter``, ``forward_backward_batch``, ``prepare_model_inputs`` / ``prepare_model_outputs``,
``forward_step``) and the alignment of routing rows to this rank's model input. The per-pass decision and sessions
are :mod:`verl_stable.routing.replay_pass`; building the engine class and registering it in verl is
:mod:`verl_stable.integration.fsdp_engine`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu

from verl_stable.integration.losses import relabel_stable_metrics, side_read_metrics, summed_count_metrics
from verl_stable.metric_names import COVERAGE
from verl_stable.routing import alignment
from verl_stable.routing.checks import check_id_range
from verl_stable.routing.disagreement import expert_sets_differ
from verl_stable.routing.families import ModelRouting, UnsupportedModelError, bind_model
from verl_stable.routing.replay_audit import disagreement_metrics
from verl_stable.routing.replay_pass import (
    METRIC_PREFIX,
    MODES,
    ROUTED_EXPERTS,
    MicroBatchTargets,
    ReplayAction,
    ReplayPass,
    RouterReplayError,
    coverage_counts,
    last_forward_rows,
    r2_drift_per_layer,
    replay_action,
    routed_rows,
    token_roles,
)
from verl_stable.routing.trace import MISSING
from verl_stable.transport.expansion import MOE_ROUTING_FIELD, attach_moe_routing, without_compact_fields
from verl_stable.transport.fields import IDS_FIELD
from verl_stable.transport.side_rows import SharedRowReader

logger = logging.getLogger("verl_stable")


class RouterReplayMixin:
    """R2 / R3 router replay for verl's ``FSDPEngineWithLMHead`` (Hugging Face MoE models).

    Mixed in before verl's engine class (see :func:`verl_stable.integration.fsdp_engine.engine_class`); every
    method calls verl's implementation and only adds routing around it. With ``router_replay.mode=disabled`` and no
    ``routed_experts`` in the batch every call goes straight to verl's implementation.
    """

    # Provided by verl's FSDPEngineWithLMHead.
    module: torch.nn.Module
    use_ulysses_sp: bool
    ulysses_sequence_parallel_size: int
    ulysses_device_mesh: Any

    def __init__(self, model_config: Any, engine_config: Any, optimizer_config: Any, checkpoint_config: Any, **kwargs):
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config, **kwargs)
        self._init_router_replay(engine_config)

    # ------------------------------------------------------------------------------------------- setup
    def _init_router_replay(self, engine_config: Any) -> None:
        """Replay state; split from ``__init__`` so the state machine can be set up on a bare engine in tests."""
        router_replay = getattr(engine_config, "router_replay", None)
        if isinstance(router_replay, Mapping):
            # ``+...fsdp_config.router_replay.mode=R3`` without a ``_target_`` reaches the engine as a plain dict.
            mode = router_replay.get("mode", "disabled") or "disabled"
        else:
            mode = getattr(router_replay, "mode", "disabled") or "disabled"
        if mode not in MODES:
            raise ValueError(f"router_replay.mode must be one of {MODES}, got {mode!r}")
        self.router_replay_mode: str = mode
        self._engine_forward_only = bool(getattr(engine_config, "forward_only", False))
        self._reference_depth = 0
        self._model_routing: ModelRouting | None = None
        self._routing_unsupported: str | None = None
        self._replay_pass: ReplayPass | None = None
        self._prompt_rows = SharedRowReader()
        self._side_read_counts: dict[str, int] | None = None
        if mode != "disabled" and self._engine_forward_only:
            logger.info("router_replay.mode=%s ignored by a forward-only engine (reference policy never replays)", mode)

    def initialize(self) -> None:
        super().initialize()
        self._bind_routing(strict=self.router_replay_mode != "disabled" and not self._engine_forward_only)

    def _bind_routing(self, strict: bool) -> None:
        try:
            self._model_routing = bind_model(self.module)
        except UnsupportedModelError as exc:
            if strict:
                raise RouterReplayError(
                    f"router_replay.mode={self.router_replay_mode} needs a Hugging Face MoE model whose routing can "
                    f"be replayed: {exc}"
                ) from exc
            self._routing_unsupported = str(exc)

    def disable_adapter(self):  # noqa: D102 - same contract as verl's
        return self._reference_scope(super().disable_adapter())

    @contextmanager
    def _reference_scope(self, inner: Any) -> Iterator[Any]:
        """A reference-policy pass (LoRA adapter off): never recorded, never replayed."""
        self._reference_depth += 1
        try:
            with inner as value:
                yield value
        finally:
            self._reference_depth -= 1

    # ------------------------------------------------------------------------------------------- passes
    def _action_for(self, data: TensorDict, forward_only: bool) -> ReplayAction:
        flag = tu.get_non_tensor_data(data=data, key="enable_routing_replay", default=None)
        action = replay_action(
            self.router_replay_mode,
            forward_only=forward_only,
            engine_forward_only=self._engine_forward_only,
            reference_pass=self._reference_depth > 0,
            batch_has_routing=_has_routing(data),
            worker_flag=None if flag is None else bool(flag),
        )
        if action is ReplayAction.OBSERVE and self._model_routing is None:
            return ReplayAction.NONE  # a dense model or an unsupported family: nothing to observe
        return action

    def forward_backward_batch(self, data: TensorDict, loss_function: Callable, forward_only: bool = False) -> Any:
        if self._model_routing is not None and IDS_FIELD in data.keys():
            # The rollout side ships compact uint8 routing (integration.rollout); its MoE-layer rows are gathered and
            # checked here, on the actor, only for the batch being processed (the prompt rows its groups share come
            # from the rank's reader: one TransferQueue read per step, see rollout.SharedRowReader).
            attach_moe_routing(data, self._model_routing.layout, reader=self._prompt_rows)
            if not forward_only:  # reported with the mini-step's first micro-batch (forward_step)
                self._side_read_counts = self._prompt_rows.take_counts()
            data = without_compact_fields(data)  # consumed: verl's micro-batch split need not index them
        action = self._action_for(data, forward_only)
        if action is ReplayAction.NONE:
            return super().forward_backward_batch(data, loss_function, forward_only=forward_only)
        if self._model_routing is None:
            raise RouterReplayError(f"router replay is not bound to the model: {self._routing_unsupported}")
        if action is ReplayAction.REPLAY and not _has_routing(data):
            raise RouterReplayError(self._missing_routing_message(forward_only))
        if self._replay_pass is not None:
            raise RouterReplayError("forward_backward_batch re-entered while a router replay pass is active")
        replay_pass = ReplayPass(action=action, routing=self._model_routing, model=self.module)
        self._replay_pass = replay_pass
        try:
            replay_pass.open()
            return super().forward_backward_batch(data, loss_function, forward_only=forward_only)
        finally:
            replay_pass.close()
            self._replay_pass = None

    def _missing_routing_message(self, forward_only: bool) -> str:
        if self.router_replay_mode == "R3":
            return (
                f"router_replay.mode=R3 but the batch has no '{ROUTED_EXPERTS}': set "
                "actor_rollout_ref.rollout.enable_rollout_routing_replay=True so the rollout exports routing"
            )
        return (
            f"router_replay.mode=R2 but the update batch has no '{ROUTED_EXPERTS}': it is recorded by "
            "compute_log_prob, which did not run (rollout_correction.bypass_mode uses the rollout log-probs as "
            "pi_old and skips it; use R3 or recompute old log-probs)"
        )

    def prepare_model_inputs(self, micro_batch: TensorDict):
        model_inputs, output_args = super().prepare_model_inputs(micro_batch)
        replay_pass = self._replay_pass
        if replay_pass is not None:
            targets = None
            if replay_pass.action in (ReplayAction.REPLAY, ReplayAction.OBSERVE):
                targets = self._align_targets(micro_batch, model_inputs, output_args)
            replay_pass.output_args = dict(output_args)
            replay_pass.arm(targets)
        return model_inputs, output_args

    def prepare_model_outputs(self, output, output_args, micro_batch: TensorDict, logits_processor_func):
        model_output = super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)
        replay_pass = self._replay_pass
        if replay_pass is None:
            return model_output
        if replay_pass.action is ReplayAction.RECORD:
            model_output[ROUTED_EXPERTS] = self._recorded_routing(micro_batch, output_args)
        else:
            replay_pass.metrics.update(self._agreement_metrics(replay_pass))
        return model_output

    def forward_step(self, micro_batch: TensorDict, loss_function, forward_only):
        loss, output = super().forward_step(micro_batch, loss_function=loss_function, forward_only=forward_only)
        replay_pass = self._replay_pass
        if replay_pass is not None and replay_pass.metrics:
            metrics = output.setdefault("metrics", {})
            metrics.update({METRIC_PREFIX + key: value for key, value in replay_pass.metrics.items()})
        if output.get("metrics"):
            relabel_stable_metrics(output["metrics"])
        coverage = None if replay_pass is None or replay_pass.targets is None else replay_pass.targets.coverage
        side_reads, self._side_read_counts = self._side_read_counts, None
        if coverage is not None or side_reads is not None:
            # after the relabelling, which would make them MEAN: counts add up (see the module docstring)
            dp_size = int(tu.get_non_tensor_data(data=micro_batch, key="dp_size", default=1) or 1)
            metrics = output.setdefault("metrics", {})
            metrics.update(summed_count_metrics(coverage or {}, dp_size, f"{COVERAGE}/"))
            if side_reads is not None:
                metrics.update(side_read_metrics(side_reads, dp_size))
        return loss, output

    # ------------------------------------------------------------------------------------------- alignment
    def _sp_rank(self) -> int:
        if not self.use_ulysses_sp:
            return 0
        return int(self.ulysses_device_mesh["sp"].get_local_rank())

    def _check_layout_supported(self) -> None:
        if self.use_ulysses_sp:
            config = getattr(getattr(self.module, "module", self.module), "config", None)
            if hasattr(config, "vision_config"):
                raise RouterReplayError(
                    "router replay with Ulysses sequence parallelism is not supported for vision-language models "
                    "(their inputs are sliced after the embedding)"
                )

    def _align_targets(self, micro_batch: TensorDict, model_inputs: dict, output_args: dict) -> MicroBatchTargets:
        """The micro-batch's ``routed_experts`` in the order this rank's routers see tokens."""
        assert self._model_routing is not None
        self._check_layout_supported()
        layout = self._model_routing.layout
        if MOE_ROUTING_FIELD in micro_batch.keys():
            # the compact transport's MoE-layer rows, checked once on this actor where they were gathered
            # (transport.expansion.attach_moe_routing)
            moe, offsets = routed_rows(micro_batch, MOE_ROUTING_FIELD)
            if moe.shape[1:] != (layout.num_moe_layers, layout.top_k):
                raise RouterReplayError(
                    f"{MOE_ROUTING_FIELD} rows are {tuple(moe.shape[1:])} but the {layout.model_type} model expects "
                    f"[{layout.num_moe_layers} MoE layers, top_k {layout.top_k}]"
                )
        else:
            # verl's own int16 rows (its agent loop's routed_experts, or R2's recording of pi_old): this is their
            # one check on the actor
            rows, offsets = routed_rows(micro_batch)
            if rows.shape[1] != layout.num_hidden_layers or rows.shape[2] != layout.top_k:
                raise RouterReplayError(
                    f"routed_experts rows are [{rows.shape[1]} layers, top_k {rows.shape[2]}] but the "
                    f"{layout.model_type} model expects [{layout.num_hidden_layers} decoder layers, top_k "
                    f"{layout.top_k}] (routing indexed by absolute decoder layer, dense layers as zero rows)"
                )
            moe = alignment.select_layers(rows, layout.moe_layers)
            check_id_range(moe, layout.num_experts)
        # a row holds data iff its top-k ids are distinct, so the rows handed to the replayer are distinct and in range:
        # checked once (set_checked_rows), not again by a trace
        has_data = alignment.rows_with_data(moe)
        dense = moe.to(torch.long).masked_fill_(~has_data.unsqueeze(-1), MISSING)
        use_remove_padding = tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True)
        if use_remove_padding:
            static_pad = self._get_packed_pad_size(int(offsets[-1]))
            aligned, sp_pad = alignment.ulysses_shard(
                alignment.packed_layout(dense, offsets, static_pad=static_pad),
                self.ulysses_sequence_parallel_size,
                self._sp_rank(),
            )
            if static_pad + sp_pad != int(output_args.get("pad_size", 0)):
                raise RouterReplayError(
                    f"routing alignment expected {static_pad + sp_pad} pad tokens but verl padded "
                    f"{output_args.get('pad_size')}: verl's packing rule changed"
                )
            token_mask = aligned.has_data.reshape(1, -1)
            padding_tokens = static_pad + sp_pad
        else:
            width = int(model_inputs["input_ids"].shape[1])
            aligned = alignment.padded_layout(dense, offsets, max_seq_len=width)
            token_mask = aligned.has_data.reshape(-1, width)
            padding_tokens = (offsets.numel() - 1) * width - int(offsets[-1])
        coverage = None
        if self._replay_pass is not None and self._replay_pass.action is ReplayAction.REPLAY:
            roles = token_roles(micro_batch, offsets)
            if roles is not None:
                coverage = coverage_counts(has_data, offsets, *roles, padding_tokens=padding_tokens)
        return MicroBatchTargets(dense=aligned.token_rows(), token_mask=token_mask, coverage=coverage)

    def _recorded_routing(self, micro_batch: TensorDict, output_args: dict) -> torch.Tensor:
        """R2: routing per sample, ``[b, j, num_hidden_layers, top_k]`` int16, nested as input_ids."""
        assert self._replay_pass is not None and self._model_routing is not None
        self._check_layout_supported()
        layout = self._model_routing.layout
        ids, (batch, width) = last_forward_rows(self._replay_pass.natural)
        offsets = micro_batch["input_ids"].offsets()
        ids = ids.to(torch.int32)  # collectives do not take uint8 everywhere; int32 also holds > 256 experts
        if tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
            packed = self._gather_and_unpad_packed(ids, int(output_args.get("pad_size", 0)))
        else:
            packed = alignment.rows_from_padded_layout(ids, offsets, width)
        if packed.shape[0] != int(offsets[-1]):
            raise RouterReplayError(f"recorded {packed.shape[0]} routing rows for {int(offsets[-1])} tokens")
        absolute = alignment.scatter_layers(packed, layout.moe_layers, layout.num_hidden_layers).to(torch.int16)
        self._replay_pass.metrics["recorded_rows"] = float(packed.shape[0] * len(layout.moe_layers))
        return torch.nested.nested_tensor_from_jagged(absolute, offsets)

    def _agreement_metrics(self, replay_pass: ReplayPass) -> dict[str, float]:
        """Disagreement of the router's own and of the used routing with the reference routing, plus row counts."""
        targets = replay_pass.targets
        assert targets is not None
        natural, _ = last_forward_rows(replay_pass.natural)
        token_rows = targets.token_mask.reshape(-1).to(natural.device)
        target = targets.dense.to(natural.device)
        has_data = target[..., 0] != MISSING  # [n, M]; a row without data is MISSING in every slot
        compared = int(has_data.sum())
        natural = natural[token_rows]
        replayed = replay_pass.action is ReplayAction.REPLAY
        if replayed:  # the router's own and the used experts against the target in one comparison
            used, _ = last_forward_rows(replay_pass.used)
            both = torch.stack([natural, used[token_rows]]).to(torch.long)
            differ = expert_sets_differ(both, target.expand(2, *target.shape)) & has_data
            router_differ_rows, used_differ_rows = differ[0], differ[1]
        else:
            router_differ_rows = expert_sets_differ(natural.to(torch.long), target) & has_data
        router_differ = int(router_differ_rows.sum())
        metrics = {
            "router_disagreement": router_differ / max(compared, 1),
            "compared_rows": float(compared),
            "missing_rows": float(has_data.numel() - compared),
            "padding_rows": float((~token_rows).sum()) * target.shape[1],
        }
        if replay_pass.action is ReplayAction.REPLAY and self.router_replay_mode == "R2":
            # the update replays pi_old's routing: the router's own choice is how far routing drifted since pi_old
            metrics["r2_drift"] = metrics["router_disagreement"]
            per_layer = r2_drift_per_layer(natural.to(torch.long), target, has_data)
            metrics.update({f"r2_drift/layer_{i}": value for i, value in enumerate(per_layer)})
        if replayed:
            metrics["replayed_rows"] = float(compared)
        # where routing differs: overall, per MoE layer (so a fault confined to one layer is not averaged away) and
        # per token (at least one of its layers); under replay the used experts, else the router's own choice
        disagree = used_differ_rows if replayed else router_differ_rows
        metrics.update(disagreement_metrics(has_data.sum(dim=0).tolist(), disagree.sum(dim=0).tolist()))
        tokens = has_data.any(dim=1)
        metrics["disagreement/token_any_layer"] = int((disagree.any(dim=1) & tokens).sum()) / max(int(tokens.sum()), 1)
        return metrics


def _has_routing(data: TensorDict) -> bool:
    """Whether a batch carries reference routing: verl's ``routed_experts`` or the compact transport's MoE rows."""
    keys = data.keys()
    return ROUTED_EXPERTS in keys or MOE_ROUTING_FIELD in keys
