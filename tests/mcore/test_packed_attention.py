"""PackedDotProductAttention: megatron's local core attention with verl's packed (THD) format, on CPU.

References are independent: per-sequence causal softmax attention written out below with plain matmuls in float64,
and (for the unpacked path) megatron's own DotProductAttention.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from verl_stable.cpu.megatron.attention import PackedDotProductAttention, check_contracts  # noqa: E402

HEADS, GROUPS, DIM = 4, 2, 8


@pytest.fixture(scope="module", autouse=True)
def model_parallel() -> Iterator[None]:
    """megatron's parallel state at world size 1 (a one-process gloo group), torn down after the module."""
    if dist.is_initialized():
        pytest.fail("torch.distributed already initialized by another test in this process")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(str(Path(tmp) / "store"), 1), rank=0, world_size=1)
        try:
            parallel_state.initialize_model_parallel()
            yield
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def make_config(heads: int = HEADS, groups: int = GROUPS, **overrides) -> TransformerConfig:
    kwargs = dict(
        num_layers=4,
        hidden_size=heads * DIM,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=DIM,
        use_cpu_initialization=True,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def make_attention(config: TransformerConfig | None = None, cls=PackedDotProductAttention, layer_number: int = 1, **kw):
    config = config or make_config()
    return cls(config, layer_number, kw.pop("attn_mask_type", AttnMaskType.causal), "self", **kw).eval()


def thd_params(lengths: list[int], padded: list[int] | None = None, **overrides) -> PackedSeqParams:
    def cu(ls: list[int]) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32)

    kwargs = dict(
        qkv_format="thd",
        cu_seqlens_q=cu(lengths),
        cu_seqlens_kv=cu(lengths),
        cu_seqlens_q_padded=None if padded is None else cu(padded),
        cu_seqlens_kv_padded=None if padded is None else cu(padded),
        max_seqlen_q=max(padded or lengths),
        max_seqlen_kv=max(padded or lengths),
    )
    kwargs.update(overrides)
    return PackedSeqParams(**kwargs)


def qkv(tokens: int, heads: int = HEADS, groups: int = GROUPS, seed: int = 0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, DIM, generator=gen).to(dtype)
    k = torch.randn(tokens, groups, DIM, generator=gen).to(dtype)
    v = torch.randn(tokens, groups, DIM, generator=gen).to(dtype)
    return q, k, v


def reference(q, k, v, lengths: list[int], scale: float, padded: list[int] | None = None) -> torch.Tensor:
    """Causal softmax attention per sequence and head, float64, written out; padding rows zero. ``[T, H * D]``."""
    heads, groups = q.shape[1], k.shape[1]
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(q.shape, dtype=torch.float64)
    start = 0
    for n, slot in zip(lengths, padded or lengths, strict=True):
        for h in range(heads):
            g = h // (heads // groups)
            qs, ks, vs = q[start : start + n, h], k[start : start + n, g], v[start : start + n, g]
            scores = qs @ ks.T * scale
            future = torch.ones(n, n, dtype=torch.bool).triu(1)
            probs = torch.softmax(scores.masked_fill(future, -math.inf), dim=-1)
            out[start : start + n, h] = probs @ vs
        start += slot
    return out.reshape(q.shape[0], -1)


LENGTHS = [5, 1, 7, 3, 1]


