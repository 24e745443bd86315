"""Prompt rows once per group: the side-entry protocol between the agent-loop workers and the actors.

verl's V1 agent loop runs the ``rollout.n`` sessions of a prompt in one worker (``AgentLoopWorkerTQ._run_prompt``)
as independent tasks that each put their own TransferQueue row as soon as they finish (key ``{uid}_{session}_{i}``);
the trainer then balances, filters and shuffles those rows individually across data-parallel ranks and
mini-batches. So the group's shared copy of its prompt rows is a TransferQueue entry of its own (a *side entry*),
not a sample. This module owns every step of its life (``+verl_stable.routing.share_prompt_rows``, default true;
``false`` keeps every row with its sample):

1. worker (:class:`PromptRowSharing`, :func:`shared_sample_fields`): a group of ``n > 1`` samples shares its prompt
   rows when that saves at least ``share_prompt_rows_min_bytes`` (``(n - 1) x`` the rows' bytes; default 2 MiB, 0
   shares every group). Its first finished sample puts its validated prompt rows ``[start, prompt_len)`` into
   :data:`PROMPT_PARTITION` (verl's trainer samples only ``train`` / ``val``), under a 128-bit key of the uid,
   partition, start and the rows' bytes (:func:`prompt_rows_key`), before its own row. A sibling whose prompt rows
   are identical stores only its later rows plus :data:`PROMPT_REF_FIELD` (24 bytes) and waits for that put; a
   sibling whose rows differ (an engine may route the same prompt differently across requests) keeps all its rows and
   is counted. The per-worker cache holds in-flight groups only;
2. actor (:func:`attach_shared_prompt_rows`): one ``kv_batch_get`` of the (mini-)batch's distinct entries puts the
   prompt rows back in front of each sample's own rows. A missing or misshapen entry raises
   :class:`SharedPromptRowsError`; rows that arrive in another dtype than the sample's are validated (against the
   layout when given) before they are narrowed, so a wrapped id can never become a plausible one. Each
   data-parallel rank reads the entries of the groups it holds, through its :class:`SharedRowReader`, which keeps
   the entries of its last read: verl hands a rank the same samples for ``compute_log_prob`` and every update
   mini-step of a step, so a rank reads once per step (counted: :data:`SIDE_READ_COUNTS`);
3. lifetime (:func:`clear_stale_prompt_rows`, :func:`async_clear_stale_prompt_rows`): entries whose group has no key
   left in ``train`` / ``val`` are cleared by every worker when verl dispatches new prompts (any trainer class;
   alongside that dispatch's rollout, which does not wait for it), so they follow verl's own ``kv_clear`` (after the
   step, on DAPO/failure eviction, after validation) within a dispatch or two; the stable trainers
   (``trainer.v1.trainer_mode=stable_*``) clear what is left after the last step. A worker clears an entry only when
   two of its consecutive passes found it stale (:class:`StaleSweep`; the pass after the last step clears at once):
   in an async run with partial rollouts an actor once missed an entry that a single pass had just cleared, so a
   group can look keyless for a moment.

Correctness rests on two facts: the key covers the rows' content, so a reference can only resolve to bytes equal to
the sample's own prompt rows; and a side entry is put before any sample that refers to it, while its group's prompt
key exists, so clearing by "no key of the group left" never removes an entry a live sample still needs.

Bytes per real token on this path (Qwen3-30B-A3B shape, batch builder of ``benchmarks/bench_routing_transport.py``,
fields + counters; verl V1 stores 768): responses up to 4k, prompts up to 1k: 384 per sample vs 314 per group for
n = 8 (1.22x), 287 for n = 16 (1.34x); prompts up to 4k: 213 (n = 8, 1.80x) and 171 (n = 16, 2.25x), every group
shared (``--share-min-bytes 0``); with the default minimum, groups of prompts under 781 tokens (n = 8) keep their rows:
358 per group at n = 8 with prompts up to 1k (1.07x).
:class:`~verl_stable.routing.transport.PackedRouting` deduplicates the same way where a whole batch travels as one
object. The price is round trips: one put per group (awaited by its other samples), one read per actor rank and step,
the sweep's listing per dispatch. Where prompt rows are small they cost more than the bytes they save: on the tiny CPU
model of ``benchmarks/bench_dp_overhead.py`` (groups save a few hundred bytes) sharing every group cost 1.06x of plain
GRPO's step time against 1.02x without (docs/benchmarks.md). ``benchmarks/bench_side_entry_cost.py`` measures the
break-even on TransferQueue (fixed cost of a put and a read against the cost per byte they move); the default
minimum is that break-even, rounded down to a power of two, so a group below it keeps its rows, puts nothing and
costs no round trip, and a worker that put no side entry skips the sweep.

No verl import; TransferQueue is imported only when no reader / writer is passed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from verl_stable.routing.checks import jagged_parts
from verl_stable.routing.codecs import (
    ExpertIdRangeError,
    RoutedRows,
    RoutingFormatError,
    RowCountError,
    validate_ids,
)
from verl_stable.routing.trace import RoutingLayout
from verl_stable.routing.transport import IDS_FIELD, SPAN_FIELD, sample_fields

__all__ = [
    "PROMPT_PARTITION",
    "PROMPT_REF_FIELD",
    "SOURCE_PARTITIONS",
    "PromptRowSharing",
    "ShareDecision",
    "SharedPrompt",
    "SIDE_READ_COUNTS",
    "SharedPromptRowsError",
    "SharedRowReader",
    "StaleSweep",
    "async_clear_stale_prompt_rows",
    "attach_shared_prompt_rows",
    "merged_sample_rows",
    "clear_stale_prompt_rows",
    "key_of_ref",
    "prompt_ref",
    "prompt_rows_key",
    "shared_sample_fields",
    "stale_prompt_entries",
]

PROMPT_PARTITION = "stable_routing_prompts"
"""TransferQueue partition of the shared prompt rows. verl's V1 trainer samples only ``train`` / ``val``; its
ReplayBuffer lists every partition but never materialises keys of another one."""
PROMPT_REF_FIELD = "stable_routing_prompt_ref"
"""Per-sample int64 ``[3]``: ``(rows, key_hi, key_lo)``. ``rows > 0``: the sample's first ``rows`` routing rows are
not in its :data:`IDS_FIELD` but in the :data:`PROMPT_PARTITION` entry whose key is the 16 bytes ``key_hi, key_lo``
(big-endian) in hex; ``rows == 0``: the sample carries all its rows (not shared, or already re-attached)."""
SIDE_READ_COUNTS: tuple[str, ...] = ("side_reads", "side_read_entries", "side_read_reused", "side_read_bytes")
"""What re-attaching shared prompt rows cost an actor rank (:meth:`SharedRowReader.take_counts`): TransferQueue reads
issued, entries fetched by them, entries served from the rank's held entries instead, bytes fetched."""
SOURCE_PARTITIONS = ("train", "val")
"""verl V1's sample partitions (``AgentLoopWorkerTQ``): a side entry lives while its group has a key in one."""


