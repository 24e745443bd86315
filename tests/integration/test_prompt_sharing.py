"""Prompt rows once per group on verl's V1 / TransferQueue path (issue #5).

The store is a small in-memory stand-in with TransferQueue's ``kv_*`` signatures and behaviour
(``testkit.kv_store``); a real TransferQueue needs a Ray cluster with three
CPUs for its controller and storage units, which the e2e run in ``test_rollout_routing.py`` exercises. Everything
else is verl's real code: ``AgentLoopOutput``, ``AgentLoopWorkerTQ._run_prompt`` / ``_agent_loop_postprocess``,
``list_of_dict_to_tensordict`` and its TensorDict ops, and ``ReplayBuffer``'s own partition scan.
"""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch
import transfer_queue as tq
from omegaconf import OmegaConf
from tensordict import TensorDict
from testkit import kv_store
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
from verl.utils import tensordict_utils as tu
from verl.utils.tensordict_utils import list_of_dict_to_tensordict

from verl_stable.integration import rollout
from verl_stable.routing.codecs import BoundaryStats, RowCountError
from verl_stable.routing.trace import RoutingLayout
from verl_stable.transport.boundary import BOUNDARY_COLUMNS, BOUNDARY_FIELD, TRANSPORT_METRIC_PREFIX, transport_metrics
from verl_stable.transport.expansion import expand_compact_routing, routing_trace_from_batch
from verl_stable.transport.fields import IDS_FIELD, SPAN_FIELD
from verl_stable.transport.options import DEFAULT_SHARE_MIN_BYTES, MANAGER_FQN, RolloutRoutingOptions
from verl_stable.transport.sharing import (
    PROMPT_PARTITION,
    PROMPT_REF_FIELD,
    PromptRowSharing,
    SharedPromptRowsError,
    prompt_rows_key,
)
from verl_stable.transport.side_rows import (
    SharedRowReader,
    StaleSweep,
    async_clear_stale_prompt_rows,
    attach_shared_prompt_rows,
    clear_stale_prompt_rows,
    stale_prompt_entries,
)

LAYOUT = RoutingLayout("qwen3_moe", "qwen3_moe", 5, (1, 2, 4), 2, 8)  # decoder layers 0 and 3 dense
PREFIX = TRANSPORT_METRIC_PREFIX


class KVStore(kv_store.KVStore):
    def side_entries(self) -> dict[str, dict]:
        return self.kv_list(PROMPT_PARTITION).get(PROMPT_PARTITION, {})


def vllm_rows(rng: np.random.Generator, rows: int) -> np.ndarray:
    """vLLM 0.24 layout: uint8 [rows, num_hidden_layers, top_k], zero rows for the dense layers."""
    out = np.zeros((rows, LAYOUT.num_hidden_layers, LAYOUT.top_k), dtype=np.uint8)
    scores = rng.random((rows, LAYOUT.num_moe_layers, LAYOUT.num_experts))
    out[:, list(LAYOUT.moe_layers)] = np.argsort(scores, axis=-1)[..., : LAYOUT.top_k]
    return out


def group_outputs(rng, prompt_len: int, response_lens: list[int], differ: set[int] = frozenset()):
    """One prompt's ``rollout.n`` outputs: identical prompt rows except for the sessions in ``differ``."""
    prompt_ids = rng.integers(1, 100, prompt_len).tolist()
    prompt_rows = vllm_rows(rng, prompt_len)
    outputs = []
    for i, r in enumerate(response_lens):
        rows = np.concatenate([vllm_rows(rng, prompt_len) if i in differ else prompt_rows, vllm_rows(rng, r - 1)])
        outputs.append(
            AgentLoopOutput(
                prompt_ids=prompt_ids,
                response_ids=rng.integers(1, 100, r).tolist(),
                response_mask=[1] * r,
                routed_experts=rows,
                metrics=AgentLoopMetrics(),
            )
        )
    return outputs


def as_sample(output) -> dict:
    d = output.as_dict()
    d["input_ids"] = torch.cat([d["prompts"], d["responses"]])  # as AgentLoopWorkerTQ adds it
    return d


def put_side(store: KVStore, compact) -> None:
    side = compact.shared_prompt
    if side is not None:
        store.kv_put(side.key, PROMPT_PARTITION, TensorDict({IDS_FIELD: side.ids[None]}, [1]), side.tag)


def shared_batch(rng, store, groups, **kwargs):
    """Compact every group's outputs with sharing (side entries into ``store``); verl's reference int16 routing."""
    sharing = PromptRowSharing()
    samples, reference = [], []
    for g, outputs in enumerate(groups):
        for o in outputs:
            reference.append(o.model_copy(deep=True).as_dict()["routed_experts"])
            compact = rollout.compact_agent_loop_output(o, LAYOUT, sharing=sharing, uid=f"uid{g}", **kwargs)
            put_side(store, compact)
            samples.append(as_sample(compact))
    return list_of_dict_to_tensordict(samples), reference, sharing


