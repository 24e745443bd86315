"""verl's agent-loop classes with compact routing: the output, the TransferQueue worker and its manager.

Select the manager by its dotted path,
``+actor_rollout_ref.rollout.agent.agent_loop_manager_class=verl_stable.integration.rollout.CompactRoutingAgentLoopManagerTQ``
(:data:`~.config.MANAGER_FQN`); it starts :class:`CompactRoutingAgentLoopWorkerTQ` workers, which before each sample
is stored validate and compact its routing (:mod:`.boundary`), share its group's prompt rows (:mod:`.sharing`) and
put the compact fields instead of verl's int16 ``routed_experts`` (:class:`CompactRoutingAgentLoopOutput`). The
workers also make rollouts reproducible (:mod:`.seeding`): every sample is sent with a sampling seed derived from its
identity and verl's ``actor_rollout_ref.rollout.seed``, and with a sync trainer the trainer gets the samples in
dispatch order (``stable_sync`` sorts them by the manager's :class:`~.seeding.DispatchLedger`; under verl's ``sync``
the workers put them in that order, across workers too: with several workers the manager numbers each prompt's group
with a global turn, :class:`~.seeding.DispatchTurns`, which the first worker holds for all).

This module imports verl's agent loop, TransferQueue's client and Ray at import time (close to a second on top of
``import verl``), so the package imports it only when one of its names is first used; the plugin's import of
:mod:`verl_stable.integration.rollout`, which runs in every verl process, does not reach it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
import torch
from omegaconf import OmegaConf
from pydantic import ConfigDict
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ, AgentLoopWorkerTQ

from verl_stable.routing.codecs import BoundaryStats
from verl_stable.routing.families import layout_from_config
from verl_stable.routing.trace import RoutingLayout
from verl_stable.transport.boundary import (
    BOUNDARY_FIELD,
    boundary_counters,
    compact_token_routing,
    merge_stats,
)
from verl_stable.transport.fields import IDS_FIELD, sample_fields
from verl_stable.transport.options import DEFAULT_OPTIONS, RolloutRoutingOptions
from verl_stable.transport.seeding import (
    PROMPT_IDENTITY_FIELDS,
    DispatchLedger,
    DispatchTurns,
    PromptOccurrences,
    RemoteTurns,
    RolloutSeeding,
    prompt_content_key,
)
from verl_stable.transport.sharing import (
    PROMPT_PARTITION,
    PROMPT_REF_FIELD,
    PromptRowSharing,
    SharedPromptRowsError,
    key_of_ref,
    shared_sample_fields,
)
from verl_stable.transport.side_rows import StaleSweep, async_clear_stale_prompt_rows

__all__ = [
    "CompactRoutingAgentLoopManagerTQ",
    "CompactRoutingAgentLoopOutput",
    "CompactRoutingAgentLoopWorkerTQ",
    "compact_agent_loop_output",
]

logger = logging.getLogger("verl_stable.routing")

TRAINER_MODE_KEY = "trainer.v1.trainer_mode"
# verl's own sync trainer takes a step's samples in put order and cannot be told another: put them in dispatch order
# (one after another). stable_sync sorts the sampled batch by the manager's DispatchLedger instead, so puts never wait.
ORDERED_PUT_MODES = ("sync",)
OCCURRENCE_FIELD = "__verl_stable_occurrence__"
"""Batch column the manager adds for its workers (popped before verl sees the prompt, so never stored)."""
TURN_FIELD = "__verl_stable_turn__"
"""Batch column of each prompt's global turn (:class:`~.seeding.DispatchTurns`), added by the manager under an ordered
put mode with several workers; popped like :data:`OCCURRENCE_FIELD`."""


class CompactRoutingAgentLoopOutput(AgentLoopOutput):
    """AgentLoopOutput carrying the compact routing fields (see :func:`compact_agent_loop_output`)."""

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


def compact_agent_loop_output(
    output: Any,
    layout: RoutingLayout,
    options: RolloutRoutingOptions = DEFAULT_OPTIONS,
    stats: BoundaryStats | None = None,
    sharing: PromptRowSharing | None = None,
    uid: str | None = None,
    partition: str = "train",
    group_size: int | None = None,
    response_length: int | None = None,
) -> Any:
    """An ``AgentLoopOutput`` whose ``as_dict`` emits the compact fields instead of verl's int16 ``routed_experts``.

    Besides :data:`IDS_FIELD` / :data:`SPAN_FIELD` it emits :data:`BOUNDARY_FIELD` (this sample's counters, read by
    :func:`~.boundary.fetch_transport_metrics` on the trainer); ``stats`` accumulates the worker's running totals.

    With ``sharing`` (the worker's :class:`~.sharing.PromptRowSharing`) the sample also emits
    :data:`PROMPT_REF_FIELD`; with the group's ``uid`` too its prompt rows may be shared: its :data:`IDS_FIELD` then
    holds only the rows after them (:data:`SPAN_FIELD` still covers the whole span), and ``output.shared_prompt`` is
    the side entry to put before the sample when this sample is the group's first (``None`` otherwise).
    ``uid=None``: never shared (a group of one), the field is zero. ``group_size`` (the group's ``rollout.n``)
    decides with ``sharing.min_saved_bytes`` whether the group's prompt rows are worth a side entry.
    ``response_length`` (verl's ``rollout.response_length``) lets a response verl cut at that limit carry the one
    extra row of its last kept token, which is trimmed and counted (:func:`~.boundary.compact_token_routing`).
    """
    sample_stats = BoundaryStats()
    try:
        rows = compact_token_routing(
            output.routed_experts,
            prompt_len=len(output.prompt_ids),
            response_mask=output.response_mask,
            layout=layout,
            options=options,
            stats=sample_stats,
            response_length=response_length,
        )
    finally:
        if stats is not None:
            merge_stats(stats, sample_stats)
    seq_len = len(output.prompt_ids) + len(output.response_ids)
    output.extra_fields["stable_routing_missing_positions"] = seq_len - (0 if rows is None else rows.num_rows)
    output.extra_fields["stable_routing_skipped"] = int(output.routed_experts is not None and rows is None)
    values = {name: getattr(output, name) for name in type(output).model_fields}
    values["routed_experts"] = None
    values.pop("compact_routing", None)
    values.pop("shared_prompt", None)
    compact = CompactRoutingAgentLoopOutput.model_construct(
        _fields_set=set(output.model_fields_set) - {"routed_experts"}, **values, compact_routing=None
    )
    # the rows are the boundary decoder's, validated and narrowed there: not checked again
    if sharing is None:
        fields, share = sample_fields(rows, layout, checked=True), None
    else:
        fields, share = shared_sample_fields(
            rows,
            layout,
            sharing,
            prompt_len=len(output.prompt_ids),
            uid=uid,
            partition=partition,
            group_size=group_size,
            checked=True,
        )
    fields[BOUNDARY_FIELD] = boundary_counters(
        fields, seq_len=seq_len, layout=layout, sample_stats=sample_stats, share=share
    )
    compact.compact_routing = fields
    compact.shared_prompt = None if share is None else share.side
    return compact


class CompactRoutingAgentLoopWorkerTQ(AgentLoopWorkerTQ.__ray_actor_class__):
    """AgentLoopWorkerTQ that validates and compacts routing before it enters TransferQueue, and seeds every sample.

    Reproducibility (:mod:`.seeding`): each sample's sampling params carry ``seed`` = :func:`~.seeding.sample_seed`
    of (``rollout.seed``, global step, train/val, the prompt's content, its occurrence in the step, the sample's index
    in its group); the ``hf`` server and vLLM draw the sample from a generator of that seed. With a sync trainer
    verl's ``sync`` trainer (``trainer.v1.trainer_mode=sync``) the samples are put into TransferQueue in dispatch order
    (:class:`~.seeding.PutOrder`; with several workers also after every group dispatched earlier to another worker,
    :class:`~.seeding.DispatchTurns`), which is the order verl's replay buffer hands them to the trainer;
    ``stable_sync`` sorts each sampled batch into dispatch order itself (:class:`~.seeding.DispatchLedger`), so puts
    do not wait.
    """

    stable_seeding: RolloutSeeding | None = None
    """Per-sample seeds and put order (set by ``__init__``; None leaves sampling and puts as verl does them)."""
    stable_response_length: int | None = None
    """verl's ``rollout.response_length``, where its agent loops cut a response (set by ``__init__``; None: the
    boundary refuses the extra routing row of a cut response)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stable_routing_enabled = bool(self.rollout_config.enable_rollout_routing_replay)
        self.stable_routing_options = RolloutRoutingOptions.from_config(self.config)
        self.stable_routing_stats = BoundaryStats()
        self.stable_response_length = int(self.rollout_config.response_length)
        self.stable_routing_layout = (
            layout_from_config(self.model_config.hf_config) if self.stable_routing_enabled else None
        )
        self.stable_prompt_sharing = PromptRowSharing(self.stable_routing_options.share_prompt_rows_min_bytes)
        self.stable_stale_sweep = StaleSweep()
        # set at this worker's first side entry: a worker that never put one has nothing of its own to sweep
        self.stable_put_side_entries = False
        self.stable_clearing: asyncio.Future | None = None  # the sweep of the last dispatch, while it runs
        # uid -> side-entry key -> its put; in-flight groups of more than one sample only
        self.stable_prompt_puts: dict[str, dict[str, asyncio.Future]] = {}
        self.stable_group_sizes: dict[str, int] = {}  # uid -> its samples (rollout.n), same groups
        mode = OmegaConf.select(self.config, TRAINER_MODE_KEY, default="sync")
        self.stable_seeding = RolloutSeeding(self.rollout_config.seed, ordered_puts=mode in ORDERED_PUT_MODES)

    def stable_set_turns(self, turns: Any = None) -> None:
        """Take part in the global turns of groups across workers (with ordered puts, each group then also waits for
        the groups dispatched before it to other workers): ``None`` holds them here (the first worker), a
        :class:`~.seeding.DispatchTurns` is used in-process, anything else is the Ray handle of the worker holding
        them."""
        if turns is None:
            turns = self.stable_turns_held = DispatchTurns()
        if self.stable_seeding is not None:
            self.stable_seeding.turns = turns if isinstance(turns, DispatchTurns) else RemoteTurns(turns)

    # the global turns, held by the first worker for the manager (reserve) and the other workers (wait, release)
    stable_turns_held: DispatchTurns | None = None

    def stable_turn_reserve(self, count: int) -> int:
        """Reserve ``count`` consecutive global turns (the manager, one per prompt it dispatches); the first."""
        return self.stable_turns_held.reserve(count)

    async def stable_turn_wait(self, turn: int) -> None:
        """Return once every global turn before ``turn`` has been released (another worker's group)."""
        await self.stable_turns_held.wait_turn(turn)

    def stable_turn_release(self, turn: int) -> None:
        """Another worker's group of ``turn`` has settled."""
        self.stable_turns_held.release(turn)

    def _stable_compact(self, output: Any, uid: str, partition: str) -> Any:
        if not self.stable_routing_options.share_prompt_rows:
            return compact_agent_loop_output(
                output,
                self.stable_routing_layout,
                self.stable_routing_options,
                self.stable_routing_stats,
                response_length=self.stable_response_length,
            )
        return compact_agent_loop_output(
            output,
            self.stable_routing_layout,
            self.stable_routing_options,
            self.stable_routing_stats,
            sharing=self.stable_prompt_sharing,
            uid=uid if uid in self.stable_prompt_puts else None,  # a group of one shares nothing
            partition=partition,
            group_size=self.stable_group_sizes.get(uid),
            response_length=self.stable_response_length,
        )

    async def _stable_put_shared(self, outputs: list[Any], uid: str) -> None:
        """Put this group's side entry (its first sample) or wait for the sibling's put, before the sample."""
        # looked up at call time, not import time: tests (and any stand-in store) replace TransferQueue's functions
        import transfer_queue as tq
        from tensordict import TensorDict

        puts = self.stable_prompt_puts.get(uid, {})
        for output in outputs:
            side = output.shared_prompt
            if side is not None and side.key not in puts:
                fields = TensorDict({IDS_FIELD: side.ids.unsqueeze(0)}, batch_size=[1])
                self.stable_put_side_entries = True
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
        if self.stable_routing_enabled and self.stable_put_side_entries:
            # a new dispatch follows verl's clearing of finished groups: drop their shared prompt rows (any
            # trainer class; the stable_* trainers sweep once more after training). Alongside the rollout, not
            # before it: nothing of this dispatch waits for housekeeping (one sweep at a time). Every worker that
            # put a side entry sweeps at each later dispatch, so one that never put any (all its groups below
            # share_prompt_rows_min_bytes) leaves nothing behind by skipping its own listing.
            if self.stable_clearing is None or self.stable_clearing.done():
                self.stable_clearing = asyncio.ensure_future(self._stable_clear_stale())
        return await super().generate_sequences(batch)

    async def _stable_clear_stale(self) -> None:
        try:
            await async_clear_stale_prompt_rows(sweep=self.stable_stale_sweep)
        except Exception as exc:  # housekeeping must not fail a rollout; the next dispatch retries
            logger.warning("verl-stable: clearing shared prompt rows failed: %s", exc)

    async def _agent_loop_postprocess(self, output: Any, validate: bool, **kwargs: Any) -> Any:
        if self.stable_routing_enabled:
            uid, partition = str(kwargs.get("uid")), "val" if validate else "train"
            outputs = output if isinstance(output, list) else [output]
            outputs = [self._stable_compact(o, uid, partition) for o in outputs]
            if self.stable_routing_options.share_prompt_rows:
                await self._stable_put_shared(outputs, uid)
            output = outputs if isinstance(output, list) else outputs[0]
        seeding, uid, index = self.stable_seeding, kwargs.get("uid"), int(kwargs.get("session_id", 0))
        if seeding is None or seeding.ticket(uid, index) is None:
            return await super()._agent_loop_postprocess(output, validate, **kwargs)
        try:
            # score while earlier samples finish (verl's postprocess skips a sample already scored), then put in turn
            scored = output if isinstance(output, list) else [output]
            if scored:
                await self._compute_score(scored, kwargs=kwargs)
            await seeding.wait_turn(uid, index)
            return await super()._agent_loop_postprocess(output, validate, **kwargs)
        finally:
            seeding.release(uid, index)  # put, or failed: the next sample's turn either way

    async def _run_agent_loop(self, sampling_params: dict[str, Any], trajectory: dict[str, Any], **kwargs: Any) -> Any:
        seeding, uid, index = self.stable_seeding, kwargs.get("uid"), int(kwargs.get("session_id", 0))
        seed = seeding.seed(uid, index) if seeding is not None else None
        if seed is not None:
            # a copy: verl hands one dict to every sample of the group
            sampling_params = {**sampling_params, "seed": seed}
        try:
            return await super()._run_agent_loop(sampling_params, trajectory, **kwargs)
        finally:
            if seeding is not None:
                seeding.release(uid, index)  # failed before its put: must not hold later samples back

    async def _run_prompt(self, prompt: dict, sampling_params: dict, trajectory: dict, **kwargs: Any) -> None:
        uid = str(prompt.get("uid"))
        rollout = self.config.actor_rollout_ref.rollout
        n = int(prompt.get("__rollout_n__", rollout.val_kwargs.n if trajectory["validate"] else rollout.n))
        if self.stable_routing_enabled and n > 1:
            self.stable_prompt_puts[uid] = {}
            self.stable_group_sizes[uid] = n
        occurrence = prompt.pop(OCCURRENCE_FIELD, None)  # the manager's numbering; not a dataset field
        turn = prompt.pop(TURN_FIELD, None)  # likewise
        if self.stable_seeding is not None:
            # before the first await: groups start in batch order, so occurrences and tickets follow the batch
            step = prompt.get("global_steps", trajectory.get("step", 0))
            self.stable_seeding.dispatch(
                uid,
                prompt,
                int(step),
                bool(trajectory["validate"]),
                n,
                occurrence=None if occurrence is None else int(occurrence),
                turn=None if turn is None else int(turn),
            )
        try:
            return await super()._run_prompt(prompt, sampling_params, trajectory, **kwargs)
        finally:
            # every session of the group has settled (verl's contract): forget it
            self.stable_prompt_sharing.forget(uid)
            self.stable_prompt_puts.pop(uid, None)
            self.stable_group_sizes.pop(uid, None)
            if self.stable_seeding is not None:
                self.stable_seeding.finish(uid)  # samples that never reached a put must not block later groups

    def stable_routing_metrics(self) -> dict[str, float]:
        """Boundary counters of this worker (``stable/routing/*``)."""
        return self.stable_routing_stats.as_metrics()


_REMOTE_WORKER = ray.remote(CompactRoutingAgentLoopWorkerTQ)


class CompactRoutingAgentLoopManagerTQ(AgentLoopManagerTQ):
    """AgentLoopManagerTQ whose workers carry compact, validated routing (select it by FQN, see module doc).

    It also numbers repeated prompts for the workers' sampling seeds (:data:`OCCURRENCE_FIELD`): verl splits a batch
    over several workers, and a prompt drawn twice in one step must get two groups of samples even when its two
    copies land on different workers. And it records the order it dispatched prompts in (:attr:`stable_dispatch`),
    by which the ``stable_sync`` trainer sorts each batch it samples. Under verl's own ``sync`` trainer with several
    workers it numbers each prompt's group with a global turn (:data:`TURN_FIELD`) from the
    :class:`~.seeding.DispatchTurns` its first worker holds for all (:attr:`stable_turns`), so that their puts follow
    dispatch order.
    """

    stable_turns: Any = None
    """Where the global turns are: the first worker's Ray handle, or an in-process
    :class:`~.seeding.DispatchTurns` (None: not needed)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # patch: agent_loop_workers_class (verl_stable.compat.catalogue)
        self.agent_loop_workers_class = _REMOTE_WORKER
        self.stable_occurrences = PromptOccurrences()
        self.stable_dispatch = DispatchLedger()
        self.stable_turns = None

    def stable_wants_turns(self) -> bool:
        """Whether the workers need global turns: puts in dispatch order (verl's ``sync``) with several workers."""
        mode = OmegaConf.select(self.config, TRAINER_MODE_KEY, default="sync")
        workers = OmegaConf.select(self.config, "actor_rollout_ref.rollout.agent.num_workers", default=1)
        return mode in ORDERED_PUT_MODES and int(workers) > 1

    async def _init_agent_loop_workers(self) -> None:
        await super()._init_agent_loop_workers()
        if self.stable_wants_turns() and len(self.agent_loop_workers) > 1:
            # the first worker holds them: no process of their own (every process under verl_stable.integration
            # imports verl). At most one group per worker waits for its turn at a time (a worker's later groups wait
            # behind its own earlier ones first), so the calls stay far below an async actor's concurrency limit.
            host, *others = self.agent_loop_workers
            await host.stable_set_turns.remote()
            await asyncio.gather(*[w.stable_set_turns.remote(host) for w in others])
            self.stable_turns = host

    def generate_sequences(self, prompts: Any) -> None:
        if "uid" in prompts.keys():
            self.stable_dispatch.record(prompts["uid"])
        return super().generate_sequences(self.stable_number_turns(self.stable_number_occurrences(prompts)))

    def stable_number_turns(self, prompts: Any) -> Any:
        """``prompts`` (the manager's own copy) with :data:`TURN_FIELD`: consecutive global turns in batch order, which
        verl's contiguous chunks hand to the workers in that order; unchanged when no turns are shared."""
        if self.stable_turns is None or not len(prompts):
            return prompts
        turns = self.stable_turns
        if isinstance(turns, DispatchTurns):
            first = turns.reserve(len(prompts))
        else:
            first = ray.get(turns.stable_turn_reserve.remote(len(prompts)))
        prompts[TURN_FIELD] = torch.arange(first, first + len(prompts), dtype=torch.int64)
        return prompts

    def stable_number_occurrences(self, prompts: Any) -> Any:
        """A shallow copy of the batch ``prompts`` with :data:`OCCURRENCE_FIELD`: each row's occurrence number of its
        prompt content at this (step, train/val), counted over every dispatch of the step in batch order."""
        keys = set(prompts.keys())
        step = int(prompts["global_steps"]) if "global_steps" in keys else 0
        validate = bool(prompts["validate"]) if "validate" in keys else False
        fields = [name for name in PROMPT_IDENTITY_FIELDS if name in keys]
        columns = {name: prompts[name] for name in fields}
        occurrences = [
            self.stable_occurrences.next(step, validate, prompt_content_key({n: columns[n][i] for n in fields}))
            for i in range(len(prompts))
        ]
        numbered = prompts.copy()  # the trainer keeps its batch: never add a column to it
        numbered[OCCURRENCE_FIELD] = torch.tensor(occurrences, dtype=torch.int64)
        return numbered
