"""mbridge on megatron's local spec: verl's ``vanilla_mbridge`` path builds, loads and exports a tiny Qwen3(-MoE).

References, all independent of the adapter: the Hugging Face checkpoint's own tensors (the round trip must give every
one back bit for bit, and each expert-parallel rank must hold exactly its experts), and the Hugging Face model's
logits on the same tokens (the Megatron model, fed through verl's own padded-batch and packed THD forwards, must
reproduce them). Models are built the way verl's Megatron engine builds them: ``AutoBridge.from_config`` from
``verl.models.mcore.mbridge``, ``set_extra_args``, ``verl.utils.megatron_utils.make_megatron_module``,
``bridge.load_weights`` / ``bridge.export_weights``.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("mbridge")
pytest.importorskip("megatron.core")

from safetensors.torch import load_file  # noqa: E402
from testkit.megatron import parallel_state  # noqa: E402
from testkit.spawn import report, spawn_and_collect  # noqa: E402

from verl_stable.cpu.megatron import bridge as B  # noqa: E402
from verl_stable.cpu.megatron.runtime import megatron_cpu_runtime  # noqa: E402

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)
TINY_MOE = dict(TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)

# Passed as verl's override_transformer_config would be: CPU initialization, and no TE / apex / CUDA fused kernels.
CPU_OVERRIDES = dict(
    use_cpu_initialization=True,
    attention_backend="local",
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
    gradient_accumulation_fusion=False,
    apply_rope_fusion=False,
)

# Megatron vs Hugging Face logits, both fp32. Measured max |difference| 0.8e-6 .. 1.5e-6 on logits of magnitude up
# to ~3.2 (an fp32 ulp there is 2.4e-7): the two sum the same products in different orders (fused QKV and SwiGLU
# matmuls, torch.nn.RMSNorm vs Hugging Face's manual RMSNorm, expert outputs combined by scatter-add vs index_add).
# 1e-5 leaves ~7x margin; a wrong weight layout or routing convention is off by 0.1 .. 1 (see the routing test).
LOGITS_ATOL = 1e-5

# name -> (transformers config class, model class, config kwargs, dtype)
CHECKPOINTS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(TINY_MOE, norm_topk_prob=True), torch.float32),
    "qwen3_moe_unnormalized": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(TINY_MOE, norm_topk_prob=False),
        torch.float32,
    ),
    "qwen3_moe_bf16": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(TINY_MOE, norm_topk_prob=True), torch.bfloat16),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", TINY, torch.float32),
}


def write_checkpoint(path: Path, kind: str, seed: int = 0) -> Path:
    """A tiny Hugging Face checkpoint of ``kind`` with every tensor random and distinct (norms too: 1 + noise)."""
    import transformers

    config_cls, model_cls, kwargs, dtype = CHECKPOINTS[kind]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1)
    model.to(dtype).save_pretrained(path)
    return path


def hf_logits(path: Path, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    """The Hugging Face model's logits, one sequence at a time (no padding, no packing)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(s.unsqueeze(0)).logits[0] for s in sequences]


def token_sequences(lengths: tuple[int, ...] = (5, 12, 9), seed: int = 1) -> list[torch.Tensor]:
    """Random token sequences of different lengths (packing and padding both have something to do)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY["vocab_size"], (n,), generator=gen) for n in lengths]


def build(path: Path, dtype: torch.dtype = torch.float32, **extra_args):
    """A local-spec bridge and its model for the checkpoint at ``path``, built as verl's Megatron engine does (bf16:
    wrapped in megatron's ``Float16Module``)."""
    from transformers import AutoConfig
    from verl.models.mcore.mbridge import AutoBridge
    from verl.utils.megatron_utils import McoreModuleWrapperConfig, make_megatron_module

    hf_config = AutoConfig.from_pretrained(path)
    with B.local_spec_bridges():
        bridge = AutoBridge.from_config(hf_config, dtype=dtype)
    bridge.set_extra_args(**CPU_OVERRIDES, **extra_args)
    model, _ = make_megatron_module(
        McoreModuleWrapperConfig(wrap_with_ddp=False), tf_config=bridge.config, hf_config=hf_config, bridge=bridge
    )
    return bridge, model


