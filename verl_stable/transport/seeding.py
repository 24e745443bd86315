"""Reproducible rollouts: a sampling seed per sample from its identity, and sample puts in dispatch order.

Two runs of one command and seed differ in verl 0.9.1 for two reasons the agent-loop worker can remove:

* **Sampling.** verl sends every sample of a step to the rollout server at once without a seed, and a server that
  batches concurrent requests (the ``hf`` backend's cross-request batching, vLLM's continuous batching) draws them
  from one random stream in arrival order. :func:`sample_seed` gives each sample a seed of its own, a stable hash of
  what the sample *is* -- the run seed, the global step, train or validation, the prompt's content
  (:func:`prompt_content_key`), which occurrence of that prompt in the step it is, and its index in the ``rollout.n``
  group -- so batching and arrival order cannot change what it samples. verl's prompt ``uid`` is a fresh
  ``uuid4`` per run, so the prompt is identified by its content, not its uid.
* **Batch order.** verl's replay buffer hands the trainer a step's samples in the order they were put into
  TransferQueue, i.e. in completion order; that order decides which samples share a PPO mini-batch (with N > 1) and
  the summation order of every loss. The order is made the dispatch order, which the dataloader's seed fixes, in
  one of two ways. With verl-stable's sync trainer (``stable_sync``) the samples are put as they finish and the
  trainer sorts each sampled batch by :class:`DispatchLedger` (the agent-loop manager records the order it
  dispatched prompts in): nothing waits. With verl's own ``sync`` trainer, which cannot be told the order,
  :class:`PutOrder` lets each sample's put wait until every sample dispatched before it has been put (or has
  failed): the puts of a step then run one after another (their cost is measured in ``docs/explanation/benchmarks.md``,
  "Two actor ranks"). verl splits a dispatch into contiguous chunks, one per agent-loop worker
  (``rollout.agent.num_workers``, 8 by default), and TransferQueue lists keys in the order their puts reached it, so
  with several workers a worker's own order is not enough: the manager also numbers each prompt's group with a
  global turn (:class:`DispatchTurns`, held by the first worker and called by the others), and a group's first put
  waits until every group dispatched before it, on any worker, has settled.

Pure Python (``hashlib``, ``json``, ``asyncio``): the worker in :mod:`.agent_loop` wires it into verl.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_SEED",
    "PROMPT_IDENTITY_FIELDS",
    "DispatchLedger",
    "DispatchTurns",
    "PromptOccurrences",
    "PutOrder",
    "RolloutSeeding",
    "SampleGroup",
    "prompt_content_key",
    "sample_seed",
]

MAX_SEED = 2**63 - 1
"""Seeds are in ``[0, MAX_SEED]``: a non-negative int64, which vLLM's ``SamplingParams.seed`` and
``torch.Generator.manual_seed`` both accept."""

PROMPT_IDENTITY_FIELDS = ("data_source", "raw_prompt", "index")
"""The dataset fields of a prompt row (verl's ``RLHFDataset``) that identify its content; ``uid`` is random per run."""

_SEED_DOMAIN = b"verl-stable/rollout-sample-seed/v1"


def _canonical(value: Any) -> Any:
    """``value`` as JSON-encodable data that is equal for equal content (numpy / torch containers to lists)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    tolist = getattr(value, "tolist", None)  # numpy arrays and scalars, torch tensors
    if callable(tolist):
        return _canonical(tolist())
    item = getattr(value, "item", None)
    if callable(item):
        return _canonical(item())
    # anything else by its text; a type whose str() is not stable (an object address) would make seeds vary by run
    return f"{type(value).__name__}:{value}"


def prompt_content_key(prompt: Mapping[str, Any], fields: tuple[str, ...] = PROMPT_IDENTITY_FIELDS) -> str:
    """A hex digest of a prompt row's content (those of ``fields`` present in ``prompt``), equal across runs.

    A row with none of ``fields`` gets the digest of nothing: its prompts are then told apart only by their
    occurrence number (dispatch order within the step), which is still the same across runs.
    """
    present = {name: _canonical(prompt[name]) for name in fields if name in prompt}
    text = json.dumps(present, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def sample_seed(run_seed: int, step: int, validate: bool, prompt_key: str, occurrence: int, sample_index: int) -> int:
    """The sampling seed of one sample, in ``[0, MAX_SEED]``: a blake2b hash of its identity.

    Args:
        run_seed: the run's seed (verl's ``actor_rollout_ref.rollout.seed``).
        step: the global step the prompt was dispatched at.
        validate: a validation sample (a separate stream from training's at the same step).
        prompt_key: :func:`prompt_content_key` of the prompt row.
        occurrence: which occurrence of that prompt content in the step it is (0 for the first), so a prompt drawn
            twice in one step gets two groups of samples, not one group twice.
        sample_index: the sample's index in its group (verl's ``session_id``, ``0 .. rollout.n - 1``).

    Raises:
        ValueError: a negative step, occurrence or sample index.
    """
    if step < 0 or occurrence < 0 or sample_index < 0:
        raise ValueError(f"step, occurrence and sample_index must be >= 0, got {step}, {occurrence}, {sample_index}")
    identity = json.dumps(
        [int(run_seed), int(step), "val" if validate else "train", str(prompt_key), int(occurrence), int(sample_index)],
        separators=(",", ":"),
    )
    digest = hashlib.blake2b(_SEED_DOMAIN + b"|" + identity.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & MAX_SEED


class PromptOccurrences:
    """Counts how often each prompt content was dispatched per (step, train/val), in dispatch order.

    Args:
        keep_steps: (step, train/val) entries kept; older steps are forgotten (their dispatches are over).
    """

    def __init__(self, keep_steps: int = 8) -> None:
        if keep_steps < 1:
            raise ValueError(f"keep_steps must be >= 1, got {keep_steps}")
        self.keep_steps = int(keep_steps)
        self._counts: dict[tuple[int, bool], Counter[str]] = {}

    def next(self, step: int, validate: bool, prompt_key: str) -> int:
        """The occurrence number of this dispatch of ``prompt_key`` at ``(step, validate)`` (0 for the first).

        A dispatch at a step below one already counted means the run went back (the guard's ``rollback``): the
        abandoned steps' counts from ``step`` on are forgotten, so the redone steps sample exactly what a resume from
        the same checkpoint samples."""
        step = int(step)
        if any(counted > step for counted, _ in self._counts):
            for key in [key for key in self._counts if key[0] >= step]:
                del self._counts[key]
        counts = self._counts.setdefault((step, bool(validate)), Counter())
        occurrence = counts[prompt_key]
        counts[prompt_key] += 1
        if len(self._counts) > self.keep_steps:
            for old in sorted(self._counts)[: len(self._counts) - self.keep_steps]:
                del self._counts[old]
        return occurrence


class PutOrder:
    """Tickets in dispatch order; a ticket's turn comes once every earlier ticket has been released.

    The worker reserves one ticket per sample when its prompt is dispatched, waits for the sample's turn right before
    putting it into TransferQueue, and releases the ticket after the put -- or when the sample fails, so a failed
    sample never holds the others back. Releasing is idempotent. Single event loop (the worker's), no threads.
    """

    def __init__(self) -> None:
        self._next = 0
        self._head = 0  # every ticket below this one has been released
        self._released: set[int] = set()
        self._advanced = asyncio.Event()

    def reserve(self, count: int) -> int:
        """Reserve ``count`` consecutive tickets; returns the first."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        first = self._next
        self._next += int(count)
        return first

    def release(self, ticket: int) -> None:
        """Mark ``ticket`` done (put or failed); wakes the samples whose turn has come."""
        if ticket < self._head or ticket >= self._next:
            return
        self._released.add(ticket)
        moved = False
        while self._head in self._released:
            self._released.remove(self._head)
            self._head += 1
            moved = True
        if moved:
            event, self._advanced = self._advanced, asyncio.Event()
            event.set()

    def is_turn(self, ticket: int) -> bool:
        """Whether every ticket before ``ticket`` has been released."""
        return self._head >= ticket

    async def wait_turn(self, ticket: int) -> None:
        """Return once every ticket before ``ticket`` has been released."""
        while not self.is_turn(ticket):
            await self._advanced.wait()

    @property
    def pending(self) -> int:
        """Tickets reserved and not yet released."""
        return self._next - self._head - len(self._released)


class DispatchTurns:
    """Global turns of prompt groups across agent-loop workers: group ``t`` may put once groups ``0 .. t-1`` settled.

    The agent-loop manager reserves one turn per prompt of each dispatch, in batch order, before verl splits the batch
    over its workers; a worker waits for its group's turn before the group's first put and releases it when the group
    has settled (every sample put, or failed). Under verl's own ``sync`` trainer with several workers this puts a
    step's samples into TransferQueue in dispatch order, which is the order its replay buffer hands them over in. In
    a Ray deployment the first agent-loop worker holds the instance and the others call it (:class:`RemoteTurns`):
    no process of its own. Single event loop, no threads.
    """

    def __init__(self) -> None:
        self._order = PutOrder()

    def reserve(self, count: int) -> int:
        """Reserve ``count`` consecutive turns; returns the first."""
        return self._order.reserve(count)

    async def wait_turn(self, turn: int) -> None:
        """Return once every turn before ``turn`` has been released."""
        await self._order.wait_turn(turn)

    def release(self, turn: int) -> None:
        """The group of ``turn`` has settled (idempotent)."""
        self._order.release(turn)

    @property
    def pending(self) -> int:
        """Turns reserved and not yet released."""
        return self._order.pending


class RemoteTurns:
    """The :class:`DispatchTurns` held by another agent-loop worker, called through its Ray actor ``handle``
    (``stable_turn_wait`` / ``stable_turn_release``), with the in-process interface."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def wait_turn(self, turn: int) -> None:
        """Return once every turn before ``turn`` has been released (one actor call)."""
        await self.handle.stable_turn_wait.remote(turn)

    def release(self, turn: int) -> None:
        """Release ``turn`` without waiting for the reply (a later ``wait_turn`` only waits longer if it overtakes)."""
        self.handle.stable_turn_release.remote(turn)


@dataclass(frozen=True)
class SampleGroup:
    """One dispatched prompt's group: what identifies it across runs, its first put ticket (None: unordered) and its
    global turn (None: this worker's order is enough)."""

    step: int
    validate: bool
    prompt_key: str
    occurrence: int
    size: int
    first_ticket: int | None = None
    turn: int | None = None


class RolloutSeeding:
    """One agent-loop worker's seeding and put-order state, keyed by the in-flight groups' uids.

    The worker calls :meth:`dispatch` when a prompt's group starts (before its first ``await``, so groups are numbered
    in batch order), :meth:`seed` for each sample's sampling params, :meth:`wait_turn` right before a sample's put,
    :meth:`release` after it (or when the sample failed) and :meth:`finish` when the whole group has settled.

    With ordered puts and ``turns`` (the workers' shared :class:`DispatchTurns`, or a :class:`RemoteTurns` to it),
    groups dispatched with a global turn also wait for every group dispatched before them on the other workers.

    Args:
        run_seed: the run's seed (verl's ``actor_rollout_ref.rollout.seed``).
        ordered_puts: put samples into TransferQueue in dispatch order (sync trainers).
        turns: the global turns of groups across workers (None: this worker's order only).
    """

    def __init__(self, run_seed: int, ordered_puts: bool, turns: Any = None) -> None:
        self.run_seed = int(run_seed)
        self.occurrences = PromptOccurrences()
        self.put_order = PutOrder() if ordered_puts else None
        self.turns = turns
        self.groups: dict[str, SampleGroup] = {}
        self._turn_reached: set[int] = set()  # global turns already waited for (a turn never goes back)

    def dispatch(
        self,
        uid: str,
        prompt: Mapping[str, Any],
        step: int,
        validate: bool,
        size: int,
        occurrence: int | None = None,
        turn: int | None = None,
    ) -> SampleGroup:
        """Register the group ``uid`` of ``size`` samples of ``prompt`` (a dataset row) dispatched at ``step``.

        ``occurrence``: the prompt's occurrence number as the agent-loop manager counted it over the whole batch
        (several workers each see a part); None counts here, over what this worker was dispatched. ``turn``: the
        group's global turn from the manager (:class:`DispatchTurns`); used with ordered puts and ``turns`` only.
        """
        key = prompt_content_key(prompt)
        if occurrence is None:
            occurrence = self.occurrences.next(step, validate, key)
        group = SampleGroup(
            step=int(step),
            validate=bool(validate),
            prompt_key=key,
            occurrence=int(occurrence),
            size=int(size),
            first_ticket=self.put_order.reserve(size) if self.put_order is not None else None,
            turn=None if turn is None or self.put_order is None or self.turns is None else int(turn),
        )
        self.groups[str(uid)] = group
        return group

    def seed(self, uid: Any, sample_index: int) -> int | None:
        """The sampling seed of sample ``sample_index`` of group ``uid`` (None: a group not dispatched here)."""
        group = self.groups.get(str(uid))
        if group is None:
            return None
        return sample_seed(
            self.run_seed, group.step, group.validate, group.prompt_key, group.occurrence, int(sample_index)
        )

    def ticket(self, uid: Any, sample_index: int) -> int | None:
        """The put ticket of a sample (None: puts are not ordered, or a group not dispatched here)."""
        group = self.groups.get(str(uid))
        if group is None or group.first_ticket is None or not 0 <= int(sample_index) < group.size:
            return None
        return group.first_ticket + int(sample_index)

    async def wait_turn(self, uid: Any, sample_index: int) -> None:
        """Return once every sample dispatched before this one has been put or has failed: on this worker, and with a
        global turn, every group dispatched before this one's on any worker."""
        ticket = self.ticket(uid, sample_index)
        if ticket is None:
            return
        await self.put_order.wait_turn(ticket)
        group = self.groups.get(str(uid))
        if group is not None and group.turn is not None and group.turn not in self._turn_reached:
            await self.turns.wait_turn(group.turn)
            self._turn_reached.add(group.turn)

    def release(self, uid: Any, sample_index: int) -> None:
        """This sample has been put, or has failed: the next sample's turn (idempotent)."""
        ticket = self.ticket(uid, sample_index)
        if ticket is not None:
            self.put_order.release(ticket)

    def finish(self, uid: Any) -> None:
        """The group has settled: release its samples that never reached a put and its global turn, and forget it."""
        group = self.groups.pop(str(uid), None)
        if group is not None and group.first_ticket is not None:
            for ticket in range(group.first_ticket, group.first_ticket + group.size):
                self.put_order.release(ticket)
        if group is not None and group.turn is not None:
            self._turn_reached.discard(group.turn)
            self.turns.release(group.turn)


class DispatchLedger:
    """The order prompts were dispatched in (the agent-loop manager records it), to sort a sampled batch back into it.

    A sample's key is verl's ``{uid}_{session_id}_{index}``; :meth:`order` sorts keys by (the uid's dispatch ordinal,
    session id, index): exactly the order :class:`PutOrder` would have put them in, whatever order they finished in.
    Ordering a batch forgets its uids (verl never samples a group twice), so the ledger holds in-flight groups only.
    """

    def __init__(self) -> None:
        self._ordinal: dict[str, int] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self._ordinal)

    def record(self, uids: Any) -> None:
        """Append the prompts ``uids`` (a dispatched batch's ``uid`` column, in batch order)."""
        for uid in uids:
            if str(uid) not in self._ordinal:
                self._ordinal[str(uid)] = self._next
                self._next += 1

    def order(self, keys: list[str]) -> list[int]:
        """Positions of ``keys`` in dispatch order, forgetting their uids.

        Keys whose uid was never recorded (a batch restored from a checkpoint, another manager) keep their relative
        order after the recorded ones.
        """
        ranks = []
        for position, key in enumerate(keys):
            uid, _, rest = str(key).partition("_")
            session, _, index = rest.partition("_")
            ordinal = self._ordinal.get(uid)
            if ordinal is None or not session.isdigit() or not index.isdigit():
                ranks.append((1, 0, 0, 0, position))
            else:
                ranks.append((0, ordinal, int(session), int(index), position))
        for key in keys:
            self._ordinal.pop(str(key).partition("_")[0], None)
        return [rank[-1] for rank in sorted(ranks)]