class SharedPromptRowsError(RowCountError):
    """A sample refers to shared prompt rows that TransferQueue does not hold (cleared too early, or never put)."""


# ------------------------------------------------------------------------------------------------ keys and refs
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


# ----------------------------------------------------------------------------------------------- worker side
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

    A group is shared only when that saves at least ``min_saved_bytes``: ``(group_size - 1) x`` the bytes of its
    prompt rows. The test depends only on the group's size and the rows' shape and dtype, so every sample of a group
    decides alike without waiting for a sibling; a group below it keeps its rows with every sample and costs no
    TransferQueue round trip.

    Args:
        min_saved_bytes: ``share_prompt_rows_min_bytes`` (0: share every group of more than one sample).
    """

    def __init__(self, min_saved_bytes: int = 0) -> None:
        if isinstance(min_saved_bytes, bool) or not isinstance(min_saved_bytes, int) or min_saved_bytes < 0:
            raise ValueError(f"min_saved_bytes must be an int >= 0, got {min_saved_bytes!r}")
        self.min_saved_bytes = min_saved_bytes
        self._stored: dict[tuple[str, str], dict[tuple[int, int], tuple[str, torch.Tensor]]] = {}

    def __len__(self) -> int:
        return len(self._stored)

    def saved_bytes(self, ids: torch.Tensor, split: int, group_size: int) -> int:
        """Bytes a group of ``group_size`` saves by storing ``split`` rows like ``ids``'s once instead of per sample."""
        return (group_size - 1) * split * (ids[:1].numel() * ids.element_size())

    def decide(
        self,
        ids: torch.Tensor,
        *,
        start: int,
        prompt_len: int,
        uid: str,
        partition: str,
        group_size: int | None = None,
    ) -> ShareDecision:
        """Split decision for one sample's validated MoE rows ``ids`` covering ``[start, start + len(ids))``.

        Args:
            group_size: samples of the group (verl's ``rollout.n`` of this prompt); required when
                ``min_saved_bytes > 0``.

        Raises:
            ValueError: ``group_size`` missing or < 1 while a minimum is set.
        """
        split = min(max(int(prompt_len) - int(start), 0), int(ids.shape[0]))
        if split == 0:
            return ShareDecision(prompt_ref(None, 0))
        if self.min_saved_bytes:
            if group_size is None or int(group_size) < 1:
                raise ValueError(
                    f"group {uid}: sharing prompt rows above {self.min_saved_bytes} saved bytes needs the group's "
                    f"size, got {group_size!r}"
                )
            if self.saved_bytes(ids, split, int(group_size)) < self.min_saved_bytes:
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
    group_size: int | None = None,
) -> tuple[dict[str, torch.Tensor], ShareDecision]:
    """:func:`~verl_stable.routing.transport.sample_fields` plus :data:`PROMPT_REF_FIELD`, prompt rows shared.

    When the sample shares its group's prompt rows, :data:`IDS_FIELD` keeps only the rows after them and
    :data:`SPAN_FIELD` still covers the whole span. ``uid=None``: never shared (zero reference). ``group_size``:
    see :meth:`PromptRowSharing.decide`.
    """
    fields = sample_fields(rows, layout)
    share = ShareDecision(prompt_ref(None, 0))
    if uid is not None and rows is not None and rows.num_rows:
        share = sharing.decide(
            fields[IDS_FIELD],
            start=rows.start,
            prompt_len=prompt_len,
            uid=uid,
            partition=partition,
            group_size=group_size,
        )
        if share.shared_rows:
            fields[IDS_FIELD] = fields[IDS_FIELD][share.shared_rows :].clone()
    fields[PROMPT_REF_FIELD] = share.ref
    return fields, share