def test_thd_equals_per_sequence_causal_reference():
    attn = make_attention()
    q, k, v = qkv(sum(LENGTHS))
    out = attn(q, k, v, None, packed_seq_params=thd_params(LENGTHS))
    assert out.shape == (sum(LENGTHS), HEADS * DIM) and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), reference(q, k, v, LENGTHS, DIM**-0.5), rtol=1e-5, atol=1e-5)
    # a length-1 sequence attends only to itself: its output is its own value row, per query head's group
    one = sum(LENGTHS[:1])
    assert torch.allclose(out[one].view(HEADS, DIM), v[one].repeat_interleave(HEADS // GROUPS, dim=0), atol=1e-6)


def test_thd_gradients_equal_the_reference():
    attn = make_attention()
    q, k, v = (t.double().requires_grad_() for t in qkv(sum(LENGTHS), seed=1))
    rq, rk, rv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    grad_out = torch.randn(sum(LENGTHS), HEADS * DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    attn(q, k, v, None, packed_seq_params=thd_params(LENGTHS)).backward(grad_out)
    reference(rq, rk, rv, LENGTHS, DIM**-0.5).backward(grad_out)
    for ours, theirs in ((q, rq), (k, rk), (v, rv)):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-9, atol=1e-9)


def test_no_information_crosses_sequences():
    attn = make_attention()
    lengths = [4, 6, 3]
    params = thd_params(lengths)
    q, k, v = qkv(sum(lengths), seed=3)
    out = attn(q, k, v, None, packed_seq_params=params)
    second = slice(4, 10)
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[second] = torch.randn(t[second].shape, generator=torch.Generator().manual_seed(4))
    out2 = attn(q2, k2, v2, None, packed_seq_params=params)
    assert torch.equal(out[:4], out2[:4]) and torch.equal(out[10:], out2[10:])
    assert not torch.allclose(out[second], out2[second])  # the changed sequence itself did change


def test_causal_within_a_sequence():
    attn = make_attention()
    lengths = [6]
    q, k, v = qkv(6, seed=5)
    out = attn(q, k, v, None, packed_seq_params=thd_params(lengths))
    k2, v2 = k.clone(), v.clone()
    k2[4:], v2[4:] = k2[4:] + 1, v2[4:] - 1
    out2 = attn(q, k2, v2, None, packed_seq_params=thd_params(lengths))
    assert torch.equal(out[:4], out2[:4]) and not torch.allclose(out[4:], out2[4:])


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 1), (6, 2)])
def test_gqa_and_mha_layouts(heads, groups):
    attn = make_attention(make_config(heads=heads, groups=groups))
    q, k, v = qkv(sum(LENGTHS), heads=heads, groups=groups, seed=6)
    out = attn(q, k, v, None, packed_seq_params=thd_params(LENGTHS))
    torch.testing.assert_close(out.double(), reference(q, k, v, LENGTHS, DIM**-0.5), rtol=1e-5, atol=1e-5)


def test_softmax_scale_argument_and_layer_scaling():
    q, k, v = qkv(sum(LENGTHS), seed=7)
    params = thd_params(LENGTHS)
    scaled = make_attention(softmax_scale=0.3)
    torch.testing.assert_close(
        scaled(q, k, v, None, packed_seq_params=params).double(), reference(q, k, v, LENGTHS, 0.3), rtol=1e-5, atol=1e-5
    )
    # apply_query_key_layer_scaling divides softmax_scale by the layer number and multiplies it back in the softmax
    layered = make_attention(make_config(apply_query_key_layer_scaling=True), layer_number=3)
    assert layered.softmax_scale == pytest.approx(DIM**-0.5 / 3)
    torch.testing.assert_close(
        layered(q, k, v, None, packed_seq_params=params).double(),
        reference(q, k, v, LENGTHS, DIM**-0.5),
        rtol=1e-5,
        atol=1e-5,
    )


def test_padded_slots_follow_transformer_engine_convention():
    """Real tokens of sequence i start at cu_seqlens_q_padded[i]; the slot's rest is padding with zero output."""
    attn = make_attention()
    lengths, padded = [3, 1, 5], [4, 2, 6]
    q, k, v = qkv(sum(padded), seed=8)
    q.requires_grad_()
    out = attn(q, k, v, None, packed_seq_params=thd_params(lengths, padded))
    torch.testing.assert_close(out.double(), reference(q, k, v, lengths, DIM**-0.5, padded), rtol=1e-5, atol=1e-5)
    pad_rows = [3, 5, 11]
    assert torch.count_nonzero(out[pad_rows]) == 0
    out.sum().backward()
    # a sequence's first query sees one key (its softmax is constant in q): look at later real queries
    assert torch.count_nonzero(q.grad[pad_rows]) == 0 and bool((q.grad[[1, 2, 7, 10]] != 0).any(-1).all())


def test_verl_packing_padded_offsets_as_both():
    """verl's preprocess_thd_engine passes its padded offsets as cu_seqlens_q and _padded: slots are sequences."""
    attn = make_attention()
    padded = [4, 2, 6]
    q, k, v = qkv(sum(padded), seed=9)
    params = thd_params(padded, padded)
    out = attn(q, k, v, None, packed_seq_params=params)
    torch.testing.assert_close(out.double(), reference(q, k, v, padded, DIM**-0.5), rtol=1e-5, atol=1e-5)


def test_padding_causal_mask_type_is_causal_in_thd():
    attn = make_attention(attn_mask_type=AttnMaskType.padding_causal)
    q, k, v = qkv(sum(LENGTHS), seed=10)
    out = attn(q, k, v, None, packed_seq_params=thd_params(LENGTHS))
    torch.testing.assert_close(out.double(), reference(q, k, v, LENGTHS, DIM**-0.5), rtol=1e-5, atol=1e-5)


def test_eval_mode_drops_nothing():
    attn = make_attention(make_config(attention_dropout=0.5))
    q, k, v = qkv(sum(LENGTHS), seed=11)
    out = attn(q, k, v, None, packed_seq_params=thd_params(LENGTHS))
    torch.testing.assert_close(out.double(), reference(q, k, v, LENGTHS, DIM**-0.5), rtol=1e-5, atol=1e-5)


