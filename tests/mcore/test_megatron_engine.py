"""R2 / R3 router replay in verl's real Megatron engine on CPU, and the project's replay metrics on it.

The engine is built the way verl's workers build it: ``EngineRegistry.new("language_model", "megatron", ...)`` on the
CPU platform, which selects ``CpuMegatronEngineWithLMHeadReplay`` (verl's ``MegatronEngineWithLMHead`` with the replay-
metrics mixin of :mod:`verl_stable.integration.megatron_replay`, under the Megatron CPU runtime), on the toy assets'
Qwen3-MoE (4 MoE layers, 16 experts, top-4) converted by mbridge, bf16. Each parallel layout runs in spawned
processes that build the engine once and run, in order: an R3 forward (``compute_log_prob``), an R3 update
(``train_batch``: forward, backward, optimizer step), an R3 forward with routes shifted by one row within each
sequence, an R3 forward whose routes have zero rows (tokens the rollout did not route), an R3 forward whose third
router's output is tampered with, then (the engine's mode switched to R2) an R2 record, a native forward after the
routers were perturbed, and an R2 update replaying the recording. The batch is verl's: left-right padded and
converted by verl's ``left_right_2_no_padding``, two micro-batches of two samples.

References are independent of verl's replay code and of the mixin:

* the experts each router actually used are read by the test's own forward hooks on the routers (``routing_map``),
  and the router's native choice from its own gate (``router.gating`` on its input, top-k);
* where each token lands among the router rows (packed sample after sample, each sample padded to a multiple of the
  tensor-parallel size, the rows split over the sequence-parallel ranks) is written down here from the lengths;
* R3 replays every row of a sequence but the last (verl's ``build_r3_replay_mask``), the last one is native; the
  metrics' expected values are counted from the lengths and response masks with plain loops.

Layouts (:data:`LAYOUTS`): world size 1; two ranks with tensor parallelism 2 and sequence parallelism (each rank
routes half of the rows; the mixin sums their counts); two ranks with expert parallelism 2 (data parallel 2, each
rank given the whole batch; the coverage counts reach verl scaled by the data-parallel size).
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable

import pytest
import torch
from testkit.spawn import report, spawn_and_collect

from verl_stable.metric_names import COVERAGE, COVERAGE_COUNTS
from verl_stable.routing.replay_audit import (
    ROW_NOT_NEEDED,
    ROW_PADDING,
    ROW_PROMPT,
    ROW_RESPONSE,
    coverage_row_counts,
    disagreement_metrics,
    rows_with_data,
    token_classes,
    used_vs_target,
)
from verl_stable.routing.replay_pass import coverage_counts

# The toy assets' model (verl_stable.toy.assets.AssetSpec defaults).
NUM_LAYERS, EXPERTS, TOPK = 4, 16, 4
# Four samples: prompt lengths and response masks (sample 3's last response token is not trained, like a tool output).
# Lengths 5, 7 | 3, 5: odd, so under tensor parallelism 2 each sample gets one pad row, and in each micro-batch the two
# sequence-parallel halves hold one pad row each. Balanced on purpose: R2 replays verl's zero routes on pad rows (one
# expert instead of top-4), and the expert-tensor-parallel gather of the routed tokens then needs equal counts per
# rank on gloo, whose all_gather takes no uneven sizes (NCCL's does).
PROMPT_LENS = (3, 3, 2, 2)
RESPONSE_MASKS = ((1, 1), (1, 1, 1, 1), (1,), (1, 1, 0))
PROMPT_WIDTH, RESPONSE_WIDTH = 4, 4
MICRO_BATCH = 2
TAMPERED_LAYER = 3  # layer_number of the router whose output the tamper run rewrites
# (sample, position) of tokens the "rollout" of the r3_holes run did not route (zero rows in every layer): a prompt and
# a response token of the first micro-batch
HOLES = ((0, 0), (1, PROMPT_LENS[1] + 1))
ROUTING = "stable/routing/"


# ================================================================================================= shared helpers
def lengths() -> list[int]:
    return [p + len(r) for p, r in zip(PROMPT_LENS, RESPONSE_MASKS, strict=True)]


def micro_batches() -> list[list[int]]:
    return [list(range(i, i + MICRO_BATCH)) for i in range(0, len(PROMPT_LENS), MICRO_BATCH)]


def padded_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """verl's left-right padded batch (prompts left-padded to 4, responses right-padded to 4) and rollout routes."""
    gen = torch.Generator().manual_seed(seed)
    batch_size, width = len(PROMPT_LENS), PROMPT_WIDTH + RESPONSE_WIDTH
    input_ids = torch.zeros(batch_size, width, dtype=torch.long)
    attention_mask = torch.zeros(batch_size, width, dtype=torch.long)
    response_mask = torch.zeros(batch_size, RESPONSE_WIDTH, dtype=torch.long)
    routes = torch.zeros(batch_size, width, NUM_LAYERS, TOPK, dtype=torch.int16)
    for b, (prompt, mask) in enumerate(zip(PROMPT_LENS, RESPONSE_MASKS, strict=True)):
        attention_mask[b, PROMPT_WIDTH - prompt : PROMPT_WIDTH + len(mask)] = 1
        response_mask[b, : len(mask)] = torch.tensor(mask)
        valid = attention_mask[b].bool()
        input_ids[b, valid] = torch.randint(5, 26, (int(valid.sum()),), generator=gen)
        for s in valid.nonzero().flatten().tolist():
            routes[b, s] = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(NUM_LAYERS)])
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "position_ids": position_ids,
        "routes": routes,
    }


