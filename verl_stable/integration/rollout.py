"""Rollout side of R3 in verl: validated, compact routing from the inference server to the actors.

verl 0.9.1 path (V1 trainer, the default): the server returns ``TokenOutput.routed_experts`` (vLLM layout,
``[rows, num_hidden_layers, top_k]``), the agent loop copies it into ``AgentLoopOutput.routed_experts``, and
``AgentLoopOutput.as_dict`` turns it into int16 ``[prompt_len + response_len, num_hidden_layers, top_k]`` that
``AgentLoopWorkerTQ`` puts into TransferQueue as one row per sample; the actors read it back as a jagged tensor.

verl-stable replaces that last step. :class:`CompactRoutingAgentLoopManagerTQ` (selected with
``+actor_rollout_ref.rollout.agent.agent_loop_manager_class=verl_stable.integration.rollout.CompactRoutingAgentLoopManagerTQ``)
starts agent-loop workers that, before the sample is stored:

1. decode and validate the routing at the boundary (:func:`compact_token_routing`): layer map, expert-id range,
   duplicate ids, all-zero MoE rows, row count ``prompt_len + last generated position`` (the last sampled token has
   no row; tool output after the last turn was never fed); an error raises, or with
   ``+verl_stable.routing.on_invalid=skip_sample`` the sample is trained with the model's own routing and counted;
2. store only the MoE layers in the smallest unsigned dtype, without padding, as the per-sample fields
   :data:`~verl_stable.routing.transport.IDS_FIELD` / :data:`~verl_stable.routing.transport.SPAN_FIELD` instead of
   verl's ``routed_experts``;
3. store the sample's boundary counters (:data:`BOUNDARY_FIELD`: tokens, validated rows, refusal and its class,
   bytes moved and what verl would have moved). verl's V1 trainer logs nothing from the agent loop (the manager's
   ``generate_sequences`` returns ``None`` and the per-sample ``metrics`` field is never read), so the trainer reads
   the counters back with :func:`fetch_transport_metrics` (one 48-byte field per sample) and logs them as
   ``stable/routing/transport/*``.

Prompt rows are stored once per *sample* on this path, not once per group: verl's V1 agent loop runs the
``rollout.n`` sessions of a prompt as independent tasks that each put their own TransferQueue row as soon as they
finish (``AgentLoopWorkerTQ._agent_loop_postprocess``, key ``{uid}_{session}_{i}``), and the trainer then balances,
filters and shuffles those rows individually across data-parallel ranks and mini-batches. Sharing the prompt rows
would make one sample's replay depend on a sibling's row that may sit on another rank, in another mini-batch, or be
dropped (failed session, staleness or rejection filters), i.e. a cross-rank TransferQueue read per mini-batch and a
lifetime rule for a row that is not a sample. The cost of not sharing (bytes per real token, Qwen3-30B-A3B shape,
``benchmarks/bench_routing_transport.py``'s batch builder; verl V1 stores 768): 384 per sample vs 313 once per group
for n = 8, prompts up to 1k and responses up to 4k tokens (1.23x); 287 for n = 16 (1.34x); with prompts up to 4k,
196 (n = 8, 1.96x) and 171 (n = 16, 2.25x). :class:`~verl_stable.routing.transport.PackedRouting` deduplicates where
a whole batch travels as one object.

The actor rebuilds the token-aligned :class:`~verl_stable.routing.trace.RoutingTrace` of a micro-batch with
:func:`routing_trace_from_batch`, or verl's own jagged ``routed_experts`` (for a replay engine written against verl's
layout) with :func:`expand_compact_routing`.

The SGLang reader of verl 0.9.1 is broken: with ``skip_tokenizer_init=True`` (verl's default) it calls
``.numpy()`` on the base64 string in ``meta_info["routed_experts"]``; otherwise it decodes with SGLang's helper as
int32 regardless of ``meta_info["routed_experts_dtype"]`` and reshapes by ``hf_config.num_experts_per_tok``.
:func:`read_sglang_routed_experts` is the fixed reader (vLLM layout out, so the rest of verl is unchanged).

Heavy verl imports (agent loop, TransferQueue, Ray) happen only when the manager/worker classes are first used.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import torch

from verl_stable.routing.codecs import (
    ON_INVALID,
    BoundaryStats,
    DuplicateExpertError,
    ExpertIdRangeError,
    LayerMapError,
    RoutedRows,
    RoutingFormatError,
    RowCountError,
    ZeroRoutingError,
    decode_sglang,
    decode_vllm,
    decode_with_policy,
    encode_verl_batch,
    encode_vllm,
    rows_to_trace,
)
from verl_stable.routing.families import layout_from_config
from verl_stable.routing.trace import RoutingLayout, RoutingTrace
from verl_stable.routing.transport import IDS_FIELD, SPAN_FIELD, rows_from_fields, sample_fields

logger = logging.getLogger("verl_stable.routing")

__all__ = [  # noqa: F822 - the verl subclasses are built lazily by the module __getattr__
    "CompactRoutingAgentLoopManagerTQ",
    "CompactRoutingAgentLoopWorkerTQ",
    "BOUNDARY_COLUMNS",
    "BOUNDARY_FIELD",
    "TRANSPORT_METRIC_PREFIX",
    "RolloutRoutingOptions",
    "boundary_counters",
    "compact_agent_loop_output",
    "fetch_transport_metrics",
    "transport_metrics",
    "compact_token_routing",
    "expand_compact_routing",
    "generated_extent",
    "read_sglang_routed_experts",
    "register",
    "routing_trace_from_batch",
]

MANAGER_FQN = "verl_stable.integration.rollout.CompactRoutingAgentLoopManagerTQ"

BOUNDARY_FIELD = "stable_routing_boundary"
"""Per-sample int64 ``[len(BOUNDARY_COLUMNS)]`` counters of the rollout boundary, stored next to the compact fields."""
BOUNDARY_COLUMNS = ("tokens", "recorded_rows", "skipped", "error_code", "bytes", "verl_bytes")
"""``tokens``: prompt + response tokens; ``recorded_rows``: validated rows kept; ``skipped``: 1 when the sample's
routing was refused under ``on_invalid=skip_sample``; ``error_code``: index of the refusal's class in
:data:`BOUNDARY_ERRORS` (-1: none); ``bytes``: bytes of the compact fields; ``verl_bytes``: what verl 0.9.1's V1
agent loop would have stored (int16 over every decoder layer and token position)."""
BOUNDARY_ERRORS: tuple[type[RoutingFormatError], ...] = (
    RoutingFormatError,
    LayerMapError,
    RowCountError,
    ExpertIdRangeError,
    DuplicateExpertError,
    ZeroRoutingError,
)
TRANSPORT_METRIC_PREFIX = "stable/routing/transport/"


@dataclass(frozen=True)
class RolloutRoutingOptions:
    """User options, read from ``verl_stable.routing`` in the trainer config (``+verl_stable.routing.on_invalid=...``).

    Attributes:
        on_invalid: ``"raise"`` (default) or ``"skip_sample"`` (train that sample with the model's own routing,
            count it in ``stable/routing/*`` and log a warning).
    """

    on_invalid: str = "raise"

    def __post_init__(self) -> None:
        if self.on_invalid not in ON_INVALID:
            raise ValueError(f"verl_stable.routing.on_invalid must be one of {ON_INVALID}, got {self.on_invalid!r}")

    @classmethod
    def from_config(cls, config: Any) -> RolloutRoutingOptions:
        """From the whole trainer config (DictConfig or mapping); missing section = defaults."""
        section = config.get("verl_stable", None) if isinstance(config, Mapping) or hasattr(config, "get") else None
        routing = section.get("routing", None) if section is not None else None
        if routing is None:
            return cls()
        return cls(on_invalid=str(routing.get("on_invalid", "raise")))


def generated_extent(response_mask: Any) -> int:
    """Response tokens up to and including the last LLM-generated one (``response_mask == 1``).

    The engine's last call saw everything before its last sampled token, so routing rows cover token positions
    ``[0, prompt_len + generated_extent - 1)`` for single- and multi-turn loops alike (tool tokens after the last
    generation were never fed through the model).
    """
    mask = np.asarray(response_mask.tolist() if isinstance(response_mask, torch.Tensor) else response_mask)
    hits = np.flatnonzero(mask)
    return int(hits[-1]) + 1 if hits.size else 0


def compact_token_routing(
    routed_experts: Any,
    *,
    prompt_len: int,
    response_mask: Any,
    layout: RoutingLayout,
    options: RolloutRoutingOptions = RolloutRoutingOptions(),
    stats: BoundaryStats | None = None,
) -> RoutedRows | None:
    """Validate and compact one sample's ``TokenOutput``/``AgentLoopOutput`` routing (vLLM layout, row 0 = token 0).

    Returns ``None`` when the sample carries no usable routing (absent, or refused under ``skip_sample``).
    """
    if routed_experts is None:
        if stats is not None:
            stats.samples += 1
        return None
    extent = generated_extent(response_mask)
    if extent == 0:
        raise RowCountError("routing was returned for a sample without any generated token")
    return decode_with_policy(
        decode_vllm,
        routed_experts,
        prompt_len=prompt_len,
        response_len=extent,
        layout=layout,
        on_invalid=options.on_invalid,
        stats=stats,
    )


def read_sglang_routed_experts(output: Mapping[str, Any], *, prompt_len: int, layout: RoutingLayout) -> np.ndarray:
    """The fixed SGLang 0.5.12 reader: one ``generate`` result -> ``TokenOutput.routed_experts`` in vLLM layout.

    Accepts the base64 string (any ``routed_experts_dtype``) or an already decoded array/tensor, validates it and
    returns ``[prompt_len + n_output - 1, num_hidden_layers, top_k]`` uint8/uint16 with zero dense layers.
    """
    meta_info = output.get("meta_info", {}) or {}
    response_len = len(output.get("output_ids", []) or [])
    rows = decode_sglang(meta_info, prompt_len=prompt_len, response_len=response_len, layout=layout)
    if rows.start != 0:
        raise RowCountError(
            f"SGLang routed_experts_start_len={rows.start}: verl's agent loop aligns TokenOutput routing from the "
            "first prompt token, so a request for it must not set routed_experts_start_len"
        )
    return encode_vllm(rows, layout)


def _sequence_lengths(data: Any) -> list[int]:
    if "input_ids" in data.keys() and data["input_ids"].is_nested:
        return data["input_ids"].offsets().diff().tolist()
    if "prompts" in data.keys() and data["prompts"].is_nested:
        return (data["prompts"].offsets().diff() + data["responses"].offsets().diff()).tolist()
    raise RowCountError("cannot tell sequence lengths: expected jagged input_ids or prompts/responses")


def _batch_rows(data: Any, lengths: list[int]) -> list[RoutedRows | None]:
    """Per-sample rows of a batch; verl's synthetic padding samples get none.

    verl's V1 trainer pads a batch to a divisible size with copies of a real sample's fields on a synthetic
    ``SYNTHETIC_PADDING_SEQ_LEN`` sequence with an all-zero ``response_mask`` (``padding_utils``), so their copied
    routing overruns their tokens. Such a sample trains nothing and gets no routing; an overrun on a sample with
    generated tokens is an error.
    """
    rows: list[RoutedRows | None] = list(rows_from_fields(data[IDS_FIELD], data[SPAN_FIELD]))
    masks = None
    for i, (sample, length) in enumerate(zip(rows, lengths, strict=True)):
        if sample is None or sample.stop <= length:
            continue
        if masks is None:
            if "response_mask" not in data.keys():
                raise RowCountError(f"sample {i}: routing covers positions up to {sample.stop} of {length} tokens")
            mask = data["response_mask"]
            masks = list(mask.unbind()) if mask.is_nested else list(mask.unbind(0))
        if masks[i].any():
            raise RowCountError(f"sample {i}: routing covers positions up to {sample.stop} of its {length} tokens")
        rows[i] = None
    return rows


def routing_trace_from_batch(data: Any, layout: RoutingLayout) -> RoutingTrace | None:
    """Actor side: the token-aligned RoutingTrace of a (micro-)batch carrying the compact fields, else ``None``.

    Sequence ``i`` has ``prompt_len_i + response_len_i`` rows (``prompts`` / ``responses`` as stored per sample,
    or ``input_ids``), in the order of the sample's tokens, valid where the engine recorded routing.
    """
    if IDS_FIELD not in data.keys():
        return None
    lengths = _sequence_lengths(data)
    return rows_to_trace(_batch_rows(data, lengths), lengths, layout)


MANAGER_CONFIG_KEY = "actor_rollout_ref.rollout.agent.agent_loop_manager_class"


def uses_compact_routing(config: Any) -> bool:
    """Whether a verl config runs the compact-routing agent-loop manager with rollout routing export on."""
    from omegaconf import OmegaConf

    fqn = OmegaConf.select(config, MANAGER_CONFIG_KEY, default=None)
    export = OmegaConf.select(config, "actor_rollout_ref.rollout.enable_rollout_routing_replay", default=False)
    return bool(export) and isinstance(fqn, str) and fqn.rsplit(".", 1)[-1] == "CompactRoutingAgentLoopManagerTQ"


def expand_compact_routing(data: Any, layout: RoutingLayout) -> bool:
    """Actor side, per (mini-/micro-)batch: add verl's ``routed_experts`` from the compact fields, in place.

    Produces verl's V1 form, jagged int16 ``[B, (prompt_len_i + response_len_i), num_hidden_layers, top_k]`` aligned
    with the jagged ``input_ids``, zero rows where nothing was recorded, so a replay engine written for verl's layout
    (the FSDP engine, verl's Megatron/VeOmni replay) consumes it unchanged. The expansion lives only on the actor,
    transiently; transport stays compact. Returns True when it added the field.
    """
    if IDS_FIELD not in data.keys() or "routed_experts" in data.keys():
        return False
    input_ids = data["input_ids"]
    if not input_ids.is_nested:
        raise RowCountError("expanding compact routing needs jagged input_ids (verl's V1 / TransferQueue batches)")
    lengths = input_ids.offsets().diff().tolist()
    rows = [r if r is not None else _no_rows(layout) for r in _batch_rows(data, lengths)]
    data["routed_experts"] = encode_verl_batch(rows, layout, lengths, nested=True).to(input_ids.device)
    return True


# ------------------------------------------------------------------------------------------ boundary metrics
def _merge_stats(total: BoundaryStats, sample: BoundaryStats) -> None:
    total.samples += sample.samples
    total.skipped_samples += sample.skipped_samples
    for name, count in (sample.errors or {}).items():
        total.errors = total.errors or {}
        total.errors[name] = total.errors.get(name, 0) + count


def boundary_counters(
    fields: Mapping[str, torch.Tensor], *, seq_len: int, layout: RoutingLayout, sample_stats: BoundaryStats
) -> torch.Tensor:
    """One sample's :data:`BOUNDARY_FIELD` from its compact fields and its own (single-sample) stats."""
    error_code = -1
    for name in sample_stats.errors or {}:
        error_code = next((i for i, cls in enumerate(BOUNDARY_ERRORS) if cls.__name__ == name), 0)
    # the counters travel too: count their own bytes
    nbytes = sum(t.numel() * t.element_size() for t in fields.values()) + 8 * len(BOUNDARY_COLUMNS)
    verl_bytes = 2 * layout.num_hidden_layers * layout.top_k * seq_len
    values = (seq_len, fields[IDS_FIELD].shape[0], sample_stats.skipped_samples, error_code, nbytes, verl_bytes)
    return torch.tensor(values, dtype=torch.int64)


def transport_metrics(counters: Any, keep: Any = None) -> dict[str, float]:
    """``stable/routing/transport/*`` metrics of a batch from its per-sample :data:`BOUNDARY_FIELD`.

    Args:
        counters: ``[B, len(BOUNDARY_COLUMNS)]`` int64 (a stacked or jagged tensor, or a list of rows).
        keep: optional boolean ``[B]``; False rows (verl's padding samples, copies of real ones) are left out.

    Returns:
        ``samples``, ``skipped_samples``, ``error/<Class>`` counts, ``recorded_rows``, ``missing_positions``
        (tokens of routed samples without a recorded row: each sample's last token, tool output after the last turn),
        ``bytes`` and ``verl_bytes`` moved, ``bytes_per_token`` and ``bytes_ratio`` (= bytes / verl_bytes).
    """
    rows = list(counters.unbind(0)) if isinstance(counters, torch.Tensor) else list(counters)
    table = torch.stack([torch.as_tensor(r, dtype=torch.int64).reshape(-1) for r in rows]) if rows else None
    if table is None or table.shape[1] != len(BOUNDARY_COLUMNS):
        raise RowCountError(
            f"{BOUNDARY_FIELD} rows must have {len(BOUNDARY_COLUMNS)} columns {BOUNDARY_COLUMNS}, got "
            f"{None if table is None else tuple(table.shape)}"
        )
    if keep is not None:
        mask = torch.as_tensor(np.asarray(keep, dtype=bool))
        if mask.shape != (table.shape[0],):
            raise RowCountError(f"keep has shape {tuple(mask.shape)}, expected ({table.shape[0]},)")
        table = table[mask]
    col = {name: table[:, i] for i, name in enumerate(BOUNDARY_COLUMNS)}
    routed = col["recorded_rows"] > 0
    tokens, nbytes, verl_bytes = int(col["tokens"].sum()), int(col["bytes"].sum()), int(col["verl_bytes"].sum())
    out = {
        "samples": float(table.shape[0]),
        "skipped_samples": float(col["skipped"].sum()),
        "recorded_rows": float(col["recorded_rows"].sum()),
        "missing_positions": float((col["tokens"][routed] - col["recorded_rows"][routed]).sum()),
        "bytes": float(nbytes),
        "verl_bytes": float(verl_bytes),
        "bytes_per_token": nbytes / max(tokens, 1),
        "bytes_ratio": nbytes / max(verl_bytes, 1),
    }
    for i, cls in enumerate(BOUNDARY_ERRORS):
        count = int((col["error_code"] == i).sum())
        if count:
            out[f"error/{cls.__name__}"] = float(count)
    return {TRANSPORT_METRIC_PREFIX + k: v for k, v in out.items()}


def fetch_transport_metrics(batch: Any, kv_batch_get: Any = None) -> dict[str, float]:
    """Trainer side (V1): the transport metrics of a step's ``KVBatchMeta``, ``{}`` when it carries no counters.

    One TransferQueue read of 48 bytes per sample; verl's padding samples (``tag["is_padding"]``) are left out.
    """
    if kv_batch_get is None:
        import transfer_queue as tq

        kv_batch_get = tq.kv_batch_get
    try:
        data = kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=[BOUNDARY_FIELD])
    except ValueError as exc:  # TransferQueue refuses a field no sample has (routing export off)
        if BOUNDARY_FIELD not in str(exc):
            raise
        return {}
    keep = [not (tag or {}).get("is_padding", False) for tag in batch.tags] if batch.tags else None
    if keep is not None and not any(keep):
        keep = None
    return transport_metrics(data[BOUNDARY_FIELD], keep)


def _no_rows(layout: RoutingLayout) -> RoutedRows:
    return RoutedRows(0, np.zeros((0, layout.num_moe_layers, layout.top_k), dtype=np.uint8))


# ------------------------------------------------------------------------------------------- verl classes
def compact_agent_loop_output(
    output: Any,
    layout: RoutingLayout,
    options: RolloutRoutingOptions = RolloutRoutingOptions(),
    stats: BoundaryStats | None = None,
) -> Any:
    """An ``AgentLoopOutput`` whose ``as_dict`` emits the compact fields instead of verl's int16 ``routed_experts``.

    Besides :data:`IDS_FIELD` / :data:`SPAN_FIELD` it emits :data:`BOUNDARY_FIELD` (this sample's counters, read by
    :func:`fetch_transport_metrics` on the trainer); ``stats`` accumulates the worker's running totals.
    """
    output_cls = _classes()["output"]
    sample_stats = BoundaryStats()
    try:
        rows = compact_token_routing(
            output.routed_experts,
            prompt_len=len(output.prompt_ids),
            response_mask=output.response_mask,
            layout=layout,
            options=options,
            stats=sample_stats,
        )
    finally:
        if stats is not None:
            _merge_stats(stats, sample_stats)
    seq_len = len(output.prompt_ids) + len(output.response_ids)
    output.extra_fields["stable_routing_missing_positions"] = seq_len - (0 if rows is None else rows.num_rows)
    output.extra_fields["stable_routing_skipped"] = int(output.routed_experts is not None and rows is None)
    values = {name: getattr(output, name) for name in type(output).model_fields}
    values["routed_experts"] = None
    values.pop("compact_routing", None)
    compact = output_cls.model_construct(
        _fields_set=set(output.model_fields_set) - {"routed_experts"}, **values, compact_routing=None
    )
    fields = sample_fields(rows, layout)
    fields[BOUNDARY_FIELD] = boundary_counters(fields, seq_len=seq_len, layout=layout, sample_stats=sample_stats)
    compact.compact_routing = fields
    return compact


@cache
def _classes() -> dict[str, Any]:
    """Build the verl subclasses on first use (keeps ``import verl`` light in every process)."""
    import ray
    from pydantic import ConfigDict
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ, AgentLoopWorkerTQ

    class CompactRoutingAgentLoopOutput(AgentLoopOutput):
        """AgentLoopOutput carrying the compact routing fields (see module docstring)."""

        model_config = ConfigDict(arbitrary_types_allowed=True)
        compact_routing: Any = None

        def as_dict(self) -> dict[str, Any]:
            fields = self.compact_routing
            out = super().as_dict()
            out.pop("compact_routing", None)
            out.pop("routed_experts", None)
            if fields is not None:
                out.update(fields)
            return out

    base_worker = AgentLoopWorkerTQ.__ray_actor_class__

    class CompactRoutingWorker(base_worker):
        """AgentLoopWorkerTQ that validates and compacts routing before it enters TransferQueue."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.stable_routing_enabled = bool(self.rollout_config.enable_rollout_routing_replay)
            self.stable_routing_options = RolloutRoutingOptions.from_config(self.config)
            self.stable_routing_stats = BoundaryStats()
            self.stable_routing_layout = (
                layout_from_config(self.model_config.hf_config) if self.stable_routing_enabled else None
            )

        def _stable_compact(self, output: Any) -> Any:
            return compact_agent_loop_output(
                output, self.stable_routing_layout, self.stable_routing_options, self.stable_routing_stats
            )

        async def _agent_loop_postprocess(self, output: Any, validate: bool, **kwargs: Any) -> Any:
            if self.stable_routing_enabled:
                output = (
                    [self._stable_compact(o) for o in output]
                    if isinstance(output, list)
                    else self._stable_compact(output)
                )
            return await super()._agent_loop_postprocess(output, validate, **kwargs)

        def stable_routing_metrics(self) -> dict[str, float]:
            """Boundary counters of this worker (``stable/routing/*``)."""
            return self.stable_routing_stats.as_metrics()

    remote_worker = ray.remote(CompactRoutingWorker)

    class CompactRoutingManager(AgentLoopManagerTQ):
        """AgentLoopManagerTQ whose workers carry compact, validated routing (select it by FQN, see module doc)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.agent_loop_workers_class = remote_worker

    CompactRoutingAgentLoopOutput.__name__ = CompactRoutingAgentLoopOutput.__qualname__ = (
        "CompactRoutingAgentLoopOutput"
    )
    CompactRoutingWorker.__name__ = CompactRoutingWorker.__qualname__ = "CompactRoutingAgentLoopWorkerTQ"
    CompactRoutingManager.__name__ = CompactRoutingManager.__qualname__ = "CompactRoutingAgentLoopManagerTQ"
    for cls in (CompactRoutingAgentLoopOutput, CompactRoutingWorker, CompactRoutingManager):
        cls.__module__ = __name__
    return {
        "output": CompactRoutingAgentLoopOutput,
        "worker": CompactRoutingWorker,
        "manager": CompactRoutingManager,
    }


_LAZY = {
    "CompactRoutingAgentLoopOutput": "output",
    "CompactRoutingAgentLoopWorkerTQ": "worker",
    "CompactRoutingAgentLoopManagerTQ": "manager",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return _classes()[_LAZY[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> list[str]:
    """Plugin step: check the verl interfaces this module relies on (cheaply); nothing is registered in verl.

    The manager is chosen by FQN in the config, so no verl registry is touched. The check runs at ``import verl``
    in every process, so it only inspects light modules.
    """
    from verl.workers.config.rollout import AgentLoopConfig
    from verl.workers.rollout.replica import TokenOutput

    if "routed_experts" not in TokenOutput.model_fields:
        raise RuntimeError("verl's TokenOutput has no routed_experts field: rollout routing export cannot work")
    if "agent_loop_manager_class" not in {f.name for f in AgentLoopConfig.__dataclass_fields__.values()}:
        raise RuntimeError("verl's AgentLoopConfig has no agent_loop_manager_class: cannot select the compact manager")
    return [
        f"rollout routing: {MANAGER_FQN} (select via +actor_rollout_ref.rollout.agent.agent_loop_manager_class, not in verl's yaml)"
    ]
