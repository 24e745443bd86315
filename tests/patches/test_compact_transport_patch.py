"""patches/verl-0.9.1-compact-routing-transport.diff, applied for real to a copy of the installed verl 0.9.1.

The patched copy runs in a subprocess (``PYTHONPATH=<copy>``) that builds routing in vLLM 0.24's layout, passes it
through the patched ``AgentLoopOutput.as_dict`` (agent-loop side), TransferQueue's stacking
(``list_of_dict_to_tensordict``) and the patched actor worker (``ActorRolloutRefWorker.compute_log_prob`` /
``compute_ref_log_prob``), and reports tensors and errors. This process holds the unpatched verl, whose original
``as_dict`` gives the int16 padded reference that the round trip must reproduce on every real token.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import verl

from verl_stable.routing.codecs import RoutedRows, encode_vllm
from verl_stable.routing.families import layout_from_config

PATCHES = Path(__file__).parents[2] / "patches"
PATCH = PATCHES / "verl-0.9.1-compact-routing-transport.diff"
INSTALLED_VERL = Path(verl.__file__).parent
OTHER_PATCHES = sorted(p for p in PATCHES.glob("*.diff") if p != PATCH)

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is needed to apply the patch")

# (prompt_len, response_mask, extra rows over prompt_len + last generated - 1): single turn, multi-turn with tool
# output after the last turn, and a response cut at response_length while the engine went on (one more row). Each
# is stored with response_length = len(response_mask): the limit the cut sample reached, one the others respected.
SAMPLES = [
    (5, [1] * 7, 0),
    (4, [1, 1, 1, 0, 0, 1, 1, 0, 0], 0),
    (3, [1, 1, 1, 1], 1),
]


def _configs():
    from transformers import DeepseekV3Config, MixtralConfig, Qwen3MoeConfig

    small = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2, vocab_size=64)
    return {
        # dense layer 0, 64 experts -> uint8
        "deepseek_v3": DeepseekV3Config(
            num_hidden_layers=6, first_k_dense_replace=1, n_routed_experts=64, num_experts_per_tok=4,
            moe_intermediate_size=8, n_group=1, topk_group=1, **small,
        ),
        # dense layers 0 and 3 (mlp_only_layers), 300 experts -> uint16
        "qwen3_moe": Qwen3MoeConfig(
            num_hidden_layers=5, mlp_only_layers=[0, 3], num_experts=300, num_experts_per_tok=3,
            moe_intermediate_size=8, **small,
        ),
        "mixtral": MixtralConfig(num_hidden_layers=3, num_local_experts=8, num_experts_per_tok=2, **small),
    }  # fmt: skip


def _vllm_routing(layout, rows: int, seed: int) -> np.ndarray:
    """vLLM 0.24 ``CompletionOutput.routed_experts``: [rows, num_hidden_layers, top_k], zero dense layers."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(rows, layout.num_moe_layers, layout.num_experts, generator=gen).argsort(-1)[..., : layout.top_k]
    dtype = np.uint8 if layout.num_experts <= 256 else np.uint16
    return encode_vllm(RoutedRows(0, ids.numpy().astype(dtype)), layout)


# prompt rows once per group: two groups of n = 4 (deepseek_v3 layout); in g1 session 2's prompt rows differ (an
# engine may route the same prompt differently across requests); sessions finish out of order (delays)
SHARE_N, SHARE_PROMPT_LEN, SHARE_DIFFERING, SHARE_FIRST = 4, 5, 2, 1
SHARE_MASKS = [[1] * 6, [1, 1, 1, 0, 0, 1, 1, 0], [1] * 3, [1] * 8]
SHARE_EXTRA = [0, 0, 0, 1]  # session 3 was cut at response_length: one more row
SHARE_RESPONSE_LENGTH = 8  # the worker's rollout.response_length
SHARE_DELAYS = [0.02, 0.0, 0.01, 0.03]


def _sharing_fixture() -> dict:
    config, layout, _ = _fixtures("deepseek_v3")
    groups = {}
    for g, uid in enumerate(("g1", "g2")):
        prompt = _vllm_routing(layout, SHARE_PROMPT_LEN, seed=100 + g)
        sessions = []
        for s, (mask, extra) in enumerate(zip(SHARE_MASKS, SHARE_EXTRA, strict=True)):
            extent = max(j for j, m in enumerate(mask) if m) + 1
            routing = _vllm_routing(layout, SHARE_PROMPT_LEN + extent - 1 + extra, seed=200 + 10 * g + s)
            if not (uid == "g1" and s == SHARE_DIFFERING):
                routing[:SHARE_PROMPT_LEN] = prompt
            sessions.append((SHARE_PROMPT_LEN, mask, routing, SHARE_DELAYS[s]))
        groups[uid] = sessions
    return {
        "config": config,
        "n": SHARE_N,
        "groups": groups,
        "shared_session": 0,
        "response_length": SHARE_RESPONSE_LENGTH,
    }


def _kept_rows(prompt_len: int, mask: list[int]) -> int:
    """Rows of the tokens a sample trains on: every token fed to the engine before its last generated one."""
    return prompt_len + max(j for j, m in enumerate(mask) if m)


