"""Shared prompt rows read back on the actors and cleared when verl is done with them.

The reading half of the side-entry protocol of :mod:`verl_stable.transport.sharing` (steps 2 and 3 there): each
data-parallel rank's :class:`SharedRowReader` fetches the side entries a batch refers to, once per step;
:func:`attach_shared_prompt_rows` / :func:`merged_sample_rows` put the rows back in front of each sample's own rows,
validating rows that arrive in another dtype before narrowing them; :func:`clear_stale_prompt_rows` and
:class:`StaleSweep` remove entries whose group has no key left in ``train`` / ``val``.

No verl import; TransferQueue is imported only when no reader / writer is passed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from verl_stable.metric_names import SIDE_READ_COUNTS
from verl_stable.routing.checks import jagged_parts
from verl_stable.routing.codecs import ExpertIdRangeError, RoutingFormatError, validate_ids
from verl_stable.routing.trace import RoutingLayout
from verl_stable.transport.fields import IDS_FIELD, SPAN_FIELD
from verl_stable.transport.sharing import (
    PROMPT_PARTITION,
    PROMPT_REF_FIELD,
    SOURCE_PARTITIONS,
    SharedPromptRowsError,
    key_of_ref,
)

__all__ = [
    "SIDE_READ_COUNTS",
    "SharedRowReader",
    "StaleSweep",
    "async_clear_stale_prompt_rows",
    "attach_shared_prompt_rows",
    "clear_stale_prompt_rows",
    "merged_sample_rows",
    "stale_prompt_entries",
]


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
