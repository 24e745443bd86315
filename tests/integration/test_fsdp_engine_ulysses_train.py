"""Training under Ulysses sequence parallelism with R3 and R2 replay: the gradients and the optimizer step of the
plugin's FSDP engine at sp=2 and at dp=2 x sp=2 equal a single rank's (sp=1).

Seven spawned processes on CPU, three worlds (gloo over a file store each): two ranks of one sp=2 group; four ranks
of dp=2 x sp=2 (each dp pair gets two of the four samples, verl's contiguous dispatch); one rank alone (sp=1, the
reference). Each builds ``verl_stable.integration.fsdp_engine.engine_class()`` (verl's ``FSDPEngineWithLMHead`` +
our mixin) through verl's real ``initialize``: the model loaded from disk, verl's ``apply_monkey_patch`` (Ulysses),
FSDP2 over all ranks of its world (fp32 mixed-precision policy), verl's default gradient checkpointing, the optimizer
built by verl from its config (SGD, so that one step is ``p - lr * g`` and float noise in ``g`` stays float noise in
``p``). Every update is verl's own path: ``optimizer_zero_grad``, ``forward_backward_batch`` with a loss function
(micro-batches of two packed samples; at sp=2 two of them, gradient accumulation with FSDP's deferred gradient sync),
``optimizer_step`` (clip, step). The loss is ``-sum_t A_t log p_t / batch_num_tokens * dp_size``, verl's
normalisation, with fixed per-token advantages ``A``.

Under Ulysses each sp rank computes the loss on the log-probs gathered over its group; verl's ``Gather`` scales the
gradient of its own slice by the group size and FSDP averages the gradients over all ranks, so the result is the
full-batch gradient. Attention: the sp ranks run verl's real Ulysses all-to-all around a pure-torch varlen kernel
(``verl_stable.cpu.attention.varlen_causal_attention``; flash-attn does not run on CPU); the reference runs
transformers' own ``sdpa`` on the whole packed sequence, an independent attention implementation.

* R3: one update on the rollout's routing (random experts, so the gradient can only match if every rank replayed
  its slice of the routing in every micro-batch, forward and checkpoint recompute); the reference also computes the
  gradient without replay, which must differ.
* R2 at N = 2: ``compute_log_prob`` records pi_old's routing (gathered over the sp group), then two update
  mini-steps replay it; the second runs after an optimizer step large enough that the live router has drifted
  (``r2_drift > 0``), so replay changes the routing there.

Compared: gradients (full tensors of FSDP's sharded gradients), grad norms, and the parameters after each step; the
experts every MoE block received (a pre-hook on its ``experts`` module, independent of the routing library).
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from test_fsdp_engine_ulysses import (
    LENGTHS,
    MOE_LAYERS,
    SP,
    _flash_convention_attention,
    _rollout_routing,
    _UsedExperts,
)
from testkit.moe import engine_model
from testkit.spawn import report, spawn_and_collect

from verl_stable.cpu.attention import varlen_causal_attention

# seven processes that each import verl and build its engine three times: minutes on two cores, so scheduled with the
# end-to-end files (tests/conftest.py) and left out by ``-m "not e2e"``
pytestmark = pytest.mark.e2e

ATTN = "verl_stable_test_ulysses_train"
LR = 0.02  # SGD: one step moves the routers of the tiny random model enough for an R2 drift of ~25 % in mini-step 2
MICRO_BATCH = 2  # two micro-batches of the 4 samples: 12 packed tokens (6 per sp rank), then 9 (+1 pad, 5 per rank)
# name: (world size, ulysses size, attention); dp = world size / ulysses size
GROUPS = {"sp2": (SP, SP, ATTN), "dp2sp2": (2 * SP, SP, ATTN), "sp1": (1, 1, "sdpa")}


# ============================================================================================== rank side
def _register_attention() -> None:
    """An attention under transformers' flash-attention call convention, looked up per call: verl's Ulysses patch
    replaces ``flash_attention._flash_attention_forward`` and calls the kernel it references (set to the varlen one)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN, _flash_convention_attention)


def _advantages() -> torch.Tensor:
    """Fixed per-token advantages, zero at each sample's last position (its log-prob predicts nothing)."""
    gen = torch.Generator().manual_seed(2)
    adv = torch.randn(sum(LENGTHS), generator=gen)
    ends = torch.tensor(LENGTHS).cumsum(0) - 1
    adv[ends] = 0.0
    return adv