def _fixtures(family: str):
    config = _configs()[family]
    layout = layout_from_config(config)
    samples = []
    for i, (prompt_len, mask, extra) in enumerate(SAMPLES):
        extent = max(j for j, m in enumerate(mask) if m) + 1
        samples.append((prompt_len, mask, _vllm_routing(layout, prompt_len + extent - 1 + extra, seed=i)))
    return config, layout, samples


PROBE = textwrap.dedent(
    """
    import json, pickle, sys
    import torch
    import verl
    from tensordict import TensorDict
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
    from verl.trainer.ppo import metric_utils
    from verl.trainer.ppo.padding_utils import construct_minimal_padding_template
    from verl.utils import rollout_routing as rr
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict
    from verl.workers.engine_workers import ActorRolloutRefWorker

    args = pickle.load(open(sys.argv[1], "rb"))
    result = {"verl_file": verl.__file__, "families": {}, "errors": {}}

    def output(prompt_len, mask, routing):
        return AgentLoopOutput(prompt_ids=list(range(1, prompt_len + 1)), response_ids=[7] * len(mask),
                               response_mask=mask, routed_experts=routing, metrics=AgentLoopMetrics())

    def catch(name, fn):
        try:
            fn()
            result["errors"][name] = None
        except Exception as exc:
            result["errors"][name] = [type(exc).__name__, str(exc)]

    class Captured:
        def __init__(self):
            self.data = None
        def infer_batch(self, data):
            self.data = data.clone()
            return None

    class FakeWorker:  # the attributes compute_log_prob touches; the methods are verl's, patched
        profiler = None
        enable_routing_replay = False
        def __init__(self):
            self.actor, self.ref = Captured(), Captured()

    for family, (config, samples) in args["families"].items():
        layout = rr.RoutingLayout.from_hf_config(config)
        fields = [output(*s).as_dict(routing_layout=layout, response_length=len(s[1])) for s in samples]
        default = [output(*s).as_dict()["routed_experts"] for s in samples]  # patched, routing_layout omitted
        keep = ("prompts", "responses", rr.ROUTING_IDS_KEY, rr.ROUTING_LAYOUT_KEY)
        td = list_of_dict_to_tensordict([{k: f[k] for k in keep} for f in fields])
        td["input_ids"] = torch.nested.as_nested_tensor(
            [torch.cat([f["prompts"], f["responses"]]) for f in fields], layout=torch.jagged)
        worker = FakeWorker()
        ActorRolloutRefWorker.compute_log_prob(worker, td.clone())
        ActorRolloutRefWorker.compute_ref_log_prob(worker, td.clone())
        actor_keys, ref_keys = sorted(worker.actor.data.keys()), sorted(worker.ref.data.keys())
        expanded = [t.clone() for t in worker.actor.data["routed_experts"].unbind()]
        # TransferQueue may hand equal-shaped per-sample fields back jagged: the expansion takes either form
        td_jagged = td.clone()
        td_jagged[rr.ROUTING_LAYOUT_KEY] = torch.nested.as_nested_tensor(
            list(td[rr.ROUTING_LAYOUT_KEY].unbind(0)), layout=torch.jagged)
        rr.expand_compact_routing_(td_jagged)
        # R2: routing recorded by compute_log_prob (already `routed_experts`) wins over the rollout's
        td_r2 = td.clone()
        recorded = torch.nested.as_nested_tensor([torch.full_like(d, 1) for d in default], layout=torch.jagged)
        td_r2["routed_experts"] = recorded
        added = rr.expand_compact_routing_(td_r2)
        result["families"][family] = {
            "layout": [layout.num_hidden_layers, list(layout.moe_layers), layout.top_k, layout.num_experts],
            "ids": [f[rr.ROUTING_IDS_KEY] for f in fields],
            "layout_tensor": fields[0][rr.ROUTING_LAYOUT_KEY],
            "compact_keys": sorted(fields[0].keys()),
            "expanded": expanded,
            "expanded_jagged": [t.clone() for t in td_jagged["routed_experts"].unbind()],
            "default": default,
            "actor_keys": actor_keys,
            "ref_keys": ref_keys,
            "r2_kept": (not added) and all(torch.equal(a, b) for a, b in zip(td_r2["routed_experts"].unbind(), recorded.unbind()))
                       and rr.ROUTING_IDS_KEY not in td_r2.keys(),
        }

    # the trainer's rollout MoE load-balance metrics read `routed_experts` from TransferQueue: expand on the fly
    family = "deepseek_v3"
    config, samples = args["families"][family]
    layout = rr.RoutingLayout.from_hf_config(config)
    stored = [output(*s).as_dict(routing_layout=layout, response_length=len(s[1])) for s in samples]
    for fields, s in zip(stored, samples):
        rr.share_prompt_rows_(fields, s[0], None)  # what AgentLoopWorkerTQ stores: a zero prompt reference
    store = list_of_dict_to_tensordict(stored)
    requested = []
    def kv_batch_get(keys, partition_id, select_fields):
        requested.append(list(select_fields))
        missing = [f for f in select_fields if f not in store.keys()]
        if missing:
            raise ValueError(f"fields {missing} not found")
        return store.select(*select_fields).clone()
    acc = metric_utils.RolloutMoELoadBalanceMetricsAccumulator()
    got = metric_utils.get_metric_data_with_optional_routed_experts(
        keys=["k"] * len(samples), partition_id="train", fields=["prompts", "responses"], moe_lb_metrics_interval=1,
        global_steps=1, accumulator=acc, kv_batch_get=kv_batch_get)
    result["metrics_requested"] = requested
    result["metrics_routed_experts"] = [t.clone() for t in got["routed_experts"].unbind()]

    # V1 pads a batch to a divisible size with synthetic samples copied from a real one: they must carry no routing
    from verl.trainer.ppo.padding_utils import SYNTHETIC_PADDING_SEQ_LEN, construct_minimal_padding_template
    real = output(*samples[0]).as_dict(routing_layout=layout)
    real["input_ids"] = torch.cat([real["prompts"], real["responses"]])
    real = {k: v for k, v in real.items() if isinstance(v, torch.Tensor)}
    pad, _ = construct_minimal_padding_template(dict(real), {"prompt_len": 5}, eos_token_id=2)
    td = list_of_dict_to_tensordict([real, pad])
    rr.expand_compact_routing_(td)
    result["padding"] = {"seq_len": SYNTHETIC_PADDING_SEQ_LEN, "rows": int(pad[rr.ROUTING_IDS_KEY].shape[0]),
                         "expanded": [t.clone() for t in td["routed_experts"].unbind()]}

    # boundary validation, one case per error (deepseek_v3 layout: dense layer 0, 64 experts, top-4)
    prompt_len, mask, good = samples[0]
    def with_routing(edit):
        bad = good.copy().astype("int64")
        edit(bad)
        return lambda: output(prompt_len, mask, bad).as_dict(routing_layout=layout)
    def set_(index, value):
        def edit(a):
            a[index] = value
        return edit
    catch("ok", with_routing(lambda a: None))
    read_only = good.copy()
    read_only.flags.writeable = False  # engines may hand out read-only buffers
    catch("ok_read_only", lambda: output(prompt_len, mask, read_only).as_dict(routing_layout=layout))
    catch("row_count_short", lambda: output(prompt_len, mask, good[:-2]).as_dict(routing_layout=layout))
    catch("row_count_long", lambda: output(prompt_len, mask, __import__("numpy").concatenate([good, good[:2]])).as_dict(routing_layout=layout))
    catch("wrong_layers", lambda: output(prompt_len, mask, good[:, :-1]).as_dict(routing_layout=layout))
    catch("wrong_top_k", lambda: output(prompt_len, mask, good[:, :, :-1]).as_dict(routing_layout=layout))
    catch("float_ids", lambda: output(prompt_len, mask, good.astype("float32")).as_dict(routing_layout=layout))
    catch("float_tensor_ids", lambda: output(prompt_len, mask, torch.from_numpy(good).float()).as_dict(routing_layout=layout))
    catch("wrapping_id", with_routing(set_((3, 2, 1), 2**32 + 5)))
    catch("id_out_of_range", with_routing(set_((3, 2, 1), 64)))
    catch("negative_id", with_routing(set_((4, 5, 0), -1)))
    catch("duplicate_id", with_routing(lambda a: a.__setitem__((6, 1, 1), a[6, 1, 0])))
    catch("all_zero_moe_row", with_routing(set_((2, 4), 0)))
    catch("dense_layer_routed", with_routing(set_((5, 0, 0), 3)))
    catch("dense_model", lambda: rr.RoutingLayout.from_hf_config(args["dense_config"]))
    # the extra row of a response cut at response_length: only at that limit (then trimmed), never elsewhere
    cut_len, cut_mask, cut_routing = samples[2]
    catch("cut_at_limit", lambda: output(cut_len, cut_mask, cut_routing).as_dict(routing_layout=layout, response_length=len(cut_mask)))
    catch("extra_row_below_limit", lambda: output(cut_len, cut_mask, cut_routing).as_dict(routing_layout=layout, response_length=len(cut_mask) + 1))
    catch("extra_row_limit_unknown", lambda: output(cut_len, cut_mask, cut_routing).as_dict(routing_layout=layout))
    catch("two_extra_rows", lambda: output(cut_len, cut_mask, __import__("numpy").concatenate([cut_routing, cut_routing[-1:]])).as_dict(routing_layout=layout, response_length=len(cut_mask)))
    bad_extra = cut_routing.copy().astype("int64")
    bad_extra[-1, 1, 0] = 64  # only the row that is trimmed: validated before the trim
    catch("extra_row_out_of_range", lambda: output(cut_len, cut_mask, bad_extra).as_dict(routing_layout=layout, response_length=len(cut_mask)))
    ids = output(*samples[0]).as_dict(routing_layout=layout)
    seq_len = samples[0][0] + len(samples[0][1])
    catch("expand_too_many_rows", lambda: rr.expand_routed_experts([ids[rr.ROUTING_IDS_KEY]], [ids[rr.ROUTING_LAYOUT_KEY]], [3]))
    catch("expand_wrong_dtype", lambda: rr.expand_routed_experts([ids[rr.ROUTING_IDS_KEY].to(torch.int16)], [ids[rr.ROUTING_LAYOUT_KEY]], [seq_len]))
    other = rr.RoutingLayout(6, (2, 3, 4, 5), 4, 64).to_tensor()
    catch("expand_mixed_layouts", lambda: rr.expand_routed_experts([ids[rr.ROUTING_IDS_KEY]] * 2, [ids[rr.ROUTING_LAYOUT_KEY], other], [seq_len] * 2))
    catch("expand_bad_layout_tensor", lambda: rr.expand_routed_experts([ids[rr.ROUTING_IDS_KEY]], [torch.tensor([6, 4, 64, 3, 1])], [seq_len]))
    huge = rr.RoutingLayout(6, (1, 2, 3, 4, 5), 4, 40000)
    catch("expand_int16_overflow", lambda: rr.expand_routed_experts([torch.zeros(1, 5, 4, dtype=torch.uint16)], [huge.to_tensor()], [4]))
    catch("expand_count_mismatch", lambda: rr.expand_routed_experts([ids[rr.ROUTING_IDS_KEY]] * 2, [ids[rr.ROUTING_LAYOUT_KEY]], [seq_len]))
    def missing_layout():
        td = TensorDict({rr.ROUTING_IDS_KEY: torch.nested.as_nested_tensor([ids[rr.ROUTING_IDS_KEY]], layout=torch.jagged)}, batch_size=[1])
        rr.expand_compact_routing_(td)
    catch("expand_missing_layout", missing_layout)

    # bytes per real token at Qwen3-30B-A3B's shape (48 layers, all MoE, top-8, 128 experts)
    big = rr.RoutingLayout(48, tuple(range(48)), 8, 128)
    gen = torch.Generator().manual_seed(0)
    prompt_len, response_len = 256, 768
    rows = prompt_len + response_len - 1
    routing = torch.rand(rows, 48, 128, generator=gen).argsort(-1)[..., :8].to(torch.uint8).numpy()
    out = output(prompt_len, [1] * response_len, routing)
    compact = out.as_dict(routing_layout=big)
    original = out.as_dict()["routed_experts"]
    tokens = prompt_len + response_len
    result["bytes"] = {
        "compact_per_token": sum(compact[k].numel() * compact[k].element_size() for k in (rr.ROUTING_IDS_KEY, rr.ROUTING_LAYOUT_KEY)) / tokens,
        "original_per_token": original.numel() * original.element_size() / tokens,
    }

    # prompt rows once per rollout.n group: agent-loop worker -> TransferQueue (in memory) -> actor worker -> clear
    import asyncio
    from collections import defaultdict
    from omegaconf import OmegaConf
    import transfer_queue
    from verl.trainer.ppo.v1 import agent_loop_tq, replay_buffer, trainer_base

    class Store:  # TransferQueue's kv_* signatures over dicts; records every put
        def __init__(self):
            self.parts, self.puts = {}, []
        def _row(self, partition_id, key):
            return self.parts.setdefault(partition_id, {}).setdefault(key, [{}, {}])
        async def async_kv_put(self, key, partition_id, fields=None, tag=None):
            self.puts.append((partition_id, key))
            row = self._row(partition_id, key)
            if fields is not None:
                row[0].update({k: fields[k][0].clone() for k in fields.keys()})
            row[1].update(tag or {})
        async def async_kv_batch_put(self, keys, partition_id, fields=None, tags=None):
            columns = {}
            for name in fields.keys():
                value = fields[name]
                if isinstance(value, torch.Tensor):
                    columns[name] = list(value.unbind()) if value.is_nested else list(value.unbind(0))
            for i, key in enumerate(keys):
                self.puts.append((partition_id, key))
                row = self._row(partition_id, key)
                row[0].update({name: parts[i].clone() for name, parts in columns.items()})
                row[1].update(tags[i] if tags else {})
        def kv_batch_get(self, keys, partition_id, select_fields=None):
            rows = self.parts.get(partition_id, {})
            if any(k not in rows for k in keys):
                raise ValueError("keys or partition were not found!")
            missing = [f for f in select_fields if any(f not in rows[k][0] for k in keys)]
            if missing:
                raise ValueError(f"fields {missing} not found")
            return list_of_dict_to_tensordict([{f: rows[k][0][f] for f in select_fields} for k in keys])
        def kv_list(self, partition_id=None):
            parts = self.parts if partition_id is None else {p: self.parts[p] for p in [partition_id] if p in self.parts}
            return {p: {k: dict(row[1]) for k, row in rows.items()} for p, rows in parts.items()}
        def kv_clear(self, keys, partition_id):
            for key in [keys] if isinstance(keys, str) else keys:
                self.parts.get(partition_id, {}).pop(key, None)

    store = Store()
    for name in ("async_kv_put", "async_kv_batch_put", "kv_batch_get", "kv_list", "kv_clear"):
        setattr(transfer_queue, name, getattr(store, name))

    share = args["sharing"]
    layout = rr.RoutingLayout.from_hf_config(share["config"])
    worker = object.__new__(agent_loop_tq.AgentLoopWorkerTQ.__ray_actor_class__)
    worker.routing_layout, worker.routing_prompt_groups = layout, {}
    worker.routing_response_length = share["response_length"]
    worker.config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"n": share["n"], "val_kwargs": {"n": 1}}}})
    async def no_score(outputs, kwargs):
        return None
    async def no_teacher(*a, **k):
        return None
    worker._compute_score, worker._compute_teacher_logprobs = no_score, no_teacher
    worker._compute_multi_modal_inputs = lambda output, input_ids: {}
    worker._compute_position_ids = lambda ids, mask, mm: torch.arange(ids.shape[1]).unsqueeze(0)
    groups_seen = []
    async def run_agent_loop(sampling_params, trajectory, trace, session_id, uid, **kwargs):
        prompt_len, mask, routing, delay = share["groups"][uid][session_id]
        await asyncio.sleep(delay)  # sessions finish out of order
        groups_seen.append(len(worker.routing_prompt_groups))
        await worker._agent_loop_postprocess(output(prompt_len, mask, routing), trajectory["validate"], uid=uid,
                                             session_id=session_id, global_steps=1)
    worker._run_agent_loop = run_agent_loop
    async def rollout():
        await asyncio.gather(*[worker._run_prompt({"uid": uid}, {}, trajectory={"validate": False})
                               for uid in share["groups"]])
    asyncio.run(rollout())
    P = rr.ROUTING_PROMPT_PARTITION
    sample_keys = {uid: [f"{uid}_{s}_0" for s in range(len(sessions))] for uid, sessions in share["groups"].items()}
    stored = {uid: [store.parts["train"][k][0] for k in keys] for uid, keys in sample_keys.items()}
    sharing = {
        "status": {uid: store.parts["train"][uid][1]["status"] for uid in share["groups"]},
        "side_puts": [key for part, key in store.puts if part == P],
        "side_tags": {k: row[1] for k, row in store.parts[P].items()},
        "stored_rows": {uid: [int(f[rr.ROUTING_IDS_KEY].shape[0]) for f in fs] for uid, fs in stored.items()},
        "refs": {uid: [f[rr.ROUTING_PROMPT_REF_KEY].tolist() for f in fs] for uid, fs in stored.items()},
        "groups_during": max(groups_seen), "groups_after": len(worker.routing_prompt_groups),
    }
    select = ["prompts", "responses", "input_ids", rr.ROUTING_IDS_KEY, rr.ROUTING_LAYOUT_KEY, rr.ROUTING_PROMPT_REF_KEY]
    def actor_expand(uid):
        td = transfer_queue.kv_batch_get(keys=sample_keys[uid], partition_id="train", select_fields=select)
        actor = FakeWorker()
        ActorRolloutRefWorker.compute_log_prob(actor, td)
        return [t.clone() for t in actor.actor.data["routed_experts"].unbind()]
    reads = []
    get = transfer_queue.kv_batch_get
    def counting_get(keys, partition_id, select_fields=None):
        reads.append((partition_id, list(keys)))
        return get(keys=keys, partition_id=partition_id, select_fields=select_fields)
    transfer_queue.kv_batch_get = counting_get
    sharing["expanded"] = {uid: actor_expand(uid) for uid in share["groups"]}
    sharing["actor_reads"] = reads
    transfer_queue.kv_batch_get = get
    got = metric_utils.get_metric_data_with_optional_routed_experts(
        keys=sample_keys["g1"], partition_id="train", fields=["prompts", "responses"], moe_lb_metrics_interval=1,
        global_steps=1, accumulator=metric_utils.RolloutMoELoadBalanceMetricsAccumulator(), kv_batch_get=get)
    sharing["metrics_routed_experts"] = [t.clone() for t in got["routed_experts"].unbind()]
    real = dict(stored["g1"][share["shared_session"]])
    pad, _ = construct_minimal_padding_template(real, {"prompt_len": 5}, eos_token_id=2)
    sharing["padding_ref"] = pad[rr.ROUTING_PROMPT_REF_KEY].tolist()
    # ReplayBuffer evicts group g2 (failure / DAPO / staleness): its side entry goes, g1's stays
    rb = object.__new__(replay_buffer.ReplayBuffer)
    rb.partitions = defaultdict(dict, {"train": {k: {} for keys in sample_keys.values() for k in keys}})
    rb.pending_keys, rb.running_keys, rb.finished_keys, rb.failure_keys = (defaultdict(set) for _ in range(4))
    rb.prompt_global_steps, rb._dapo_classification_cache = defaultdict(dict), defaultdict(dict)
    rb._clear_groups("train", {"g2"})
    sharing["side_after_evict"] = sorted(row[1]["uid"] for row in store.parts[P].values())
    sharing["g1_after_evict"] = actor_expand("g1")
    # the trainer's step-end clear of g1's samples also clears g1's side entry; the actor then fails loudly
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"enable_rollout_routing_replay": True}}})
    transfer_queue.kv_clear(keys=sample_keys["g1"], partition_id="train")
    trainer_base._clear_routing_prompt_rows(config, "train", sample_keys["g1"])
    sharing["side_after_step"] = len(store.parts[P])
    store.parts["train"].update({k: [f, {}] for k, f in zip(sample_keys["g1"], stored["g1"])})  # samples only
    catch("share_missing_entry", lambda: actor_expand("g1"))
    result["sharing"] = sharing
    torch.save(result, args["out"])
    """
)


