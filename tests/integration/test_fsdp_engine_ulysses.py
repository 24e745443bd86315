"""The plugin's FSDP router replay under Ulysses sequence parallelism (sp=2), on two real gloo ranks on CPU.

Each rank is a spawned process that builds ``verl_stable.integration.fsdp_engine.engine_class()`` (verl's
``FSDPEngineWithLMHead`` + our mixin) through verl's real ``__init__`` / ``initialize`` (device mesh, Ulysses group)
with ``ulysses_sequence_parallel_size=2`` and ``use_remove_padding=True``; only FSDP wrapping is skipped (the module
is a tiny random Qwen3-MoE: layers 0 and 2 MoE, layer 1 dense, top-2 of 8 experts). verl pads the packed 21 tokens
to 22 and gives each rank 11 rows.

Attention under SP on CPU. verl's Ulysses attention is a patch of transformers' flash-attention entry
(``apply_monkey_patch`` replaces ``_flash_attention_forward`` with ``_ulysses_flash_attention_forward``: all-to-all
to full sequence / split heads, attention, all-to-all back); its ``sdpa`` path has no Ulysses support, so with plain
sdpa each rank would attend only inside its own slice. flash-attn does not run on CPU. The ranks therefore run
verl's real ``apply_monkey_patch`` and its real all-to-all, and only the kernel underneath (verl's reference to
transformers' ``_flash_attention_forward``) is replaced by a pure-torch varlen causal attention (block-diagonal by
``position_ids``, as flash-attn's varlen path does: the CPU runtime's ``verl_stable.cpu.attention.
varlen_causal_attention``). With that, SP log-probs are compared with a single-rank engine running transformers' own
``sdpa`` on the whole packed sequence (an independent attention implementation).

References: the experts every MoE block actually used, read by a pre-hook on its ``experts`` module (independent of
the routing library and of the engine's recorders); the rollout routing given to R3; a single-rank R3 forward; a
single-rank ``verl_stable.routing.capture`` of the natural routing for R2.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from testkit.moe import EXPERTS, MOE_LAYERS, NUM_LAYERS, TOPK, engine_model
from testkit.spawn import report, spawn_and_collect

from verl_stable.cpu.attention import varlen_causal_attention

LENGTHS = [5, 7, 3, 6]  # 21 packed tokens: one Ulysses pad row, 11 rows per rank
SP = 2
ATTN = "verl_stable_test_ulysses"  # the attention name the SP ranks register (flash-attention call convention)
KERNEL_CALLS: list[tuple[int, int]] = []  # (sequence length, heads) per kernel call, in a rank process


# ============================================================================================== rank side
def _rollout_routing(seed: int = 1) -> torch.Tensor:
    """``[21, num_hidden_layers, top_k]`` int16: distinct random experts in MoE layers, zeros in the dense layer."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.zeros(sum(LENGTHS), NUM_LAYERS, TOPK, dtype=torch.int16)
    for layer in MOE_LAYERS:
        rows[:, layer] = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(sum(LENGTHS))]).to(
            torch.int16
        )
    return rows


def _batch(routed: torch.Tensor | None):
    """verl's engine input: nested (padding removed) tensors, one micro-batch of all four samples."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    gen = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])

    def nested(values):
        return torch.nested.nested_tensor_from_jagged(values, offsets)

    fields = {
        "input_ids": nested(torch.randint(1, 64, (total,), generator=gen)),
        "position_ids": nested(torch.cat([torch.arange(n) for n in LENGTHS])),
        "loss_mask": nested(torch.ones(total, dtype=torch.int64)),
    }
    if routed is not None:
        fields["routed_experts"] = nested(routed)
    td = TensorDict(fields, batch_size=[len(LENGTHS)])
    tu.assign_non_tensor(
        td,
        use_remove_padding=True,
        temperature=1.0,
        pad_token_id=0,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=len(LENGTHS),
        return_model_output=True,
    )
    return td


def _recorded_kernel(query, *args, **kwargs):
    """The CPU runtime's varlen kernel, recording each call's (sequence length, heads)."""
    KERNEL_CALLS.append((query.shape[1], query.shape[2]))
    return varlen_causal_attention(query, *args, **kwargs)


def _flash_convention_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """An attention under transformers' flash_attention_forward convention ([B, H, S, D] in, [B, S, H, D] out) that
    calls ``flash_attention._flash_attention_forward`` as it stands at call time: verl's Ulysses patch of it."""
    from transformers.integrations import flash_attention

    out = flash_attention._flash_attention_forward(  # looked up per call: verl's patched function
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        attention_mask,
        query_length=query.shape[2],
        is_causal=True,
        softmax_scale=scaling,
        position_ids=kwargs.get("position_ids"),
    )
    return out, None