def token_routes(routes: torch.Tensor) -> list[torch.Tensor]:
    """Per sample, the ``[length, layers, K]`` routes of its tokens, in token order."""
    mask = padded_batch()["attention_mask"].bool()
    return [routes[b][mask[b]] for b in range(len(PROMPT_LENS))]


def with_holes(routes: torch.Tensor) -> torch.Tensor:
    """Routes with the :data:`HOLES` tokens' rows zeroed in every layer (verl's layout of an unrouted token)."""
    mask = padded_batch()["attention_mask"].bool()
    out = routes.clone()
    for s, j in HOLES:
        out[s, mask[s].nonzero().flatten()[j]] = 0
    return out


def shifted(routes: torch.Tensor) -> torch.Tensor:
    """Routes moved one row down within each sequence (row j gets row j - 1's, the first the last's)."""
    mask = padded_batch()["attention_mask"].bool()
    out = routes.clone()
    for b in range(len(PROMPT_LENS)):
        out[b][mask[b]] = routes[b][mask[b]].roll(1, dims=0)
    return out


def packed_rows(tp: int) -> list[list[tuple[int, int] | None]]:
    """Per micro-batch, the (sample, position) of each router row, ``None`` for a pad row (``tp``-aligned samples)."""
    out = []
    for samples in micro_batches():
        rows: list[tuple[int, int] | None] = []
        for s in samples:
            n = lengths()[s]
            rows += [(s, j) for j in range(n)] + [None] * ((-n) % tp)
        out.append(rows)
    return out


def multi_hot(ids: torch.Tensor) -> torch.Tensor:
    return torch.zeros(EXPERTS, dtype=torch.bool).scatter(0, ids.long(), True)


def replayed_under_r3(sample: int, position: int) -> bool:
    """verl's R3 rule: every row of a sequence with a response but its last one."""
    return sum(RESPONSE_MASKS[sample]) > 0 and position < lengths()[sample] - 1


def expected_coverage(samples: list[int], tp: int, replayed: Callable[[int, int], bool]) -> dict[str, float]:
    """The coverage counts of one micro-batch, by plain loops over its tokens (times the MoE layers)."""
    counts = dict.fromkeys(COVERAGE_COUNTS, 0)
    for s in samples:
        prompt, mask = PROMPT_LENS[s], RESPONSE_MASKS[s]
        trained = [j for j, m in enumerate(mask) if m]
        last = prompt + trained[-1] if trained else -1
        for j in range(lengths()[s]):
            if j >= last:
                counts["not_needed_rows"] += 1
                continue
            kind = "prompt" if j < prompt else "response"
            counts[f"{kind}_rows"] += 1
            counts[f"{kind}_replayed_rows"] += int(replayed(s, j))
        counts["padding_rows"] += (-lengths()[s]) % tp
    return {name: float(value * NUM_LAYERS) for name, value in counts.items()}