def test_group_stores_prompt_rows_once_and_every_sample_replays_its_own_routing():
    rng = np.random.default_rng(0)
    store = KVStore()
    groups = [group_outputs(rng, 6, [3, 5, 2, 4]), group_outputs(rng, 9, [2, 2])]
    batch, reference, sharing = shared_batch(rng, store, groups)
    assert len(store.side_entries()) == 2 and len(sharing) == 2
    assert [t["rows"] for t in store.side_entries().values()] == [6, 9]
    # every sample stores only its rows after the prompt; the span still covers the whole sequence
    assert [p.shape[0] for p in batch[IDS_FIELD].unbind()] == [2, 4, 1, 3, 1, 1]
    assert batch[SPAN_FIELD].tolist() == [[0, 8], [0, 10], [0, 7], [0, 9], [0, 10], [0, 10]]
    assert batch[PROMPT_REF_FIELD][:, 0].tolist() == [6, 6, 6, 6, 9, 9]

    # the unshared path (sharing off) is the independent reference for the trace
    unshared = list_of_dict_to_tensordict(
        [as_sample(rollout.compact_agent_loop_output(o, LAYOUT)) for g in copy.deepcopy(groups) for o in g]
    )
    assert PROMPT_REF_FIELD not in unshared.keys()
    expected = routing_trace_from_batch(unshared, LAYOUT).to_tensor()
    reads = []

    def kv_batch_get(**kw):
        reads.append(kw)
        return store.kv_batch_get(**kw)

    # verl's own shuffle + micro-batch chunking before the actor sees it
    perm = [5, 2, 0, 3, 1, 4]
    chunks = tu.chunk_tensordict(tu.index_select_tensor_dict(batch, perm), 3)
    got = []
    for chunk in chunks:
        assert expand_compact_routing(chunk, LAYOUT, kv_batch_get=kv_batch_get)
        got += list(chunk["routed_experts"].unbind())
        # expanded: a second pass has nothing to do and reads nothing (the reads are counted below)
        assert not expand_compact_routing(chunk, LAYOUT, kv_batch_get=kv_batch_get)
    assert [len(r["keys"]) for r in reads] == [2, 1, 2]  # one read per micro-batch, each group once
    assert all(r["partition_id"] == PROMPT_PARTITION for r in reads)
    for i, j in enumerate(perm):  # token for token verl's own int16 layout
        assert torch.equal(got[i], reference[j]), j
    trace = routing_trace_from_batch(batch, LAYOUT, kv_batch_get=store.kv_batch_get)
    assert torch.equal(trace.to_tensor(), expected)


def test_a_ranks_reader_reads_once_per_step_and_serves_the_update_mini_batches_from_what_it_holds():
    rng = np.random.default_rng(4)
    store = KVStore()
    groups = [group_outputs(rng, 6, [3, 5, 2, 4]), group_outputs(rng, 9, [2, 2]), group_outputs(rng, 7, [4, 3])]
    batch, reference, _ = shared_batch(rng, store, groups)
    reads = []

    def kv_batch_get(**kw):
        reads.append(sorted(kw["keys"]))
        return store.kv_batch_get(**kw)

    reader = SharedRowReader(kv_batch_get)
    sizes = {k: f[IDS_FIELD].numel() for k, (f, _) in store.data[PROMPT_PARTITION].items()}
    # this rank's share of the step (groups 0 and 1, group 1 split with another rank): compute_log_prob
    mine = [0, 1, 2, 3, 4]
    old = tu.index_select_tensor_dict(batch, mine)
    assert expand_compact_routing(old, LAYOUT, reader=reader)
    assert len(reads) == 1 and len(reader) == 2
    assert reader.take_counts() == {
        "side_reads": 1,
        "side_read_entries": 2,
        "side_read_reused": 0,
        "side_read_bytes": sizes[reads[0][0]] + sizes[reads[0][1]],
    }
    # update_actor: the same samples reshuffled into two mini-batches read nothing and replay the same rows
    for part in ([4, 1], [3, 0, 2]):
        mini = tu.index_select_tensor_dict(batch, part)
        assert expand_compact_routing(mini, LAYOUT, reader=reader)
        for got, j in zip(mini["routed_experts"].unbind(), part, strict=True):
            assert torch.equal(got, reference[j]), j
    assert len(reads) == 1
    assert reader.take_counts() == {
        "side_reads": 0,
        "side_read_entries": 0,
        "side_read_reused": 3,
        "side_read_bytes": 0,
    }
    # the next step's batch (group 2 new, group 1 held): one read of the new entry only; then the reader holds
    # exactly that batch's entries
    nxt = tu.index_select_tensor_dict(batch, [5, 6, 7])
    assert expand_compact_routing(nxt, LAYOUT, reader=reader)
    assert len(reads) == 2 and len(reads[1]) == 1 and len(reader) == 2
    assert reader.take_counts()["side_read_reused"] == 1
    for got, j in zip(nxt["routed_experts"].unbind(), [5, 6, 7], strict=True):
        assert torch.equal(got, reference[j]), j
    # an entry cleared from TransferQueue is an error, held or not held by another reader
    (gone,) = reads[1]
    store.kv_clear([gone], PROMPT_PARTITION)
    with pytest.raises(SharedPromptRowsError, match="not in TransferQueue"):
        expand_compact_routing(
            tu.index_select_tensor_dict(batch, [6]), LAYOUT, reader=SharedRowReader(store.kv_batch_get)
        )

    # TransferQueue leaves a missing key out of its answer when others are found: never pair rows with wrong keys
    def drops_missing(keys, partition_id, select_fields=None):
        return store.kv_batch_get([k for k in keys if k != gone], partition_id, select_fields)

    with pytest.raises(SharedPromptRowsError, match=r"1 of 3 shared prompt-row entries are not in"):
        expand_compact_routing(batch.clone(), LAYOUT, reader=SharedRowReader(drops_missing))