@pytest.fixture(scope="module")
def patched_verl(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("patched")
    shutil.copytree(INSTALLED_VERL, root / "verl", ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run(["git", "apply", "-p1", str(PATCH)], cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return root


@pytest.fixture(scope="module")
def probe(patched_verl, tmp_path_factory) -> dict:
    import pickle

    from transformers import LlamaConfig

    work = tmp_path_factory.mktemp("probe")
    families = {}
    for family in _configs():
        config, _, samples = _fixtures(family)
        families[family] = (config, samples)
    dense = LlamaConfig(num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2)
    args = {"families": families, "dense_config": dense, "out": str(work / "result.pt"), "sharing": _sharing_fixture()}
    (work / "args.pkl").write_bytes(pickle.dumps(args))
    (work / "probe.py").write_text(PROBE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(patched_verl), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, str(work / "probe.py"), str(work / "args.pkl")],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(work / "result.pt", weights_only=False)


def _original_as_dict(prompt_len: int, mask: list[int], routing: np.ndarray) -> torch.Tensor:
    """verl 0.9.1's own conversion (this process imports the unpatched, installed verl)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    assert "routing_layout" not in inspect.signature(AgentLoopOutput.as_dict).parameters, "installed verl is patched"
    out = AgentLoopOutput(
        prompt_ids=list(range(1, prompt_len + 1)),
        response_ids=[7] * len(mask),
        response_mask=mask,
        routed_experts=routing,
        metrics=AgentLoopMetrics(),
    )
    return out.as_dict()["routed_experts"]


def _trained_reference(prompt_len: int, mask: list[int], routing: np.ndarray) -> torch.Tensor:
    """verl 0.9.1's conversion of the rows of trained tokens (a cut response's extra row trimmed, as the patch does)."""
    return _original_as_dict(prompt_len, mask, routing[: _kept_rows(prompt_len, mask)])


# ---------------------------------------------------------------------------------------------------- applying
def test_patch_applies_cleanly_to_installed_verl():
    proc = subprocess.run(
        ["git", "apply", "--check", "-p1", str(PATCH)], cwd=INSTALLED_VERL.parent, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_patched_copy_is_what_runs(probe, patched_verl):
    assert Path(probe["verl_file"]).resolve().is_relative_to(patched_verl.resolve())
    assert not Path(verl.__file__).resolve().is_relative_to(patched_verl.resolve())


def test_patch_leaves_fsdp_engine_and_rr_mode_alone():
    """The FSDP router-replay diff owns transformer_impl.py, fsdp.yaml and the rr_mode lines."""
    text = PATCH.read_text()
    touched = {line.split()[-1] for line in text.splitlines() if line.startswith("+++ ")}
    assert "b/verl/workers/engine/fsdp/transformer_impl.py" not in touched
    assert not any("fsdp.yaml" in path for path in touched)
    assert not any("rr_mode" in line for line in text.splitlines() if line[:1] in "+- ")


def test_patched_code_does_not_import_verl_stable():
    added = [line for line in PATCH.read_text().splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert added and not any("verl_stable" in line for line in added)


@pytest.mark.parametrize("other", OTHER_PATCHES, ids=[p.name for p in OTHER_PATCHES])
@pytest.mark.parametrize("order", ["this_first", "other_first"])
def test_applies_together_with_other_patches_in_either_order(other, order, tmp_path):
    shutil.copytree(INSTALLED_VERL, tmp_path / "verl", ignore=shutil.ignore_patterns("__pycache__"))
    sequence = [PATCH, other] if order == "this_first" else [other, PATCH]
    for patch in sequence:
        proc = subprocess.run(["git", "apply", "-p1", str(patch)], cwd=tmp_path, capture_output=True, text=True)
        assert proc.returncode == 0, f"{patch.name}: {proc.stderr}"


# ------------------------------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "mixtral"])
def test_round_trip_equals_verl_original_on_every_token(probe, family):
    """The expansion is verl's unpatched ``as_dict`` of the rows of trained tokens; without a layout the patched
    ``as_dict`` is verl's own, the extra row of a cut response included."""
    _, layout, samples = _fixtures(family)
    got = probe["families"][family]
    for i, (prompt_len, mask, routing) in enumerate(samples):
        reference = _trained_reference(prompt_len, mask, routing)
        assert reference.dtype == torch.int16 and reference.shape[0] == prompt_len + len(mask)
        assert reference[: routing.shape[0] - 1].any(), "fixture must carry routing"
        for key in ("expanded", "expanded_jagged"):
            assert got[key][i].dtype == torch.int16, key
            torch.testing.assert_close(got[key][i], reference, rtol=0, atol=0, msg=f"{key} sample {i}")
        original = _original_as_dict(prompt_len, mask, routing)
        torch.testing.assert_close(got["default"][i], original, rtol=0, atol=0, msg=f"default sample {i}")


def test_a_response_cut_at_response_length_has_its_extra_row_trimmed(probe):
    """verl's own layout keeps the cut sample's extra row (the last kept token's routing, which fed only the cut
    token); the patch stores only the rows of trained tokens, as for any other sample (the plugin does the same)."""
    _, layout, samples = _fixtures("deepseek_v3")
    prompt_len, mask, routing = samples[2]
    kept = _kept_rows(prompt_len, mask)
    assert routing.shape[0] == kept + 1 and prompt_len + len(mask) == kept + 1
    assert _original_as_dict(prompt_len, mask, routing)[kept].any()  # verl 0.9.1 stores it
    got = probe["families"]["deepseek_v3"]
    assert got["ids"][2].shape[0] == kept
    assert not got["expanded"][2][kept].any() and got["expanded"][2][:kept].any()
    assert probe["errors"]["cut_at_limit"] is None


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "mixtral"])
def test_compact_fields_hold_only_moe_layers_and_recorded_rows(probe, family):
    _, layout, samples = _fixtures(family)
    got = probe["families"][family]
    assert got["layout"] == [layout.num_hidden_layers, list(layout.moe_layers), layout.top_k, layout.num_experts]
    assert {"routed_experts_compact", "routed_experts_layout", "prompts", "responses"} <= set(got["compact_keys"])
    assert "routed_experts" not in got["compact_keys"], "verl's int16 layout must not travel next to the compact one"
    expected_dtype = torch.uint8 if layout.num_experts <= 256 else torch.uint16
    for ids, (prompt_len, mask, routing) in zip(got["ids"], samples, strict=True):
        kept = _kept_rows(prompt_len, mask)
        assert ids.dtype == expected_dtype
        assert tuple(ids.shape) == (kept, layout.num_moe_layers, layout.top_k)
        assert np.array_equal(ids.view(torch.int16).numpy().astype(np.int64) & 0xFFFF if ids.dtype == torch.uint16
                              else ids.numpy(), routing[:kept, list(layout.moe_layers)])  # fmt: skip
    head = got["layout_tensor"].tolist()
    assert head == [layout.num_hidden_layers, layout.top_k, layout.num_experts, layout.num_moe_layers,
                    *layout.moe_layers]  # fmt: skip


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_worker_expands_for_the_actor_and_drops_for_the_reference(probe, family):
    got = probe["families"][family]
    assert "routed_experts" in got["actor_keys"]
    assert "routed_experts_compact" not in got["actor_keys"] and "routed_experts_layout" not in got["actor_keys"]
    assert not {"routed_experts", "routed_experts_compact", "routed_experts_layout"} & set(got["ref_keys"])


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_recorded_routing_wins_over_rollout_routing(probe, family):
    assert probe["families"][family]["r2_kept"]