# ================================================================================================= pure functions
def test_token_classes_and_row_counts_agree_with_the_fsdp_coverage_counts():
    offsets = torch.tensor([0, *torch.tensor(lengths()).cumsum(0).tolist()])
    tokens = int(offsets[-1])
    gen = torch.Generator().manual_seed(3)
    is_prompt = torch.zeros(tokens, dtype=torch.bool)
    trained = torch.zeros(tokens, dtype=torch.bool)
    for b, (prompt, mask) in enumerate(zip(PROMPT_LENS, RESPONSE_MASKS, strict=True)):
        start = int(offsets[b])
        is_prompt[start : start + prompt] = True
        trained[start + prompt : start + prompt + len(mask)] = torch.tensor(mask, dtype=torch.bool)
    has_data = torch.rand(tokens, 3, generator=gen) < 0.7
    reference = coverage_counts(has_data, offsets, is_prompt, trained, padding_tokens=5)
    classes = token_classes(offsets, is_prompt, trained)
    rows = torch.cat([classes, torch.full((5,), ROW_PADDING)])  # pad rows anywhere count the same
    ours = sum(
        coverage_row_counts(rows, torch.cat([has_data[:, layer], torch.ones(5, dtype=torch.bool)]))
        for layer in range(3)
    )
    assert dict(zip(COVERAGE_COUNTS, ours.tolist(), strict=True)) == reference
    # the classes themselves, for the sample whose last response token is not trained (the last five tokens)
    assert classes[-5:].tolist() == [ROW_PROMPT] * 2 + [ROW_RESPONSE] + [ROW_NOT_NEEDED] * 2
    assert coverage_row_counts(rows, None)[1] == coverage_row_counts(rows, None)[0]  # no mask: every row replayed


def test_used_vs_target_counts_replayed_rows_whose_expert_set_differs():
    targets = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 7]])
    used = torch.zeros(4, 8, dtype=torch.bool)
    used[0, [2, 1]] = True  # same set, other order
    used[1, [3, 5]] = True  # differs
    used[2, [0, 1]] = True  # differs, but not replayed below
    used[3, 7] = True  # a duplicated target id is one expert
    replayed, differ = used_vs_target(used, targets)
    assert (int(replayed), int(differ)) == (4, 2)
    replayed, differ = used_vs_target(used, targets, torch.tensor([True, True, False, True]))
    assert (int(replayed), int(differ)) == (3, 1)
    with pytest.raises(ValueError, match="not the same rows"):
        used_vs_target(used, targets[:3])


def test_rows_with_data_are_rows_of_distinct_experts():
    ids = torch.tensor([[3, 1, 2, 0], [0, 0, 0, 0], [5, 5, 1, 2], [0, 1, 2, 3]])
    assert rows_with_data(ids).tolist() == [True, False, False, True]
    assert rows_with_data(torch.zeros(3, 1, dtype=torch.long)).tolist() == [True] * 3  # top-1: cannot tell


def test_disagreement_metrics_per_layer_and_max():
    metrics = disagreement_metrics([10, 0, 4], [1, 0, 2])
    assert metrics == {
        "disagreement": 3 / 14,
        "disagreement/layer_0": 0.1,
        "disagreement/layer_1": 0.0,
        "disagreement/layer_2": 0.5,
        "disagreement/layer_max": 0.5,
    }
    with pytest.raises(ValueError, match="differing rows"):
        disagreement_metrics([1], [2])


# ================================================================================================= the engine (spawned)
class RouterProbe:
    """The test's own hooks on every router: the experts it used, its native choice, and an optional tamper."""

    def __init__(self, engine) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.phase = ""
        self.tamper = False
        self.calls: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        self.routers = [m for m in engine.module[0].modules() if isinstance(m, TopKRouter)]
        for router in self.routers:
            router.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, router, args, kwargs, output):
        with torch.no_grad():
            logits = router.gating(args[0] if args else kwargs["input"]).reshape(-1, EXPERTS)
            native = torch.zeros_like(logits, dtype=torch.bool).scatter(1, logits.topk(TOPK, dim=-1).indices, True)
        used = output[1].detach().clone()
        self.calls.setdefault(self.phase, []).append((router.layer_number, used, native))
        if self.tamper and router.layer_number == TAMPERED_LAYER:
            return output[0], output[1].roll(1, dims=1)  # every row now names other experts than it was given