def test_bytes_count_the_shared_rows_once():
    rng = np.random.default_rng(1)
    store = KVStore()
    groups = [group_outputs(rng, 40, [3, 5, 2, 4])]
    batch, _, _ = shared_batch(rng, store, copy.deepcopy(groups))
    unshared = list_of_dict_to_tensordict([as_sample(rollout.compact_agent_loop_output(o, LAYOUT)) for o in groups[0]])
    shared_m = transport_metrics(batch[BOUNDARY_FIELD])
    plain_m = transport_metrics(unshared[BOUNDARY_FIELD])
    row = LAYOUT.num_moe_layers * LAYOUT.top_k  # uint8
    # independent count: every tensor put, the side entry's ids once
    side_bytes = sum(f[IDS_FIELD].numel() for f, _ in store.data[PROMPT_PARTITION].values())
    put = sum(t.numel() * t.element_size() for d in batch.unbind(0) for k, t in d.items() if k.startswith("stable_"))
    assert (
        shared_m[f"{PREFIX}bytes"]
        == put + side_bytes
        == side_bytes + sum(d[IDS_FIELD].numel() + 16 + 24 + 8 * len(BOUNDARY_COLUMNS) for d in batch.unbind(0))
    )
    assert plain_m[f"{PREFIX}bytes"] - shared_m[f"{PREFIX}bytes"] == 3 * 40 * row - 4 * 24
    assert shared_m[f"{PREFIX}verl_bytes"] == plain_m[f"{PREFIX}verl_bytes"]
    assert shared_m[f"{PREFIX}bytes_ratio"] == shared_m[f"{PREFIX}bytes"] / shared_m[f"{PREFIX}verl_bytes"]
    assert shared_m[f"{PREFIX}recorded_rows"] == plain_m[f"{PREFIX}recorded_rows"] == 4 * 40 + 2 + 4 + 1 + 3
    assert shared_m[f"{PREFIX}prompt_groups_shared"] == 1.0 and plain_m[f"{PREFIX}prompt_groups_shared"] == 0.0
    assert shared_m[f"{PREFIX}shared_prompt_rows"] == 160.0
    assert shared_m[f"{PREFIX}prompt_rows_deduplicated"] == 120.0
    assert shared_m[f"{PREFIX}prompt_rows_differ"] == 0.0


def test_a_sibling_with_different_prompt_rows_keeps_its_own_and_is_counted():
    rng = np.random.default_rng(2)
    store = KVStore()
    groups = [group_outputs(rng, 5, [3, 4, 2], differ={1})]
    reference_rows = groups[0][1].routed_experts[:, list(LAYOUT.moe_layers)]
    batch, reference, _ = shared_batch(rng, store, groups)
    assert len(store.side_entries()) == 1
    refs = batch[PROMPT_REF_FIELD]
    assert refs[:, 0].tolist() == [5, 0, 5] and not refs[1].any()
    np.testing.assert_array_equal(batch[IDS_FIELD][1].numpy(), reference_rows)  # all of its rows, its own
    m = transport_metrics(batch[BOUNDARY_FIELD])
    assert m[f"{PREFIX}prompt_rows_differ"] == 1.0 and m[f"{PREFIX}shared_prompt_rows"] == 10.0
    assert expand_compact_routing(batch, LAYOUT, kv_batch_get=store.kv_batch_get)
    for got, ref in zip(batch["routed_experts"].unbind(), reference, strict=True):
        assert torch.equal(got, ref)
    # the key depends on the rows: a differing sibling can never resolve to the stored copy
    prompt = torch.from_numpy(reference_rows[:5].copy())
    assert prompt_rows_key("uid0", "train", 0, prompt) not in store.side_entries()