def test_trainer_moe_metrics_read_the_compact_fields(probe):
    assert probe["metrics_requested"][0][-1] == "routed_experts"
    assert probe["metrics_requested"][1][-3:] == [
        "routed_experts_compact",
        "routed_experts_layout",
        "routed_experts_prompt_ref",
    ]
    _, _, samples = _fixtures("deepseek_v3")
    for got, (prompt_len, mask, routing) in zip(probe["metrics_routed_experts"], samples, strict=True):
        reference = _trained_reference(prompt_len, mask, routing)
        torch.testing.assert_close(got, reference, rtol=0, atol=0)


def test_padding_samples_carry_no_routing(probe):
    padding = probe["padding"]
    assert padding["rows"] == 0
    real, pad = padding["expanded"]
    torch.testing.assert_close(real, _original_as_dict(*_fixtures("deepseek_v3")[2][0]), rtol=0, atol=0)
    assert pad.shape == (padding["seq_len"], 6, 4) and not pad.any()


def test_bytes_per_real_token_at_most_half_of_verl(probe):
    per_token = probe["bytes"]
    assert per_token["original_per_token"] == 2 * 48 * 8  # int16 over every layer and position
    ratio = per_token["compact_per_token"] / per_token["original_per_token"]
    assert 0.45 < ratio <= 0.5, per_token