def test_training_dropout_forks_the_model_parallel_rng_and_is_unbiased(monkeypatch):
    """In training, attention dropout runs inside the tracker's model-parallel fork (as the original's does), and
    dropped-and-rescaled probabilities average to the eval output."""
    forks = []

    class CountingTracker:
        def fork(self, name: str = "model-parallel-rng"):
            forks.append(name)
            return contextlib.nullcontext()

    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", CountingTracker)
    attn = make_attention(make_config(attention_dropout=0.5))
    lengths = [3, 5]
    q, k, v = qkv(sum(lengths), seed=17)
    params = thd_params(lengths)
    expected = attn(q, k, v, None, packed_seq_params=params)
    assert forks == []  # eval: no dropout, no fork
    attn.train()
    torch.manual_seed(18)
    draws = torch.stack([attn(q, k, v, None, packed_seq_params=params) for _ in range(400)])
    assert forks == ["model-parallel-rng"] * 400
    assert not torch.allclose(draws[0], expected, atol=1e-3)
    # relative error of the mean of 400 draws: ~0.05 (sampling noise); dropping without rescaling would give 0.5
    assert (draws.mean(0) - expected).norm() / expected.norm() < 0.15


def test_tensor_parallel_partition_heads():
    """Under TP=2 the module sees half the heads and groups, as the original computes them; each rank's THD
    attention over its own heads is the reference restricted to those heads."""
    tp2 = SimpleNamespace(tp=SimpleNamespace(size=lambda: 2))
    attn = make_attention(pg_collection=tp2)
    original = make_attention(cls=DotProductAttention, pg_collection=tp2)
    for name in ("num_attention_heads_per_partition", "num_query_groups_per_partition", "hidden_size_per_partition"):
        assert getattr(attn, name) == getattr(original, name)
    assert (attn.num_attention_heads_per_partition, attn.num_query_groups_per_partition) == (2, 1)
    q, k, v = qkv(sum(LENGTHS), seed=12)
    full = reference(q, k, v, LENGTHS, DIM**-0.5).view(-1, HEADS, DIM)
    for rank in range(2):
        heads, group = slice(2 * rank, 2 * rank + 2), slice(rank, rank + 1)
        out = attn(q[:, heads], k[:, group], v[:, group], None, packed_seq_params=thd_params(LENGTHS))
        torch.testing.assert_close(out.double(), full[:, heads].reshape(len(q), -1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="heads per partition"):
        attn(q, k, v, None, packed_seq_params=thd_params(LENGTHS))


def test_bf16_close_to_reference():
    attn = make_attention(make_config(bf16=True, params_dtype=torch.bfloat16))
    q, k, v = qkv(sum(LENGTHS), seed=13, dtype=torch.bfloat16)
    out = attn(q, k, v, None, packed_seq_params=thd_params(LENGTHS))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), reference(q, k, v, LENGTHS, DIM**-0.5), rtol=2e-2, atol=2e-2)


@contextlib.contextmanager
def original_runs_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Just enough for megatron's own DotProductAttention.forward on a CPU-only torch build (the CPU runtime's job
    in production): its matmul buffer and its dropout's RNG fork both hard-code CUDA."""

    class CpuBuffer:
        def get_tensor(self, shape, dtype, name, mem_alloc_context=None):
            return torch.empty(shape, dtype=dtype)

    class NoFork:
        def fork(self, name: str = "model-parallel-rng"):
            return contextlib.nullcontext()

    monkeypatch.setattr(parallel_state, "get_global_memory_buffer", CpuBuffer)
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", NoFork)
    yield
    monkeypatch.undo()


def test_unpacked_path_is_the_original(monkeypatch):
    """Without packed_seq_params the output is megatron's DotProductAttention's, bit for bit, and that is causal
    attention per batch row."""
    ours, original = make_attention(), make_attention(cls=DotProductAttention)
    seq, batch = 6, 2
    gen = torch.Generator().manual_seed(14)
    q = torch.randn(seq, batch, HEADS, DIM, generator=gen)
    k, v = (torch.randn(seq, batch, GROUPS, DIM, generator=gen) for _ in range(2))
    # explicit causal mask (True = masked): get_default_causal_mask builds it on CUDA only (the CPU runtime fixes it)
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None]
    with original_runs_on_cpu(monkeypatch):
        out = ours(q, k, v, mask)
        expected = original(q, k, v, mask)
    assert out.shape == (seq, batch, HEADS * DIM)
    assert torch.equal(out, expected)
    for b in range(batch):
        ref = reference(q[:, b], k[:, b], v[:, b], [seq], DIM**-0.5)
        torch.testing.assert_close(out[:, b].double(), ref, rtol=1e-5, atol=1e-5)


