"""The rollout boundary: validating and compacting one sample's routing, and counting what crossed.

verl 0.9.1 path (V1 trainer, the default): the server returns ``TokenOutput.routed_experts`` (vLLM layout,
``[rows, num_hidden_layers, top_k]``), the agent loop copies it into ``AgentLoopOutput.routed_experts``, and
``AgentLoopOutput.as_dict`` turns it into int16 ``[prompt_len + response_len, num_hidden_layers, top_k]`` that
``AgentLoopWorkerTQ`` puts into TransferQueue as one row per sample. verl-stable's agent-loop workers
(:mod:`.agent_loop`) replace that last step; this module owns what they run for each sample:

1. decode and validate the routing (:func:`compact_token_routing`): layer map, expert-id range, duplicate ids,
   all-zero MoE rows, row count ``prompt_len + last generated position`` (the last sampled token has no row; tool
   output after the last turn was never fed); an error raises, or with ``+verl_stable.routing.on_invalid=skip_sample``
   the sample is trained with the model's own routing and counted. A response that verl's agent loop cut at
   ``rollout.response_length`` (a multi-turn conversation whose last turn crossed it: verl does not cap a turn at the
   remaining budget) carries one row more, that of its last kept token, which fed only the cut token: it is validated
   with the rest, then trimmed and counted (``trimmed_rows``). The compact result (MoE layers only, smallest unsigned
   dtype, no padding) travels as :data:`~verl_stable.transport.fields.IDS_FIELD` /
   :data:`~verl_stable.transport.fields.SPAN_FIELD`;
2. the sample's boundary counters (:data:`BOUNDARY_FIELD`, :func:`boundary_counters`: tokens, validated rows,
   refusal and its class, bytes moved and what verl would have moved, rows trimmed). verl's V1 trainer logs nothing
   from the agent loop (the manager's ``generate_sequences`` returns ``None`` and the per-sample ``metrics`` field is
   never read), so the trainer reads the counters back (one int64 per column of :data:`BOUNDARY_COLUMNS` and sample;
   the ``stable_*`` trainers in the same TransferQueue read as the monitor's token fields,
   :func:`fetch_transport_metrics` on its own) and logs them as
   ``stable/routing/transport/*`` (:func:`transport_metrics`).

The SGLang reader of verl 0.9.1 is broken: with ``skip_tokenizer_init=True`` (verl's default) it calls
``.numpy()`` on the base64 string in ``meta_info["routed_experts"]``; otherwise it decodes with SGLang's helper as
int32 regardless of ``meta_info["routed_experts_dtype"]`` and reshapes by ``hf_config.num_experts_per_tok``.
:func:`read_sglang_routed_experts` is the fixed reader (vLLM layout out, so the rest of verl is unchanged).

No verl import; TransferQueue is imported only by :func:`fetch_transport_metrics` when no reader is passed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from verl_stable.metric_names import TRANSPORT
from verl_stable.routing.checks import count as checked_count
from verl_stable.routing.codecs import (
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
    encode_vllm,
)
from verl_stable.routing.trace import RoutingLayout
from verl_stable.transport.fields import IDS_FIELD
from verl_stable.transport.options import DEFAULT_OPTIONS, RolloutRoutingOptions

if TYPE_CHECKING:
    from verl_stable.transport.sharing import ShareDecision

__all__ = [
    "BOUNDARY_COLUMNS",
    "BOUNDARY_ERRORS",
    "BOUNDARY_FIELD",
    "TRANSPORT_METRIC_PREFIX",
    "boundary_counters",
    "compact_token_routing",
    "fetch_transport_metrics",
    "generated_extent",
    "merge_stats",
    "read_sglang_routed_experts",
    "transport_metrics",
]

BOUNDARY_FIELD = "stable_routing_boundary"
"""Per-sample int64 ``[len(BOUNDARY_COLUMNS)]`` counters of the rollout boundary, stored next to the compact fields."""
BOUNDARY_COLUMNS = (
    "tokens",
    "recorded_rows",
    "skipped",
    "error_code",
    "bytes",
    "verl_bytes",
    "shared_prompt_rows",
    "side_rows",
    "prompt_rows_differ",
    "trimmed_rows",
)
"""``tokens``: prompt + response tokens; ``recorded_rows``: validated rows kept; ``skipped``: 1 when the sample's
routing was refused under ``on_invalid=skip_sample``; ``error_code``: index of the refusal's class in
:data:`BOUNDARY_ERRORS` (-1: none); ``bytes``: bytes this sample put into TransferQueue (its compact fields, plus the
group's shared prompt rows when this sample put them); ``verl_bytes``: what verl 0.9.1's V1 agent loop would have
stored (int16 over every decoder layer and token position); ``shared_prompt_rows``: leading rows this sample refers
to in the side partition instead of storing; ``side_rows``: rows of the side entry this sample put (0 or its prompt
rows; > 0 once per shared group); ``prompt_rows_differ``: 1 when its prompt rows differed from the group's stored
copy and it kept them whole (see :mod:`.sharing`); ``trimmed_rows``: rows dropped because verl cut the response at
``rollout.response_length`` (0, or 1 for a cut sample: the row of its last kept token, see
:func:`compact_token_routing`)."""
BOUNDARY_ERRORS: tuple[type[RoutingFormatError], ...] = (
    RoutingFormatError,
    LayerMapError,
    RowCountError,
    ExpertIdRangeError,
    DuplicateExpertError,
    ZeroRoutingError,
)
TRANSPORT_METRIC_PREFIX = TRANSPORT


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
    options: RolloutRoutingOptions = DEFAULT_OPTIONS,
    stats: BoundaryStats | None = None,
    response_length: int | None = None,
) -> RoutedRows | None:
    """Validate and compact one sample's ``TokenOutput``/``AgentLoopOutput`` routing (vLLM layout, row 0 = token 0).

    The routing must have ``prompt_len + extent - 1`` rows (``extent``: :func:`generated_extent`), with one
    exception. verl's agent loops cut ``response_ids`` / ``response_mask`` to ``rollout.response_length`` and the
    routing to ``prompt_len + response_length`` rows, and its ``ToolAgentLoop`` does not cap a turn at the budget left,
    so a conversation whose last turn crosses the limit arrives with one row more than the tokens it trains on: the
    row of its last kept token, which fed only the cut token. Such a sample is recognised by its last kept token being
    a generated one at the limit (``extent == response_length``; a sample that was not cut keeps no such row); its
    payload is validated whole, the extra row included, then that row is trimmed and counted in ``stats``
    (``truncated_samples``, ``trimmed_rows``). Any other row count is refused: an extra row on a sample that did not
    reach the limit, more than one extra row (verl keeps at most one), too few rows, and any routing for a sample
    without a generated token (``extent == 0``). Every refusal goes through ``options.on_invalid``.

    Args:
        routed_experts: the engine's ``[rows, num_hidden_layers, top_k]`` routing as the agent loop returned it, or
            ``None`` (no routing exported).
        prompt_len: prompt tokens of the sample.
        response_mask: the sample's response mask (1: generated by the model).
        layout: the served model's layer layout.
        options: the boundary's options (``on_invalid``).
        stats: the sample's counters, updated in place.
        response_length: verl's ``rollout.response_length``, the limit its agent loops cut responses at; ``None``
            (unknown) refuses the extra row of a cut response.

    Returns:
        The validated rows, or ``None`` when the sample carries no usable routing (absent, or refused under
        ``skip_sample``).

    Raises:
        RoutingFormatError: malformed routing under ``on_invalid="raise"`` (its subclasses name the problem).
    """
    if routed_experts is None:
        if stats is not None:
            stats.samples += 1
        return None
    extent = generated_extent(response_mask)
    cut = response_length is not None and extent == checked_count(response_length, "response_length")
    extra = int(cut and extent > 0 and _leading_rows(routed_experts) == prompt_len + extent)
    # decoded with the extra row: every row the engine returned is validated before one is dropped
    rows = decode_with_policy(
        _decode_generated,
        routed_experts,
        prompt_len=prompt_len,
        response_len=extent + extra,
        layout=layout,
        on_invalid=options.on_invalid,
        stats=stats,
    )
    if rows is None or not extra:
        return rows
    if stats is not None:
        stats.truncated_samples += 1
        stats.trimmed_rows += extra
    return RoutedRows(rows.start, rows.ids[: rows.num_rows - extra])


def _decode_generated(routed_experts: Any, *, response_len: int, **kwargs: Any) -> RoutedRows:
    """:func:`~verl_stable.routing.codecs.decode_vllm` of a sample's routing. Routing for a sample without a
    generated token (``response_len == 0``: nothing it trains on was sampled, so no row can be placed) is refused
    here, inside the user's policy: under ``skip_sample`` it is skipped and counted like any other malformed
    payload."""
    if response_len == 0:
        raise RowCountError("routing was returned for a sample without any generated token")
    return decode_vllm(routed_experts, response_len=response_len, **kwargs)


def _leading_rows(routed_experts: Any) -> int | None:
    """Rows of an engine payload (array, tensor or nested lists); ``None`` when it has none to count (the decoder
    then refuses it with the reason)."""
    shape = getattr(routed_experts, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else None
    return len(routed_experts) if isinstance(routed_experts, (list, tuple)) else None


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


def merge_stats(total: BoundaryStats, sample: BoundaryStats) -> None:
    """Add one sample's boundary stats to a worker's running totals."""
    total.samples += sample.samples
    total.skipped_samples += sample.skipped_samples
    total.truncated_samples += sample.truncated_samples
    total.trimmed_rows += sample.trimmed_rows
    for name, count in (sample.errors or {}).items():
        total.errors = total.errors or {}
        total.errors[name] = total.errors.get(name, 0) + count


def boundary_counters(
    fields: Mapping[str, torch.Tensor],
    *,
    seq_len: int,
    layout: RoutingLayout,
    sample_stats: BoundaryStats,
    share: ShareDecision | None = None,
) -> torch.Tensor:
    """One sample's :data:`BOUNDARY_FIELD` from its compact fields, its own (single-sample) stats and how its prompt
    rows travel (``share``; ``None``: sharing off)."""
    error_code = -1
    for name in sample_stats.errors or {}:
        error_code = next((i for i, cls in enumerate(BOUNDARY_ERRORS) if cls.__name__ == name), 0)
    shared_rows = 0 if share is None else share.shared_rows
    side = None if share is None else share.side
    # the counters travel too: count their own bytes; a group's side entry is counted once, by the sample that put it
    nbytes = sum(t.numel() * t.element_size() for t in fields.values()) + 8 * len(BOUNDARY_COLUMNS)
    nbytes += 0 if side is None else side.nbytes
    verl_bytes = 2 * layout.num_hidden_layers * layout.top_k * seq_len
    values = (
        seq_len,
        fields[IDS_FIELD].shape[0] + shared_rows,
        sample_stats.skipped_samples,
        error_code,
        nbytes,
        verl_bytes,
        shared_rows,
        0 if side is None else side.ids.shape[0],
        int(share is not None and share.differs),
        sample_stats.trimmed_rows,
    )
    return torch.tensor(values, dtype=torch.int64)


def transport_metrics(counters: Any, keep: Any = None) -> dict[str, float]:
    """``stable/routing/transport/*`` metrics of a batch from its per-sample :data:`BOUNDARY_FIELD`.

    Args:
        counters: ``[B, len(BOUNDARY_COLUMNS)]`` int64 (a stacked or jagged tensor, or a list of rows).
        keep: optional boolean ``[B]``; False rows (verl's padding samples, copies of real ones) are left out.

    Returns:
        ``samples``, ``skipped_samples``, ``error/<Class>`` counts, ``recorded_rows``, ``missing_positions``
        (tokens of routed samples without a recorded row: each sample's last token, tool output after the last turn),
        ``bytes`` and ``verl_bytes`` moved (shared prompt rows counted once), ``bytes_per_token`` and
        ``bytes_ratio`` (= bytes / verl_bytes); ``truncated_samples`` (samples whose response verl cut at
        ``response_length``, their extra row trimmed) and ``trimmed_rows`` (those rows, also counted in
        ``missing_positions``); ``prompt_groups_shared`` (side entries put),
        ``shared_prompt_rows`` (rows samples referred to instead of storing), ``prompt_rows_deduplicated``
        (``shared_prompt_rows`` minus the rows stored once) and ``prompt_rows_differ`` (samples whose prompt rows
        differed from their group's stored copy).
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
        "truncated_samples": float((col["trimmed_rows"] > 0).sum()),
        "trimmed_rows": float(col["trimmed_rows"].sum()),
        "prompt_groups_shared": float((col["side_rows"] > 0).sum()),
        "shared_prompt_rows": float(col["shared_prompt_rows"].sum()),
        "prompt_rows_deduplicated": float(col["shared_prompt_rows"].sum() - col["side_rows"].sum()),
        "prompt_rows_differ": float(col["prompt_rows_differ"].sum()),
    }
    for i, cls in enumerate(BOUNDARY_ERRORS):
        count = int((col["error_code"] == i).sum())
        if count:
            out[f"error/{cls.__name__}"] = float(count)
    return {TRANSPORT_METRIC_PREFIX + k: v for k, v in out.items()}


def fetch_transport_metrics(batch: Any, kv_batch_get: Any = None) -> dict[str, float]:
    """Trainer side (V1): the transport metrics of a step's ``KVBatchMeta``, ``{}`` when it carries no counters.

    One TransferQueue read of 8 bytes per column of :data:`BOUNDARY_COLUMNS` and sample; verl's padding samples
    (``tag["is_padding"]``) are left out.
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