# ------------------------------------------------------------------------------------------------ validation
ERRORS = {
    "row_count_short": "routing rows",
    "row_count_long": "routing rows",
    "wrong_layers": "must be [rows, 6 layers, top-4]",
    "wrong_top_k": "must be [rows, 6 layers, top-4]",
    "float_ids": "integer expert ids",
    "float_tensor_ids": "integer expert ids, got dtype torch.float32",
    "wrapping_id": "expert id 4294967301 outside [0, 64)",
    "id_out_of_range": "expert id 64 outside [0, 64) at token position 3, decoder layer 2",
    "negative_id": "expert id -1 outside [0, 64) at token position 4, decoder layer 5",
    "duplicate_id": "repeat within a top-4 row at token position 6, decoder layer 1",
    "all_zero_moe_row": "all-zero routing row at token position 2, decoder layer 4",
    "extra_row_below_limit": "7 routing rows for a sample of 3 prompt tokens whose last generated token is response "
    "token 3: expected 6 (every token fed to the engine before the last generated one)",
    "extra_row_limit_unknown": "7 routing rows for a sample of 3 prompt tokens",
    "two_extra_rows": "8 routing rows for a sample of 3 prompt tokens whose last generated token is response token 3:"
    " expected 6 (every token fed to the engine before the last generated one) or 7 (a response cut at "
    "response_length 4",
    "extra_row_out_of_range": "expert id 64 outside [0, 64) at token position 6, decoder layer 1",
    "dense_layer_routed": "routing in a dense layer at token position 5, decoder layer 0",
    "dense_model": "needs an MoE config",
    "expand_too_many_rows": "rows for 3 tokens",
    "expand_wrong_dtype": "expected torch.uint8",
    "expand_mixed_layouts": "different routing layouts",
    "expand_bad_layout_tensor": "(H, K, E, L, *layers)",
    "expand_count_mismatch": "2 routing entries, 1 layouts and 1 sequences",
    "expand_int16_overflow": "num_experts=40000 does not fit",
    "expand_missing_layout": "without routed_experts_layout",
}


