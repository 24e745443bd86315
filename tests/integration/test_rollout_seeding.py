"""Reproducible rollouts (issue #17): per-sample seeds from the sample's identity, and puts in dispatch order.

The derivation and the ordering are pure Python (:mod:`verl_stable.transport.seeding`); the last tests run
verl's real ``AgentLoopWorkerTQ._run_prompt`` / ``_agent_loop_postprocess`` through our worker subclass, with an
in-memory stand-in for TransferQueue's put and for the agent loop's LLM call (the only stand-ins).
"""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys

import numpy as np
import pytest
import torch
import transfer_queue as tq
from omegaconf import OmegaConf
from verl.experimental.agent_loop import agent_loop as verl_agent_loop
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ, AgentLoopWorkerTQ

from verl_stable.integration import rollout
from verl_stable.integration.rollout.agent_loop import OCCURRENCE_FIELD, ORDERED_PUT_MODES, TURN_FIELD
from verl_stable.transport.options import RolloutRoutingOptions
from verl_stable.transport.seeding import (
    MAX_SEED,
    DispatchLedger,
    DispatchTurns,
    PromptOccurrences,
    PutOrder,
    RolloutSeeding,
    prompt_content_key,
    sample_seed,
)
from verl_stable.transport.sharing import PromptRowSharing

KEY = prompt_content_key({"raw_prompt": [{"role": "user", "content": "max 3 8 1"}], "index": 0})


