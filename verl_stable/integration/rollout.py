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

Prompt rows travel once per *group* (``+verl_stable.routing.share_prompt_rows``, default true; ``false`` keeps
every row with its sample). verl's V1 agent loop runs the ``rollout.n`` sessions of a prompt in one worker
(``AgentLoopWorkerTQ._run_prompt``) as independent tasks that each put their own TransferQueue row as soon as they
finish (key ``{uid}_{session}_{i}``); the trainer then balances, filters and shuffles those rows individually across
data-parallel ranks and mini-batches. So the shared copy is a TransferQueue entry of its own, not a sample:

1. worker: the first finished sample of a group (more than one sample) puts its validated prompt rows
   ``[start, prompt_len)`` into the partition :data:`PROMPT_PARTITION` (verl's trainer samples only ``train`` /
   ``val``), under a 128-bit key of the uid, partition, start and the rows' bytes (:func:`prompt_rows_key`), before
   its own row. A sibling whose prompt rows are identical stores only its later rows plus :data:`PROMPT_REF_FIELD`
   (24 bytes) and waits for that put; a sibling whose rows differ (an engine may route the same prompt differently
   across requests) keeps all its rows and is counted (never another sample's routing). The per-worker cache
   (:class:`PromptRowSharing`) holds in-flight groups only;
2. actor: :func:`expand_compact_routing` / :func:`routing_trace_from_batch` first re-attach the prompt rows
   (:func:`attach_shared_prompt_rows`: one ``kv_batch_get`` of the (mini-)batch's distinct entries); a missing entry
   raises :class:`SharedPromptRowsError`. Each data-parallel rank reads the entries of the groups it holds;
3. lifetime: entries whose group has no key left in ``train`` / ``val`` are cleared
   (:func:`clear_stale_prompt_rows`) by every worker when verl dispatches new prompts (any trainer class) and by
   the stable trainers (``trainer.v1.trainer_mode=stable_*``) at every step start and after the last step, so they
   follow verl's own ``kv_clear`` (after the step, on DAPO/failure eviction, after validation) within a step.

``stable/routing/transport/bytes`` counts what the rollout put: each group's entry once (by the sample that put it),
plus ``prompt_groups_shared``, ``shared_prompt_rows``, ``prompt_rows_deduplicated`` and ``prompt_rows_differ``.
Bytes per real token on this path (Qwen3-30B-A3B shape, batch builder of ``benchmarks/bench_routing_transport.py``,
fields + counters; verl V1 stores 768): responses up to 4k, prompts up to 1k: 384 per sample vs 314 per group for
n = 8 (1.22x), 287 for n = 16 (1.34x); prompts up to 4k: 213 (n = 8, 1.80x) and 171 (n = 16, 2.25x).
:class:`~verl_stable.routing.transport.PackedRouting` deduplicates the same way where a whole batch travels as one
object.

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

import asyncio
import hashlib
import logging
import struct
from collections.abc import Mapping, Sequence
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
    "PROMPT_PARTITION",
    "PROMPT_REF_FIELD",
    "PromptRowSharing",
    "ShareDecision",
    "SharedPrompt",
    "SharedPromptRowsError",
    "attach_shared_prompt_rows",
    "async_clear_stale_prompt_rows",
    "clear_stale_prompt_rows",
    "stale_prompt_entries",
    "key_of_ref",
    "prompt_ref",
    "prompt_rows_key",
    "shared_sample_fields",
]

MANAGER_FQN = "verl_stable.integration.rollout.CompactRoutingAgentLoopManagerTQ"

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
)
"""``tokens``: prompt + response tokens; ``recorded_rows``: validated rows kept; ``skipped``: 1 when the sample's
routing was refused under ``on_invalid=skip_sample``; ``error_code``: index of the refusal's class in
:data:`BOUNDARY_ERRORS` (-1: none); ``bytes``: bytes this sample put into TransferQueue (its compact fields, plus the
group's shared prompt rows when this sample put them); ``verl_bytes``: what verl 0.9.1's V1 agent loop would have
stored (int16 over every decoder layer and token position); ``shared_prompt_rows``: leading rows this sample refers
to in :data:`PROMPT_PARTITION` instead of storing; ``side_rows``: rows of the side entry this sample put (0 or its
prompt rows; > 0 once per shared group); ``prompt_rows_differ``: 1 when its prompt rows differed from the group's
stored copy and it kept them whole."""
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
        share_prompt_rows: store the prompt rows once per group in :data:`PROMPT_PARTITION` (default on;
            ``+verl_stable.routing.share_prompt_rows=false`` keeps them with every sample).
    """

    on_invalid: str = "raise"
    share_prompt_rows: bool = True

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
        share = routing.get("share_prompt_rows", True)
        if not isinstance(share, bool):
            raise ValueError(f"verl_stable.routing.share_prompt_rows must be true or false, got {share!r}")
        return cls(on_invalid=str(routing.get("on_invalid", "raise")), share_prompt_rows=share)


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


def routing_trace_from_batch(data: Any, layout: RoutingLayout, kv_batch_get: Any = None) -> RoutingTrace | None:
    """Actor side: the token-aligned RoutingTrace of a (micro-)batch carrying the compact fields, else ``None``.

    Sequence ``i`` has ``prompt_len_i + response_len_i`` rows (``prompts`` / ``responses`` as stored per sample,
    or ``input_ids``), in the order of the sample's tokens, valid where the engine recorded routing. Shared prompt
    rows are re-attached first (:func:`attach_shared_prompt_rows`, reading with ``kv_batch_get``, default
    TransferQueue's).
    """
    if IDS_FIELD not in data.keys():
        return None
    attach_shared_prompt_rows(data, kv_batch_get)
    lengths = _sequence_lengths(data)
    return rows_to_trace(_batch_rows(data, lengths), lengths, layout)


MANAGER_CONFIG_KEY = "actor_rollout_ref.rollout.agent.agent_loop_manager_class"


def uses_compact_routing(config: Any) -> bool:
    """Whether a verl config runs the compact-routing agent-loop manager with rollout routing export on."""
    from omegaconf import OmegaConf

    fqn = OmegaConf.select(config, MANAGER_CONFIG_KEY, default=None)
    export = OmegaConf.select(config, "actor_rollout_ref.rollout.enable_rollout_routing_replay", default=False)
    return bool(export) and isinstance(fqn, str) and fqn.rsplit(".", 1)[-1] == "CompactRoutingAgentLoopManagerTQ"


def expand_compact_routing(data: Any, layout: RoutingLayout, kv_batch_get: Any = None) -> bool:
    """Actor side, per (mini-/micro-)batch: add verl's ``routed_experts`` from the compact fields, in place.

    Produces verl's V1 form, jagged int16 ``[B, (prompt_len_i + response_len_i), num_hidden_layers, top_k]`` aligned
    with the jagged ``input_ids``, zero rows where nothing was recorded, so a replay engine written for verl's layout
    (the FSDP engine, verl's Megatron/VeOmni replay) consumes it unchanged. The expansion lives only on the actor,
    transiently; transport stays compact. Shared prompt rows are re-attached first
    (:func:`attach_shared_prompt_rows`: one ``kv_batch_get`` of the batch's groups, default TransferQueue's).
    Returns True when it added the field.
    """
    if IDS_FIELD not in data.keys() or "routed_experts" in data.keys():
        return False
    input_ids = data["input_ids"]
    if not input_ids.is_nested:
        raise RowCountError("expanding compact routing needs jagged input_ids (verl's V1 / TransferQueue batches)")
    attach_shared_prompt_rows(data, kv_batch_get)
    lengths = input_ids.offsets().diff().tolist()
    rows = [r if r is not None else _no_rows(layout) for r in _batch_rows(data, lengths)]
    data["routed_experts"] = encode_verl_batch(rows, layout, lengths, nested=True).to(input_ids.device)
    return True


# ------------------------------------------------------------------------------- prompt rows once per group
PROMPT_PARTITION = "stable_routing_prompts"
"""TransferQueue partition of the shared prompt rows. verl's V1 trainer samples only ``train`` / ``val``; its
ReplayBuffer lists every partition but never materialises keys of another one."""
PROMPT_REF_FIELD = "stable_routing_prompt_ref"
"""Per-sample int64 ``[3]``: ``(rows, key_hi, key_lo)``. ``rows > 0``: the sample's first ``rows`` routing rows are
not in its :data:`IDS_FIELD` but in the :data:`PROMPT_PARTITION` entry whose key is the 16 bytes ``key_hi, key_lo``
(big-endian) in hex; ``rows == 0``: the sample carries all its rows (not shared, or already re-attached)."""
SOURCE_PARTITIONS = ("train", "val")
"""verl V1's sample partitions (``AgentLoopWorkerTQ``): a side entry lives while its group has a key in one."""


class SharedPromptRowsError(RowCountError):
    """A sample refers to shared prompt rows that TransferQueue does not hold (cleared too early, or never put)."""


def prompt_rows_key(uid: str, partition: str, start: int, ids: torch.Tensor) -> str:
    """Side-entry key: 128-bit BLAKE2b of the group, its partition, the first covered position and the rows' bytes.

    The rows' content is part of the key, so two writers of one group (or a retried put) can only write identical
    entries, and a sibling whose rows differ can never resolve to another sample's routing.
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{uid}\x00{partition}\x00{start}\x00{tuple(ids.shape)}\x00{ids.dtype}\x00".encode())
    digest.update(ids.contiguous().numpy().tobytes())
    return digest.hexdigest()


def prompt_ref(key: str | None, rows: int) -> torch.Tensor:
    """The :data:`PROMPT_REF_FIELD` value (``key=None``: not shared)."""
    if key is None:
        return torch.zeros(3, dtype=torch.int64)
    hi, lo = struct.unpack(">qq", bytes.fromhex(key))
    return torch.tensor([rows, hi, lo], dtype=torch.int64)


def key_of_ref(ref: torch.Tensor | Sequence[int]) -> str:
    """Inverse of :func:`prompt_ref`: the side-entry key of a shared sample's reference."""
    _, hi, lo = (int(v) for v in ref)
    return struct.pack(">qq", hi, lo).hex()


@dataclass(frozen=True)
class SharedPrompt:
    """One side entry to put into :data:`PROMPT_PARTITION` (before the sample that refers to it).

    Attributes:
        key: :func:`prompt_rows_key`.
        ids: ``[rows, num_moe_layers, top_k]`` prompt rows.
        tag: ``{"uid", "partition", "rows"}``; ``uid``/``partition`` decide its lifetime
            (:func:`clear_stale_prompt_rows`).
    """

    key: str
    ids: torch.Tensor
    tag: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return self.ids.numel() * self.ids.element_size()


@dataclass(frozen=True)
class ShareDecision:
    """How one sample's prompt rows travel.

    Attributes:
        ref: the sample's :data:`PROMPT_REF_FIELD`.
        shared_rows: leading rows left out of the sample's own :data:`IDS_FIELD` (0: it keeps them all).
        side: the entry this sample must put first (``None``: not shared, or a sibling put it).
        differs: the sample's prompt rows differ from the group's stored copy (kept whole, counted).
    """

    ref: torch.Tensor
    shared_rows: int = 0
    side: SharedPrompt | None = None
    differs: bool = False


class PromptRowSharing:
    """Per agent-loop worker: the prompt rows this worker stored for each of its in-flight groups.

    verl's V1 ``AgentLoopWorkerTQ._run_prompt`` runs all ``rollout.n`` sessions of a prompt in one worker, so the
    first finished sample of a group stores the prompt rows ``[start, prompt_len)`` once and every sibling whose rows
    are identical refers to them. A sibling whose rows differ (an engine may route the same prompt differently
    across requests) keeps its own rows: a sample never replays another sample's routing.
    :meth:`forget` drops a group when its sessions have settled, so the cache holds in-flight groups only.
    """

    def __init__(self) -> None:
        self._stored: dict[tuple[str, str], dict[tuple[int, int], tuple[str, torch.Tensor]]] = {}

    def __len__(self) -> int:
        return len(self._stored)

    def decide(self, ids: torch.Tensor, *, start: int, prompt_len: int, uid: str, partition: str) -> ShareDecision:
        """Split decision for one sample's validated MoE rows ``ids`` covering ``[start, start + len(ids))``."""
        split = min(max(int(prompt_len) - int(start), 0), int(ids.shape[0]))
        if split == 0:
            return ShareDecision(prompt_ref(None, 0))
        prompt = ids[:split]
        group = self._stored.setdefault((partition, str(uid)), {})
        stored = group.get((int(start), split))
        if stored is not None:
            key, rows = stored
            if torch.equal(rows, prompt):
                return ShareDecision(prompt_ref(key, split), split)
            return ShareDecision(prompt_ref(None, 0), differs=True)
        key = prompt_rows_key(str(uid), partition, int(start), prompt)
        rows = prompt.clone()
        group[(int(start), split)] = (key, rows)
        side = SharedPrompt(key, rows, {"uid": str(uid), "partition": partition, "rows": split})
        return ShareDecision(prompt_ref(key, split), split, side)

    def forget(self, uid: str, partition: str | None = None) -> None:
        """Drop a settled group (both partitions unless ``partition`` is given)."""
        for part in (partition,) if partition is not None else SOURCE_PARTITIONS:
            self._stored.pop((part, str(uid)), None)


def shared_sample_fields(
    rows: RoutedRows | None,
    layout: RoutingLayout,
    sharing: PromptRowSharing,
    *,
    prompt_len: int,
    uid: str | None,
    partition: str = "train",
) -> tuple[dict[str, torch.Tensor], ShareDecision]:
    """:func:`~verl_stable.routing.transport.sample_fields` plus :data:`PROMPT_REF_FIELD`, prompt rows shared.

    When the sample shares its group's prompt rows, :data:`IDS_FIELD` keeps only the rows after them and
    :data:`SPAN_FIELD` still covers the whole span. ``uid=None``: never shared (zero reference).
    """
    fields = sample_fields(rows, layout)
    share = ShareDecision(prompt_ref(None, 0))
    if uid is not None and rows is not None and rows.num_rows:
        share = sharing.decide(fields[IDS_FIELD], start=rows.start, prompt_len=prompt_len, uid=uid, partition=partition)
        if share.shared_rows:
            fields[IDS_FIELD] = fields[IDS_FIELD][share.shared_rows :].clone()
    fields[PROMPT_REF_FIELD] = share.ref
    return fields, share


def _refs_tensor(refs: Any) -> torch.Tensor:
    if isinstance(refs, torch.Tensor) and refs.is_nested:
        parts = [p.reshape(-1) for p in refs.unbind()]
        table = torch.stack(parts) if parts else torch.zeros(0, 3, dtype=torch.int64)
    else:
        table = torch.as_tensor(refs)
    if table.dim() != 2 or table.shape[1] != 3:
        raise SharedPromptRowsError(
            f"{PROMPT_REF_FIELD} must be [B, 3] (rows, key_hi, key_lo), got {tuple(table.shape)}"
        )
    return table.to(torch.int64)


def attach_shared_prompt_rows(data: Any, kv_batch_get: Any = None) -> int:
    """Actor side: put the shared prompt rows back in front of each sample's own :data:`IDS_FIELD`, in place.

    One ``kv_batch_get`` of the batch's distinct side entries. Afterwards :data:`IDS_FIELD` covers each sample's
    whole span again and :data:`PROMPT_REF_FIELD` is zero, so a second call reads nothing.

    Returns:
        The number of samples that got their prompt rows back.

    Raises:
        SharedPromptRowsError: a side entry is missing (cleared before the actor ran, or never put), or it does not
            have the rows the sample refers to.
    """
    if PROMPT_REF_FIELD not in data.keys():
        return 0
    refs = _refs_tensor(data[PROMPT_REF_FIELD])
    shared = (refs[:, 0] > 0).tolist()
    if not any(shared):
        return 0
    keys = [key_of_ref(ref) if s else None for ref, s in zip(refs.tolist(), shared, strict=True)]
    unique = sorted({k for k in keys if k is not None})
    if kv_batch_get is None:
        import transfer_queue as tq

        kv_batch_get = tq.kv_batch_get
    try:
        got = kv_batch_get(keys=unique, partition_id=PROMPT_PARTITION, select_fields=[IDS_FIELD])
    except (ValueError, KeyError) as exc:  # TransferQueue: "keys or partition were not found!"
        raise SharedPromptRowsError(
            f"{len(unique)} shared prompt-row entries (e.g. {unique[0]}) are not in TransferQueue partition "
            f"{PROMPT_PARTITION!r}: they were cleared before the actor read the batch, or never put ({exc})"
        ) from exc
    found = got[IDS_FIELD]
    rows_of = dict(zip(unique, list(found.unbind()) if found.is_nested else list(found.unbind(0)), strict=True))
    parts = _unbind_ids(data[IDS_FIELD])
    if len(parts) != len(keys):
        raise SharedPromptRowsError(f"{len(parts)} routing entries but {len(keys)} {PROMPT_REF_FIELD} rows")
    merged = []
    for i, (part, key) in enumerate(zip(parts, keys, strict=True)):
        if key is None:
            merged.append(part)
            continue
        prompt = rows_of[key]
        want = int(refs[i, 0])
        if prompt.shape[0] != want or prompt.shape[1:] != part.shape[1:]:
            raise SharedPromptRowsError(
                f"sample {i}: shared entry {key} holds {tuple(prompt.shape)} rows, the sample expects {want} rows of "
                f"{tuple(part.shape[1:])}"
            )
        merged.append(torch.cat([prompt.to(part.device, part.dtype), part]))
    data[IDS_FIELD] = torch.nested.as_nested_tensor(merged, layout=torch.jagged)
    data[PROMPT_REF_FIELD] = torch.zeros_like(refs)
    return sum(shared)


def _unbind_ids(ids: Any) -> list[torch.Tensor]:
    if isinstance(ids, torch.Tensor):
        return list(ids.unbind()) if ids.is_nested else list(ids.unbind(0))
    return list(ids)


def stale_prompt_entries(side: Mapping[str, Any], sources: Mapping[str, Any]) -> list[str]:
    """Side entries (``{key: tag}`` of :data:`PROMPT_PARTITION`) whose group has no key in its sample partition.

    ``sources`` maps each of :data:`SOURCE_PARTITIONS` to its keys (verl's ``"{uid}"`` / ``"{uid}_{session}_{i}"``).
    """
    live = {(partition, key.split("_")[0]) for partition, keys in sources.items() for key in keys}
    return [key for key, tag in side.items() if ((tag or {}).get("partition"), (tag or {}).get("uid")) not in live]


def clear_stale_prompt_rows(kv_list: Any = None, kv_clear: Any = None) -> int:
    """Clear the side entries whose group has no key left in verl's sample partitions (TransferQueue's sync API).

    verl clears a group's keys itself (after the step, on eviction, after validation); this follows it. The side
    partition is listed *before* the sample partitions: an entry is put only while its group's prompt key exists, so
    an entry seen first and then without any key of its group belongs to a group verl has finished with, also while
    async rollouts keep putting. Any number of processes may run it at once.

    Returns:
        The number of entries cleared.
    """
    if kv_list is None or kv_clear is None:
        import transfer_queue as tq

        kv_list, kv_clear = kv_list or tq.kv_list, kv_clear or tq.kv_clear
    side = (kv_list(PROMPT_PARTITION) or {}).get(PROMPT_PARTITION, {})
    if not side:
        return 0
    sources = {p: (kv_list(p) or {}).get(p, {}) for p in SOURCE_PARTITIONS}
    stale = stale_prompt_entries(side, sources)
    if stale:
        kv_clear(keys=stale, partition_id=PROMPT_PARTITION)
    return len(stale)


async def async_clear_stale_prompt_rows(kv_list: Any = None, kv_clear: Any = None) -> int:
    """:func:`clear_stale_prompt_rows` with TransferQueue's async API (inside an agent-loop worker's event loop)."""
    if kv_list is None or kv_clear is None:
        import transfer_queue as tq

        kv_list, kv_clear = kv_list or tq.async_kv_list, kv_clear or tq.async_kv_clear
    side = ((await kv_list(PROMPT_PARTITION)) or {}).get(PROMPT_PARTITION, {})
    if not side:
        return 0
    sources = {p: ((await kv_list(p)) or {}).get(p, {}) for p in SOURCE_PARTITIONS}
    stale = stale_prompt_entries(side, sources)
    if stale:
        await kv_clear(keys=stale, partition_id=PROMPT_PARTITION)
    return len(stale)


# ------------------------------------------------------------------------------------------ boundary metrics
def _merge_stats(total: BoundaryStats, sample: BoundaryStats) -> None:
    total.samples += sample.samples
    total.skipped_samples += sample.skipped_samples
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
        ``bytes_ratio`` (= bytes / verl_bytes); ``prompt_groups_shared`` (side entries put),
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
    sharing: PromptRowSharing | None = None,
    uid: str | None = None,
    partition: str = "train",
) -> Any:
    """An ``AgentLoopOutput`` whose ``as_dict`` emits the compact fields instead of verl's int16 ``routed_experts``.

    Besides :data:`IDS_FIELD` / :data:`SPAN_FIELD` it emits :data:`BOUNDARY_FIELD` (this sample's counters, read by
    :func:`fetch_transport_metrics` on the trainer); ``stats`` accumulates the worker's running totals.

    With ``sharing`` (the worker's :class:`PromptRowSharing`) the sample also emits :data:`PROMPT_REF_FIELD`; with
    the group's ``uid`` too its prompt rows may be shared: its :data:`IDS_FIELD` then holds only the rows after them
    (:data:`SPAN_FIELD` still covers the whole span), and ``output.shared_prompt`` is the side entry to put before
    the sample when this sample is the group's first (``None`` otherwise). ``uid=None``: never shared (a group of
    one), the field is zero.
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
    values.pop("shared_prompt", None)
    compact = output_cls.model_construct(
        _fields_set=set(output.model_fields_set) - {"routed_experts"}, **values, compact_routing=None
    )
    if sharing is None:
        fields, share = sample_fields(rows, layout), None
    else:
        fields, share = shared_sample_fields(
            rows, layout, sharing, prompt_len=len(output.prompt_ids), uid=uid, partition=partition
        )
    fields[BOUNDARY_FIELD] = boundary_counters(
        fields, seq_len=seq_len, layout=layout, sample_stats=sample_stats, share=share
    )
    compact.compact_routing = fields
    compact.shared_prompt = None if share is None else share.side
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
        shared_prompt: Any = None

        def as_dict(self) -> dict[str, Any]:
            fields = self.compact_routing
            out = super().as_dict()
            out.pop("compact_routing", None)
            out.pop("shared_prompt", None)
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
            self.stable_prompt_sharing = PromptRowSharing()
            # uid -> side-entry key -> its put; in-flight groups of more than one sample only
            self.stable_prompt_puts: dict[str, dict[str, asyncio.Future]] = {}

        def _stable_compact(self, output: Any, uid: str, partition: str) -> Any:
            if not self.stable_routing_options.share_prompt_rows:
                return compact_agent_loop_output(
                    output, self.stable_routing_layout, self.stable_routing_options, self.stable_routing_stats
                )
            return compact_agent_loop_output(
                output,
                self.stable_routing_layout,
                self.stable_routing_options,
                self.stable_routing_stats,
                sharing=self.stable_prompt_sharing,
                uid=uid if uid in self.stable_prompt_puts else None,  # a group of one shares nothing
                partition=partition,
            )

        async def _stable_put_shared(self, outputs: list[Any], uid: str) -> None:
            """Put this group's side entry (its first sample) or wait for the sibling's put, before the sample."""
            import transfer_queue as tq
            from tensordict import TensorDict

            puts = self.stable_prompt_puts.get(uid, {})
            for output in outputs:
                side = output.shared_prompt
                if side is not None and side.key not in puts:
                    fields = TensorDict({IDS_FIELD: side.ids.unsqueeze(0)}, batch_size=[1])
                    puts[side.key] = asyncio.ensure_future(
                        tq.async_kv_put(key=side.key, partition_id=PROMPT_PARTITION, fields=fields, tag=side.tag)
                    )
            for output in outputs:
                ref = output.compact_routing.get(PROMPT_REF_FIELD)
                if ref is not None and int(ref[0]) > 0:
                    key = key_of_ref(ref)
                    if key not in puts:
                        raise SharedPromptRowsError(f"group {uid}: a sample refers to prompt rows {key} never put")
                    await asyncio.shield(puts[key])

        async def generate_sequences(self, batch: Any) -> None:
            if self.stable_routing_enabled and self.stable_routing_options.share_prompt_rows:
                # a new dispatch follows verl's clearing of finished groups: drop their shared prompt rows (any
                # trainer class; the stable_* trainers also do it at each step start)
                try:
                    await async_clear_stale_prompt_rows()
                except Exception as exc:  # housekeeping must not fail a rollout; the next dispatch retries
                    logger.warning("verl-stable: clearing shared prompt rows failed: %s", exc)
            return await super().generate_sequences(batch)

        async def _agent_loop_postprocess(self, output: Any, validate: bool, **kwargs: Any) -> Any:
            if self.stable_routing_enabled:
                uid, partition = str(kwargs.get("uid")), "val" if validate else "train"
                outputs = output if isinstance(output, list) else [output]
                outputs = [self._stable_compact(o, uid, partition) for o in outputs]
                if self.stable_routing_options.share_prompt_rows:
                    await self._stable_put_shared(outputs, uid)
                output = outputs if isinstance(output, list) else outputs[0]
            return await super()._agent_loop_postprocess(output, validate, **kwargs)

        async def _run_prompt(self, prompt: dict, sampling_params: dict, trajectory: dict, **kwargs: Any) -> None:
            uid = str(prompt.get("uid"))
            rollout = self.config.actor_rollout_ref.rollout
            n = prompt.get("__rollout_n__", rollout.val_kwargs.n if trajectory["validate"] else rollout.n)
            if self.stable_routing_enabled and int(n) > 1:
                self.stable_prompt_puts[uid] = {}
            try:
                return await super()._run_prompt(prompt, sampling_params, trajectory, **kwargs)
            finally:
                # every session of the group has settled (verl's contract): forget it
                self.stable_prompt_sharing.forget(uid)
                self.stable_prompt_puts.pop(uid, None)

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