def test_missing_or_mismatched_side_entry_is_a_clear_error():
    rng = np.random.default_rng(3)
    store = KVStore()
    batch, _, _ = shared_batch(rng, store, [group_outputs(rng, 4, [2, 3])])
    (key,) = store.side_entries()
    fields, tag = store.data[PROMPT_PARTITION][key]
    store.kv_clear([key], PROMPT_PARTITION)
    with pytest.raises(SharedPromptRowsError, match="not in TransferQueue partition 'stable_routing_prompts'"):
        expand_compact_routing(batch.clone(), LAYOUT, kv_batch_get=store.kv_batch_get)
    assert issubclass(SharedPromptRowsError, RowCountError)
    store.kv_put(key, PROMPT_PARTITION, TensorDict({IDS_FIELD: fields[IDS_FIELD][None, :3]}, [1]), tag)
    with pytest.raises(SharedPromptRowsError, match="sample 0: shared entry .* expects 4 rows"):
        routing_trace_from_batch(batch.clone(), LAYOUT, kv_batch_get=store.kv_batch_get)
    # without the side entry the sample's own fields do not describe its span: never silently used
    from verl_stable.transport.fields import rows_from_fields

    with pytest.raises(RowCountError, match=r"span \[0, 5\) but \(1, 3, 2\)"):
        rows_from_fields(batch[IDS_FIELD], batch[SPAN_FIELD])
    bad = batch.clone()
    bad[PROMPT_REF_FIELD] = torch.ones(2, 2, dtype=torch.int64)
    with pytest.raises(SharedPromptRowsError, match=r"must be \[B, 3\]"):
        attach_shared_prompt_rows(bad, store.kv_batch_get)


def _verl_keys(store: KVStore, partition: str, uid: str, n: int, status: str) -> None:
    """What verl's trainer and AgentLoopWorkerTQ put for one group: the prompt key, then each session's sample."""
    store.kv_put(uid, partition, tag={"is_prompt": True, "status": status, "global_steps": 1})
    store.kv_batch_put([f"{uid}_{i}_0" for i in range(n)], partition, tags=[{"status": "success"}] * n)


def _shared_groups(store: KVStore, rng, uids: tuple[str, ...]) -> None:
    """Two-sample groups ``uids`` as verl and the workers leave them: finished prompt keys, sample keys, side entries."""
    for uid in uids:
        _verl_keys(store, "train", uid, 2, "finished")
        sharing = PromptRowSharing()
        for o in group_outputs(rng, 3, [2, 2]):
            put_side(store, rollout.compact_agent_loop_output(o, LAYOUT, sharing=sharing, uid=uid))


def test_side_entries_are_cleared_with_their_group_and_do_not_accumulate():
    rng = np.random.default_rng(4)
    store = KVStore()
    for step in range(4):  # a step: groups generated, sampled, trained, cleared by verl; then verl-stable's hook
        uids = [f"s{step}g{g}" for g in range(3)]
        for uid in uids:
            _verl_keys(store, "train", uid, 2, "finished")
            sharing = PromptRowSharing()
            for o in group_outputs(rng, 4, [2, 3]):
                put_side(store, rollout.compact_agent_loop_output(o, LAYOUT, sharing=sharing, uid=uid))
        assert len(store.side_entries()) == 3  # the previous step's were cleared
        in_flight = f"s{step}next"  # an async rollout already running for the next step
        _verl_keys(store, "train", in_flight, 0, "running")
        sharing = PromptRowSharing()
        put_side(
            store,
            rollout.compact_agent_loop_output(group_outputs(rng, 4, [2])[0], LAYOUT, sharing=sharing, uid=in_flight),
        )
        store.kv_clear(uids, "train")  # ReplayBuffer._materialize_batch: the prompt keys
        assert clear_stale_prompt_rows(store.kv_list, store.kv_clear) == 0  # samples still being trained
        store.kv_clear([f"{u}_{i}_0" for u in uids for i in range(2)], "train")  # verl's step-end kv_clear
        assert clear_stale_prompt_rows(store.kv_list, store.kv_clear) == 3
        assert [t["uid"] for t in store.side_entries().values()] == [in_flight]
        store.kv_clear([in_flight], "train")  # evicted (DAPO / failure): verl's _clear_groups
        assert clear_stale_prompt_rows(store.kv_list, store.kv_clear) == 1
        assert store.side_entries() == {}
    # a validation group lives in "val": a train key of the same uid does not keep it
    _verl_keys(store, "train", "v0", 1, "finished")
    put_side(
        store,
        rollout.compact_agent_loop_output(
            group_outputs(rng, 4, [2])[0], LAYOUT, sharing=PromptRowSharing(), uid="v0", partition="val"
        ),
    )
    assert clear_stale_prompt_rows(store.kv_list, store.kv_clear) == 1
    assert clear_stale_prompt_rows(KVStore().kv_list, KVStore().kv_clear) == 0  # nothing ever shared


