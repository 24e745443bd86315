"""Rollout routing export on real verl objects: AgentLoopOutput, AgentLoopWorkerTQ's postprocess, verl's stacking."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
from verl.utils import tensordict_utils as tu
from verl.utils.import_utils import load_class_from_fqn
from verl.utils.tensordict_utils import list_of_dict_to_tensordict

from verl_stable.integration import rollout
from verl_stable.routing.codecs import (
    BoundaryStats,
    ExpertIdRangeError,
    LayerMapError,
    RoutedRows,
    RowCountError,
    ZeroRoutingError,
    encode_sglang,
)
from verl_stable.routing.trace import RoutingLayout
from verl_stable.transport.boundary import (
    BOUNDARY_COLUMNS,
    BOUNDARY_ERRORS,
    BOUNDARY_FIELD,
    TRANSPORT_METRIC_PREFIX,
    fetch_transport_metrics,
    read_sglang_routed_experts,
    transport_metrics,
)
from verl_stable.transport.expansion import (
    COMPACT_FIELDS,
    MOE_ROUTING_FIELD,
    attach_moe_routing,
    expand_compact_routing,
    routing_trace_from_batch,
    without_compact_fields,
)
from verl_stable.transport.fields import IDS_FIELD, SPAN_FIELD, dense_rows_from_fields
from verl_stable.transport.options import MANAGER_FQN, RolloutRoutingOptions
from verl_stable.transport.sharing import PROMPT_REF_FIELD, PromptRowSharing

LAYOUT = RoutingLayout("qwen3_moe", "qwen3_moe", 5, (1, 2, 4), 2, 8)  # decoder layers 0 and 3 dense


def vllm_routing(rng: np.random.Generator, rows: int) -> np.ndarray:
    """vLLM 0.24 layout: uint8 [rows, num_hidden_layers, top_k], zero rows for the dense layers."""
    out = np.zeros((rows, LAYOUT.num_hidden_layers, LAYOUT.top_k), dtype=np.uint8)
    scores = rng.random((rows, LAYOUT.num_moe_layers, LAYOUT.num_experts))
    out[:, list(LAYOUT.moe_layers)] = np.argsort(scores, axis=-1)[..., : LAYOUT.top_k]
    return out


def agent_output(rng, prompt_len: int, response_mask: list[int], rows: int | None = None) -> AgentLoopOutput:
    extent = max(i for i, m in enumerate(response_mask) if m) + 1
    rows = prompt_len + extent - 1 if rows is None else rows
    return AgentLoopOutput(
        prompt_ids=rng.integers(1, 100, prompt_len).tolist(),
        response_ids=rng.integers(1, 100, len(response_mask)).tolist(),
        response_mask=response_mask,
        routed_experts=vllm_routing(rng, rows),
        metrics=AgentLoopMetrics(),
    )


def test_compact_fields_match_verls_own_int16_layout():
    """Independent reference: verl's unmodified as_dict. Valid rows must equal it on MoE layers; every other
    position must be exactly the rows verl zero-fills."""
    rng = np.random.default_rng(0)
    outputs = [
        agent_output(rng, 4, [1, 1, 1]),  # single turn
        agent_output(rng, 6, [1, 1, 0, 0, 1, 0, 0]),  # multi-turn, tool output after the last generation
        agent_output(rng, 3, [1]),
        agent_output(rng, 5, [1, 1]),
    ]
    verl_dicts = [o.model_copy(deep=True).as_dict() for o in outputs]
    compact = [rollout.compact_agent_loop_output(o, LAYOUT) for o in outputs]
    fields = []
    for c in compact:
        d = c.as_dict()
        assert "routed_experts" not in d and "compact_routing" not in d
        d["input_ids"] = torch.cat([d["prompts"], d["responses"]])  # as AgentLoopWorkerTQ adds it
        fields.append(d)
    batch = list_of_dict_to_tensordict(fields)  # verl's own stacking into one TransferQueue put
    assert batch[IDS_FIELD].is_nested and batch[IDS_FIELD].dtype == torch.uint8
    trace = routing_trace_from_batch(batch, LAYOUT)
    assert trace.lengths.tolist() == [7, 13, 4, 7]
    for i, (verl_dict, seq) in enumerate(zip(verl_dicts, trace.split(), strict=True)):
        verl_moe = verl_dict["routed_experts"][:, list(LAYOUT.moe_layers)].long()
        valid = seq.valid_mask().all(dim=1)
        assert torch.equal(seq.to_tensor()[valid], verl_moe[valid]), i
        assert not verl_moe[~valid].any(), i  # what we mark missing, verl carried as zero rows
    # missing = last generated token + tool tokens after it
    assert [int((~s.valid_mask().all(dim=1)).sum()) for s in trace.split()] == [1, 3, 1, 1]
    assert [c.extra_fields["stable_routing_missing_positions"] for c in compact] == [1, 3, 1, 1]
    # verl's own TensorDict ops (shuffle/select, micro-batch chunking, concat) keep fields and tokens together
    perm = [2, 0, 3, 1]
    shuffled = tu.index_select_tensor_dict(batch, perm)
    chunks = tu.chunk_tensordict(shuffled, 2)
    rejoined = tu.concat_tensordict(chunks)
    for chunk in (*chunks, rejoined):
        dense = dense_rows_from_fields(chunk[IDS_FIELD], chunk[SPAN_FIELD], chunk["input_ids"].offsets(), LAYOUT)
        assert dense.shape[0] == int(chunk["input_ids"].offsets()[-1])
    assert torch.equal(
        routing_trace_from_batch(rejoined, LAYOUT).to_tensor(),
        torch.cat([trace.sequence(i).to_tensor() for i in perm]),
    )
    # expanded back on the actor, it is verl's own field, value for value
    assert expand_compact_routing(batch, LAYOUT) and not expand_compact_routing(batch, LAYOUT)
    for got, verl_dict in zip(batch["routed_experts"].unbind(), verl_dicts, strict=True):
        assert got.dtype == torch.int16 and torch.equal(got, verl_dict["routed_experts"])
    ours = sum(t.numel() * t.element_size() for t in batch[IDS_FIELD].unbind())
    verls = sum(d["routed_experts"].numel() * 2 for d in verl_dicts)
    assert ours * 10 / 3 < verls  # uint8 over 3 of 5 layers vs int16 over 5, on recorded rows only
    # what the engine hands verl's micro-batch split: the expanded field without the consumed compact ones
    engine_batch = without_compact_fields(batch)
    compact_fields = {IDS_FIELD, SPAN_FIELD, BOUNDARY_FIELD}  # no prompt refs: nothing shared here
    assert compact_fields <= set(COMPACT_FIELDS) and compact_fields <= set(batch.keys())  # the caller's keeps
    assert not set(COMPACT_FIELDS) & set(engine_batch.keys())
    assert set(engine_batch.keys()) == set(batch.keys()) - set(COMPACT_FIELDS)
    assert engine_batch["routed_experts"] is batch["routed_experts"] and engine_batch["input_ids"] is batch["input_ids"]
    assert without_compact_fields(engine_batch) is engine_batch


@pytest.mark.parametrize("sharing", [None, PromptRowSharing(min_saved_bytes=0)])
def test_each_samples_ids_are_checked_once_on_their_way_through_the_agent_loop(monkeypatch, sharing):
    """One check per hop: the boundary's decoder validates a sample's ids; the fields built from its rows do not
    check them again (``sample_fields(..., checked=True)``), and what they carry is the decoder's rows unchanged."""
    from verl_stable.routing.codecs import common

    calls = []
    check = common.check_expert_ids
    monkeypatch.setattr(common, "check_expert_ids", lambda *a, **k: calls.append(a[0].shape) or check(*a, **k))
    rng = np.random.default_rng(3)
    output = agent_output(rng, 4, [1, 1, 1])
    expected = np.asarray(output.routed_experts)[:, list(LAYOUT.moe_layers)]
    compact = rollout.compact_agent_loop_output(output, LAYOUT, sharing=sharing, uid="u0", group_size=2)
    assert len(calls) == 1
    ids = compact.compact_routing[IDS_FIELD]
    assert ids.dtype == torch.uint8 and torch.equal(ids, torch.from_numpy(expected[-ids.shape[0] :]))