def _engine_body(rank: int, world: int, tmp: str, port: int, tp: int, ep: int, model_dir: str) -> dict:
    os.environ.update(
        VERL_PLATFORM="cpu", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1"
    )
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    import torch.distributed as dist

    from verl_stable.cpu import runtime as cpu_runtime

    cpu_runtime.register()
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", world), rank=rank, world_size=world)
    from tensordict import TensorDict
    from verl.trainer.config.config import CheckpointConfig
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric import Metric
    from verl.workers.config import EngineRouterReplayConfig, HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.utils.padding import left_right_2_no_padding

    from verl_stable.cpu.megatron.options import TRANSFORMER_CONFIG
    from verl_stable.integration import megatron_replay, plugin

    if rank == 0 and not os.path.exists(f"{model_dir}/config.json"):
        from verl_stable.toy.assets import AssetSpec, build_model, build_tokenizer

        build_model(model_dir, AssetSpec(), build_tokenizer(model_dir))
    dist.barrier()
    engine_config = McoreEngineConfig(
        strategy="megatron",
        vanilla_mbridge=True,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1 if ep > 1 else None,
        sequence_parallel=tp > 1,
        dtype="bfloat16",
        override_transformer_config=dict(TRANSFORMER_CONFIG),  # the CPU runtime's settings (local spec, ...)
        router_replay=EngineRouterReplayConfig(mode="R3"),
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=MICRO_BATCH,
    )
    engine = EngineRegistry.new(
        "language_model",
        "megatron",
        model_config=HFModelConfig(path=model_dir),
        engine_config=engine_config,
        optimizer_config=McoreOptimizerConfig(lr=1e-2, total_training_steps=10),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    probe = RouterProbe(engine)
    data = padded_batch()

    def batch(routes: torch.Tensor | None, replay: bool = True) -> TensorDict:
        fields = {k: v.clone() for k, v in data.items() if k != "routes"}
        if routes is not None and routes.is_nested:
            td = left_right_2_no_padding(TensorDict(fields, batch_size=[len(PROMPT_LENS)]))
            td["routed_experts"] = torch.nested.nested_tensor_from_jagged(routes.values(), td["input_ids"].offsets())
        else:
            if routes is not None:
                fields["routed_experts"] = routes
            td = left_right_2_no_padding(TensorDict(fields, batch_size=[len(PROMPT_LENS)]))
        tu.assign_non_tensor(
            td,
            use_remove_padding=True,
            temperature=1.0,
            use_dynamic_bsz=False,
            micro_batch_size_per_gpu=MICRO_BATCH,
            enable_routing_replay=replay,
        )
        return td

    def loss_fn(model_output, data, dp_group=None):
        return -model_output["log_probs"].values().float().mean(), {}

    def plain(metrics: dict) -> dict:
        return {
            k: (v.aggregation.value, list(v.values))
            for k, v in metrics.items()
            if isinstance(v, Metric) and k.startswith("stable/")
        }

    def forward(phase: str, td: TensorDict) -> dict:
        probe.phase = phase
        with engine.eval_mode():
            return engine.forward_backward_batch(td, loss_function=loss_fn, forward_only=True)

    def update(phase: str, td: TensorDict) -> tuple[dict, list[str]]:
        before = {n: p.detach().clone() for n, p in engine.module[0].named_parameters()}
        probe.phase = phase
        with engine.train_mode():
            out = engine.train_batch(td, loss_function=loss_fn)
        after = dict(engine.module[0].named_parameters())
        return out, [n for n, p in before.items() if not torch.equal(p, after[n].detach())]

    report_: dict = {"rank": rank, "metrics": {}, "params": [n for n, _ in engine.module[0].named_parameters()]}
    report_["mro"] = [f"{k.__module__}.{k.__qualname__}" for k in type(engine).__mro__]
    registry = EngineRegistry._engines["language_model"]["megatron"]
    report_["cuda_engine"] = {
        f"{k[0]}:{k[1]}": v is megatron_replay.engine_class() for k, v in registry.items() if isinstance(k, tuple)
    }
    status = plugin.STATUS["megatron_replay_metrics"]
    report_["plugin_step"] = (status.ok, status.registered)

    report_["metrics"]["r3_forward"] = plain(forward("r3_forward", batch(data["routes"]))["metrics"])
    out, report_["r3_changed"] = update("r3_update", batch(data["routes"]))
    report_["metrics"]["r3_update"] = plain(out["metrics"])
    report_["metrics"]["r3_shifted"] = plain(forward("r3_shifted", batch(shifted(data["routes"])))["metrics"])
    report_["metrics"]["r3_holes"] = plain(forward("r3_holes", batch(with_holes(data["routes"])))["metrics"])
    probe.tamper = True
    report_["metrics"]["tampered"] = plain(forward("tampered", batch(data["routes"]))["metrics"])
    probe.tamper = False

    # verl reads router_replay.mode on every call: switching it turns this engine into an R2 actor with the same
    # weights (a second engine would re-register verl's process-global RouterReplay instances)
    object.__setattr__(engine.engine_config.router_replay, "mode", "R2")
    out = forward("r2_record", batch(None))
    recorded = out["model_output"]["routed_experts"]
    report_["recorded"] = [r.clone() for r in recorded.unbind()]
    report_["metrics"]["r2_record"] = plain(out["metrics"])
    gen = torch.Generator().manual_seed(11)  # the same perturbation on every rank (the routers are replicated)
    with torch.no_grad():
        for router in probe.routers:
            router.weight.add_(torch.randn(router.weight.shape, generator=gen).to(router.weight.dtype))
    forward("r2_native", batch(None, replay=False))
    out, report_["r2_changed"] = update("r2_update", batch(recorded))
    report_["metrics"]["r2_update"] = plain(out["metrics"])
    report_["calls"] = probe.calls
    dist.destroy_process_group()
    return report_


def _engine_rank(rank: int, world: int, tmp: str, port: int, tp: int, ep: int, model_dir: str, results) -> None:
    body = lambda: _engine_body(rank, world, tmp, port, tp, ep, model_dir)  # noqa: E731
    report(results, {"rank": rank}, body, f"{tmp}/rank{rank}.pt")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """Where the first layout's rank 0 writes the toy model (tokenizer and weights); later layouts reuse it."""
    return str(tmp_path_factory.mktemp("megatron_model"))


def _run_layout(model_dir: str, world: int, tp: int, ep: int) -> list[dict]:
    tmp = tempfile.mkdtemp(prefix=f"megatron_tp{tp}_ep{ep}_")
    port = _free_port()
    args = [(rank, world, tmp, port, tp, ep, model_dir) for rank in range(world)]
    # ~15 s per layout on two idle cores; the margin is for a machine shared with the rest of the suite
    spawn_and_collect(_engine_rank, args, timeout=600, what="megatron engine rank")
    return [torch.load(f"{tmp}/rank{rank}.pt", weights_only=False) for rank in range(world)]


# name: (world size, tensor parallel, expert parallel). tp2: sequence parallel, each rank routes half of the rows;
# ep2: data parallel 2 (each rank given the whole batch here), experts split over the ranks.
LAYOUTS = {"world1": (1, 1, 1), "tp2": (2, 2, 1), "ep2": (2, 1, 2)}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request, model_dir) -> tuple[int, list[dict]]:
    world, tp, ep = LAYOUTS[request.param]
    return tp, _run_layout(model_dir, world, tp, ep)