def test_a_sweep_clears_an_entry_only_when_two_consecutive_passes_found_it_stale():
    rng = np.random.default_rng(9)
    store = KVStore()
    _shared_groups(store, rng, ("a", "b"))
    sweep = StaleSweep()
    store.kv_clear(["a", "a_0_0", "a_1_0", "b", "b_0_0", "b_1_0"], "train")  # both groups look keyless ...
    assert clear_stale_prompt_rows(store.kv_list, store.kv_clear, sweep) == 0  # ... first pass: kept
    assert len(store.side_entries()) == 2
    _verl_keys(store, "train", "b", 1, "finished")  # b was keyless only for a moment (its keys are back)
    assert clear_stale_prompt_rows(store.kv_list, store.kv_clear, sweep) == 1  # a: stale twice, cleared
    assert [t["uid"] for t in store.side_entries().values()] == ["b"]
    store.kv_clear(["b", "b_0_0"], "train")
    assert clear_stale_prompt_rows(store.kv_list, store.kv_clear, sweep) == 0  # b's first stale pass
    assert asyncio.run(async_clear_stale_prompt_rows(store.async_kv_list, store.async_kv_clear, sweep)) == 1
    assert store.side_entries() == {}


def test_a_sweep_is_one_listing_of_every_partition():
    """One controller snapshot per pass (it runs at every dispatch): not one request per partition."""
    rng = np.random.default_rng(12)
    store = KVStore()
    _shared_groups(store, rng, ("a", "b"))
    store.kv_clear(["a", "a_0_0", "a_1_0"], "train")
    calls = []

    async def async_kv_list(partition_id=None):
        calls.append(partition_id)
        return await store.async_kv_list(partition_id)

    assert asyncio.run(async_clear_stale_prompt_rows(async_kv_list, store.async_kv_clear)) == 1
    assert calls == [None] and [t["uid"] for t in store.side_entries().values()] == ["b"]
    sync_calls = []
    assert clear_stale_prompt_rows(lambda p=None: sync_calls.append(p) or store.kv_list(p), store.kv_clear) == 0
    assert sync_calls == [None]


def test_agent_loop_workers_clear_with_the_async_api_too():
    """What each worker runs when verl dispatches new prompts (any trainer class)."""
    rng = np.random.default_rng(8)
    store = KVStore()
    _shared_groups(store, rng, ("a", "b"))
    store.kv_clear(["a", "a_0_0", "a_1_0"], "train")
    assert asyncio.run(async_clear_stale_prompt_rows(store.async_kv_list, store.async_kv_clear)) == 1
    assert [t["uid"] for t in store.side_entries().values()] == ["b"]
    assert stale_prompt_entries({"k": None}, {"train": ["b"]}) == ["k"]  # an entry without a tag goes too


def test_verl_replay_buffer_never_samples_the_side_partition(monkeypatch):
    """verl's ReplayBuffer lists every partition; the side entries must not become samples or prompt groups."""
    from collections import defaultdict

    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    rng = np.random.default_rng(5)
    store = KVStore()
    _verl_keys(store, "train", "u0", 2, "finished")
    sharing = PromptRowSharing()
    for o in group_outputs(rng, 4, [2, 3]):
        put_side(store, rollout.compact_agent_loop_output(o, LAYOUT, sharing=sharing, uid="u0"))
    assert len(store.side_entries()) == 1
    buffer = ReplayBuffer.__new__(ReplayBuffer)  # verl's metadata scan and batch build need no trainer config
    buffer.partitions = defaultdict(dict)
    for name in ("pending_keys", "running_keys", "finished_keys", "failure_keys"):
        setattr(buffer, name, defaultdict(set))
    buffer.prompt_global_steps = defaultdict(dict)
    monkeypatch.setattr(tq, "kv_list", store.kv_list)
    monkeypatch.setattr(tq, "kv_clear", store.kv_clear)
    buffer._sync_metadata_from_transfer_queue()
    assert buffer.finished_keys["train"] == {"u0"}
    assert not any(buffer.finished_keys[p] or buffer.running_keys[p] for p in [PROMPT_PARTITION])
    meta = buffer._materialize_batch("train", ["u0"], dict(buffer.partitions["train"]))
    assert meta.partition_id == "train" and sorted(meta.keys) == ["u0_0_0", "u0_1_0"]
    assert len(store.side_entries()) == 1  # still there for the actors