def test_valid_routing_passes(probe):
    assert probe["errors"]["ok"] is None and probe["errors"]["ok_read_only"] is None


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_every_validation_error_is_clear(probe, case):
    error = probe["errors"][case]
    assert error is not None, f"{case} was accepted"
    name, message = error
    assert name == "RolloutRoutingError", (name, message)
    assert ERRORS[case] in message, message
    if case in ("extra_row_below_limit", "extra_row_limit_unknown"):
        assert " or " not in message, message  # below the limit / limit unknown: the extra row is never allowed


def test_probe_reports_every_case(probe):
    assert set(probe["errors"]) == set(ERRORS) | {"ok", "ok_read_only", "share_missing_entry", "cut_at_limit"}
    json.dumps(probe["errors"])  # plain strings only


# ------------------------------------------------------------------------------- prompt rows once per group
def _shared(uid: str, session: int) -> bool:
    return not (uid == "g1" and session == SHARE_DIFFERING)


def test_group_round_trip_equals_verl_original_on_every_token(probe):
    """Agent-loop postprocess -> TransferQueue -> actor worker gives verl's unpatched int16 routing, every sample."""
    sharing = probe["sharing"]
    assert sharing["status"] == {"g1": "finished", "g2": "finished"}
    for uid, sessions in _sharing_fixture()["groups"].items():
        assert len(sharing["expanded"][uid]) == SHARE_N
        for s, (prompt_len, mask, routing, _) in enumerate(sessions):
            reference = _trained_reference(prompt_len, mask, routing)
            assert reference[:prompt_len].any()
            torch.testing.assert_close(sharing["expanded"][uid][s], reference, rtol=0, atol=0, msg=f"{uid} {s}")
    for got, sample in zip(sharing["metrics_routed_experts"], _sharing_fixture()["groups"]["g1"], strict=True):
        torch.testing.assert_close(got, _trained_reference(*sample[:3]), rtol=0, atol=0)