def router_maps(ranks: list[dict], tp: int, phase: str, which: int) -> list[list[dict[int, torch.Tensor]]]:
    """The ``[rows, experts]`` maps (``which``: 1 used, 2 native) of a phase, per view, micro-batch and layer number.

    Under tensor (sequence) parallelism the ranks route consecutive slices of the same rows: one view, their slices
    concatenated in rank order. Otherwise every rank routes all rows of its batch: one view per rank.
    """
    per_rank = []
    for r in ranks:
        calls = r["calls"][phase]
        assert len(calls) == len(micro_batches()) * NUM_LAYERS, f"{len(calls)} router calls in {phase}"
        per_rank.append(calls)
    groups = [per_rank] if tp > 1 else [[calls] for calls in per_rank]
    views = []
    for group in groups:
        view = []
        for m in range(len(micro_batches())):
            layer_maps = {}
            for i in range(NUM_LAYERS):
                parts = [calls[m * NUM_LAYERS + i] for calls in group]
                layer_maps[parts[0][0]] = torch.cat([p[which] for p in parts])
            view.append(layer_maps)
        views.append(view)
    return views


def _check_replayed(ranks, tp, phase, routes, replayed: Callable[[int, int], bool], native_elsewhere: bool) -> None:
    """Replayed rows used exactly ``routes`` (per sample, token order); other token rows the router's own choice."""
    differs_from_native = total = 0
    for used, native in zip(router_maps(ranks, tp, phase, 1), router_maps(ranks, tp, phase, 2), strict=True):
        for m, rows in enumerate(packed_rows(tp)):
            assert used[m][1].shape[0] == len(rows)
            for layer in range(1, NUM_LAYERS + 1):
                for r, where in enumerate(rows):
                    if where is None:
                        continue
                    s, j = where
                    if replayed(s, j):
                        expected = multi_hot(routes[s][j, layer - 1])
                        assert torch.equal(used[m][layer][r], expected), (phase, m, layer, where)
                        differs_from_native += int(not torch.equal(native[m][layer][r], expected))
                        total += 1
                    elif native_elsewhere:
                        assert torch.equal(used[m][layer][r], native[m][layer][r]), (phase, m, layer, where)
    # the given routes are not what the router would choose anyway: the replay decided the experts
    assert differs_from_native > total * 0.8, f"{differs_from_native} of {total} rows"