def test_switch_off_keeps_every_row_with_its_sample():
    options = RolloutRoutingOptions.from_config(
        OmegaConf.create({"verl_stable": {"routing": {"share_prompt_rows": False}}})
    )
    assert not options.share_prompt_rows and RolloutRoutingOptions().share_prompt_rows
    assert RolloutRoutingOptions.from_config(OmegaConf.create({})).share_prompt_rows
    with pytest.raises(ValueError, match=r"verl_stable\.routing\.share_prompt_rows must be a bool \(true/false\)"):
        RolloutRoutingOptions.from_config(OmegaConf.create({"verl_stable": {"routing": {"share_prompt_rows": "no"}}}))
    assert RolloutRoutingOptions().share_prompt_rows_min_bytes == DEFAULT_SHARE_MIN_BYTES == 1 << 21
    section = {"verl_stable": {"routing": {"share_prompt_rows_min_bytes": 0}}}
    assert RolloutRoutingOptions.from_config(OmegaConf.create(section)).share_prompt_rows_min_bytes == 0
    for bad in (-1, True, 0.5, "1MB"):
        with pytest.raises(
            ValueError, match=r"verl_stable\.routing\.share_prompt_rows_min_bytes must be (>= 0|an int), got"
        ):
            RolloutRoutingOptions.from_config(
                OmegaConf.create({"verl_stable": {"routing": {"share_prompt_rows_min_bytes": bad}}})
            )
    worker, store = _worker(n=3, options=options)
    asyncio.run(worker._run_prompt(_prompt("u0"), {}, {"validate": False}))
    assert store.side_entries() == {} and set(store.data) == {"train"}
    samples = store.kv_batch_get(["u0_0_0", "u0_1_0", "u0_2_0"], "train", [IDS_FIELD, SPAN_FIELD])
    assert PROMPT_REF_FIELD not in store.data["train"]["u0_0_0"][0]
    spans = [s.tolist() for s in samples[SPAN_FIELD].unbind()]
    assert [p.shape[0] for p in samples[IDS_FIELD].unbind()] == [b - a for a, b in spans]


# ------------------------------------------------------------------------------------- the real verl worker
def _prompt(uid: str) -> dict:
    return {"uid": uid, "global_steps": 1, "index": 0}


def _worker(n: int, options: RolloutRoutingOptions | None = None, differ: set[int] = frozenset()):
    """verl's AgentLoopWorkerTQ (our subclass) without Ray; the LLM call is the only stand-in."""
    store = KVStore()
    worker_cls = rollout.CompactRoutingAgentLoopWorkerTQ
    worker = worker_cls.__new__(worker_cls)
    worker.config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"n": n, "val_kwargs": {"n": 1}}}})
    worker.reward_loop_worker_handles, worker.distillation_enabled, worker.processor = None, False, None
    worker.stable_routing_enabled = True
    worker.stable_routing_layout = LAYOUT
    # these groups' prompt rows are a few hundred bytes: share them whatever they save unless a test says otherwise
    worker.stable_routing_options = options or RolloutRoutingOptions(share_prompt_rows_min_bytes=0)
    worker.stable_routing_stats = BoundaryStats()
    worker.stable_prompt_sharing = PromptRowSharing(worker.stable_routing_options.share_prompt_rows_min_bytes)
    worker.stable_prompt_puts, worker.stable_group_sizes, worker.stable_put_side_entries = {}, {}, False
    rng = np.random.default_rng(7)
    outputs = group_outputs(rng, 6, [4, 2, 5, 3, 2, 3, 4, 2][:n], differ=differ)
    worker.reference = [o.model_copy(deep=True).as_dict()["routed_experts"] for o in outputs]

    async def run_agent_loop(sampling_params, trajectory, trace, session_id, **kwargs):
        await asyncio.sleep(0.001 * ((session_id * 7) % 5))  # sessions finish out of order
        output = outputs[session_id].model_copy(deep=True)
        return await worker._agent_loop_postprocess(output, trajectory["validate"], session_id=session_id, **kwargs)

    worker._run_agent_loop = run_agent_loop
    tq.async_kv_put, tq.async_kv_batch_put = store.async_kv_put, store.async_kv_batch_put
    return worker, store


@pytest.fixture(autouse=True)
def _restore_tq():
    saved = (tq.async_kv_put, tq.async_kv_batch_put)
    yield
    tq.async_kv_put, tq.async_kv_batch_put = saved