def rope(positions: int) -> torch.Tensor:
    """RoPE angles ``[S, 1, 1, D]`` for positions ``0 .. S-1`` (megatron's layout, as its RotaryEmbedding builds)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    return torch.cat([freqs, freqs], dim=-1)[:, None, None, :]


def test_self_attention_packed_equals_each_sequence_alone(monkeypatch):
    """Through megatron's SelfAttention (local spec: QKV projection, qk RMSNorm, RoPE per sequence, output projection),
    a THD-packed micro-batch gives each sequence what running it alone (unpacked, megatron's own core attention) gives:
    the THD shapes SelfAttention hands core attention and expects back are the ones this class uses."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    config = make_config(qk_layernorm=True, normalization="RMSNorm", attention_dropout=0.0)

    def layer(core_attention: type) -> torch.nn.Module:
        spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm").submodules.self_attention
        spec.submodules.core_attention = core_attention
        return build_module(spec, config=config, layer_number=1).eval()

    torch.manual_seed(15)
    packed_layer, single_layer = layer(PackedDotProductAttention), layer(DotProductAttention)
    single_layer.load_state_dict(packed_layer.state_dict())
    assert any(t.std() > 0 for t in packed_layer.state_dict().values() if t.is_floating_point())
    lengths = [4, 1, 6]
    hidden = torch.randn(sum(lengths), 1, HEADS * DIM, generator=torch.Generator().manual_seed(16))
    out, _ = packed_layer(hidden, None, rotary_pos_emb=rope(max(lengths)), packed_seq_params=thd_params(lengths))
    assert out.shape == hidden.shape
    start = 0
    with original_runs_on_cpu(monkeypatch):
        for n in lengths:
            mask = torch.ones(n, n, dtype=torch.bool).triu(1)[None, None]
            alone, _ = single_layer(hidden[start : start + n], mask, rotary_pos_emb=rope(n))
            torch.testing.assert_close(out[start : start + n], alone, rtol=1e-5, atol=1e-5)
            start += n


def _refused(attn, match: str, *, tokens: int = 6, q=None, **kwargs) -> None:
    lengths = [2, 4]
    q_, k, v = qkv(tokens)
    kwargs.setdefault("packed_seq_params", thd_params(lengths))
    with pytest.raises(ValueError, match=match):
        attn(q_ if q is None else q, k, v, kwargs.pop("attention_mask", None), **kwargs)


def test_refusals():
    attn = make_attention()
    _refused(attn, "attention_bias", attention_bias=torch.zeros(1))
    _refused(attn, "attention_bias", attention_bias=torch.zeros(1), packed_seq_params=None)
    _refused(attn, "attention_mask", attention_mask=torch.zeros(1, 1, 6, 6, dtype=torch.bool))
    _refused(attn, "attn_mask_type", attn_mask_type=AttnMaskType.no_mask)
    _refused(make_attention(attn_mask_type=AttnMaskType.padding), "attn_mask_type")
    _refused(attn, "qkv_format", packed_seq_params=thd_params([2, 4], qkv_format="sbhd"))
    _refused(attn, "local_cp_size", packed_seq_params=thd_params([2, 4], local_cp_size=2))
    cross = thd_params([2, 4], cu_seqlens_kv=torch.tensor([0, 3, 6], dtype=torch.int32))
    _refused(attn, "cu_seqlens_kv", packed_seq_params=cross)
    _refused(attn, "cu_seqlens_q ends at 6 but the packed query has 7", tokens=7)
    _refused(attn, "cu_seqlens_q_padded", packed_seq_params=thd_params([3, 3], [2, 4]))
    bad = torch.tensor([1, 2, 6])
    _refused(attn, "must start at 0", packed_seq_params=thd_params([2, 4], cu_seqlens_q=bad, cu_seqlens_kv=bad))
    _refused(attn, r"\[T, heads, dim\]", q=torch.zeros(6, 1, HEADS, DIM))
    window = make_attention(make_config(window_size=(2, 0), window_attn_skip_freq=None))
    _refused(window, "window_size")
    with pytest.raises(ValueError, match="context_parallel_size"):
        make_attention(make_config(context_parallel_size=2))


def test_refuses_softmax_offsets(monkeypatch):
    # the original allocates the offsets on torch.cuda.current_device(); a CPU device stands in for the test
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    attn = make_attention(make_config(softmax_type="off-by-one"))
    monkeypatch.undo()
    _refused(attn, "softmax_type")


def test_contracts_hold():
    results = check_contracts()
    assert results and all(r.ok for r in results), [r.detail for r in results if not r.ok]