# ------------------------------------------------------------------------------------------------- actor side
def _refs_tensor(refs: Any) -> torch.Tensor:
    if isinstance(refs, torch.Tensor) and refs.is_nested:
        parts = [p.reshape(-1) for p in jagged_parts(refs)]
        table = torch.stack(parts) if parts else torch.zeros(0, 3, dtype=torch.int64)
    else:
        table = torch.as_tensor(refs)
    if table.dim() != 2 or table.shape[1] != 3:
        raise SharedPromptRowsError(
            f"{PROMPT_REF_FIELD} must be [B, 3] (rows, key_hi, key_lo), got {tuple(table.shape)}"
        )
    return table.to(torch.int64)


def _unbind_ids(ids: Any) -> list[torch.Tensor]:
    if isinstance(ids, torch.Tensor):
        return jagged_parts(ids)
    return list(ids)


def _span_start(data: Any, i: int) -> int:
    """First token position of sample ``i`` (for error messages; 0 when the batch carries no spans)."""
    if SPAN_FIELD not in data.keys():
        return 0
    spans = data[SPAN_FIELD]
    span = jagged_parts(spans)[i] if spans.is_nested else spans[i]
    return max(int(span.reshape(-1)[0]), 0)


def _check_before_cast(
    prompt: torch.Tensor, dtype: torch.dtype, layout: RoutingLayout | None, *, where: str, start: int
) -> None:
    """Check shared prompt rows before they are cast to the sample's dtype ``dtype``.

    Entries written by this module have the sample's dtype; one that arrives wider (an older writer, a store that
    widens) would wrap silently under ``.to``, turning an out-of-range id into a plausible one. With the layout the
    rows are validated as at the engine boundary; in any case every id must fit ``dtype``.

    Raises:
        RoutingFormatError: the rows are not integers; its subclasses as
            :func:`~verl_stable.routing.codecs.validate_ids` finds problems (with ``layout``);
            ExpertIdRangeError also for an id that ``dtype`` cannot hold.
    """
    try:
        if prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
            raise RoutingFormatError(f"expert ids must be integers, got dtype {prompt.dtype}")
        ids = prompt.detach().cpu().numpy()
        if layout is not None:
            validate_ids(ids, layout, start=start)
        if ids.size:
            info = torch.iinfo(dtype)
            low, high = int(ids.min()), int(ids.max())
            if low < info.min or high > info.max:
                bad = high if high > info.max else low
                raise ExpertIdRangeError(
                    f"expert id {bad} does not fit the sample's dtype {dtype} (ids up to {info.max}): it would wrap"
                )
    except RoutingFormatError as exc:
        raise type(exc)(f"{where}: {exc}") from None