def test_real_worker_puts_one_side_entry_per_group_before_its_samples():
    worker, store = _worker(n=4, differ={2})
    order = []
    put_one, put_batch = store.async_kv_put, store.async_kv_batch_put

    async def logged_put(key, partition_id, fields=None, tag=None):
        order.append((partition_id, key))
        await put_one(key, partition_id, fields, tag)

    async def logged_batch(keys, partition_id, fields=None, tags=None):
        order.extend((partition_id, k) for k in keys)
        await put_batch(keys, partition_id, fields, tags)

    tq.async_kv_put, tq.async_kv_batch_put = logged_put, logged_batch
    asyncio.run(worker._run_prompt(_prompt("u0"), {}, {"validate": False}))
    side = store.side_entries()
    assert len(side) == 1 and next(iter(side.values())) == {"uid": "u0", "partition": "train", "rows": 6}
    first_sample = next(i for i, (p, k) in enumerate(order) if p == "train" and k != "u0")
    assert order.index((PROMPT_PARTITION, next(iter(side)))) < first_sample
    assert store.data["train"]["u0"][1]["status"] == "finished"
    assert len(worker.stable_prompt_sharing) == 0 and worker.stable_prompt_puts == worker.stable_group_sizes == {}
    keys = [f"u0_{i}_0" for i in range(4)]
    batch = store.kv_batch_get(keys, "train")
    assert [int(r[0]) for r in batch[PROMPT_REF_FIELD].unbind()] == [6, 6, 0, 6]
    m = transport_metrics(batch[BOUNDARY_FIELD])
    assert m[f"{PREFIX}prompt_groups_shared"] == 1.0 and m[f"{PREFIX}prompt_rows_differ"] == 1.0
    assert expand_compact_routing(batch, LAYOUT, kv_batch_get=store.kv_batch_get)
    for got, ref in zip(batch["routed_experts"].unbind(), worker.reference, strict=True):
        assert torch.equal(got, ref)


