"""The two rollout-routing transport diffs, applied for real to a copy of the installed verl 0.9.1.

``verl-0.9.1-compact-routing-encoding.diff`` (``rollout.routed_experts_encoding``) and
``verl-0.9.1-routing-prompt-rows-once.diff`` (``rollout.routing_prompt_rows_once``): each applies alone and stacked
with every other diff under ``patches/`` in either order. The patched copy runs in a subprocess
(``PYTHONPATH=<copy>``); this process holds the unpatched verl, whose ``AgentLoopOutput.as_dict`` gives the int16
reference. Switched off, the patched verl stores and hands the actor exactly what the unpatched one does; switched
on (each alone and both), the actor's ``routed_experts`` equals that reference on every token.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import verl

PATCHES = Path(__file__).parents[2] / "patches"


def _load_patched_tree():
    """``patches/tools/patched_tree.py`` (copy verl, apply a diff), loaded by path: ``patches/tools`` is no package."""
    if "patched_tree" in sys.modules:  # check_series.py, loaded by another test, loads it too: keep one module
        return sys.modules["patched_tree"]
    spec = importlib.util.spec_from_file_location("patched_tree", PATCHES / "tools" / "patched_tree.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


pt = _load_patched_tree()
ENCODING = PATCHES / "verl-0.9.1-compact-routing-encoding.diff"
PROMPT_ROWS = PATCHES / "verl-0.9.1-routing-prompt-rows-once.diff"
OURS = (ENCODING, PROMPT_ROWS)
OTHERS = sorted(p for p in PATCHES.glob("verl-0.9.1-*.diff") if p not in OURS)
INSTALLED_VERL = Path(verl.__file__).parent

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is needed to apply the diffs")

# DeepSeek-V3 conventions, tiny: 4 decoder layers, layer 0 dense, top-4 of 64 experts
CONFIG = dict(num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=64, num_experts_per_tok=4)
LAYERS, TOP_K, EXPERTS, MOE = 4, 4, 64, (1, 2, 3)
# one rollout.n group of 3 (one prompt): single turn, multi-turn with tool output after the last turn, single turn
PROMPT_LEN = 5
MASKS = [[1] * 7, [1, 1, 1, 0, 0, 1, 1, 0, 0], [1] * 4]


def _rows(rows: int, seed: int) -> np.ndarray:
    """vLLM's layout [rows, layers, top_k] uint8: distinct ids per MoE (token, layer), dense layer zero."""
    rng = np.random.default_rng(seed)
    out = np.zeros((rows, LAYERS, TOP_K), dtype=np.uint8)
    for t in range(rows):
        for layer in MOE:
            out[t, layer] = rng.choice(EXPERTS, size=TOP_K, replace=False)
    return out


def _samples() -> list[tuple[int, list[int], np.ndarray]]:
    """The group's engine routing: the same prompt rows, then each sample's own (every token fed before its last
    generated one has a row)."""
    prompt = _rows(PROMPT_LEN, 0)
    out = []
    for i, mask in enumerate(MASKS):
        generated = max(j for j, m in enumerate(mask) if m) + 1
        out.append((PROMPT_LEN, mask, np.concatenate([prompt, _rows(generated - 1, i + 1)])))
    return out


def _reference(prompt_len: int, mask: list[int], routing: np.ndarray) -> torch.Tensor:
    """verl 0.9.1's own int16 routed_experts (this process imports the unpatched, installed verl)."""
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


def _patched_verl(root: Path, diffs) -> Path:
    """A copy of the installed verl package in ``root`` with the ``verl/`` parts of ``diffs`` applied, in order.

    Only the package is copied (the subprocess imports nothing else), so the diffs' verl tests and docs are left out.
    """
    try:
        return pt.patched_copy(root, diffs, include="verl/*", source=INSTALLED_VERL)
    except pt.DiffDoesNotApply as exc:
        pytest.fail(str(exc))


