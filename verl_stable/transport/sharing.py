"""Prompt rows once per group: the side-entry protocol between the agent-loop workers and the actors.

verl's V1 agent loop runs the ``rollout.n`` sessions of a prompt in one worker (``AgentLoopWorkerTQ._run_prompt``)
as independent tasks that each put their own TransferQueue row as soon as they finish (key ``{uid}_{session}_{i}``);
the trainer then balances, filters and shuffles those rows individually across data-parallel ranks and
mini-batches. So the group's shared copy of its prompt rows is a TransferQueue entry of its own (a *side entry*),
not a sample. This module and :mod:`verl_stable.transport.side_rows` own every step of its life (``+verl_stable.routing.share_prompt_rows``, default true;
``false`` keeps every row with its sample):

1. worker (:class:`PromptRowSharing`, :func:`shared_sample_fields`): a group of ``n > 1`` samples shares its prompt
   rows when that saves at least ``share_prompt_rows_min_bytes`` (``(n - 1) x`` the rows' bytes; default 2 MiB, 0
   shares every group). Its first finished sample puts its validated prompt rows ``[start, prompt_len)`` into
   :data:`PROMPT_PARTITION` (verl's trainer samples only ``train`` / ``val``), under a 128-bit key of the uid,
   partition, start and the rows' bytes (:func:`prompt_rows_key`), before its own row. A sibling whose prompt rows
   are identical stores only its later rows plus :data:`PROMPT_REF_FIELD` (24 bytes) and waits for that put; a
   sibling whose rows differ (an engine may route the same prompt differently across requests) keeps all its rows and
   is counted. The per-worker cache holds in-flight groups only;
2. actor (:mod:`~verl_stable.transport.side_rows`, :func:`attach_shared_prompt_rows`): one ``kv_batch_get`` of the (mini-)batch's distinct entries puts the
   prompt rows back in front of each sample's own rows. A missing or misshapen entry raises
   :class:`SharedPromptRowsError`; rows that arrive in another dtype than the sample's are validated (against the
   layout when given) before they are narrowed, so a wrapped id can never become a plausible one. Each
   data-parallel rank reads the entries of the groups it holds, through its :class:`SharedRowReader`, which keeps
   the entries of its last read: verl hands a rank the same samples for ``compute_log_prob`` and every update
   mini-step of a step, so a rank reads once per step (counted: :data:`SIDE_READ_COUNTS`);
3. lifetime (:mod:`~verl_stable.transport.side_rows`, :func:`clear_stale_prompt_rows`, :func:`async_clear_stale_prompt_rows`): entries whose group has no key
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

What it saves and what it costs (bytes per token, round trips, the break-even behind the default minimum) is measured
in docs/explanation/benchmarks.md (``benchmarks/bench_routing_transport.py``, ``benchmarks/bench_side_entry_cost.py``).

No verl import; TransferQueue is imported only when no reader / writer is passed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from verl_stable.routing.codecs import (
    RoutedRows,
    RowCountError,
)
from verl_stable.routing.trace import RoutingLayout
from verl_stable.transport.fields import IDS_FIELD, sample_fields

__all__ = [
    "PROMPT_PARTITION",
    "PROMPT_REF_FIELD",
    "SOURCE_PARTITIONS",
    "PromptRowSharing",
    "ShareDecision",
    "SharedPrompt",
    "SharedPromptRowsError",
    "key_of_ref",
    "prompt_ref",
    "prompt_rows_key",
    "shared_sample_fields",
]

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
    checked: bool = False,
) -> tuple[dict[str, torch.Tensor], ShareDecision]:
    """:func:`~verl_stable.transport.fields.sample_fields` plus :data:`PROMPT_REF_FIELD`, prompt rows shared.

    When the sample shares its group's prompt rows, :data:`IDS_FIELD` keeps only the rows after them and
    :data:`SPAN_FIELD` still covers the whole span. ``uid=None``: never shared (zero reference). ``group_size``:
    see :meth:`PromptRowSharing.decide`. ``checked``: as for :func:`~verl_stable.transport.fields.sample_fields`.
    """
    fields = sample_fields(rows, layout, checked=checked)
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