class SharedRowReader:
    """One actor rank's reader of side entries: fetches what a batch needs, keeps the entries of its last fetch.

    verl dispatches the same samples to a data-parallel rank for ``compute_log_prob`` and for ``update_actor`` (whose
    mini-batches are subsets of them), so after the first read of a step every later batch of the rank refers to
    entries already held and reads nothing. Holding an entry can never serve stale rows: its key covers its content
    (:func:`prompt_rows_key`). Only the entries of the last batch that needed a read are held (that batch
    materialised them anyway): a batch with any entry not held fetches the missing ones in one ``kv_batch_get`` and
    then holds exactly its own entries.

    Args:
        kv_batch_get: TransferQueue's ``kv_batch_get`` signature; default TransferQueue's, resolved at the first read.
    """

    def __init__(self, kv_batch_get: Any = None) -> None:
        self._kv_batch_get = kv_batch_get
        self._held: dict[str, torch.Tensor] = {}
        self._counts = dict.fromkeys(SIDE_READ_COUNTS, 0)

    def __len__(self) -> int:
        return len(self._held)

    def rows(self, keys: Sequence[str]) -> dict[str, torch.Tensor]:
        """``{key: [rows, num_moe_layers, top_k]}`` for the distinct ``keys``.

        Raises:
            SharedPromptRowsError: an entry TransferQueue does not hold (cleared before the actor read it, or
                never put).
        """
        missing = [k for k in keys if k not in self._held]
        self._counts["side_read_reused"] += len(keys) - len(missing)
        if not missing:
            return {k: self._held[k] for k in keys}
        fetched = self._fetch(missing)
        self._counts["side_reads"] += 1
        self._counts["side_read_entries"] += len(missing)
        self._counts["side_read_bytes"] += sum(t.numel() * t.element_size() for t in fetched.values())
        self._held = {k: self._held[k] if k in self._held else fetched[k] for k in keys}
        return dict(self._held)

    def take_counts(self) -> dict[str, int]:
        """The :data:`SIDE_READ_COUNTS` since the last call, restarting them."""
        counts, self._counts = self._counts, dict.fromkeys(SIDE_READ_COUNTS, 0)
        return counts

    def _fetch(self, keys: list[str]) -> dict[str, torch.Tensor]:
        if self._kv_batch_get is None:
            import transfer_queue as tq

            self._kv_batch_get = tq.kv_batch_get
        try:
            got = self._kv_batch_get(keys=keys, partition_id=PROMPT_PARTITION, select_fields=[IDS_FIELD])
        except (ValueError, KeyError) as exc:  # TransferQueue: "keys or partition were not found!"
            raise SharedPromptRowsError(
                f"{len(keys)} shared prompt-row entries (e.g. {keys[0]}) are not in TransferQueue partition "
                f"{PROMPT_PARTITION!r}: they were cleared before the actor read the batch, or never put ({exc})"
            ) from exc
        found = got[IDS_FIELD]
        rows = jagged_parts(found)
        if len(rows) != len(keys):  # TransferQueue leaves out missing keys unless all are missing
            raise SharedPromptRowsError(
                f"{len(keys) - len(rows)} of {len(keys)} shared prompt-row entries are not in TransferQueue partition "
                f"{PROMPT_PARTITION!r} (asked for {keys}): they were cleared before the actor read the batch, or "
                "never put"
            )
        return dict(zip(keys, rows, strict=True))