PROBE = textwrap.dedent(
    """
    import asyncio, pickle, sys
    import torch
    import transfer_queue
    import verl
    from transformers import DeepseekV3Config
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
    from verl.trainer.ppo import metric_utils
    from verl.utils import rollout_routing as rr
    from verl.utils import routing_prompt_rows as pr
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict
    from verl.workers.config import RolloutConfig
    from verl.workers.engine_workers import ActorRolloutRefWorker

    args = pickle.load(open(sys.argv[1], "rb"))
    samples = args["samples"]
    layout = rr.RoutingLayout.from_hf_config(DeepseekV3Config(
        hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_attention_heads=2, **args["config"]))
    result = {"verl_file": verl.__file__}

    def output(prompt_len, mask, routing):
        return AgentLoopOutput(prompt_ids=list(range(1, prompt_len + 1)), response_ids=[7] * len(mask),
                               response_mask=mask, routed_experts=routing, metrics=AgentLoopMetrics())

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

    side = {}
    reads = []
    def side_get(keys, partition_id, select_fields=None):
        reads.append((partition_id, list(keys)))
        return list_of_dict_to_tensordict([{"rows": side[key]} for key in keys])
    transfer_queue.kv_batch_get = side_get  # the actor's default reader

    def actor_sees(fields):
        td = list_of_dict_to_tensordict(fields)
        td["input_ids"] = torch.nested.as_nested_tensor(
            [torch.cat([f["prompts"], f["responses"]]) for f in fields], layout=torch.jagged)
        worker = FakeWorker()
        ActorRolloutRefWorker.compute_log_prob(worker, td.clone())
        ActorRolloutRefWorker.compute_ref_log_prob(worker, td.clone())
        return worker.actor.data, worker.ref.data

    def stored(encoding, once):
        fields = []
        sharing = pr.PromptRowsSharing(0) if once else None
        if sharing is not None:
            sharing.open_group("train", "g", len(samples))
        for s in samples:
            kwargs = {"routing_layout": layout, "response_length": len(s[1])} if encoding == "compact" else {}
            f = {k: v for k, v in output(*s).as_dict(**kwargs).items() if isinstance(v, torch.Tensor)}
            if sharing is not None:
                async def put(key, partition_id, fields, tag):
                    side[key] = fields["rows"][0]
                asyncio.run(sharing.store_(f, s[0], "train", "g", put))
            fields.append(f)
        return fields

    for encoding in ("int16", "compact"):
        for once in (False, True):
            fields = stored(encoding, once)
            reads.clear()
            actor, ref = actor_sees(fields)
            result[(encoding, once)] = {
                "stored_keys": sorted(fields[0].keys()),
                "stored_rows": [int(f.get("routed_experts", f.get(rr.ROUTING_IDS_KEY)).shape[0]) for f in fields],
                "actor_keys": sorted(actor.keys()),
                "ref_keys": sorted(ref.keys()),
                "actor_routing": [t.clone() for t in actor["routed_experts"].unbind()],
                "side_reads": [len(k) for p, k in reads if p == pr.PROMPT_ROWS_PARTITION],
            }

    config = RolloutConfig(name="vllm")
    result["defaults"] = [config.routed_experts_encoding, config.routing_prompt_rows_once,
                          config.routing_prompt_rows_min_bytes]

    calls = []
    store = list_of_dict_to_tensordict(stored("int16", False))
    def kv_batch_get(keys, partition_id, select_fields):
        calls.append(list(select_fields))
        return store.select(*select_fields).clone()
    metric_utils.get_metric_data_with_optional_routed_experts(
        keys=["k"] * len(samples), partition_id="train", fields=["prompts", "responses"], moe_lb_metrics_interval=1,
        global_steps=1, accumulator=metric_utils.RolloutMoELoadBalanceMetricsAccumulator(), kv_batch_get=kv_batch_get)
    result["metric_calls"] = calls
    pickle.dump(result, open(sys.argv[2], "wb"))
    """
)


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    root = _patched_verl(tmp_path_factory.mktemp("patched"), OURS)
    work = tmp_path_factory.mktemp("probe")
    (work / "args.pkl").write_bytes(pickle.dumps({"samples": _samples(), "config": CONFIG}))
    (work / "probe.py").write_text(PROBE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, str(work / "probe.py"), str(work / "args.pkl"), str(work / "out.pkl")],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = pickle.loads((work / "out.pkl").read_bytes())
    result["root"] = root
    return result


# ---------------------------------------------------------------------------------------------------- applying
@pytest.mark.parametrize("diff", OURS, ids=[p.name for p in OURS])
def test_applies_to_installed_verl(diff):
    checked = pt.check_diff(INSTALLED_VERL.parent, diff, include="verl/*")
    assert checked.ok, checked.message