def _batch(routed: torch.Tensor | None, samples: range = range(len(LENGTHS))):
    """verl's engine input for ``samples`` (a data-parallel rank's shard): nested (padding removed) tensors."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    gen = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    per_token = {
        "input_ids": torch.randint(1, 64, (total,), generator=gen),
        "position_ids": torch.cat([torch.arange(n) for n in LENGTHS]),
        "loss_mask": torch.ones(total, dtype=torch.int64),
        "advantages": _advantages(),
    }
    if routed is not None:
        per_token["routed_experts"] = routed
    lengths = [LENGTHS[i] for i in samples]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    start, stop = sum(LENGTHS[: samples.start]), sum(LENGTHS[: samples.stop])
    fields = {k: torch.nested.nested_tensor_from_jagged(v[start:stop], offsets) for k, v in per_token.items()}
    td = TensorDict(fields, batch_size=[len(lengths)])
    tu.assign_non_tensor(
        td,
        use_remove_padding=True,
        temperature=1.0,
        pad_token_id=0,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=MICRO_BATCH,
        return_model_output=True,
    )
    return td


def _shard(dp_rank: int, dp: int) -> range:
    """The samples of a data-parallel rank (verl's dispatch: contiguous chunks)."""
    per = len(LENGTHS) // dp
    return range(dp_rank * per, (dp_rank + 1) * per)


def weighted_log_prob_loss(model_output, data, dp_group=None):
    """``-sum_t A_t log p_t / batch_num_tokens * dp_size`` over the micro-batch (verl's global-token normalisation)."""
    log_probs = model_output["log_probs"].values()
    adv = data["advantages"].values().to(log_probs.dtype)
    loss = -(adv * log_probs).sum() / data["batch_num_tokens"] * data["dp_size"]
    return loss, {}


def _process_body(name: str, rank: int, tmp: str) -> dict:
    import torch.distributed as dist
    from verl.plugin.platform import platform_manager

    from verl_stable.cpu.platform import platform_class

    world, sp, attn = GROUPS[name]
    platform_manager._current_platform = platform_class()()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store_{name}", world), rank=rank, world_size=world)

    from verl.models.transformers import monkey_patch
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import EngineRouterReplayConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

    from verl_stable.integration import fsdp_engine as fe

    _register_attention()
    model_config = HFModelConfig(
        path=f"{tmp}/model",
        load_tokenizer=False,
        use_remove_padding=True,
        override_config={"attn_implementation": attn},
    )
    cls = fe.engine_class()

    def engine(mode: str):
        config = FSDPEngineConfig(
            strategy="fsdp2",
            router_replay=EngineRouterReplayConfig(mode=mode),
            ulysses_sequence_parallel_size=sp,
            use_torch_compile=False,
            mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        )
        optim = FSDPOptimizerConfig(optimizer="SGD", lr=LR, weight_decay=0.0, clip_grad=1e9)
        eng = cls(model_config, config, optim, CheckpointConfig())
        eng.initialize()  # verl's: load, apply_monkey_patch, FSDP2, optimizer, lr scheduler
        monkey_patch._flash_attention_forward = varlen_causal_attention  # the kernel under verl's all-to-all
        return eng

    def full(tensors) -> dict[str, torch.Tensor]:
        """Full tensors of FSDP2's shards (a collective: every rank, same order)."""
        out = {}
        for key, value in tensors:
            if value is None:
                continue
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            out[key] = value.detach().clone()
        return out

    def update(eng, data) -> dict:
        """One update mini-step as verl's ``train_batch`` runs it, with the gradients read between backward and step."""
        with eng.train_mode():
            eng.optimizer_zero_grad()
            out = eng.forward_backward_batch(data, weighted_log_prob_loss, forward_only=False)
            grads = full((key, p.grad) for key, p in eng.module.named_parameters())
            grad_norm = eng.optimizer_step()
        params = full(eng.module.named_parameters())
        metrics = {k: v.values for k, v in out["metrics"].items() if k.startswith(fe.METRIC_PREFIX)}
        return {"grads": grads, "grad_norm": grad_norm, "params": params, "metrics": metrics}

    samples = _shard(rank // sp, world // sp)
    out: dict = {"name": name, "rank": rank, "samples": (samples.start, samples.stop)}
    # R3: one update on the rollout's routing
    r3 = engine("R3")
    out["sp_engine"] = {
        "use_ulysses_sp": r3.use_ulysses_sp,
        "sp_rank": r3._sp_rank(),
        "dp": r3.get_data_parallel_size(),
    }
    used = _UsedExperts(r3.module)
    out["r3"] = update(r3, _batch(_rollout_routing(), samples))
    out["r3_used"] = _calls(used)
    used.remove()
    del r3
    if name == "sp1":  # the same update without replay: the gradient replay must change
        out["natural"] = update(engine("disabled"), _batch(None))

    # R2 at N = 2: record pi_old's routing, then two update mini-steps replay it
    r2 = engine("R2")
    with r2.eval_mode():
        recorded = r2.forward_backward_batch(_batch(None, samples), loss_function=None, forward_only=True)
    recorded = recorded["model_output"]
    out["r2_recorded"] = recorded["routed_experts"].values()
    out["r2_old_log_probs"] = recorded["log_probs"].values()
    used = _UsedExperts(r2.module)
    # the recorded rows travel with their samples (placed in a full-batch tensor that _batch cuts the shard from)
    pi_old = torch.zeros(sum(LENGTHS), *out["r2_recorded"].shape[1:], dtype=out["r2_recorded"].dtype)
    pi_old[sum(LENGTHS[: samples.start]) : sum(LENGTHS[: samples.stop])] = out["r2_recorded"]
    out["r2"] = [update(r2, _batch(pi_old, samples)) for _ in range(2)]
    out["r2_used"] = _calls(used)
    used.remove()
    dist.destroy_process_group()
    return out


def _calls(used: _UsedExperts) -> list[torch.Tensor]:
    """``[rows, moe_layers, top_k]`` expert ids per call of the MoE blocks, in call order: with verl's default
    gradient checkpointing each micro-batch's forward is followed by its recompute in the backward."""
    calls = len(used.ids[MOE_LAYERS[0]])
    return [torch.stack([used.ids[layer][i] for layer in MOE_LAYERS], dim=1) for i in range(calls)]


def _process(name: str, rank: int, tmp: str, results) -> None:
    report(results, {"name": name, "rank": rank}, lambda: _process_body(name, rank, tmp), f"{tmp}/{name}_{rank}.pt")


# ============================================================================================== test side
@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    """``{"sp2": [2 ranks], "dp2sp2": [4 ranks], "sp1": [1 rank]}``: seven spawned processes, three worlds."""
    tmp = tempfile.mkdtemp(prefix="ulysses_train_")
    engine_model().save_pretrained(f"{tmp}/model")  # one set of weights, loaded by verl in every process
    args = [(name, rank, tmp) for name, (world, _, _) in GROUPS.items() for rank in range(world)]
    spawn_and_collect(_process, args, timeout=600, what="process")
    return {
        name: [torch.load(f"{tmp}/{name}_{rank}.pt") for rank in range(world)] for name, (world, _, _) in GROUPS.items()
    }


MICRO_BATCHES = ((0, 12), (12, 21))  # packed token rows of the two micro-batches
GRAD_ATOL = 1e-6  # float32 gradients of the same sums taken in another order (Ulysses slices, all-to-all, FSDP mean)


def _assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, atol: float) -> None:
    assert got.keys() == want.keys(), what
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=atol, msg=lambda m, k=key: f"{what} {k}: {m}")


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _stitched(runs: dict[str, list[dict]], key: str, call: int) -> torch.Tensor:
    """One MoE call's experts over the sp ranks (rank slices in order, the Ulysses pad row dropped), ids sorted."""
    start, stop = MICRO_BATCHES[(call // 2) % 2]
    return torch.cat([r[key][call] for r in runs["sp2"]])[: stop - start].sort(dim=-1).values


def _expected(routing: torch.Tensor, call: int) -> torch.Tensor:
    start, stop = MICRO_BATCHES[(call // 2) % 2]
    return routing[start:stop, list(MOE_LAYERS)].long().sort(dim=-1).values


LAYOUTS = ("sp2", "dp2sp2")


def test_the_processes_run_ulysses_sp2_dp2_sp2_and_a_single_rank(runs):
    assert [r["sp_engine"] for r in runs["sp2"]] == [{"use_ulysses_sp": True, "sp_rank": i, "dp": 1} for i in range(SP)]
    assert [r["sp_engine"] for r in runs["dp2sp2"]] == [
        {"use_ulysses_sp": True, "sp_rank": i % SP, "dp": 2} for i in range(2 * SP)
    ]
    assert runs["sp1"][0]["sp_engine"] == {"use_ulysses_sp": False, "sp_rank": 0, "dp": 1}
    # per micro-batch a forward and its gradient-checkpointing recompute, each routing only the rank's slice:
    # 12 packed rows, then 9 (+1 Ulysses pad), split over the two ranks
    assert [[u.shape[0] for u in r["r3_used"]] for r in runs["sp2"]] == [[6, 6, 5, 5]] * SP
    assert [u.shape[0] for u in runs["sp1"][0]["r3_used"]] == [12, 12, 9, 9]
    assert [len(r["r2_used"]) for r in (*runs["sp2"], runs["sp1"][0])] == [8, 8, 8]  # two mini-steps
    # dp=2 x sp=2: each dp pair holds one micro-batch of two samples, split over its two sp ranks
    assert [[u.shape[0] for u in r["r3_used"]] for r in runs["dp2sp2"]] == [[6, 6], [6, 6], [5, 5], [5, 5]]


def test_r3_update_under_ulysses_replays_the_rollout_routing_on_every_rank(runs):
    ref = runs["sp1"][0]
    rollout = _rollout_routing()
    for call in range(4):  # forward and recompute of both micro-batches, on both layouts
        assert torch.equal(_stitched(runs, "r3_used", call), _expected(rollout, call)), call
        assert torch.equal(ref["r3_used"][call].sort(dim=-1).values, _expected(rollout, call)), call
    for r in (*runs["sp2"], *runs["dp2sp2"], ref):
        assert set(r["r3"]["metrics"][fe_prefix("disagreement")]) == {0.0}
    # replay is in the gradient: the same update on the model's own routing is a different one
    assert _max_diff(ref["r3"]["grads"], ref["natural"]["grads"]) > 1e-3
    assert ref["r3"]["grad_norm"] > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_r3_update_under_ulysses_equals_the_single_rank_update(runs, layout):
    ref = runs["sp1"][0]
    print(
        f"{layout} R3 max |grad - grad(sp1)|:", [_max_diff(r["r3"]["grads"], ref["r3"]["grads"]) for r in runs[layout]]
    )
    for r in runs[layout]:
        # FSDP's averaged gradient over all ranks == the single rank's full-batch gradient
        _assert_same_tensors(r["r3"]["grads"], ref["r3"]["grads"], "R3 grad", atol=GRAD_ATOL)
        assert r["r3"]["grad_norm"] == pytest.approx(ref["r3"]["grad_norm"], rel=1e-5)
        _assert_same_tensors(r["r3"]["params"], ref["r3"]["params"], "R3 param after step", atol=LR * GRAD_ATOL)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_r2_records_under_ulysses_what_a_single_rank_records(runs, layout):
    ref = runs["sp1"][0]
    for r in runs[layout]:  # each rank: its dp shard's samples, gathered over its sp group, unpadded
        start, stop = (sum(LENGTHS[:i]) for i in r["samples"])
        assert torch.equal(r["r2_recorded"], ref["r2_recorded"][start:stop])
        torch.testing.assert_close(r["r2_old_log_probs"], ref["r2_old_log_probs"][start:stop], rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_r2_two_mini_steps_under_ulysses_equal_the_single_rank_updates(runs, layout):
    ref = runs["sp1"][0]
    for step in (0, 1):
        diffs = [_max_diff(r["r2"][step]["grads"], ref["r2"][step]["grads"]) for r in runs[layout]]
        print(f"{layout} R2 mini-step {step} max |grad - grad(sp1)|:", diffs)
        for r in runs[layout]:
            assert set(r["r2"][step]["metrics"][fe_prefix("disagreement")]) == {0.0}, step
            _assert_same_tensors(r["r2"][step]["grads"], ref["r2"][step]["grads"], f"R2 step {step} grad", GRAD_ATOL)
            assert r["r2"][step]["grad_norm"] == pytest.approx(ref["r2"][step]["grad_norm"], rel=1e-5)
            _assert_same_tensors(
                r["r2"][step]["params"], ref["r2"][step]["params"], f"R2 step {step} param", atol=LR * GRAD_ATOL
            )
    # mini-step 1 on pi_old's weights: no drift; mini-step 2 after the step: the live router moved
    for run in (*runs[layout], ref):
        assert set(run["r2"][0]["metrics"][fe_prefix("r2_drift")]) == {0.0}
    assert max(max(run["r2"][1]["metrics"][fe_prefix("r2_drift")]) for run in runs[layout]) > 0.0
    assert max(ref["r2"][1]["metrics"][fe_prefix("r2_drift")]) > 0.0


def test_r2_mini_steps_under_ulysses_replay_pi_olds_routing_on_every_rank(runs):
    ref = runs["sp1"][0]
    # every call of both mini-steps (forward and recompute, every micro-batch, every sp rank) used pi_old's experts,
    # also in mini-step 2, where the live router had drifted from them
    for call in range(8):
        assert torch.equal(_stitched(runs, "r2_used", call), _expected(ref["r2_recorded"], call)), call
        assert torch.equal(ref["r2_used"][call].sort(dim=-1).values, _expected(ref["r2_recorded"], call)), call


def fe_prefix(name: str) -> str:
    from verl_stable.routing.replay_pass import METRIC_PREFIX

    return METRIC_PREFIX + name