def attach_shared_prompt_rows(
    data: Any, kv_batch_get: Any = None, layout: RoutingLayout | None = None, reader: SharedRowReader | None = None
) -> int:
    """Actor side: put the shared prompt rows back in front of each sample's own :data:`IDS_FIELD`, in place.

    The batch's distinct side entries come from ``reader`` (a rank's :class:`SharedRowReader`: one ``kv_batch_get``
    of the entries it does not hold), else from one ``kv_batch_get`` (``kv_batch_get``, default TransferQueue's).
    Afterwards :data:`IDS_FIELD` covers each sample's whole span again and :data:`PROMPT_REF_FIELD` is zero, so a
    second call reads nothing. Rows that arrive in another dtype than the sample's own are checked before the cast
    (validated against ``layout`` when given).

    Returns:
        The number of samples that got their prompt rows back.

    Raises:
        SharedPromptRowsError: a side entry is missing (cleared before the actor ran, or never put), or it does not
            have the rows the sample refers to.
        RoutingFormatError: (its subclasses as found) an entry in another dtype whose ids would not survive the
            cast, or fail validation against ``layout``.
    """
    merged = merged_sample_rows(data, kv_batch_get, layout, reader)
    if merged is None:
        return 0
    parts, shared = merged
    data[IDS_FIELD] = torch.nested.as_nested_tensor(parts, layout=torch.jagged)
    data[PROMPT_REF_FIELD] = torch.zeros_like(_refs_tensor(data[PROMPT_REF_FIELD]))
    return shared


def merged_sample_rows(
    data: Any, kv_batch_get: Any = None, layout: RoutingLayout | None = None, reader: SharedRowReader | None = None
) -> tuple[list[torch.Tensor], int] | None:
    """Each sample's rows with its shared prompt rows in front, without writing them back into ``data``.

    What :func:`attach_shared_prompt_rows` stores (same reads, same checks, same errors), for a caller that
    consumes the rows at once (the actor's expansion to verl's layout).

    Returns:
        ``(rows per sample, samples that got prompt rows)``, or None when no sample of the batch refers to a side
        entry (the rows are then :data:`IDS_FIELD` as it is).
    """
    if PROMPT_REF_FIELD not in data.keys():
        return None
    refs = _refs_tensor(data[PROMPT_REF_FIELD])
    shared = (refs[:, 0] > 0).tolist()
    if not any(shared):
        return None
    ref_rows = refs.tolist()
    keys = [key_of_ref(ref) if s else None for ref, s in zip(ref_rows, shared, strict=True)]
    unique = sorted({k for k in keys if k is not None})
    rows_of = (reader if reader is not None else SharedRowReader(kv_batch_get)).rows(unique)
    parts = _unbind_ids(data[IDS_FIELD])
    if len(parts) != len(keys):
        raise SharedPromptRowsError(f"{len(parts)} routing entries but {len(keys)} {PROMPT_REF_FIELD} rows")
    merged = []
    checked: set[tuple[str, torch.dtype]] = set()  # an entry is shared by its group: check it once per target dtype
    for i, (part, key) in enumerate(zip(parts, keys, strict=True)):
        if key is None:
            merged.append(part)
            continue
        prompt = rows_of[key]
        want = ref_rows[i][0]
        if prompt.shape[0] != want or prompt.shape[1:] != part.shape[1:]:
            raise SharedPromptRowsError(
                f"sample {i}: shared entry {key} holds {tuple(prompt.shape)} rows, the sample expects {want} rows of "
                f"{tuple(part.shape[1:])}"
            )
        if prompt.dtype != part.dtype and (key, part.dtype) not in checked:
            where = f"sample {i}: shared entry {key} ({prompt.dtype})"
            _check_before_cast(prompt, part.dtype, layout, where=where, start=_span_start(data, i))
            checked.add((key, part.dtype))
        merged.append(torch.cat([prompt.to(part.device, part.dtype), part]))
    return merged, sum(shared)