def test_rows_not_in_the_layouts_storage_dtype_are_checked_even_when_said_to_be():
    """``checked=True`` skips the check only for rows a decoder narrowed: wider rows are validated before narrowing
    (an id of 300 must never wrap to a plausible expert 44)."""
    from verl_stable.transport.fields import sample_fields

    wide = np.zeros((2, LAYOUT.num_moe_layers, LAYOUT.top_k), dtype=np.int64)
    wide[..., 1] = 1
    wide[1, 0] = (3, 300)
    with pytest.raises(ExpertIdRangeError):
        sample_fields(RoutedRows(0, wide), LAYOUT, checked=True)


def test_boundary_errors_and_configured_fallback():
    rng = np.random.default_rng(1)
    too_many = agent_output(rng, 4, [1, 1, 1], rows=7)  # a row for the last sampled token
    with pytest.raises(RowCountError, match="7 routed rows, expected 6"):
        rollout.compact_agent_loop_output(too_many, LAYOUT)
    zeros = agent_output(rng, 4, [1, 1, 1])
    zeros.routed_experts[:] = 0  # the all-zero engine failure
    with pytest.raises(ZeroRoutingError):
        rollout.compact_agent_loop_output(zeros.model_copy(deep=True), LAYOUT)
    options = RolloutRoutingOptions.from_config(
        OmegaConf.create({"verl_stable": {"routing": {"on_invalid": "skip_sample"}}})
    )
    stats = BoundaryStats()
    skipped = rollout.compact_agent_loop_output(zeros, LAYOUT, options, stats)
    d = skipped.as_dict()
    assert d[IDS_FIELD].shape == (0, 3, 2) and d[SPAN_FIELD].tolist() == [0, 0]
    assert skipped.extra_fields["stable_routing_skipped"] == 1 and stats.skipped_samples == 1
    assert RolloutRoutingOptions.from_config(OmegaConf.create({})).on_invalid == "raise"
    with pytest.raises(ValueError, match="on_invalid"):
        RolloutRoutingOptions(on_invalid="guess")