def _install_ulysses_attention(model) -> None:
    """verl's Ulysses patch as ``_build_model_optimizer`` applies it, over a CPU kernel, selected on ``model``."""
    from transformers import AttentionInterface
    from transformers.integrations import flash_attention
    from verl.models.transformers import monkey_patch

    monkey_patch.apply_monkey_patch(model=model, ulysses_sp_size=SP, use_remove_padding=True)
    assert flash_attention._flash_attention_forward is monkey_patch._ulysses_flash_attention_forward
    monkey_patch._flash_attention_forward = _recorded_kernel  # the kernel under verl's all-to-all
    AttentionInterface.register(ATTN, _flash_convention_attention)


class _UsedExperts:
    """The expert ids each MoE block's ``experts`` module received, per forward (rows of this rank)."""

    def __init__(self, model) -> None:
        self.ids: dict[int, list[torch.Tensor]] = {layer: [] for layer in MOE_LAYERS}
        self._handles = [
            model.model.layers[layer].mlp.experts.register_forward_pre_hook(
                lambda _m, args, layer=layer: self.ids[layer].append(args[1].detach().clone())
            )
            for layer in MOE_LAYERS
        ]

    def last(self) -> torch.Tensor:
        """``[rows, moe_layers, top_k]`` of the last forward, each row's ids sorted."""
        return torch.stack([self.ids[layer][-1] for layer in MOE_LAYERS], dim=1).sort(dim=-1).values

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _rank_body(rank: int, tmp: str) -> dict:
    import torch.distributed as dist
    from verl.plugin.platform import platform_manager

    from verl_stable.cpu.platform import platform_class

    platform_manager._current_platform = platform_class()()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", SP), rank=rank, world_size=SP)

    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import EngineRouterReplayConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

    from verl_stable.integration import fsdp_engine as fe
    from verl_stable.routing import capture

    model = engine_model()
    model.save_pretrained(f"{tmp}/model{rank}")
    model_config = HFModelConfig(path=f"{tmp}/model{rank}", load_tokenizer=False, use_remove_padding=True)
    _install_ulysses_attention(model)
    cls = fe.engine_class()

    def engine(mode: str, sp: int):
        config = FSDPEngineConfig(
            router_replay=EngineRouterReplayConfig(mode=mode),
            ulysses_sequence_parallel_size=sp,
            use_torch_compile=False,
        )
        eng = cls(model_config, config, FSDPOptimizerConfig(lr=1e-3), CheckpointConfig())

        def build_without_fsdp():  # FSDP sharding is out of scope here; the module is the HF model itself
            eng.module, eng.optimizer, eng.lr_scheduler = model, None, None

        eng._build_model_optimizer = build_without_fsdp
        eng._autocast_dtype = torch.float32
        eng.initialize()
        return eng

    def run(eng, data):
        with eng.eval_mode():  # sets verl's Ulysses group for the forward, as the worker does
            out = eng.forward_backward_batch(data, loss_function=None, forward_only=True)
        return out["model_output"], out["metrics"]

    routing = _rollout_routing()
    used = _UsedExperts(model)
    out: dict = {"rank": rank}

    # Ulysses sp=2: every rank sees its 11 rows; verl gathers the outputs back over the SP group.
    model.set_attn_implementation(ATTN)
    r3 = engine("R3", SP)
    out["sp_engine"] = {
        "use_ulysses_sp": r3.use_ulysses_sp,
        "sp_rank": r3._sp_rank(),
        "use_rmpad": r3.use_remove_padding,
    }
    KERNEL_CALLS.clear()
    r3_out, r3_metrics = run(r3, _batch(routing))
    out["kernel_calls"] = list(KERNEL_CALLS)
    out["r3_used"] = used.last()
    out["r3_log_probs"] = r3_out["log_probs"].values()
    out["r3_disagreement"] = r3_metrics[fe.METRIC_PREFIX + "disagreement"].values
    out["r3_padding_rows"] = r3_metrics[fe.METRIC_PREFIX + "padding_rows"].values
    r2_out, _ = run(engine("R2", SP), _batch(None))
    out["r2_used"] = used.last()
    out["r2_recorded"] = r2_out["routed_experts"].values()
    out["r2_recorded_offsets"] = r2_out["routed_experts"].offsets()
    out["r2_log_probs"] = r2_out["log_probs"].values()

    # Plain sdpa under SP: verl has no Ulysses path for it, each rank attends inside its own slice only.
    model.set_attn_implementation("sdpa")
    local, _ = run(r3, _batch(routing))
    out["r3_log_probs_sdpa_sp"] = local["log_probs"].values()

    # Single rank (sp=1, the whole packed sequence on each rank) with transformers' own sdpa.
    one_r3, _ = run(engine("R3", 1), _batch(routing))
    out["single_r3_used"] = used.last()
    out["single_r3_log_probs"] = one_r3["log_probs"].values()
    plain = engine("disabled", 1)
    with capture(model, use_attention_mask=False) as rec:
        natural, _ = run(plain, _batch(None))
    out["single_capture"] = rec.trace.to_tensor()
    out["single_natural_log_probs"] = natural["log_probs"].values()
    used.remove()
    dist.destroy_process_group()
    return out


