"""The project's replay metrics on verl's Megatron engine: what each router actually used under R2 / R3 replay.

verl's Megatron engine replays MoE routing itself (``verl.utils.megatron.router_replay_patch``): with
``router_replay.mode`` R2 or R3 and the batch flag ``enable_routing_replay``, its ``forward_step`` gives every
router's ``RouterReplay`` the target top-k ids of the micro-batch (R3: the rollout's routes, aligned by
``align_r3_router_replay_data``, with a replay mask from ``build_r3_replay_mask`` that leaves each sequence's final
row native; R2 update: the routes ``compute_log_prob`` recorded, every row). It reports nothing about the result.
:class:`MegatronReplayMetricsMixin` measures it, per micro-batch, from the routers' outputs: a forward hook on each
``TopKRouter`` of the forwarded model reads the router's ``routing_map`` (the experts its tokens are dispatched to)
and the targets and mask verl set on it, while the router is in ``REPLAY_FORWARD`` (the backward's recomputation,
``REPLAY_BACKWARD``, is not counted again). Nothing verl computes is changed.

Metrics, per micro-batch, under the names the FSDP replay engine uses where the meaning is the same
(:mod:`verl_stable.integration.fsdp_replay`; logged as ``actor/stable/routing/...``):

* ``stable/routing/disagreement``: fraction of replayed (row, MoE layer) decisions whose *used* expert set differs
  from the target verl set; 0 under exact replay. ``disagreement/layer_<i>`` per MoE layer (i = MoE-layer ordinal)
  and ``disagreement/layer_max`` their maximum, so a fault confined to one layer is not averaged away.
* ``stable/routing/router_disagreement``: the same for the experts each router *would* have chosen (its own top-k
  of the same scores, by verl's routing function), over the replayed rows that hold a routing: the numeric mismatch
  the replay is hiding (rollout vs training in R3, policy drift since pi_old in R2). Under R2 (update passes) also
  ``stable/routing/r2_drift`` and ``r2_drift/layer_<i>``, as on FSDP. The router's own choice is read where verl
  computes it: each router's ``RouterReplay.get_replay_topk`` is wrapped for the pass (an object-scoped patch of
  the engine's own routers, removed at the end of it) to keep the ids verl's ``default_compute_topk`` returns for
  its R3 replay mask, or to run it once, without gradient, where verl does not (R2's update passes)
  (:class:`~verl_stable.integration.megatron_audit.NativeChoiceTap`).
* ``stable/routing/compared_rows`` = ``replayed_rows``: the replayed (row, MoE layer) decisions.
* ``stable/routing/transport/<count>`` for :data:`~verl_stable.transport.side_rows.SIDE_READ_COUNTS` and
  ``side_reads_per_rank`` (batches carrying the compact transport): the rank's TransferQueue reads of shared prompt
  rows since its last update mini-step, once per update mini-step, as on FSDP.
* ``stable/routing/coverage/<count>`` (:data:`~verl_stable.metric_names.COVERAGE_COUNTS`, classes in
  :mod:`verl_stable.routing.replay_pass`): the rows the routers saw by class (response / prompt rows before the
  sample's last trained token, not-needed rows, packing pad), with how many of each took a replayed routing, in
  (row, MoE layer) rows. A row verl replays from a zero target (a token the rollout did not route: verl forces
  expert 0 there) counts as not replayed, as FSDP counts a row without data. The row of each router input is mapped
  to its token by packing the micro-batch's token classes with verl's own ``preprocess_thd_engine`` (the call verl
  packs the targets with) and splitting them for sequence parallelism, so the classes land on the router rows the
  targets do; a micro-batch whose mapping does not
  match the router's rows (a packing rule this module does not know) reports no coverage, with a warning.
  Coverage needs ``response_mask`` (verl's layout: ``[B, R]`` next to ``attention_mask``, or nested per response).

Aggregation, as on FSDP: every metric reaches verl as a :class:`verl.utils.metric.Metric`, one value per
micro-batch (verl's ``postprocess_batch_func`` collects them with ``append_to_dict``); the fractions MEAN (``_max``:
MAX), the coverage counts ``Metric(SUM)`` times the data-parallel size, so that verl's ``aggregate_dp`` turns them
into the sum over ranks and micro-batches and the trainer's ``coverage_totals`` sums the mini-steps (the guard's
``replay_coverage`` rule then works on Megatron as on FSDP). The stable metrics of the loss (``actor/stable/...``)
are relabelled per micro-batch as FSDP's ``forward_step`` does
(:func:`verl_stable.integration.losses.relabel_stable_metrics`).

Sampling: a batch whose non-tensor :data:`REPLAY_METRICS_FLAG` is false (the monitored trainers set it from
``stable.monitor.replay_metrics_interval``: step 1 and every N-th step after it measured) goes to verl untouched --
no hook, no tap, no metric.

Parallelism: each rank counts the rows its routers saw; at the end of ``forward_backward_batch`` the per-micro-batch
counts are summed over the groups that split them (the pipeline group: disjoint layers; the tensor group under
sequence parallelism and the context group: disjoint rows), which every rank of those groups reaches, and attached
to the output of the ranks that return metrics. Dynamic context parallelism (micro-batch-dependent groups) is not
measured (a warning says so). Tested (tests/mcore/test_megatron_engine.py, on CPU) at world size 1, tensor parallel 2
with sequence parallelism, expert parallel 2, pipeline parallel 2 (with and without virtual pipeline stages) and
(EP, TP, PP) = (2, 1, 2), (1, 2, 2), (2, 2, 1); the context-parallel sum is not exercised (the CPU runtime refuses
context parallelism).
Written against megatron-core 0.16.1's ``TopKRouter`` (its forward returns ``probs, routing_map``) and verl 0.9.1's
``RouterReplay``.

The compact transport (:mod:`verl_stable.transport`): a batch that carries the rollout's routing in the project's
compact form (uint8 ids, ragged spans, shared prompt rows; ``CompactRoutingAgentLoopManagerTQ``) is expanded here, on
the actor, into verl's own int16 ``routed_experts`` (all decoder layers) before verl's engine sees it
(:func:`verl_stable.transport.expansion.expand_compact_routing`, which checks the ids: the actor's one check, verl's
replay does none): verl's Megatron replay then runs on exactly what verl's own agent loop would have given it, while
the transport stays compact. (The FSDP engine, which aligns the rows itself, takes the MoE-layer rows instead.)

The routers' forward hook and what it counts into are :mod:`verl_stable.integration.megatron_audit`. Building the
engine classes (:func:`engine_class`) and registering the language-model class for verl's
``("megatron", cuda)`` engine keys (:func:`register`, a plugin step) are here too; the CPU engines of
:mod:`verl_stable.cpu.megatron.engine` subclass :func:`engine_class`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.metric import Metric
from verl.utils.py_functional import append_to_dict

from verl_stable.compat.import_hooks import when_imported
from verl_stable.integration.engine_keys import hold_engine_key
from verl_stable.integration.losses import (
    relabel_stable_metrics,
    side_read_metrics,
    stable_metric_aggregation,
    summed_count_metrics,
)
from verl_stable.integration.megatron_audit import COVERAGE_WIDTH, PER_LAYER, Audit, NativeChoiceTap, router_hook
from verl_stable.metric_names import COVERAGE, COVERAGE_COUNTS
from verl_stable.routing.families import layout_from_config
from verl_stable.routing.replay_audit import (
    ROW_PADDING,
    RowRuns,
    class_runs,
    disagreement_metrics,
    packed_row_classes,
)
from verl_stable.routing.replay_pass import METRIC_PREFIX, response_layout
from verl_stable.transport.expansion import expand_compact_routing, without_compact_fields
from verl_stable.transport.fields import IDS_FIELD
from verl_stable.transport.side_rows import SharedRowReader

__all__ = [
    "BACKEND",
    "ENGINE_MODULE",
    "ENGINE_PACKAGE",
    "MODEL_TYPE",
    "REPLAY_METRICS_FLAG",
    "VENDOR_KEYS",
    "MegatronReplayMetricsMixin",
    "engine_class",
    "register",
    "register_engine",
]

logger = logging.getLogger("verl_stable")

ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"
REPLAY_METRICS_FLAG = "stable_replay_metrics"
"""The batch's non-tensor flag (verl's ``extra_info``) that says whether this pass's replay metrics are measured: the
monitored trainers set it each step from ``stable.monitor.replay_metrics_interval``; absent (verl's own trainers):
measured."""
# model_type -> verl's class in ENGINE_MODULE
BASES = {"language_model": "MegatronEngineWithLMHead", "value_model": "MegatronEngineWithValueHead"}
REPLAY_SUFFIX = "Replay"


class MegatronReplayMetricsMixin:
    """The replay metrics of the module docstring, for verl's ``MegatronEngineWithLMHead`` (GPU and CPU alike).

    Mixed in before verl's engine class (:func:`engine_class`); every method calls verl's implementation and only
    measures around it. Without ``router_replay.mode`` R2 / R3 and the batch flag ``enable_routing_replay``, calls go
    straight to verl.
    """

    # Provided by verl's MegatronEngine.
    module: list[torch.nn.Module]
    tf_config: Any
    engine_config: Any
    enable_routing_replay: bool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._replay_audit: Audit | None = None
        self._audit_warned: set[str] = set()
        self._compact_layout: Any = None  # the model's RoutingLayout, read from its config on the first compact batch
        self._prompt_rows = SharedRowReader()
        self._routers: list[Any] | None = None  # the replaying routers, found on the first measured pass
        self._device: torch.device | None = None  # the model's device, read on the first measured pass

    # ------------------------------------------------------------------------------------------- passes
    def _expand_compact(self, data: TensorDict, forward_only: bool) -> tuple[TensorDict, dict[str, int] | None]:
        """verl's ``routed_experts`` from the compact transport's fields (the batch unchanged without them), and for
        an update mini-step the rank's side-entry reads since its last one (``None`` otherwise)."""
        if IDS_FIELD not in data.keys():
            return data, None
        if self._compact_layout is None:
            self._compact_layout = layout_from_config(self.model_config.hf_config)
        expand_compact_routing(data, self._compact_layout, reader=self._prompt_rows)
        side_reads = None if forward_only else self._prompt_rows.take_counts()
        return without_compact_fields(data), side_reads  # consumed: verl's micro-batch split need not index them

    def forward_backward_batch(self, data: TensorDict, loss_function: Callable, forward_only: bool = False) -> Any:
        data, side_reads = self._expand_compact(data, forward_only)
        if not self._audit_wanted(data):
            output = super().forward_backward_batch(data, loss_function, forward_only=forward_only)
            self._report_side_reads(data, output, side_reads)
            return output
        if self._replay_audit is not None:
            raise RuntimeError("forward_backward_batch re-entered while a router replay audit is active")
        audit = Audit(ordinals=self._moe_ordinals(), device=self._model_device())
        self._replay_audit = audit
        try:
            self._attach_hooks(audit)
            output = super().forward_backward_batch(data, loss_function, forward_only=forward_only)
        finally:
            for handle in audit.handles:
                handle.remove()
            self._replay_audit = None
        self._report(audit, data, output)
        self._report_side_reads(data, output, side_reads)
        return output

    def forward_step(
        self,
        batch_iter: Iterator[TensorDict],
        model: Any,
        logits_processor_func: Callable,
        postprocess_micro_batch_func: Callable,
    ) -> Any:
        audit = self._replay_audit
        if audit is None:
            return super().forward_step(batch_iter, model, logits_processor_func, postprocess_micro_batch_func)
        batch = next(batch_iter)  # read here for its token classes; verl's forward_step gets it back, unchanged
        audit.begin(model, self._router_rows(batch))
        result = super().forward_step(iter([batch]), model, logits_processor_func, postprocess_micro_batch_func)
        audit.flush()  # the routers of this micro-batch have run: counted now, their references dropped
        return result

    def postprocess_micro_batch_func(self, *args: Any, **kwargs: Any) -> Any:
        result = super().postprocess_micro_batch_func(*args, **kwargs)
        # the loss's stable/ metrics get the aggregation they have on FSDP (one value per micro-batch here)
        output = result[-1]
        if isinstance(output, dict) and output.get("metrics"):
            relabel_stable_metrics(output["metrics"])
        return result

    # ------------------------------------------------------------------------------------------- measuring
    def _audit_wanted(self, data: TensorDict) -> bool:
        if not getattr(self, "enable_routing_replay", False):
            return False
        if not tu.get_non_tensor_data(data=data, key="enable_routing_replay", default=False):
            return False
        if not tu.get_non_tensor_data(data=data, key=REPLAY_METRICS_FLAG, default=True):
            return False  # a step the trainer samples out (stable.monitor.replay_metrics_interval): verl's replay only
        if getattr(self.engine_config, "dynamic_context_parallel", False):
            self._warn_once("dcp", "router replay metrics are not measured under dynamic context parallelism")
            return False
        return True

    def _model_device(self) -> torch.device:
        """Where the model's parameters live, read once: ``parameters()`` walks the module tree on every call."""
        if self._device is None:
            self._device = next(self.module[0].parameters()).device
        return self._device

    def _moe_ordinals(self) -> dict[int, int]:
        """Router ``layer_number`` (1-based, global) -> MoE-layer ordinal, by verl's rule for MoE layers."""
        from verl.utils.megatron.router_replay_utils import is_moe_layer

        moe_layers = [i for i in range(self.tf_config.num_layers) if is_moe_layer(self.tf_config, i)]
        return {layer + 1: ordinal for ordinal, layer in enumerate(moe_layers)}

    def _replaying_routers(self) -> list[Any]:
        """Every replay-enabled router of the decoder (every model chunk of this rank), found once: the modules do not
        change after the engine is built, and walking them every pass costs as much as counting a micro-batch."""
        if self._routers is None:
            from megatron.core.transformer.moe.router import TopKRouter
            from verl.utils.megatron_utils import unwrap_model

            self._routers = [
                router
                for chunk in unwrap_model(self.module)
                # the decoder's routers only: MTP layers restart their numbering (verl's replay skips them too)
                for router in getattr(chunk, "decoder", chunk).modules()
                if isinstance(router, TopKRouter) and getattr(router, "router_replay", None) is not None
            ]
        return self._routers

    def _attach_hooks(self, audit: Audit) -> None:
        """A measuring hook and a native-choice tap on every replaying router, for one pass."""
        from verl.utils.megatron_utils import unwrap_model

        for chunk in unwrap_model(self.module):
            audit.handles.append(chunk.register_forward_pre_hook(self._capture_packing(audit), with_kwargs=True))
        for router in self._replaying_routers():
            audit.handles.append(router.register_forward_hook(router_hook(audit)))
            audit.handles.append(NativeChoiceTap(router.router_replay, audit.native))

    def _router_rows(self, batch: TensorDict) -> Callable[[Any], RowRuns | torch.Tensor] | None:
        """The token class of each row the routers see for ``batch``, as a callable the audit runs with the forward's
        ``PackedSeqParams`` when it counts the micro-batch (``None`` when the batch has no response layout: then no
        coverage is counted).

        The rows are the packed, sequence-parallel-split layout verl packs the replay targets into. Without context
        parallelism (and fp8 padding, or DeepSeek-V4's local-row minimum) that layout is Megatron's THD buffer as the
        forward's ``PackedSeqParams`` describe it: sequence ``i``'s tokens at ``cu_seqlens_q_padded[i]`` onwards, pad
        rows after them. Its classes are runs (:func:`~verl_stable.routing.replay_audit.class_runs`, a few integers per
        sequence) in the slots the parameters verl passed the model give (:meth:`_capture_packing`), and the coverage
        is counted from the runs' bounds; otherwise, or when those parameters do not describe this batch, the classes
        are packed by verl's own ``preprocess_thd_engine`` with the arguments its ``set_router_replay_data`` uses (a
        loop over the sequences: as costly as the rest of the metrics together on a small model).
        """
        input_ids = batch["input_ids"]
        if not getattr(input_ids, "is_nested", False):
            return None
        offsets = input_ids.offsets().cpu()
        layout = response_layout(batch, offsets)
        if layout is None:
            return None
        lengths = offsets.diff()
        response_lengths, trained = layout
        local_cp_size = tu.get_non_tensor_data(data=batch, key="local_cp_size", default=None)

        def rows(packed: Any) -> RowRuns | torch.Tensor:
            slots = None if local_cp_size is not None else self._packed_slots(lengths, packed)
            if slots is not None:
                return self._sequence_parallel_runs(class_runs(lengths, response_lengths, trained, slots))
            classes = packed_row_classes(lengths, response_lengths, trained)
            return self._rows_by_verl(classes, offsets, local_cp_size)

        return rows

    def _capture_packing(self, audit: Audit) -> Callable[..., None]:
        """A forward pre-hook for a model chunk: keeps the ``packed_seq_params`` verl passes it in ``audit``."""

        def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
            audit.packed = kwargs.get("packed_seq_params")

        return hook

    def _packed_slots(self, lengths: torch.Tensor, packed: Any) -> list[int] | None:
        """The rows each sequence occupies in the forward's THD buffer (its tokens, then pad rows), from the
        ``PackedSeqParams`` verl passed the model, or ``None`` where that layout does not apply."""
        from megatron.core import parallel_state as mpu

        config = self.tf_config
        padded = getattr(packed, "cu_seqlens_q_padded", None)
        if (
            padded is None
            or mpu.get_context_parallel_world_size() > 1
            or config.fp8 in ("e4m3", "hybrid")
            or getattr(config, "experimental_attention_variant", None) == "dsv4_hybrid"
        ):
            return None
        bounds = padded.tolist()
        if len(bounds) != lengths.numel() + 1 or bounds[0] != 0:
            return None  # not this batch's sequences
        slots = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        if any(slot < n for slot, n in zip(slots, lengths.tolist(), strict=True)):
            return None
        return slots

    def _sequence_parallel_runs(self, runs: RowRuns) -> RowRuns:
        """The runs of the rows this rank's routers see: the packed buffer's equal consecutive slice of this
        tensor-parallel rank, as verl splits the replay targets (``scatter_to_sequence_parallel_region``; megatron
        requires sequence parallelism for MoE under tensor parallelism)."""
        from megatron.core import parallel_state as mpu

        size = mpu.get_tensor_model_parallel_world_size()
        if size == 1:
            return runs
        share, rank = runs.rows // size, mpu.get_tensor_model_parallel_rank()
        return runs.window(rank * share, (rank + 1) * share)

    def _rows_by_verl(self, classes: torch.Tensor, offsets: torch.Tensor, local_cp_size: int | None) -> torch.Tensor:
        """The router rows' classes packed by verl's ``preprocess_thd_engine``, as verl packs the replay targets."""
        from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region
        from verl.models.mcore.util import preprocess_thd_engine

        device = self._model_device()
        nested = torch.nested.nested_tensor_from_jagged(classes.to(device), offsets=offsets.to(device))
        config = self.tf_config
        dsv4 = getattr(config, "experimental_attention_variant", None) == "dsv4_hybrid"
        with torch.no_grad():
            # the arguments verl's set_router_replay_data packs the replay targets with
            packed, _, _ = preprocess_thd_engine(
                nested,
                pre_process=True,
                use_fp8_padding=config.fp8 in ("e4m3", "hybrid"),
                min_local_rows=config.csa_window_size if dsv4 else None,
                local_cp_size=local_cp_size,
                cp_layout="contiguous" if dsv4 else "zigzag",
            )
            rows = scatter_to_sequence_parallel_region(packed.reshape(-1))
        assert ROW_PADDING == 0  # preprocess_thd_engine fills the pad rows with zeros
        return rows

    def _reduce(self, table: torch.Tensor) -> torch.Tensor:
        """Sum the counts over the groups that split a micro-batch's rows or layers (every rank of them calls)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        groups = []
        if mpu.get_pipeline_model_parallel_world_size() > 1:
            groups.append(mpu.get_pipeline_model_parallel_group())
        if self.tf_config.sequence_parallel and mpu.get_tensor_model_parallel_world_size() > 1:
            groups.append(mpu.get_tensor_model_parallel_group())
        if mpu.get_context_parallel_world_size() > 1:
            groups.append(mpu.get_context_parallel_group())
        for group in groups:
            dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)
        return table

    def _report(self, audit: Audit, data: TensorDict, output: Any) -> None:
        """Attach the micro-batches' metrics to verl's output (the ranks that return metrics)."""
        table = self._reduce(audit.table()).cpu()
        if not isinstance(output, dict) or "metrics" not in output:
            return  # not a last pipeline stage: its counts went into the sum above
        layers = len(audit.ordinals)
        dp_size = int(tu.get_non_tensor_data(data=data, key="dp_size", default=1) or 1)
        for counts in table.tolist():
            measured, unknown, unfitted = counts[-3:]
            if measured == 0:
                continue  # no router replayed in this micro-batch (R2 recording)
            per_layer = counts[: PER_LAYER * layers]
            replayed, differ = per_layer[0::PER_LAYER], per_layer[1::PER_LAYER]
            with_data, own_differs = per_layer[2::PER_LAYER], per_layer[3::PER_LAYER]
            values: dict[str, Any] = dict(disagreement_metrics(replayed, differ))
            values["compared_rows"] = float(sum(replayed))
            values["replayed_rows"] = float(sum(replayed))
            if sum(with_data):
                values["router_disagreement"] = sum(own_differs) / sum(with_data)
                if self.engine_config.router_replay.mode == "R2":  # only update passes replay under R2
                    values["r2_drift"] = values["router_disagreement"]
                    for i, (n, d) in enumerate(zip(with_data, own_differs, strict=True)):
                        values[f"r2_drift/layer_{i}"] = d / max(n, 1)
            metrics = {
                METRIC_PREFIX + key: Metric(aggregation=stable_metric_aggregation(METRIC_PREFIX + key), value=value)
                for key, value in values.items()
            }
            if unfitted:
                self._warn_once(
                    "rows",
                    "router replay coverage not counted: the packed micro-batch does not match the router's rows "
                    "(verl's packing changed?)",
                )
            elif not unknown:
                coverage = counts[PER_LAYER * layers : PER_LAYER * layers + COVERAGE_WIDTH]
                metrics.update(
                    summed_count_metrics(dict(zip(COVERAGE_COUNTS, coverage, strict=True)), dp_size, f"{COVERAGE}/")
                )
            append_to_dict(output["metrics"], metrics)

    def _report_side_reads(self, data: TensorDict, output: Any, side_reads: dict[str, int] | None) -> None:
        """The update mini-step's side-entry read counts, once per mini-step, as on FSDP (the module docstring)."""
        if side_reads is None or not isinstance(output, dict) or "metrics" not in output:
            return
        dp_size = int(tu.get_non_tensor_data(data=data, key="dp_size", default=1) or 1)
        append_to_dict(output["metrics"], side_read_metrics(side_reads, dp_size))

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._audit_warned:
            self._audit_warned.add(key)
            logger.warning("verl-stable: %s", message)


# ------------------------------------------------------------------------------------------- classes
_CLASSES: dict[str, type] = {}


def engine_class(model_type: str = "language_model") -> type:
    """``(MegatronReplayMetricsMixin, verl's Megatron engine for model_type)``, built once, on first use.

    Built lazily: importing this module (the plugin does, in every process) must not import megatron-core.

    Raises:
        KeyError: an unknown model type.
    """
    if model_type not in _CLASSES:
        import importlib

        base = getattr(importlib.import_module(ENGINE_MODULE), BASES[model_type])
        name = base.__name__ + REPLAY_SUFFIX
        _CLASSES[model_type] = type(
            name,
            (MegatronReplayMetricsMixin, base),
            {"__module__": __name__, "__qualname__": name, "__doc__": __doc__},
        )
    return _CLASSES[model_type]


def __getattr__(name: str) -> type:
    # importable (and picklable) by name: verl_stable.integration.megatron_replay.MegatronEngineWithLMHeadReplay
    for model_type, base_name in BASES.items():
        if name == base_name + REPLAY_SUFFIX:
            return engine_class(model_type)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# (device, vendor) keys: verl's get_engine_cls looks these up before the device-only "cuda" key where verl registers
# its own Megatron engine, so ours is selected without replacing verl's registration. On the CPU platform the
# ("cpu", "cpu") key gets engine_class under the Megatron CPU runtime (verl_stable.cpu.megatron.engine), ahead of the
# plain "cpu" key where the CPU runtime registers verl's own class.
VENDOR_KEYS: tuple[tuple[str, str], ...] = (("cuda", "nvidia"), ("cuda", "amd"))
CPU_KEY: tuple[str, str] = ("cpu", "cpu")
BACKEND = "megatron"
MODEL_TYPE = "language_model"
ENGINE_PACKAGE = "verl.workers.engine"  # imports verl's Megatron engine where megatron-core is installed


def register_engine() -> list[str]:
    """Register the language-model class of :func:`engine_class` for every (cuda, vendor) key (idempotent).

    Nothing is registered where verl could not import its Megatron engine (no megatron-core).

    Raises:
        RuntimeError: another engine class already holds one of the keys.
    """
    import importlib

    if getattr(importlib.import_module(ENGINE_PACKAGE), BASES[MODEL_TYPE], None) is None:
        return [f"skipped: verl's Megatron engine is not importable ({ENGINE_PACKAGE}.{BASES[MODEL_TYPE]} is None)"]
    cls = engine_class(MODEL_TYPE)
    classes = {key: cls for key in VENDOR_KEYS}
    from verl_stable.cpu.platform import cpu_selected

    if cpu_selected():
        from verl_stable.cpu.megatron.engine import cpu_engine_class

        classes[CPU_KEY] = cpu_engine_class(MODEL_TYPE, cls)
    purpose = "the Megatron replay metrics"
    return [hold_engine_key(MODEL_TYPE, BACKEND, key, held, purpose) for key, held in classes.items()]


def register() -> list[str]:
    """Plugin step: select the measuring Megatron engine for cuda (nvidia, amd).

    Registers at once when verl's engine package is already imported, else right after it is. A failure of the
    deferred registration is logged, not raised: verl's own engine still replays, only these metrics are missing.
    Returns what is (or will be) registered.
    """
    hook = when_imported(ENGINE_PACKAGE, register_engine, deferred_errors="log")
    if hook.fired:
        return hook.result
    keys = "|".join(f"{k[0]}:{k[1]}" for k in VENDOR_KEYS)
    return [f"engine:{MODEL_TYPE}/{BACKEND}/{keys} (on import of {ENGINE_PACKAGE}, where megatron-core is installed)"]