def _metric(ranks: list[dict], phase: str, name: str) -> tuple[str, list[float]]:
    values = {str(r["metrics"][phase][name]) for r in ranks}
    assert len(values) == 1, f"ranks report different {name}: {values}"
    return ranks[0]["metrics"][phase][name]


def _check_metrics(
    ranks,
    tp,
    phase,
    replayed: Callable[[int, int], bool],
    pads_replayed: bool,
    compared: Callable[[int, int], bool] | None = None,
) -> None:
    """Zero disagreement, replayed-row and coverage counts per micro-batch, all counted from the lengths here.

    ``replayed``: the token rows that took a routing from the batch (coverage); ``compared``: the token rows verl
    replayed at all (default: the same). The coverage counts are sums over data-parallel ranks (verl averages a SUM
    metric over them): every rank here was given the whole batch, so the sum is the data-parallel size times one
    batch's counts.
    """
    compared_rule = compared or replayed
    n = len(micro_batches())
    dp = len(ranks) // tp
    for name in ("disagreement", *(f"disagreement/layer_{i}" for i in range(NUM_LAYERS))):
        assert _metric(ranks, phase, ROUTING + name) == ("mean", [0.0] * n)
    assert _metric(ranks, phase, ROUTING + "disagreement/layer_max") == ("max", [0.0] * n)
    compared_rows = []
    coverage = {name: [] for name in COVERAGE_COUNTS}
    for samples in micro_batches():
        rows = sum(int(compared_rule(s, j)) for s in samples for j in range(lengths()[s]))
        rows += sum((-lengths()[s]) % tp for s in samples) if pads_replayed else 0
        compared_rows.append(float(rows * NUM_LAYERS))
        for name, value in expected_coverage(samples, tp, replayed).items():
            coverage[name].append(value * dp)
    assert _metric(ranks, phase, ROUTING + "compared_rows") == ("mean", compared_rows)
    assert _metric(ranks, phase, ROUTING + "replayed_rows") == ("mean", compared_rows)
    for name in COVERAGE_COUNTS:
        assert _metric(ranks, phase, f"{COVERAGE}/{name}") == ("sum", coverage[name]), name


def test_the_engine_verl_builds_is_the_cpu_engine_on_the_metrics_mixin(layout):
    _, ranks = layout
    mro = ranks[0]["mro"]
    # verl looks up the ("cpu", "cpu") key the plugin step fills before the plain "cpu" key of the CPU runtime
    assert mro[0] == "verl_stable.cpu.megatron.engine.CpuMegatronEngineWithLMHeadReplay"
    assert mro[1:4] == [
        "verl_stable.integration.megatron_replay.MegatronEngineWithLMHeadReplay",
        "verl_stable.integration.megatron_replay.MegatronReplayMetricsMixin",
        "verl.workers.engine.megatron.transformer_impl.MegatronEngineWithLMHead",
    ]
    # the plugin step selected the mixin class for the cuda vendors; verl's own class stays the device-only "cuda" one
    # cuda keys: the metrics class itself; the ("cpu", "cpu") key: that class under the CPU runtime (its subclass)
    assert ranks[0]["cuda_engine"] == {"cuda:nvidia": True, "cuda:amd": True, "cpu:cpu": False}
    ok, registered = ranks[0]["plugin_step"]
    assert ok and registered == [
        "engine:language_model/megatron/cuda:nvidia",
        "engine:language_model/megatron/cuda:amd",
        "engine:language_model/megatron/cpu:cpu",
    ]