def test_identical_prompt_rows_are_stored_once_per_group(probe):
    sharing = probe["sharing"]
    assert len(sharing["side_puts"]) == 2 == len(set(sharing["side_puts"]))  # one entry per group, put once
    assert sorted(tag["uid"] for tag in sharing["side_tags"].values()) == ["g1", "g2"]
    assert all(
        tag["rows"] == SHARE_PROMPT_LEN and tag["partition_id"] == "train" for tag in sharing["side_tags"].values()
    )
    for uid, sessions in _sharing_fixture()["groups"].items():
        key = next(k for k, tag in sharing["side_tags"].items() if tag["uid"] == uid)
        for s, (prompt_len, mask, _, _) in enumerate(sessions):
            rows, ref = sharing["stored_rows"][uid][s], sharing["refs"][uid][s]
            if _shared(uid, s):
                assert rows == _kept_rows(prompt_len, mask) - prompt_len, (uid, s)
                assert ref[0] == prompt_len and struct.pack(">qq", ref[1], ref[2]).hex() == key
            else:
                assert rows == _kept_rows(prompt_len, mask) and ref == [0, 0, 0], (uid, s)
    # the worker forgets a group once its sessions settle
    assert sharing["groups_during"] == 2 and sharing["groups_after"] == 0


def test_actor_reads_the_distinct_side_entries_once(probe):
    side = [keys for partition, keys in probe["sharing"]["actor_reads"] if partition == "routing_prompt_rows"]
    assert [len(keys) for keys in side] == [1, 1]  # one read per group's batch, its one entry


def test_padding_sample_does_not_refer_to_shared_rows(probe):
    assert probe["sharing"]["padding_ref"] == [0, 0, 0]


def test_clearing_a_group_clears_its_side_entry(probe):
    sharing = probe["sharing"]
    assert sharing["side_after_evict"] == ["g1"]  # ReplayBuffer._clear_groups({"g2"})
    for got, sample in zip(sharing["g1_after_evict"], _sharing_fixture()["groups"]["g1"], strict=True):
        torch.testing.assert_close(got, _trained_reference(*sample[:3]), rtol=0, atol=0)
    assert sharing["side_after_step"] == 0  # step-end clear of g1's samples


def test_missing_side_entry_raises(probe):
    name, message = probe["errors"]["share_missing_entry"]
    assert name == "RolloutRoutingError" and "routing_prompt_rows" in message and "never put" in message