def test_boundary_counters_travel_with_each_sample():
    """Per-sample counters, checked against verl's own int16 layout for the bytes verl would have moved."""
    rng = np.random.default_rng(4)
    outputs = [agent_output(rng, 4, [1, 1, 1]), agent_output(rng, 6, [1, 1, 0, 0, 1, 0, 0])]
    verl_bytes = [o.model_copy(deep=True).as_dict()["routed_experts"].numel() * 2 for o in outputs]
    zeros = agent_output(rng, 3, [1, 1])
    zeros.routed_experts[:] = 0
    options = RolloutRoutingOptions(on_invalid="skip_sample")
    stats = BoundaryStats()
    dicts = [rollout.compact_agent_loop_output(o, LAYOUT, options, stats).as_dict() for o in (*outputs, zeros)]
    columns = {name: i for i, name in enumerate(BOUNDARY_COLUMNS)}
    counters = [d[BOUNDARY_FIELD] for d in dicts]
    assert [c[columns["tokens"]] for c in counters] == [7, 13, 5]
    assert [c[columns["recorded_rows"]] for c in counters] == [6, 10, 0]
    assert [c[columns["skipped"]] for c in counters] == [0, 0, 1]
    zero_code = BOUNDARY_ERRORS.index(ZeroRoutingError)
    assert [c[columns["error_code"]] for c in counters] == [-1, -1, zero_code]
    assert [c[columns["verl_bytes"]] for c in counters[:2]] == verl_bytes
    for c, d in zip(counters, dicts, strict=True):  # uint8 ids + int64 span + the counters themselves
        assert c[columns["bytes"]] == d[IDS_FIELD].numel() + 16 + 8 * len(BOUNDARY_COLUMNS)
    assert stats.samples == 3 and stats.skipped_samples == 1 and stats.errors == {"ZeroRoutingError": 1}

    batch = list_of_dict_to_tensordict(dicts)  # verl's stacking: equal shapes -> [B, columns]
    metrics = transport_metrics(batch[BOUNDARY_FIELD])
    prefix = TRANSPORT_METRIC_PREFIX
    ids_bytes = [d[IDS_FIELD].numel() for d in dicts]
    moved = sum(ids_bytes) + 3 * (16 + 8 * len(BOUNDARY_COLUMNS))
    assert metrics == {
        f"{prefix}samples": 3.0,
        f"{prefix}skipped_samples": 1.0,
        f"{prefix}recorded_rows": 16.0,
        f"{prefix}missing_positions": 1.0 + 3.0,  # last token; last token + 2 tool tokens
        f"{prefix}bytes": float(moved),
        f"{prefix}verl_bytes": float(sum(verl_bytes) + 5 * 5 * 2 * 2),
        f"{prefix}bytes_per_token": moved / 25,
        f"{prefix}bytes_ratio": moved / (sum(verl_bytes) + 100),
        f"{prefix}error/ZeroRoutingError": 1.0,
        f"{prefix}truncated_samples": 0.0,  # none reached response_length (test_a_conversation_cut_...)
        f"{prefix}trimmed_rows": 0.0,
        f"{prefix}prompt_groups_shared": 0.0,  # sharing is the worker's (test_prompt_sharing.py)
        f"{prefix}shared_prompt_rows": 0.0,
        f"{prefix}prompt_rows_deduplicated": 0.0,
        f"{prefix}prompt_rows_differ": 0.0,
    }
    kept = transport_metrics(batch[BOUNDARY_FIELD], keep=[True, False, False])
    assert kept[f"{prefix}samples"] == 1.0 and kept[f"{prefix}recorded_rows"] == 6.0
    assert f"{prefix}error/ZeroRoutingError" not in kept
    with pytest.raises(RowCountError, match="columns"):
        transport_metrics(torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(RowCountError, match="keep has shape"):
        transport_metrics(batch[BOUNDARY_FIELD], keep=[True])


def test_trainer_fetches_transport_metrics_from_transfer_queue():
    """The trainer-side read: one field from the store, verl's padding samples left out, nothing when absent."""
    from transfer_queue import KVBatchMeta

    rng = np.random.default_rng(5)
    dicts = [rollout.compact_agent_loop_output(agent_output(rng, 4, [1, 1]), LAYOUT).as_dict() for _ in range(3)]
    store = list_of_dict_to_tensordict(dicts)
    calls = []

    def kv_batch_get(keys, partition_id, select_fields):  # TransferQueue's read, the only stand-in
        calls.append((tuple(keys), partition_id, tuple(select_fields)))
        missing = [f for f in select_fields if f not in store.keys()]
        if missing:
            raise ValueError(f"fields {missing} not found")
        return store.select(*select_fields)

    meta = KVBatchMeta(keys=["a", "b", "c"], tags=[{}, {}, {"is_padding": True}], partition_id="train")
    metrics = fetch_transport_metrics(meta, kv_batch_get)
    assert calls == [(("a", "b", "c"), "train", (BOUNDARY_FIELD,))]
    assert metrics[f"{TRANSPORT_METRIC_PREFIX}samples"] == 2.0
    assert metrics[f"{TRANSPORT_METRIC_PREFIX}recorded_rows"] == 2 * 5.0
    store = store.exclude(BOUNDARY_FIELD)
    assert fetch_transport_metrics(meta, kv_batch_get) == {}


def test_verl_padding_samples_get_no_routing():
    """verl's V1 upsampling copies a real sample's fields onto a synthetic 128-token no-op sequence."""
    from verl.trainer.ppo.padding_utils import SYNTHETIC_PADDING_SEQ_LEN, construct_minimal_padding_template

    rng = np.random.default_rng(6)
    output = agent_output(rng, 150, [1] * 20)  # longer than the synthetic sequence: its copied span overruns it
    reference = output.model_copy(deep=True).as_dict()["routed_experts"]
    real = rollout.compact_agent_loop_output(output, LAYOUT).as_dict()
    real["input_ids"] = torch.cat([real["prompts"], real["responses"]])
    real = {k: v for k, v in real.items() if isinstance(v, torch.Tensor)}
    pad, _ = construct_minimal_padding_template(dict(real), {}, eos_token_id=2)
    assert pad[SPAN_FIELD].tolist() == [0, 169]  # verl copied it as is
    batch = list_of_dict_to_tensordict([real, pad])
    trace = routing_trace_from_batch(batch, LAYOUT)
    assert trace.lengths.tolist() == [170, SYNTHETIC_PADDING_SEQ_LEN]
    assert not trace.sequence(1).valid_mask().any() and trace.sequence(0).valid_mask().all(dim=1).sum() == 169
    assert expand_compact_routing(batch, LAYOUT)
    got_real, got_pad = batch["routed_experts"].unbind()
    assert torch.equal(got_real, reference)
    assert got_pad.shape == (SYNTHETIC_PADDING_SEQ_LEN, 5, 2) and not got_pad.any()
    # the same overrun on a sample that generated tokens is a real misalignment
    broken = list_of_dict_to_tensordict([real, {**pad, "response_mask": torch.ones(1, dtype=torch.int64)}])
    with pytest.raises(RowCountError, match="sample 1: routing covers positions up to 169 of its 128 tokens"):
        expand_compact_routing(broken, LAYOUT)
    with pytest.raises(RowCountError, match="sample 1"):
        routing_trace_from_batch(broken.exclude("response_mask"), LAYOUT)


def test_the_fsdp_actors_moe_rows_are_verls_rows_on_the_moe_layers_without_the_detour():
    """attach_moe_routing gives the MoE-layer rows of what verl's own agent loop would have stored, compact."""
    rng = np.random.default_rng(12)
    outputs = [agent_output(rng, p, m) for p, m in ((5, [1, 1, 0, 1]), (3, [1]), (6, [1, 1]))]
    references = [o.model_copy(deep=True).as_dict()["routed_experts"] for o in outputs]  # all decoder layers
    fields = []
    for output in outputs:
        d = rollout.compact_agent_loop_output(output, LAYOUT).as_dict()
        d["input_ids"] = torch.cat([d["prompts"], d["responses"]])
        fields.append({k: v for k, v in d.items() if isinstance(v, torch.Tensor)})
    batch = list_of_dict_to_tensordict(fields)
    assert attach_moe_routing(batch, LAYOUT)
    assert "routed_experts" not in batch.keys() and not attach_moe_routing(batch, LAYOUT)
    moe = batch[MOE_ROUTING_FIELD]
    assert moe.dtype == torch.uint8 and torch.equal(moe.offsets(), batch["input_ids"].offsets())
    for got, reference in zip(moe.unbind(), references, strict=True):
        assert torch.equal(got.long(), reference[:, list(LAYOUT.moe_layers)].long())
        assert not reference[:, [0, 3]].any()  # the dense layers verl's form carries as zeros, left out here
    # a batch that already carries verl's routed_experts (R2's recording of pi_old) keeps it: nothing added
    recorded = list_of_dict_to_tensordict(fields)
    recorded["routed_experts"] = torch.nested.nested_tensor_from_jagged(
        torch.zeros(int(recorded["input_ids"].offsets()[-1]), 5, 2, dtype=torch.int16), recorded["input_ids"].offsets()
    )
    assert not attach_moe_routing(recorded, LAYOUT) and MOE_ROUTING_FIELD not in recorded.keys()


def test_the_moe_rows_are_int16_beyond_256_experts_and_refused_beyond_int16():
    """Hand-computed ids above uint8's range survive the detour-free path exactly; a layout whose ids int16 cannot hold
    (as verl's own form cannot) is refused before anything is written, never wrapped."""
    wide = RoutingLayout("qwen3_moe", "qwen3_moe", 3, (0, 2), 2, 300)
    ids = np.zeros((6, 3, 2), dtype=np.int16)  # prompt 4 + response 3 - 1 rows, layer 1 dense
    ids[:, 0] = [[299, 0], [256, 257], [1, 298], [42, 260], [3, 299], [7, 8]]
    ids[:, 2] = [[298, 299], [0, 1], [255, 256], [100, 200], [270, 5], [9, 10]]
    samples = []
    for response in ([9, 10, 11], [9, 10]):  # two lengths: verl makes equal-length samples dense, not jagged
        output = AgentLoopOutput(
            prompt_ids=[5, 6, 7, 8],
            response_ids=response,
            response_mask=[1] * len(response),
            routed_experts=ids[: 4 + len(response) - 1],
            metrics=AgentLoopMetrics(),
        )
        d = rollout.compact_agent_loop_output(output, wide).as_dict()
        d["input_ids"] = torch.cat([d["prompts"], d["responses"]])
        samples.append({k: v for k, v in d.items() if isinstance(v, torch.Tensor)})
    batch = list_of_dict_to_tensordict(samples)
    assert attach_moe_routing(batch, wide)
    for got, tokens in zip(batch[MOE_ROUTING_FIELD].unbind(), (7, 6), strict=True):
        assert got.dtype == torch.int16 and got.shape == (tokens, 2, 2)
        assert torch.equal(got[:-1], torch.from_numpy(ids[: tokens - 1][:, [0, 2]])) and not got[-1].any()
    huge = RoutingLayout("qwen3_moe", "qwen3_moe", 3, (0, 2), 2, 40_000)
    fresh = list_of_dict_to_tensordict(samples)
    with pytest.raises(ExpertIdRangeError, match="int16 holds expert ids up to 32767, the model has 40000 experts"):
        attach_moe_routing(fresh, huge)
    assert MOE_ROUTING_FIELD not in fresh.keys()


def test_actor_expansion_names_the_sample_whose_routing_is_corrupt():
    """The actor validates a batch's rows in one pass; a bad id is then located and named per sample."""
    rng = np.random.default_rng(9)
    fields = []
    for prompt_len, mask in ((5, [1, 1]), (3, [1, 1, 1]), (4, [1])):
        d = rollout.compact_agent_loop_output(agent_output(rng, prompt_len, mask), LAYOUT).as_dict()
        d["input_ids"] = torch.cat([d["prompts"], d["responses"]])
        fields.append({k: v for k, v in d.items() if isinstance(v, torch.Tensor)})
    ids = fields[1][IDS_FIELD].clone()
    ids[2, 1, 0] = LAYOUT.num_experts  # one id past the last expert, in sample 1's third routed row
    fields[1][IDS_FIELD] = ids
    batch = list_of_dict_to_tensordict(fields)
    start = int(batch[SPAN_FIELD][1][0])
    with pytest.raises(ExpertIdRangeError, match=rf"sample 1: .*token position {start + 2}, MoE layer 1"):
        expand_compact_routing(batch, LAYOUT)
    assert "routed_experts" not in batch.keys()
    # the FSDP actor's gathering is the same, single check on the actor
    with pytest.raises(ExpertIdRangeError, match=rf"sample 1: .*token position {start + 2}, MoE layer 1"):
        attach_moe_routing(batch, LAYOUT)
    assert MOE_ROUTING_FIELD not in batch.keys()


def test_sglang_reader_fix_returns_vllm_layout():
    rng = np.random.default_rng(2)
    full = vllm_routing(rng, 5 + 3 - 1)
    rows = RoutedRows(0, full[:, list(LAYOUT.moe_layers)])
    for wire in ("int32", "uint8"):
        output = {"output_ids": [7, 8, 9], "meta_info": encode_sglang(rows, LAYOUT, wire_dtype=wire)}
        np.testing.assert_array_equal(read_sglang_routed_experts(output, prompt_len=5, layout=LAYOUT), full)
    offset = {"output_ids": [7, 8, 9], "meta_info": encode_sglang(RoutedRows(2, rows.ids[2:]), LAYOUT)}
    with pytest.raises(RowCountError, match="routed_experts_start_len=2"):
        read_sglang_routed_experts(offset, prompt_len=5, layout=LAYOUT)


def test_manager_resolves_by_fqn_and_worker_postprocess_puts_compact_fields(monkeypatch):
    """verl's loader finds the manager; the worker runs verl's real AgentLoopWorkerTQ postprocess."""
    import ray
    import transfer_queue as tq
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ, AgentLoopWorkerTQ

    manager_cls = load_class_from_fqn(MANAGER_FQN, "AgentLoopManager")
    assert issubclass(manager_cls, AgentLoopManagerTQ)
    worker_cls = rollout.CompactRoutingAgentLoopWorkerTQ
    assert issubclass(worker_cls, AgentLoopWorkerTQ.__ray_actor_class__)
    manager = manager_cls.__new__(manager_cls)
    manager_cls.__init__(
        manager, config=OmegaConf.create({"actor_rollout_ref": {"rollout": {}, "model": {}}}), llm_client=None
    )
    assert isinstance(manager.agent_loop_workers_class, ray.actor.ActorClass)

    worker = worker_cls.__new__(worker_cls)  # the Ray/TransferQueue-free part of __init__ by hand
    worker.reward_loop_worker_handles, worker.distillation_enabled, worker.processor = None, False, None
    worker.stable_routing_enabled = True
    worker.stable_routing_layout, worker.stable_routing_options = LAYOUT, RolloutRoutingOptions()
    worker.stable_routing_stats = BoundaryStats()
    worker.stable_prompt_sharing, worker.stable_prompt_puts, worker.stable_group_sizes = (
        PromptRowSharing(),
        {},
        {},
    )
    put = {}

    async def capture(keys, fields, tags, partition_id):  # TransferQueue's put, the only stand-in
        put.update(keys=keys, fields=fields, tags=tags)

    monkeypatch.setattr(tq, "async_kv_batch_put", capture)
    rng = np.random.default_rng(3)
    output = agent_output(rng, 4, [1, 1, 1])
    expected = output.routed_experts[:, list(LAYOUT.moe_layers)]
    asyncio.run(worker._agent_loop_postprocess(output, False, uid="u0", session_id=0, global_steps=1))
    fields = put["fields"]
    assert put["keys"] == ["u0_0_0"] and "routed_experts" not in fields.keys()
    assert fields[BOUNDARY_FIELD][0, 1].item() == 6  # recorded rows, stored with the sample
    assert fields[SPAN_FIELD].tolist() == [[0, 6]]
    assert fields[PROMPT_REF_FIELD].tolist() == [[0, 0, 0]]  # called outside _run_prompt: a group of one
    np.testing.assert_array_equal(fields[IDS_FIELD][0].numpy(), expected)
    assert worker.stable_routing_metrics()["stable/routing/samples"] == 1.0


def test_register_checks_verl_interfaces():
    names = rollout.register()
    assert names and MANAGER_FQN in names[0]


# ------------------------------------------------------------- a multi-turn conversation cut at response_length
ENGINE_ROWS = vllm_routing(np.random.default_rng(11), 64)
"""The engine stand-in's routing by token position: a later turn's rows extend the earlier turn's, as vLLM's do."""


class _EngineStandIn:
    """vLLM's part of verl's server client: every turn generates ``max_tokens`` digits (no EOS) and returns vLLM's
    routing rows for each position fed through the model (prompt so far + generated tokens - 1)."""

    def __init__(self, tokenizer):
        self.tokens = tokenizer.convert_tokens_to_ids(["1", "2", "3", "4", "5", "6"])

    async def generate(self, *, request_id, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        n = int(sampling_params["max_tokens"])
        return TokenOutput(token_ids=self.tokens[:n], routed_experts=ENGINE_ROWS[: len(prompt_ids) + n - 1].copy())


@pytest.fixture(scope="module")
def multi_turn(tmp_path_factory):
    """Runs verl's own ``ToolAgentLoop`` (through the project's simulated user, :mod:`verl_stable.toy.interactions`:
    answer, the question again, answer, 4 tokens per assistant turn) on the tiny tokenizer; returns a function of
    ``response_length`` giving verl's ``AgentLoopOutput``: prompt 10 tokens, conversation 18 (4 generated, 10 of the
    user turn, 4 generated)."""
    import os

    import verl
    from hydra import compose, initialize_config_dir
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap

    from verl_stable.toy import assets, interactions

    tokenizer = assets.build_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")

    def run(response_length: int) -> AgentLoopOutput:
        overrides = [
            "data.max_prompt_length=16",
            f"data.max_response_length={response_length}",
            "actor_rollout_ref.rollout.multi_turn.max_user_turns=1",
        ]
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            config = compose(config_name="ppo_trainer", overrides=overrides)
        assert config.actor_rollout_ref.rollout.response_length == response_length

        async def conversation():  # verl's loop binds the running event loop when it is built
            loop = interactions.UserSimulatorAgentLoop(
                DictConfigWrap(config),
                _EngineStandIn(tokenizer),
                tokenizer,
                None,
                None,
                DictConfigWrap(config.data),
                hf_model_type="qwen3_moe",
            )
            return await loop.run({}, raw_prompt=[{"role": "user", "content": "copy 7"}])

        return asyncio.run(conversation())

    return run


def test_a_conversation_cut_at_response_length_is_accepted_and_its_extra_row_trimmed(multi_turn):
    """verl cuts the response to R and the routing to prompt + R rows; the last kept token's row fed only the cut
    token: it is validated, trimmed and counted, and every row of a trained token is the engine's own."""
    for response_length, trimmed in ((16, 1), (15, 1), (18, 0), (32, 0)):
        output = multi_turn(response_length)
        prompt_len, response = len(output.prompt_ids), len(output.response_ids)
        assert (prompt_len, output.num_turns) == (10, 4)
        assert response == min(18, response_length) and output.response_mask[-1] == 1
        # what verl hands over: the last request's rows, cut to prompt + R (one past the last kept token when cut)
        assert output.routed_experts.shape[0] == prompt_len + response - 1 + trimmed
        reference = output.model_copy(deep=True).as_dict()["routed_experts"]  # verl's own int16 layout
        stats = BoundaryStats()
        compact = rollout.compact_agent_loop_output(output, LAYOUT, stats=stats, response_length=response_length)
        d = compact.as_dict()
        kept = prompt_len + response - 1
        assert d[SPAN_FIELD].tolist() == [0, kept], response_length
        np.testing.assert_array_equal(d[IDS_FIELD].numpy(), ENGINE_ROWS[:kept, list(LAYOUT.moe_layers)])
        assert torch.equal(d[IDS_FIELD].long(), reference[:kept, list(LAYOUT.moe_layers)].long())
        assert (stats.samples, stats.skipped_samples) == (1, 0)
        assert (stats.truncated_samples, stats.trimmed_rows) == (trimmed, trimmed)
        assert compact.extra_fields["stable_routing_missing_positions"] == 1  # the last token, as for any sample
        counters = d[BOUNDARY_FIELD]
        columns = {name: i for i, name in enumerate(BOUNDARY_COLUMNS)}
        assert counters[columns["trimmed_rows"]] == trimmed and counters[columns["recorded_rows"]] == kept
        metrics = transport_metrics(counters.unsqueeze(0))
        prefix = TRANSPORT_METRIC_PREFIX
        assert metrics[f"{prefix}truncated_samples"] == metrics[f"{prefix}trimmed_rows"] == trimmed
        assert metrics[f"{prefix}missing_positions"] == 1 and metrics[f"{prefix}skipped_samples"] == 0


def test_a_cut_conversation_is_refused_without_the_limit_and_malformed_payloads_still_are(multi_turn):
    """The extra row is accepted only at the limit verl cut at, only one, and only when valid."""
    output = multi_turn(16)
    rows = output.routed_experts
    # the refusal this accepts: the boundary that does not know the limit (before the fix, every cut sample)
    with pytest.raises(RowCountError, match="26 routed rows, expected 25"):
        rollout.compact_agent_loop_output(output.model_copy(deep=True), LAYOUT)
    # a larger limit: the response did not reach it, so nothing was cut and an extra row is malformed
    with pytest.raises(RowCountError, match="26 routed rows, expected 25"):
        rollout.compact_agent_loop_output(output.model_copy(deep=True), LAYOUT, response_length=32)
    cases = {
        "two extra rows": (np.concatenate([rows, rows[-1:]]), RowCountError, "27 routed rows, expected 25"),
        "one row short of the trained tokens": (rows[:24], RowCountError, "24 routed rows, expected 25"),
        "the extra row corrupt": (rows.copy(), ExpertIdRangeError, "token position 25"),
        "top-1 rows": (rows[:, :, :1], LayerMapError, "top-1"),
    }
    cases["the extra row corrupt"][0][25, LAYOUT.moe_layers[0], 0] = LAYOUT.num_experts  # validated before the trim
    for name, (payload, error, message) in cases.items():
        bad = output.model_copy(deep=True)
        bad.routed_experts = payload
        with pytest.raises(error, match=message):
            rollout.compact_agent_loop_output(bad, LAYOUT, response_length=16)
        stats = BoundaryStats()
        skipped = rollout.compact_agent_loop_output(
            bad, LAYOUT, RolloutRoutingOptions(on_invalid="skip_sample"), stats, response_length=16
        )
        assert skipped.as_dict()[SPAN_FIELD].tolist() == [0, 0], name  # trained on the model's own routing
        assert (stats.skipped_samples, stats.truncated_samples, stats.trimmed_rows) == (1, 0, 0), name


# ------------------------------------------------------------------------------------------------ end to end
# The compact manager -> TransferQueue -> FSDP R3 replay path through verl's main_ppo is asserted on one shared run in
# test_replay_coverage_e2e.py (with fault injection: where routing arrived it is replayed exactly, where it did not the
# sample falls back and is counted); fault-free coverage 1.0 on test_two_nodes_e2e.py and test_data_parallel_e2e.py.