def test_a_group_shares_its_prompt_rows_only_when_that_saves_the_minimum_bytes():
    """Saved bytes = (n - 1) x the prompt rows' bytes; at the minimum the group shares, one byte below it every
    sample keeps its rows, puts no side entry, and still replays exactly."""
    n, prompt_rows = 4, 6  # group_outputs' prompts: 6 routed rows
    saved = (n - 1) * prompt_rows * LAYOUT.num_moe_layers * LAYOUT.top_k  # uint8 ids
    for minimum, shared in ((saved, True), (saved + 1, False)):
        worker, store = _worker(n=n, options=RolloutRoutingOptions(share_prompt_rows_min_bytes=minimum))
        asyncio.run(worker._run_prompt(_prompt("u0"), {}, {"validate": False}))
        keys = [f"u0_{i}_0" for i in range(n)]
        batch = store.kv_batch_get(keys, "train")
        refs = [int(r[0]) for r in batch[PROMPT_REF_FIELD].unbind()]
        assert refs == ([prompt_rows] * n if shared else [0] * n), (minimum, refs)
        assert len(store.side_entries()) == int(shared) and worker.stable_put_side_entries == shared
        m = transport_metrics(batch[BOUNDARY_FIELD])
        assert m[f"{PREFIX}prompt_groups_shared"] == float(shared)
        assert m[f"{PREFIX}prompt_rows_deduplicated"] == (saved // (LAYOUT.num_moe_layers * LAYOUT.top_k)) * shared
        assert expand_compact_routing(batch, LAYOUT, kv_batch_get=store.kv_batch_get if shared else None)
        for got, ref in zip(batch["routed_experts"].unbind(), worker.reference, strict=True):
            assert torch.equal(got, ref)


def test_sharing_with_a_minimum_needs_the_group_size():
    ids = torch.zeros(8, LAYOUT.num_moe_layers, LAYOUT.top_k, dtype=torch.uint8)
    sharing = PromptRowSharing(min_saved_bytes=1)
    with pytest.raises(ValueError, match="needs the group's size, got None"):
        sharing.decide(ids, start=0, prompt_len=4, uid="u", partition="train")
    assert sharing.saved_bytes(ids, 4, 3) == 2 * 4 * LAYOUT.num_moe_layers * LAYOUT.top_k
    assert PromptRowSharing().decide(ids, start=0, prompt_len=4, uid="u", partition="train").shared_rows == 4
    for bad in (-1, True, 1.5, "1"):
        with pytest.raises(ValueError, match="min_saved_bytes must be an int >= 0"):
            PromptRowSharing(bad)


def test_real_worker_shares_nothing_for_a_group_of_one():
    worker, store = _worker(n=1)
    asyncio.run(worker._run_prompt(_prompt("u1"), {}, {"validate": False}))
    assert store.side_entries() == {}
    batch = store.kv_batch_get(["u1_0_0"], "train")
    assert not batch[PROMPT_REF_FIELD].values().any()  # the field is there (one schema per partition), zero
    assert expand_compact_routing(batch, LAYOUT, kv_batch_get=None)  # no read needed
    assert torch.equal(batch["routed_experts"][0], worker.reference[0])


def test_real_worker_sweeps_stale_entries_alongside_the_rollout_not_before_it(monkeypatch, caplog):
    """A dispatch starts its rollout at once; the stale-entry sweep runs next to it, one at a time, and its failure
    is a warning, not a failed rollout."""
    from verl_stable.integration.rollout import agent_loop

    worker, _ = _worker(n=2)
    verls_worker = type(worker).__mro__[1]  # verl's AgentLoopWorkerTQ, as the worker's class resolved it
    worker.stable_stale_sweep, worker.stable_clearing = StaleSweep(), None
    worker.stable_put_side_entries = True  # as after this worker's first side entry
    events: list[str] = []
    release = asyncio.Event()

    async def slow_sweep(sweep=None):
        events.append("sweep started")
        await release.wait()
        events.append("sweep done")
        if len([e for e in events if e == "sweep started"]) > 1:
            raise RuntimeError("store unreachable")
        return 0

    async def rollout_of(self, batch):
        events.append(f"rollout {batch}")

    monkeypatch.setattr(agent_loop, "async_clear_stale_prompt_rows", slow_sweep)
    assert verls_worker.__name__ == "AgentLoopWorkerTQ"
    monkeypatch.setattr(verls_worker, "generate_sequences", rollout_of)

    async def dispatches():
        await worker.generate_sequences("b1")
        await worker.generate_sequences("b2")  # the first sweep still runs: no second one
        release.set()
        await worker.stable_clearing
        release.clear()
        await worker.generate_sequences("b3")
        await asyncio.sleep(0)
        release.set()
        await worker.stable_clearing  # fails inside: logged

    with caplog.at_level("WARNING", logger="verl_stable"):
        asyncio.run(dispatches())
    assert events == [
        "rollout b1",
        "rollout b2",
        "sweep started",
        "sweep done",
        "rollout b3",
        "sweep started",
        "sweep done",
    ]  # the rollouts do not wait for the sweep, and b2 started none while b1's was pending
    assert "clearing shared prompt rows failed: store unreachable" in caplog.text


def test_a_worker_sweeps_only_once_it_has_put_a_side_entry(monkeypatch):
    """Every worker that put a side entry sweeps at each later dispatch; one whose groups all kept their rows
    (below ``share_prompt_rows_min_bytes``) has nothing of its own to clear and lists nothing."""
    from verl_stable.integration.rollout import agent_loop

    sweeps: list[int] = []

    async def sweep(sweep=None):
        sweeps.append(1)
        return 0

    async def rollout_of(self, batch):
        await self._run_prompt(_prompt(batch), {}, {"validate": False})

    worker, store = _worker(n=3, options=RolloutRoutingOptions())  # default minimum: 2 MiB
    worker.stable_stale_sweep, worker.stable_clearing = StaleSweep(), None
    monkeypatch.setattr(agent_loop, "async_clear_stale_prompt_rows", sweep)
    monkeypatch.setattr(type(worker).__mro__[1], "generate_sequences", rollout_of)

    async def dispatch(uid):
        await worker.generate_sequences(uid)
        if worker.stable_clearing is not None:
            await worker.stable_clearing

    asyncio.run(dispatch("u0"))
    asyncio.run(dispatch("u1"))
    assert sweeps == [] and store.side_entries() == {} and not worker.stable_put_side_entries
    worker.stable_prompt_sharing = PromptRowSharing(0)  # the next groups are worth sharing
    asyncio.run(dispatch("u2"))
    assert sweeps == [] and len(store.side_entries()) == 1 and worker.stable_put_side_entries
    asyncio.run(dispatch("u3"))
    assert sweeps == [1]


def test_stable_trainers_leave_the_sweep_to_the_workers_and_clear_what_is_left_after_training(tmp_path, monkeypatch):
    """No TransferQueue traffic at a step start (the workers sweep at each dispatch, off the step's critical path);
    after ``fit`` one pass clears every stale entry at once, a live group's entry stays."""
    import verl
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from verl_stable.integration import trainer as T

    T.register()
    with initialize_config_dir(config_dir=f"{verl.__path__[0]}/trainer/config", version_base=None):
        cfg = compose(
            config_name="ppo_trainer",
            overrides=[
                "trainer.v1.trainer_mode=stable_sync",
                f"trainer.default_local_dir={tmp_path}",
                f"+actor_rollout_ref.rollout.agent.agent_loop_manager_class={MANAGER_FQN}",
            ],
        )
    trainer = get_trainer_cls("stable_sync")(cfg)
    trainer._stable_layout = LAYOUT  # what _stable_compact_layout reads from the model's config
    rng = np.random.default_rng(10)
    store = KVStore()
    _shared_groups(store, rng, ("done", "live"))
    store.kv_clear(["done", "done_0_0", "done_1_0"], "train")
    calls = []

    def kv_list(partition_id=None):
        calls.append(partition_id)
        return store.kv_list(partition_id)

    monkeypatch.setattr(tq, "kv_list", kv_list)
    monkeypatch.setattr(tq, "kv_clear", store.kv_clear)
    monkeypatch.setattr(PPOTrainerSync, "fit", lambda self, manager: "verl's result")
    trainer.on_step_begin()
    assert calls == [] and len(store.side_entries()) == 2
    assert trainer.fit(None) == "verl's result"
    assert calls and [t["uid"] for t in store.side_entries().values()] == ["live"]  # one pass, no second needed