def test_r3_forward_and_update_use_the_given_routes_and_keep_each_final_row_native(layout):
    tp, ranks = layout
    routes = token_routes(padded_batch()["routes"])
    for phase in ("r3_forward", "r3_update"):
        _check_replayed(ranks, tp, phase, routes, replayed_under_r3, native_elsewhere=True)
        _check_metrics(ranks, tp, phase, replayed_under_r3, pads_replayed=False)
    # the final row of every sequence is not replayed (checked native above): one row per sample
    assert sum(1 for s in range(len(PROMPT_LENS)) for j in range(lengths()[s]) if not replayed_under_r3(s, j)) == 4


def test_a_route_shifted_within_its_sequence_is_followed_and_caught(layout):
    tp, ranks = layout
    given = padded_batch()["routes"]
    # the used experts follow the misaligned routes (verl replays what it is given, so its targets match) ...
    _check_replayed(ranks, tp, "r3_shifted", token_routes(shifted(given)), replayed_under_r3, native_elsewhere=True)
    assert _metric(ranks, "r3_shifted", ROUTING + "disagreement") == ("mean", [0.0, 0.0])
    # ... and the comparison against the aligned routes catches the shift
    with pytest.raises(AssertionError):
        _check_replayed(ranks, tp, "r3_shifted", token_routes(given), replayed_under_r3, native_elsewhere=True)