# ------------------------------------------------------------------------------------------------ derivation
def test_sample_seed_is_a_stable_hash_of_the_identity():
    """A fixed value: the derivation must not change silently (runs recorded before would no longer replay)."""
    assert sample_seed(0, 1, False, "k", 0, 0) == 3654703188790136140
    assert sample_seed(0, 1, False, "k", 0, 0) == sample_seed(0, 1, False, "k", 0, 0)
    # independent of Python's per-process string hashing: the same value in a process with another hash seed
    code = (
        "from verl_stable.transport.seeding import sample_seed, prompt_content_key;"
        "print(sample_seed(7, 3, True, prompt_content_key({'raw_prompt': 'p', 'index': 2}), 1, 2))"
    )
    env = {"PYTHONHASHSEED": "12345", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert int(out.stdout) == sample_seed(7, 3, True, prompt_content_key({"raw_prompt": "p", "index": 2}), 1, 2)


def test_sample_seed_differs_for_every_part_of_the_identity():
    grid = list(itertools.product((0, 1, 2**40), (0, 1, 7), (False, True), (KEY, "other"), (0, 1, 3), (0, 1, 2, 15)))
    seeds = [sample_seed(*identity) for identity in grid]
    assert len(set(seeds)) == len(grid)
    assert all(0 <= s <= MAX_SEED for s in seeds)
    # no part can stand in for another: (step 1, sample 0) is not (step 0, sample 1), and so on
    assert sample_seed(0, 1, False, KEY, 0, 0) != sample_seed(0, 0, False, KEY, 0, 1)
    assert sample_seed(1, 0, False, KEY, 0, 0) != sample_seed(0, 1, False, KEY, 0, 0)
    assert sample_seed(0, 0, False, KEY, 1, 0) != sample_seed(0, 0, False, KEY, 0, 1)
    with pytest.raises(ValueError, match=">= 0"):
        sample_seed(0, -1, False, KEY, 0, 0)
    with pytest.raises(ValueError, match=">= 0"):
        sample_seed(0, 0, False, KEY, 0, -2)


def test_prompt_content_key_reads_content_not_containers_or_uid():
    messages = [{"role": "user", "content": "max 3 8 1"}]
    as_numpy = {
        "raw_prompt": np.array(messages, dtype=object),
        "index": np.int64(0),
        "data_source": "toy",
        "uid": "6f1c...",  # a fresh uuid4 per run: never part of the identity
        "global_steps": 4,
    }
    plain = {"raw_prompt": messages, "index": 0, "data_source": "toy", "uid": "another-uuid", "global_steps": 9}
    assert prompt_content_key(as_numpy) == prompt_content_key(plain)
    assert prompt_content_key({**plain, "raw_prompt": [{"role": "user", "content": "max 3 8 2"}]}) != (
        prompt_content_key(plain)
    )
    assert prompt_content_key({**plain, "index": 1}) != prompt_content_key(plain)
    assert prompt_content_key({"uid": "x"}) == prompt_content_key({"uid": "y"})  # nothing to go by: one key


def test_occurrences_count_duplicates_per_step_and_partition():
    occ = PromptOccurrences(keep_steps=2)
    assert [occ.next(1, False, "a") for _ in range(3)] == [0, 1, 2]
    assert occ.next(1, False, "b") == 0 and occ.next(1, True, "a") == 0 and occ.next(2, False, "a") == 0
    assert occ.next(2, False, "a") == 1  # (1, False) and (1, True) were forgotten when step 2 came; 2 is kept
    with pytest.raises(ValueError, match="keep_steps"):
        PromptOccurrences(keep_steps=0)


def test_a_run_that_goes_back_counts_the_redone_steps_afresh():
    """After a guard rollback to step 2, step 3 is dispatched again: its samples must get the seeds they had the first
    time (those a resume from checkpoint 2 gives), not the next occurrence numbers."""
    occ = PromptOccurrences(keep_steps=8)
    first = [occ.next(3, False, "a"), occ.next(3, False, "a"), occ.next(4, False, "a"), occ.next(4, True, "a")]
    redone = [occ.next(3, False, "a"), occ.next(3, False, "a"), occ.next(4, False, "a"), occ.next(4, True, "a")]
    assert first == redone == [0, 1, 0, 0]
    assert occ.next(4, False, "a") == 1  # within a step, repeated dispatches still count on


# ------------------------------------------------------------------------------------------------ put order
def test_put_order_lets_each_ticket_go_after_every_earlier_one():
    async def scenario() -> list[int]:
        order, put = PutOrder(), []
        first = order.reserve(5)
        assert first == 0 and order.reserve(0) == 5 and order.pending == 5

        async def sample(ticket: int, done_after: float) -> None:
            await asyncio.sleep(done_after)  # generation finishes in reverse order
            await order.wait_turn(ticket)
            put.append(ticket)
            order.release(ticket)

        tasks = [asyncio.create_task(sample(t, 0.01 * (5 - t))) for t in range(5) if t != 2]
        await asyncio.sleep(0.08)
        assert put == [0, 1]  # ticket 2 has not settled: 3 and 4 wait
        order.release(2)  # it failed: the others go on
        order.release(2)  # idempotent
        await asyncio.gather(*tasks)
        assert order.pending == 0 and order.is_turn(5)
        return put

    assert asyncio.run(scenario()) == [0, 1, 3, 4]
    with pytest.raises(ValueError, match="count"):
        PutOrder().reserve(-1)


def test_rollout_seeding_identifies_groups_by_content_and_order_not_uid():
    run_a, run_b = RolloutSeeding(3, ordered_puts=True), RolloutSeeding(3, ordered_puts=False)
    prompt = {"raw_prompt": "p", "index": 0}
    for seeding, uids in ((run_a, ("u1", "u2", "u3")), (run_b, ("x9", "x8", "x7"))):
        seeding.dispatch(uids[0], prompt, step=1, validate=False, size=2)
        seeding.dispatch(uids[1], prompt, step=1, validate=False, size=2)  # the same prompt drawn twice
        seeding.dispatch(uids[2], {"raw_prompt": "q"}, step=1, validate=False, size=2)
    seeds_a = [run_a.seed(u, i) for u in ("u1", "u2", "u3") for i in (0, 1)]
    seeds_b = [run_b.seed(u, i) for u in ("x9", "x8", "x7") for i in (0, 1)]
    assert seeds_a == seeds_b and len(set(seeds_a)) == 6
    assert seeds_a[0] == sample_seed(3, 1, False, prompt_content_key(prompt), 0, 0)
    assert [run_a.ticket("u2", i) for i in (0, 1, 2)] == [2, 3, None]
    assert run_b.ticket("x8", 0) is None and run_a.seed("unknown", 0) is None
    other_seed = RolloutSeeding(4, ordered_puts=False)
    other_seed.dispatch("u1", prompt, step=1, validate=False, size=2)
    assert other_seed.seed("u1", 0) != seeds_a[0]
    run_a.finish("u1")
    assert "u1" not in run_a.groups and run_a.put_order.is_turn(2)


# ------------------------------------------------------------------------------------------------ the worker
class _Puts:
    """TransferQueue's async puts, recorded in call order (the order verl's replay buffer lists the keys in)."""

    def __init__(self) -> None:
        self.samples: list[str] = []
        self.tags: dict[str, dict] = {}

    async def async_kv_put(self, key, partition_id, fields=None, tag=None):
        await asyncio.sleep(0)
        self.tags[key] = {**self.tags.get(key, {}), **(tag or {})}

    async def async_kv_batch_put(self, keys, partition_id, fields=None, tags=None):
        await asyncio.sleep(0)
        self.samples.extend(keys)


def _worker(n: int, run_seed: int, trainer_mode: str = "sync"):
    """Our worker subclass without Ray: the state ``__init__`` sets, by hand."""
    worker_cls = rollout.CompactRoutingAgentLoopWorkerTQ
    worker = worker_cls.__new__(worker_cls)
    worker.config = OmegaConf.create(
        {
            "actor_rollout_ref": {"rollout": {"n": n, "val_kwargs": {"n": 1}, "seed": run_seed}},
            "trainer": {"v1": {"trainer_mode": trainer_mode}},
        }
    )
    worker.reward_loop_worker_handles, worker.distillation_enabled, worker.processor = None, False, None
    worker.stable_routing_enabled = False
    worker.stable_routing_options = RolloutRoutingOptions()
    worker.stable_prompt_sharing, worker.stable_prompt_puts, worker.stable_group_sizes = (
        PromptRowSharing(),
        {},
        {},
    )
    worker.stable_seeding = RolloutSeeding(run_seed, ordered_puts=trainer_mode in ORDERED_PUT_MODES)
    return worker


def _dispatch(worker, prompts: list[dict], monkeypatch, delays: dict[tuple[int, int], float]):
    """verl's ``_run_prompt`` for each prompt, concurrently (as ``generate_sequences`` starts them); the LLM call
    is a stand-in that records its sampling params and finishes after ``delays[(prompt, session)]``."""
    puts, seen = _Puts(), {}
    monkeypatch.setattr(tq, "async_kv_put", puts.async_kv_put)
    monkeypatch.setattr(tq, "async_kv_batch_put", puts.async_kv_batch_put)
    position = {p["uid"]: i for i, p in enumerate(prompts)}

    async def llm_call(self, sampling_params, trajectory, *, agent_name, trace=True, **kwargs):
        uid, session = kwargs["uid"], kwargs["session_id"]
        assert OCCURRENCE_FIELD not in kwargs  # the manager's column never reaches the agent loop or TransferQueue
        seen[(uid, session)] = dict(sampling_params)
        await asyncio.sleep(delays.get((position[uid], session), 0.0))
        output = AgentLoopOutput(
            prompt_ids=[1, 2, 3], response_ids=[4, 5], response_mask=[1, 1], metrics=AgentLoopMetrics()
        )
        return await self._agent_loop_postprocess(output, trajectory["validate"], **kwargs)

    monkeypatch.setattr(verl_agent_loop.AgentLoopWorker, "_run_agent_loop", llm_call)

    async def run() -> None:
        tasks = [
            asyncio.create_task(
                worker._run_prompt(dict(p), {"temperature": 1.0}, {"validate": False, "step": p["global_steps"]})
            )
            for p in prompts
        ]
        await asyncio.gather(*tasks)

    asyncio.run(run())
    return puts, seen


def _prompts(uids: list[str], step: int = 1) -> list[dict]:
    texts = ["max 3 8 1", "max 2 2 9", "max 3 8 1"]  # the first prompt again: a duplicate in the step
    return [
        {"uid": u, "global_steps": step, "index": 0, "agent_name": "single_turn_agent", "raw_prompt": t}
        for u, t in zip(uids, texts, strict=True)
    ]


def test_worker_seeds_each_sample_by_identity_and_puts_in_dispatch_order(monkeypatch):
    n = 3
    late_first = {(0, 0): 0.03, (0, 2): 0.02, (1, 1): 0.01}  # generation ends out of order
    worker = _worker(n, run_seed=5)
    puts, seen = _dispatch(worker, _prompts(["a", "b", "c"]), monkeypatch, late_first)
    assert puts.samples == [f"{u}_{i}_0" for u in "abc" for i in range(n)]  # dispatch order, not completion order
    assert all(puts.tags[u]["status"] == "finished" for u in "abc")
    seeds = {key: params["seed"] for key, params in seen.items()}
    assert len(set(seeds.values())) == 3 * n  # the duplicate prompt "c" gets its own samples
    key = prompt_content_key({"raw_prompt": "max 3 8 1", "index": 0})
    assert seeds[("a", 1)] == sample_seed(5, 1, False, key, 0, 1)
    assert seeds[("c", 1)] == sample_seed(5, 1, False, key, 1, 1)
    assert all(params["temperature"] == 1.0 for params in seen.values())
    assert worker.stable_seeding.groups == {} and worker.stable_seeding.put_order.pending == 0

    # another run: fresh uids, other completion order -> the same seeds per (prompt, sample), the same put order
    again = _worker(n, run_seed=5)
    puts2, seen2 = _dispatch(again, _prompts(["x", "y", "z"]), monkeypatch, {(2, 0): 0.03, (0, 1): 0.02})
    rename = dict(zip("xyz", "abc", strict=True))
    assert {(rename[u], i): p["seed"] for (u, i), p in seen2.items()} == seeds
    assert [rename[k[0]] + k[1:] for k in puts2.samples] == puts.samples

    # another run seed or step: other seeds
    other = _worker(n, run_seed=6)
    _, seen3 = _dispatch(other, _prompts(["a", "b", "c"]), monkeypatch, {})
    assert not {p["seed"] for p in seen3.values()} & set(seeds.values())
    later = _worker(n, run_seed=5)
    _, seen4 = _dispatch(later, _prompts(["a", "b", "c"], step=2), monkeypatch, {})
    assert not {p["seed"] for p in seen4.values()} & set(seeds.values())


def test_stable_sync_puts_as_samples_finish_and_its_ledger_restores_dispatch_order(monkeypatch):
    """Under ``stable_sync`` nothing waits to be put; sorting the batch by the manager's ledger gives exactly the
    order verl's ``sync`` trainer gets from ordered puts."""
    n, late = 3, {(0, 0): 0.03, (0, 2): 0.02, (1, 1): 0.01}
    assert ORDERED_PUT_MODES == ("sync",)
    ordered, _ = _dispatch(_worker(n, run_seed=5, trainer_mode="sync"), _prompts(["a", "b", "c"]), monkeypatch, late)
    worker = _worker(n, run_seed=5, trainer_mode="stable_sync")
    unordered, _ = _dispatch(worker, _prompts(["a", "b", "c"]), monkeypatch, late)
    assert worker.stable_seeding.put_order is None
    assert unordered.samples != ordered.samples and sorted(unordered.samples) == sorted(ordered.samples)
    assert unordered.samples[-1] == "a_0_0"  # the slowest sample was put last
    ledger = DispatchLedger()
    ledger.record(["a", "b", "c"])
    positions = ledger.order(unordered.samples)
    assert (
        [unordered.samples[i] for i in positions] == ordered.samples == [f"{u}_{i}_0" for u in "abc" for i in range(n)]
    )
    assert len(ledger) == 0  # ordering a batch forgets its groups


def test_dispatch_ledger_orders_by_group_then_session_then_index_and_leaves_strangers_last():
    ledger = DispatchLedger()
    ledger.record(["u-2", "u-1"])
    ledger.record(["u-3", "u-1"])  # a uid recorded again keeps its first place
    keys = ["u-1_10_0", "x_0_0", "u-3_0_1", "u-1_2_0", "u-2_0_0", "u-3_0_0", "odd-key", "u-1_2_1"]
    assert [keys[i] for i in ledger.order(keys)] == [
        "u-2_0_0",
        "u-1_2_0",
        "u-1_2_1",
        "u-1_10_0",  # numerically, not as text
        "u-3_0_0",
        "u-3_0_1",
        "x_0_0",  # never dispatched through this manager: after the rest, in the order sampled
        "odd-key",
    ]
    assert len(ledger) == 0 and ledger.order([]) == []


def test_async_trainers_keep_completion_order_and_a_failed_sample_blocks_nothing(monkeypatch):
    worker = _worker(2, run_seed=0, trainer_mode="stable_colocate_async")
    puts, seen = _dispatch(worker, _prompts(["a", "b", "c"])[:2], monkeypatch, {(0, 0): 0.03})
    assert puts.samples[-1] == "a_0_0"  # not ordered: the slow sample comes last
    assert len({p["seed"] for p in seen.values()}) == 4  # still seeded

    # a sync trainer: the first sample fails before its put; the others are put, in order, and nothing hangs
    worker = _worker(2, run_seed=0)
    verl_worker_tq = AgentLoopWorkerTQ.__ray_actor_class__
    real = verl_worker_tq._agent_loop_postprocess

    async def failing(self, output, validate, **kwargs):
        if (kwargs["uid"], kwargs["session_id"]) == ("a", 0):
            raise RuntimeError("reward worker died")
        return await real(self, output, validate, **kwargs)

    monkeypatch.setattr(verl_worker_tq, "_agent_loop_postprocess", failing)
    puts, _ = _dispatch(worker, _prompts(["a", "b", "c"])[:2], monkeypatch, {(0, 0): 0.02})
    assert puts.samples == ["a_1_0", "b_0_0", "b_1_0"]
    assert puts.tags["a"]["status"] == "failure" and puts.tags["b"]["status"] == "finished"


def test_a_worker_built_without_seeding_state_samples_as_verl_does(monkeypatch):
    worker = _worker(2, run_seed=0)
    worker.stable_seeding = None
    puts, seen = _dispatch(worker, _prompts(["a", "b", "c"])[:1], monkeypatch, {})
    assert all("seed" not in p for p in seen.values()) and sorted(puts.samples) == ["a_0_0", "a_1_0"]


def _verl_batch(texts: list[str], step: int, validate: bool = False):
    """A prompt batch as verl's V1 trainer dispatches it (dataloader columns, uid, global_steps)."""
    from verl.utils import tensordict_utils as tu

    n = len(texts)
    batch = tu.get_tensordict(
        {
            "raw_prompt": np.fromiter(([{"role": "user", "content": t}] for t in texts), dtype=object, count=n),
            "index": np.fromiter([0] * n, dtype=object, count=n),
            "data_source": np.fromiter(["toy"] * n, dtype=object, count=n),
            "uid": np.array([f"u{i}" for i in range(n)], dtype=object),
            "input_ids": torch.ones(n, 3, dtype=torch.long),
        }
    )
    tu.assign_non_tensor_data(batch, "global_steps", step)
    if validate:
        tu.assign_non_tensor_data(batch, "validate", True)
    return batch


def test_manager_numbers_repeated_prompts_over_the_whole_batch_for_its_workers():
    manager_cls = rollout.CompactRoutingAgentLoopManagerTQ
    manager = manager_cls.__new__(manager_cls)
    manager_cls.__init__(
        manager, config=OmegaConf.create({"actor_rollout_ref": {"rollout": {}, "model": {}}}), llm_client=None
    )
    batch = _verl_batch(["max 3 8 1", "max 2 2 9", "max 3 8 1", "max 3 8 1"], step=1)
    numbered = manager.stable_number_occurrences(batch)
    assert numbered[OCCURRENCE_FIELD].tolist() == [0, 0, 1, 2]
    assert OCCURRENCE_FIELD not in batch.keys()  # the trainer's own batch is left as it was
    # verl splits the batch over the workers: the copies on the second worker keep their numbers
    assert [c[OCCURRENCE_FIELD].tolist() for c in numbered.chunk(2)] == [[0, 0], [1, 2]]
    # a second dispatch of the same step goes on counting; another step or validation starts again
    assert manager.stable_number_occurrences(_verl_batch(["max 3 8 1"], 1))[OCCURRENCE_FIELD].tolist() == [3]
    assert manager.stable_number_occurrences(_verl_batch(["max 3 8 1"], 2))[OCCURRENCE_FIELD].tolist() == [0]
    val = manager.stable_number_occurrences(_verl_batch(["max 3 8 1"], 1, validate=True))
    assert val[OCCURRENCE_FIELD].tolist() == [0]


def test_manager_records_the_order_it_dispatches_prompts_in(monkeypatch):
    manager_cls = rollout.CompactRoutingAgentLoopManagerTQ
    manager = manager_cls.__new__(manager_cls)
    manager_cls.__init__(
        manager, config=OmegaConf.create({"actor_rollout_ref": {"rollout": {}, "model": {}}}), llm_client=None
    )
    sent = []
    monkeypatch.setattr(AgentLoopManagerTQ, "generate_sequences", lambda self, prompts: sent.append(prompts))
    batch = _verl_batch(["max 3 8 1", "max 2 2 9", "max 3 8 1"], step=1)
    manager.generate_sequences(batch)
    assert len(sent) == 1 and OCCURRENCE_FIELD in sent[0].keys()
    keys = ["u2_0_0", "u0_1_0", "u1_0_0", "u0_0_0"]  # as they finished
    assert [keys[i] for i in manager.stable_dispatch.order(keys)] == ["u0_0_0", "u0_1_0", "u1_0_0", "u2_0_0"]


def test_worker_seeds_with_the_managers_numbering(monkeypatch):
    """Two workers, each with one copy of a repeated prompt: the manager's numbers keep their samples apart."""
    seeds = []
    for occurrence in (0, 1):
        worker = _worker(2, run_seed=5)
        prompt = {**_prompts(["a", "b", "c"])[0], OCCURRENCE_FIELD: torch.tensor(occurrence)}
        puts, seen = _dispatch(worker, [prompt], monkeypatch, {})
        assert puts.samples == ["a_0_0", "a_1_0"]
        seeds.append([seen[("a", i)]["seed"] for i in (0, 1)])
    key = prompt_content_key({"raw_prompt": "max 3 8 1", "index": 0})
    assert seeds == [[sample_seed(5, 1, False, key, o, i) for i in (0, 1)] for o in (0, 1)]


# ------------------------------------------------------------------------------ several workers, verl's sync
def _two_workers(prompts: list[dict], monkeypatch, delays: dict[tuple[int, int], float], turns):
    """verl's ``chunk`` of one dispatch over two workers (``a, b`` | ``c``) running concurrently, each sample put
    after ``delays[(prompt, session)]``; ``turns``: the groups' global turns (None: each worker orders only its own)."""
    puts = _Puts()
    monkeypatch.setattr(tq, "async_kv_put", puts.async_kv_put)
    monkeypatch.setattr(tq, "async_kv_batch_put", puts.async_kv_batch_put)
    position = {p["uid"]: i for i, p in enumerate(prompts)}

    async def llm_call(self, sampling_params, trajectory, *, agent_name, trace=True, **kwargs):
        assert TURN_FIELD not in kwargs  # the manager's column never reaches the agent loop
        await asyncio.sleep(delays.get((position[kwargs["uid"]], kwargs["session_id"]), 0.0))
        output = AgentLoopOutput(
            prompt_ids=[1, 2, 3], response_ids=[4, 5], response_mask=[1, 1], metrics=AgentLoopMetrics()
        )
        return await self._agent_loop_postprocess(output, trajectory["validate"], **kwargs)

    monkeypatch.setattr(verl_agent_loop.AgentLoopWorker, "_run_agent_loop", llm_call)
    workers = [_worker(2, run_seed=5), _worker(2, run_seed=5)]
    if turns is not None:
        first = turns.reserve(len(prompts))  # the manager numbers the batch before verl chunks it
        prompts = [{**p, TURN_FIELD: torch.tensor(first + i)} for i, p in enumerate(prompts)]
        for worker in workers:
            worker.stable_set_turns(turns)
    chunks = [prompts[:2], prompts[2:]]

    async def run() -> None:
        tasks = [
            asyncio.create_task(worker._run_prompt(dict(p), {"temperature": 1.0}, {"validate": False, "step": 1}))
            for worker, chunk in zip(workers, chunks, strict=True)
            for p in chunk
        ]
        await asyncio.gather(*tasks)

    asyncio.run(run())
    return puts, workers


def test_two_workers_under_verls_sync_put_in_global_dispatch_order(monkeypatch):
    """Each worker orders its own puts; without the manager's global turns the second worker's samples, finished
    first, are put before the first worker's, so verl's replay buffer (which lists samples in put order) hands the
    trainer a batch in completion order across workers."""
    slow_first_worker = {(0, 0): 0.04, (0, 1): 0.03, (1, 0): 0.02}
    dispatch_order = [f"{u}_{i}_0" for u in "abc" for i in range(2)]
    unordered, _ = _two_workers(_prompts(["a", "b", "c"]), monkeypatch, slow_first_worker, turns=None)
    assert unordered.samples[:2] == ["c_0_0", "c_1_0"] and unordered.samples != dispatch_order
    turns = DispatchTurns()
    ordered, workers = _two_workers(_prompts(["a", "b", "c"]), monkeypatch, slow_first_worker, turns=turns)
    assert ordered.samples == dispatch_order
    assert all(ordered.tags[u]["status"] == "finished" for u in "abc")
    assert turns.pending == 0 and all(w.stable_seeding.groups == {} for w in workers)
    # the next dispatch goes on from where this one ended; a failed group releases its turn
    again, _ = _two_workers(_prompts(["x", "y", "z"]), monkeypatch, {(2, 0): 0.0, (0, 0): 0.02}, turns=turns)
    assert again.samples == [f"{u}_{i}_0" for u in "xyz" for i in range(2)] and turns.pending == 0


def test_a_failed_group_does_not_hold_back_the_other_workers(monkeypatch):
    verl_worker_tq = AgentLoopWorkerTQ.__ray_actor_class__
    real = verl_worker_tq._agent_loop_postprocess

    async def failing(self, output, validate, **kwargs):
        if kwargs["uid"] == "a":
            raise RuntimeError("reward worker died")
        return await real(self, output, validate, **kwargs)

    monkeypatch.setattr(verl_worker_tq, "_agent_loop_postprocess", failing)
    turns = DispatchTurns()
    puts, _ = _two_workers(_prompts(["a", "b", "c"]), monkeypatch, {(0, 0): 0.03, (0, 1): 0.03}, turns=turns)
    assert puts.samples == ["b_0_0", "b_1_0", "c_0_0", "c_1_0"]
    assert puts.tags["a"]["status"] == "failure" and turns.pending == 0


def test_dispatch_turns_let_a_group_go_after_every_earlier_one():
    async def scenario() -> list[int]:
        turns, done = DispatchTurns(), []
        assert turns.reserve(3) == 0 and turns.reserve(2) == 3

        async def group(ordinal: int, finish_after: float) -> None:
            await asyncio.sleep(finish_after)
            await turns.wait_turn(ordinal)
            done.append(ordinal)
            turns.release(ordinal)

        await asyncio.gather(*[group(o, 0.01 * (5 - o)) for o in range(5)])
        return done

    assert asyncio.run(scenario()) == [0, 1, 2, 3, 4]


def test_manager_numbers_group_turns_only_under_verls_sync_with_several_workers(monkeypatch):
    manager_cls = rollout.CompactRoutingAgentLoopManagerTQ
    sent = []
    monkeypatch.setattr(AgentLoopManagerTQ, "generate_sequences", lambda self, prompts: sent.append(prompts))
    for mode, workers, numbered in (("sync", 2, True), ("sync", 1, False), ("stable_sync", 2, False)):
        manager = manager_cls.__new__(manager_cls)
        config = {"actor_rollout_ref": {"rollout": {"agent": {"num_workers": workers}}, "model": {}}}
        config["trainer"] = {"v1": {"trainer_mode": mode}}
        manager_cls.__init__(manager, config=OmegaConf.create(config), llm_client=None)
        assert manager.stable_wants_turns() is numbered, (mode, workers)
        manager.stable_turns = DispatchTurns() if numbered else None  # what _init_agent_loop_workers starts
        sent.clear()
        manager.generate_sequences(_verl_batch(["max 3 8 1", "max 2 2 9", "max 3 8 1"], step=1))
        manager.generate_sequences(_verl_batch(["max 2 2 9"], step=1))
        if numbered:
            assert [b[TURN_FIELD].tolist() for b in sent] == [[0, 1, 2], [3]]
        else:
            assert all(TURN_FIELD not in b.keys() for b in sent)