def export(bridge, model) -> dict[str, torch.Tensor]:
    """mbridge's export as a Hugging Face state dict (copies: the generator may hand out views of parameters)."""
    return {name: tensor.detach().clone() for name, tensor in bridge.export_weights(model)}


def megatron_logits(model, sequences: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """Logits per sequence from verl's two forward layouts: right-padded BSHD (causal mask) and packed THD."""
    from verl.models.mcore.model_forward import gptmodel_forward_model_engine

    module = model[0].eval()
    longest = max(len(s) for s in sequences)
    padded = torch.zeros(len(sequences), longest, dtype=torch.long)
    for row, s in enumerate(sequences):
        padded[row, : len(s)] = s
    positions = torch.arange(longest).expand(len(sequences), -1)
    with torch.no_grad():
        bshd = module(input_ids=padded, position_ids=positions, attention_mask=None)
        nested = torch.nested.nested_tensor(sequences, layout=torch.jagged)
        thd = gptmodel_forward_model_engine(module, nested, multi_modal_inputs={}, data_format="thd")
    return {
        "bshd": [bshd[row, : len(s)] for row, s in enumerate(sequences)],
        "thd": list(thd.unbind()),
    }


def assert_logits_close(got: dict[str, list[torch.Tensor]], expected: list[torch.Tensor]) -> None:
    for layout, rows in got.items():
        for index, (row, ref) in enumerate(zip(rows, expected, strict=True)):
            assert row.shape == ref.shape, (layout, index)
            torch.testing.assert_close(
                row, ref, atol=LOGITS_ATOL, rtol=0, msg=lambda m, i=index, la=layout: f"{la}[{i}]: {m}"
            )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    @functools.cache
    def make(kind: str) -> Path:
        return write_checkpoint(tmp_path_factory.mktemp(kind), kind)

    return make


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    """A gloo world of one with megatron's groups, under the Megatron CPU runtime."""
    store = tmp_path_factory.mktemp("store") / "store"
    with megatron_cpu_runtime(), parallel_state(0, 1, str(store)):
        yield


# ---------------------------------------------------------------------------------------------------------- names
@pytest.mark.parametrize(
    ("name", "dense", "offset", "expected"),
    [
        (
            "decoder.layers.3.input_layernorm.weight",
            False,
            0,
            "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight",
        ),
        ("decoder.layers.3.pre_mlp_layernorm.weight", False, 0, "decoder.layers.3.pre_mlp_layernorm.weight"),
        ("decoder.layers.3.pre_mlp_layernorm.weight", True, 0, "decoder.layers.3.mlp.linear_fc1.layer_norm_weight"),
        (
            "decoder.layers.3.mlp.experts.local_experts.2.linear_fc1.weight",
            False,
            4,
            "decoder.layers.3.mlp.experts.linear_fc1.weight6",
        ),
        (
            "decoder.layers.3.mlp.experts.local_experts.11.linear_fc2.weight",
            False,
            0,
            "decoder.layers.3.mlp.experts.linear_fc2.weight11",
        ),
        ("decoder.layers.3.mlp.router.weight", False, 4, "decoder.layers.3.mlp.router.weight"),
        (
            "decoder.layers.3.self_attention.q_layernorm.weight",
            False,
            0,
            "decoder.layers.3.self_attention.q_layernorm.weight",
        ),
        ("decoder.layers.3.mlp.linear_fc1.weight", True, 0, "decoder.layers.3.mlp.linear_fc1.weight"),
        ("embedding.word_embeddings.weight", False, 0, "embedding.word_embeddings.weight"),
    ],
)
def test_local_names_become_te_names(name, dense, offset, expected):
    assert B.te_parameter_name(name, dense_layer=dense, expert_offset=offset) == expected


def test_registry_is_switched_only_while_held():
    from mbridge.core.bridge import _MODEL_REGISTRY
    from mbridge.models import Qwen3Bridge, Qwen3MoEBridge

    assert _MODEL_REGISTRY["qwen3_moe"] is Qwen3MoEBridge
    with B.local_spec_bridges() as installed:
        local = _MODEL_REGISTRY["qwen3_moe"]
        assert local is installed["qwen3_moe"]
        assert issubclass(local, Qwen3MoEBridge) and issubclass(local, B.LocalSpecBridgeMixin)
        assert issubclass(_MODEL_REGISTRY["qwen3"], Qwen3Bridge)
        with B.local_spec_bridges():  # nested: same classes, outer state restored by the outer block
            assert _MODEL_REGISTRY["qwen3_moe"] is local
        assert _MODEL_REGISTRY["qwen3_moe"] is local
        assert _MODEL_REGISTRY["llama"].__module__.startswith("mbridge")  # not listed: untouched
    assert _MODEL_REGISTRY["qwen3_moe"] is Qwen3MoEBridge and _MODEL_REGISTRY["qwen3"] is Qwen3Bridge

    try:
        assert B.install() == ["mbridge_local_spec:qwen3", "mbridge_local_spec:qwen3_moe"]
        assert B.install() == []  # idempotent
        assert _MODEL_REGISTRY["qwen3_moe"] is local  # one class per base, across installs
        with B.local_spec_bridges():
            B.uninstall()  # the block still holds the entries
            assert _MODEL_REGISTRY["qwen3_moe"] is local
            B.install()
        assert _MODEL_REGISTRY["qwen3_moe"] is local  # install() still holds them
    finally:
        B.uninstall()
    assert _MODEL_REGISTRY["qwen3_moe"] is Qwen3MoEBridge and _MODEL_REGISTRY["qwen3"] is Qwen3Bridge
    B.uninstall()  # nothing installed: no-op
    assert _MODEL_REGISTRY["qwen3_moe"] is Qwen3MoEBridge


def test_contracts_hold():
    assert [r for r in B.check_contracts() if not r.ok] == []


# ---------------------------------------------------------------------------------------------- world size one
@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_moe_bf16", "qwen3"])
def test_round_trip_is_bit_identical(world, checkpoint, kind):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from verl_stable.cpu.megatron.attention import PackedDotProductAttention

    path = checkpoint(kind)
    reference = load_file(path / "model.safetensors")
    bridge, model = build(path, dtype=CHECKPOINTS[kind][3])
    from megatron.core.transformer.module import Float16Module

    assert isinstance(model[0], Float16Module) == (CHECKPOINTS[kind][3] is torch.bfloat16)
    gpt = model[0].module if isinstance(model[0], Float16Module) else model[0]
    names = [name for name, _ in gpt.named_parameters()]
    if kind != "qwen3":
        assert "decoder.layers.1.mlp.experts.local_experts.7.linear_fc2.weight" in names  # SequentialMLP
    assert "decoder.layers.1.input_layernorm.weight" in names  # the local spec, not TE's fused norms
    attentions = [m for m in gpt.modules() if isinstance(m, DotProductAttention)]
    assert len(attentions) == 2 and all(type(m) is PackedDotProductAttention for m in attentions)

    before = export(bridge, model)
    assert before.keys() == reference.keys()
    # every tensor starts different, so equality below is the load's doing
    assert [k for k in reference if torch.equal(before[k], reference[k])] == []

    bridge.load_weights(model, str(path))
    after = export(bridge, model)
    assert after.keys() == reference.keys()
    assert [
        k for k in reference if not (after[k].dtype == reference[k].dtype and torch.equal(after[k], reference[k]))
    ] == []


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_moe_unnormalized", "qwen3"])
def test_logits_equal_hugging_face(world, checkpoint, kind):
    path = checkpoint(kind)
    bridge, model = build(path)
    bridge.load_weights(model, str(path))
    sequences = token_sequences()
    assert_logits_close(megatron_logits(model, sequences), hf_logits(path, sequences))


def test_the_tolerance_sees_a_routing_convention_error(world, checkpoint):
    """mbridge's own Qwen3-MoE routing (renormalized top-k, whatever ``norm_topk_prob`` says) on a checkpoint with
    ``norm_topk_prob=False``: the comparison above must fail, by far."""
    path = checkpoint("qwen3_moe_unnormalized")
    bridge, model = build(path, moe_router_pre_softmax=False)
    bridge.load_weights(model, str(path))
    sequences = token_sequences()
    got = megatron_logits(model, sequences)["thd"]
    worst = max(float((g - r).abs().max()) for g, r in zip(got, hf_logits(path, sequences), strict=True))
    assert worst > 100 * LOGITS_ATOL


# --------------------------------------------------------------------------------------------- parallel layouts
WORLD = 2
LAYOUTS = {"ep2": {"ep": 2}, "tp2": {"tp": 2}}  # tp2: mbridge turns on sequence parallelism; experts are ETP-sliced


def _parallel_body(rank: int, tmp: str, path: str) -> dict:
    from megatron.core import parallel_state as mpu

    torch.set_num_threads(1)
    out = {}
    with megatron_cpu_runtime():
        # one layout after the other in the same two processes: the imports are most of the time
        for layout, sizes in LAYOUTS.items():
            with parallel_state(rank, WORLD, f"{tmp}/store_{layout}", **sizes):
                bridge, model = build(Path(path))
                bridge.load_weights(model, path)
                out[layout] = {
                    "ep_rank": mpu.get_expert_model_parallel_rank(),
                    "tp_rank": mpu.get_tensor_model_parallel_rank(),
                    "experts": {
                        n: p.detach().clone() for n, p in model[0].named_parameters() if ".local_experts." in n
                    },
                    "exported": export(bridge, model),
                    "logits": megatron_logits(model, token_sequences()),
                }
    return out


def _parallel_rank(rank: int, tmp: str, path: str, results) -> None:
    report(results, {"rank": rank}, lambda: _parallel_body(rank, tmp, path), f"{tmp}/rank{rank}.pt")


@pytest.fixture(scope="module")
def parallel_runs(checkpoint) -> list[dict]:
    """Both ranks' results for every layout in :data:`LAYOUTS` (two spawned gloo processes)."""
    path = checkpoint("qwen3_moe")
    with tempfile.TemporaryDirectory() as tmp:
        spawn_and_collect(_parallel_rank, [(r, tmp, str(path)) for r in range(WORLD)], timeout=400, what="rank")
        return [torch.load(f"{tmp}/rank{rank}.pt") for rank in range(WORLD)]


def _expert(reference: dict[str, torch.Tensor], layer: int, expert: int) -> tuple[torch.Tensor, ...]:
    hf = f"model.layers.{layer}.mlp.experts.{expert}"
    return tuple(reference[f"{hf}.{proj}_proj.weight"] for proj in ("gate", "up", "down"))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layouts_load_their_shards_and_export_the_full_checkpoint(checkpoint, parallel_runs, layout):
    path = checkpoint("qwen3_moe")
    reference = load_file(path / "model.safetensors")
    expected_logits = hf_logits(path, token_sequences())
    ep, tp = LAYOUTS[layout].get("ep", 1), LAYOUTS[layout].get("tp", 1)
    per_rank = TINY_MOE["num_experts"] // ep
    vocab = TINY["vocab_size"] // tp
    assert sorted((out[layout]["ep_rank"], out[layout]["tp_rank"]) for out in parallel_runs) == sorted(
        (r % ep, r % tp) for r in range(WORLD)
    )
    for run in parallel_runs:
        out = run[layout]
        exported = out["exported"]
        assert exported.keys() == reference.keys()
        assert [k for k in reference if not torch.equal(exported[k], reference[k])] == []
        # local expert i is the checkpoint's expert ep_rank * per_rank + i, sliced by (expert) tensor parallelism
        experts, tp_rank = out["experts"], out["tp_rank"]
        assert len(experts) == TINY["num_hidden_layers"] * per_rank * 2
        for layer in range(TINY["num_hidden_layers"]):
            for local in range(per_rank):
                gate, up, down = _expert(reference, layer, out["ep_rank"] * per_rank + local)
                mc = f"decoder.layers.{layer}.mlp.experts.local_experts.{local}"
                fc1 = torch.cat([gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank]])
                assert torch.equal(experts[f"{mc}.linear_fc1.weight"], fc1)
                assert torch.equal(experts[f"{mc}.linear_fc2.weight"], down.chunk(tp, dim=1)[tp_rank])
        # every rank ran the same tokens (through the alltoall dispatcher); under tp its logits are its vocab slice
        own_vocab = [ref[:, tp_rank * vocab : (tp_rank + 1) * vocab] for ref in expected_logits]
        assert_logits_close(out["logits"], own_vocab)