# -------------------------------------------------------------------------------------------------- lifetime
def stale_prompt_entries(side: Mapping[str, Any], sources: Mapping[str, Any]) -> list[str]:
    """Side entries (``{key: tag}`` of :data:`PROMPT_PARTITION`) whose group has no key in its sample partition.

    ``sources`` maps each of :data:`SOURCE_PARTITIONS` to its keys (verl's ``"{uid}"`` / ``"{uid}_{session}_{i}"``).
    """
    live = {(partition, key.split("_")[0]) for partition, keys in sources.items() for key in keys}
    return [key for key, tag in side.items() if ((tag or {}).get("partition"), (tag or {}).get("uid")) not in live]


class StaleSweep:
    """One process's memory between clearing passes: an entry is due once two consecutive passes found it stale."""

    def __init__(self) -> None:
        self._stale_before: set[str] = set()

    def due(self, stale: Sequence[str]) -> list[str]:
        """The entries of ``stale`` that the previous pass found stale too; remembers the rest for the next pass."""
        due = [key for key in stale if key in self._stale_before]
        self._stale_before = set(stale) - set(due)
        return due


def clear_stale_prompt_rows(kv_list: Any = None, kv_clear: Any = None, sweep: StaleSweep | None = None) -> int:
    """Clear the side entries whose group has no key left in verl's sample partitions (TransferQueue's sync API).

    verl clears a group's keys itself (after the step, on eviction, after validation); this follows it. Every
    partition is listed in one request (``kv_list()``): TransferQueue's controller answers it from one snapshot, so
    an entry listed without any key of its group belongs to a group verl had finished with at that moment (an entry
    is put only while its group's prompt key exists), also while async rollouts keep putting. One request, not one
    per partition: this runs at every dispatch. Any number of processes may run it at once.

    With ``sweep``, only the entries its previous pass found stale too are cleared (:class:`StaleSweep`).

    Returns:
        The number of entries cleared.
    """
    if kv_list is None or kv_clear is None:
        import transfer_queue as tq

        kv_list, kv_clear = kv_list or tq.kv_list, kv_clear or tq.kv_clear
    stale = _stale_in(kv_list() or {}, sweep)
    if stale:
        kv_clear(keys=stale, partition_id=PROMPT_PARTITION)
    return len(stale)


async def async_clear_stale_prompt_rows(
    kv_list: Any = None, kv_clear: Any = None, sweep: StaleSweep | None = None
) -> int:
    """:func:`clear_stale_prompt_rows` with TransferQueue's async API (inside an agent-loop worker's event loop)."""
    if kv_list is None or kv_clear is None:
        import transfer_queue as tq

        kv_list, kv_clear = kv_list or tq.async_kv_list, kv_clear or tq.async_kv_clear
    stale = _stale_in((await kv_list()) or {}, sweep)
    if stale:
        await kv_clear(keys=stale, partition_id=PROMPT_PARTITION)
    return len(stale)


def _stale_in(listing: Mapping[str, Any], sweep: StaleSweep | None) -> list[str]:
    """The side entries of one all-partition ``kv_list`` to clear now."""
    side = listing.get(PROMPT_PARTITION) or {}
    if not side:
        return []
    stale = stale_prompt_entries(side, {p: listing.get(p) or {} for p in SOURCE_PARTITIONS})
    return sweep.due(stale) if sweep is not None else stale