def _rank(rank: int, tmp: str, results) -> None:
    report(results, {"rank": rank}, lambda: _rank_body(rank, tmp), f"{tmp}/rank{rank}.pt")


# ============================================================================================== test side
@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """Both ranks' results (spawned processes, gloo over a file store), ordered by rank."""
    tmp = tempfile.mkdtemp(prefix="ulysses_")
    spawn_and_collect(_rank, [(rank, tmp) for rank in range(SP)], timeout=180, what="rank")
    return [torch.load(f"{tmp}/rank{rank}.pt") for rank in range(SP)]


def _gathered(ranks: list[dict], key: str) -> torch.Tensor:
    """Rank slices concatenated in SP order (verl's Ulysses slice is contiguous), Ulysses pad row dropped."""
    return torch.cat([r[key] for r in ranks])[: sum(LENGTHS)]


def test_ranks_run_verls_ulysses_layout_with_the_plugin_engine(ranks):
    assert [r["sp_engine"] for r in ranks] == [
        {"use_ulysses_sp": True, "sp_rank": rank, "use_rmpad": True} for rank in range(SP)
    ]
    assert [r["r3_used"].shape[0] for r in ranks] == [11, 11]  # 21 tokens + 1 Ulysses pad row, split over 2
    assert [r["single_r3_used"].shape[0] for r in ranks] == [21, 21]
    # verl's all-to-all ran: the kernel saw the whole padded sequence (22) with 1 of the 2 heads, once per layer
    assert [r["kernel_calls"] for r in ranks] == [[(22, 1)] * NUM_LAYERS] * SP


def test_r3_replays_exactly_the_rollout_routing_across_both_ranks(ranks):
    rollout = _rollout_routing()[:, list(MOE_LAYERS)].long().sort(dim=-1).values
    assert torch.equal(_gathered(ranks, "r3_used"), rollout)
    assert [r["r3_disagreement"] for r in ranks] == [[0.0], [0.0]]
    # the pad row (rank 1's last) has no routing data: counted as padding on that rank only
    assert [r["r3_padding_rows"] for r in ranks] == [[0.0], [float(len(MOE_LAYERS))]]


def test_r3_log_probs_under_ulysses_match_a_single_rank_r3_forward(ranks):
    single = ranks[0]["single_r3_log_probs"]
    assert single.shape == (sum(LENGTHS),)
    for r in ranks:
        # verl all-gathers and unpads the log-probs: every SP rank holds the whole micro-batch
        torch.testing.assert_close(r["r3_log_probs"], single, rtol=0, atol=1e-5)
    # replay is visible in the output (this comparison could not pass with routing ignored)
    assert (single - ranks[0]["single_natural_log_probs"]).abs().max() > 1e-3
    # and the attention path matters: verl's plain sdpa under SP (slice-local attention) is not the same function
    assert (ranks[0]["r3_log_probs_sdpa_sp"] - single).abs().max() > 1e-3


def test_r2_recorded_routing_is_gathered_unpadded_and_equals_a_single_rank_capture(ranks):
    reference = ranks[0]["single_capture"].sort(dim=-1).values  # [21, moe_layers, top_k], natural routing
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    for r in ranks:
        recorded = r["r2_recorded"]
        assert recorded.dtype == torch.int16 and recorded.shape == (sum(LENGTHS), NUM_LAYERS, TOPK)
        assert torch.equal(r["r2_recorded_offsets"], offsets)
        assert not recorded[:, 1].any(), "the dense decoder layer holds zero rows"
        assert torch.equal(recorded[:, list(MOE_LAYERS)].long().sort(dim=-1).values, reference)
        torch.testing.assert_close(r["r2_log_probs"], ranks[0]["single_natural_log_probs"], rtol=0, atol=1e-5)
    # what the ranks' experts received, stitched together, is the same routing
    assert torch.equal(_gathered(ranks, "r2_used"), reference)