def test_rows_the_rollout_did_not_route_are_replayed_as_expert_0_and_counted_as_fallback(layout):
    tp, ranks = layout
    routes = token_routes(with_holes(padded_batch()["routes"]))
    # verl replays a zero row as it is: the token goes to expert 0 alone (the set of its top-k ids)
    _check_replayed(ranks, tp, "r3_holes", routes, replayed_under_r3, native_elsewhere=True)
    # so nothing disagrees with the targets, but the coverage counts those rows as not replayed
    covered = lambda s, j: replayed_under_r3(s, j) and (s, j) not in HOLES  # noqa: E731
    _check_metrics(ranks, tp, "r3_holes", covered, pads_replayed=False, compared=replayed_under_r3)
    fallback = [
        _metric(ranks, "r3_holes", f"{COVERAGE}/{kind}_rows")[1][0]
        - _metric(ranks, "r3_holes", f"{COVERAGE}/{kind}_replayed_rows")[1][0]
        for kind in ("prompt", "response")
    ]
    assert fallback == [NUM_LAYERS * len(ranks) // tp] * 2  # one token each, in every MoE layer (and dp rank)


def test_disagreement_reports_a_router_whose_used_experts_are_not_its_targets(layout):
    _, ranks = layout
    expected = [0.0] * NUM_LAYERS
    expected[TAMPERED_LAYER - 1] = 1.0  # every replayed row of that layer dispatched to other experts
    for i, value in enumerate(expected):
        assert _metric(ranks, "tampered", f"{ROUTING}disagreement/layer_{i}") == ("mean", [value, value])
    assert _metric(ranks, "tampered", ROUTING + "disagreement/layer_max") == ("max", [1.0, 1.0])
    assert _metric(ranks, "tampered", ROUTING + "disagreement") == ("mean", [0.25, 0.25])  # same rows in every layer


def test_the_optimizer_step_changes_the_weights(layout):
    _, ranks = layout
    for r in ranks:
        routers = {n for n in r["params"] if n.endswith("router.weight")}
        assert len(routers) == NUM_LAYERS
        # R3 update: every router and most other parameters moved
        assert routers <= set(r["r3_changed"])
        assert len(r["r3_changed"]) > len(r["params"]) // 2
        # R2 update (the routers were perturbed by hand before it, so only the other parameters show the step)
        assert len(set(r["r2_changed"]) - routers) > (len(r["params"]) - NUM_LAYERS) // 2


def test_r2_records_the_native_routing_and_replays_it_after_the_routers_changed(layout):
    tp, ranks = layout
    recorded = ranks[0]["recorded"]
    for r in ranks[1:]:
        assert all(torch.equal(a, b) for a, b in zip(recorded, r["recorded"], strict=True))
    assert [tuple(t.shape) for t in recorded] == [(n, NUM_LAYERS, TOPK) for n in lengths()]
    every_row = lambda s, j: True  # noqa: E731 - R2 replays every token row
    # record: what the hooks saw the routers use, which is the routers' own choice
    maps = zip(router_maps(ranks, tp, "r2_record", 1), router_maps(ranks, tp, "r2_record", 2), strict=True)
    for used, native in maps:
        for m, rows in enumerate(packed_rows(tp)):
            for layer in range(1, NUM_LAYERS + 1):
                for r, where in enumerate(rows):
                    if where is not None:
                        s, j = where
                        assert torch.equal(used[m][layer][r], multi_hot(recorded[s][j, layer - 1])), (m, layer, where)
                        assert torch.equal(used[m][layer][r], native[m][layer][r])
    assert ranks[0]["metrics"]["r2_record"] == {}  # nothing replayed, nothing measured
    # the perturbed routers would now choose otherwise on most rows ...
    changed = total = 0
    for perturbed in router_maps(ranks, tp, "r2_native", 1):
        for m, rows in enumerate(packed_rows(tp)):
            for layer in range(1, NUM_LAYERS + 1):
                for r, where in enumerate(rows):
                    if where is not None:
                        s, j = where
                        changed += int(not torch.equal(perturbed[m][layer][r], multi_hot(recorded[s][j, layer - 1])))
                        total += 1
    assert changed > total * 0.8, f"{changed} of {total}"
    # ... and the update replays exactly the recording
    _check_replayed(ranks, tp, "r2_update", recorded, every_row, native_elsewhere=False)
    _check_metrics(ranks, tp, "r2_update", every_row, pads_replayed=True)


def expected_router_disagreement(ranks, tp, phase, routes, replayed: Callable[[int, int], bool]) -> list[list[float]]:
    """Per micro-batch, ``[overall, layer_0, ...]``: the share of replayed token rows holding a routing (distinct ids)
    whose target is not the expert set the router chose itself (the probe's top-k of the router's own gate)."""
    views = []
    for native in router_maps(ranks, tp, phase, 2):
        per_micro_batch = []
        for m, rows in enumerate(packed_rows(tp)):
            compared, differ = [0] * NUM_LAYERS, [0] * NUM_LAYERS
            for layer in range(1, NUM_LAYERS + 1):
                for r, where in enumerate(rows):
                    if where is None or not replayed(*where):
                        continue
                    target = routes[where[0]][where[1], layer - 1]
                    if target.unique().numel() < TOPK:
                        continue  # a row the rollout did not route: nothing to compare
                    compared[layer - 1] += 1
                    differ[layer - 1] += int(not torch.equal(native[m][layer][r], multi_hot(target)))
            per_layer = [d / max(c, 1) for c, d in zip(compared, differ, strict=True)]
            per_micro_batch.append([sum(differ) / sum(compared), *per_layer])
        views.append(per_micro_batch)
    assert all(view == views[0] for view in views), "the data-parallel ranks routed the same batch differently"
    return views[0]


def test_router_disagreement_is_the_routers_own_choice_against_its_replay_targets(layout):
    tp, ranks = layout
    given = padded_batch()["routes"]
    for phase, routes in (
        ("r3_forward", token_routes(given)),
        ("r3_update", token_routes(given)),
        ("r3_holes", token_routes(with_holes(given))),
    ):
        expected = expected_router_disagreement(ranks, tp, phase, routes, replayed_under_r3)
        assert _metric(ranks, phase, ROUTING + "router_disagreement") == ("mean", [e[0] for e in expected]), phase
        # random targets: the router would have chosen otherwise on most rows (replay hides a large mismatch)
        assert min(e[0] for e in expected) > 0.8
        assert ROUTING + "r2_drift" not in ranks[0]["metrics"][phase]  # R3: no drift since pi_old to speak of
    # R2: the update replays pi_old's recording; the perturbed routers' own choice against it is the drift
    expected = expected_router_disagreement(ranks, tp, "r2_update", ranks[0]["recorded"], lambda s, j: True)
    overall = [e[0] for e in expected]
    assert _metric(ranks, "r2_update", ROUTING + "router_disagreement") == ("mean", overall)
    assert _metric(ranks, "r2_update", ROUTING + "r2_drift") == ("mean", overall)
    for i in range(NUM_LAYERS):
        assert _metric(ranks, "r2_update", f"{ROUTING}r2_drift/layer_{i}") == ("mean", [e[1 + i] for e in expected])
    assert min(overall) > 0.5