@pytest.mark.parametrize("other", [*OTHERS, None], ids=[*(p.name for p in OTHERS), "the_two_alone"])
@pytest.mark.parametrize("order", ["ours_first", "other_first"])
def test_stacks_with_every_other_diff_in_either_order(other, order, tmp_path):
    ours = list(OURS) if order == "ours_first" else list(reversed(OURS))
    others = [] if other is None else [other]
    _patched_verl(tmp_path, [*ours, *others] if order == "ours_first" else [*others, *ours])


@pytest.mark.parametrize("diff", OURS, ids=[p.name for p in OURS])
def test_each_diff_brings_a_verl_test_a_docs_page_and_an_off_switch(diff):
    text = diff.read_text()
    touched = {line.split()[-1][2:] for line in text.splitlines() if line.startswith("+++ b/")}
    assert any(p.startswith("tests/") and p.endswith("_on_cpu.py") for p in touched), touched
    assert any(p.startswith("docs/") and p.endswith(".md") for p in touched), touched
    assert "verl/trainer/config/rollout/rollout.yaml" in touched
    assert "verl/trainer/config/_generated_ppo_trainer.yaml" in touched
    added = [line for line in text.splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert not any("verl_stable" in line for line in added)
    assert "b/verl/workers/engine/fsdp/transformer_impl.py" not in text  # the FSDP router-replay diff owns it


def test_patched_copy_is_what_runs(probe):
    assert Path(probe["verl_file"]).resolve().is_relative_to(probe["root"].resolve())
    assert not Path(verl.__file__).resolve().is_relative_to(probe["root"].resolve())


# ------------------------------------------------------------------------------------------------- switched off
def test_switches_default_to_verls_behaviour(probe):
    assert probe["defaults"] == ["int16", False, 2 * 1024 * 1024]


def test_switched_off_verl_stores_and_hands_the_actor_what_it_did(probe):
    off = probe[("int16", False)]
    assert "routed_experts" in off["stored_keys"]
    assert not {"routed_experts_compact", "routed_experts_layout", "routed_experts_prompt_ref"} & set(
        off["stored_keys"]
    )
    assert off["stored_rows"] == [PROMPT_LEN + len(m) for m in MASKS]
    assert off["side_reads"] == []
    assert "routed_experts" in off["actor_keys"] and "routed_experts" in off["ref_keys"]
    for got, sample in zip(off["actor_routing"], _samples(), strict=True):
        torch.testing.assert_close(got, _reference(*sample), rtol=0, atol=0)


def test_switched_off_metrics_fetch_is_verls_call_sequence(probe):
    """verl's own test (test_rollout_moe_lb_metrics_on_cpu.py) pins this sequence: one call, routed_experts last."""
    assert probe["metric_calls"] == [["prompts", "responses", "routed_experts"]]


# -------------------------------------------------------------------------------------------------- switched on
@pytest.mark.parametrize(
    "switches", [("compact", False), ("int16", True), ("compact", True)], ids=["encoding", "prompt_rows", "both"]
)
def test_switched_on_the_actor_gets_verls_routing_on_every_token(probe, switches):
    got = probe[switches]
    for routing, sample in zip(got["actor_routing"], _samples(), strict=True):
        assert routing.dtype == torch.int16
        torch.testing.assert_close(routing, _reference(*sample), rtol=0, atol=0)
    assert "routed_experts_compact" not in got["actor_keys"] and "routed_experts_prompt_ref" not in got["actor_keys"]
    assert "routed_experts" not in got["ref_keys"]  # the reference never replays


def test_compact_encoding_stores_one_byte_per_moe_id(probe):
    got = probe[("compact", False)]
    assert {"routed_experts_compact", "routed_experts_layout"} <= set(got["stored_keys"])
    assert "routed_experts" not in got["stored_keys"]
    generated = [max(j for j, m in enumerate(mask) if m) + 1 for mask in MASKS]
    assert got["stored_rows"] == [PROMPT_LEN + g - 1 for g in generated]  # fed rows only: no padding rows


def test_prompt_rows_are_stored_once_and_read_once(probe):
    for encoding in ("int16", "compact"):
        got = probe[(encoding, True)]
        assert "routed_experts_prompt_ref" in got["stored_keys"]
        full = probe[(encoding, False)]["stored_rows"]
        # the first sample puts the prompt rows into the side entry, and every sample stores only its later rows
        assert got["stored_rows"] == [rows - PROMPT_LEN for rows in full]
        assert got["side_reads"] == [1]  # one read of the group's one entry
