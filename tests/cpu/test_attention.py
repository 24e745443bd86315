"""The CPU runtime's varlen attention (``verl_stable.cpu.attention``): the kernel against torch's sdpa per sequence,
a packed model forward against unpacked ones, and the registration verl's model loading and Ulysses patch go through.

Under verl's Ulysses all-to-all on two gloo ranks the kernel is exercised by ``tests/integration/
test_fsdp_engine_ulysses*.py``, and in verl's own ``main_ppo`` by ``tests/integration/test_ulysses_e2e.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from verl_stable.cpu import attention
from verl_stable.cpu.attention import ATTN_IMPLEMENTATION, sequence_ids, varlen_causal_attention

LENGTHS = [5, 7, 3, 1]


def _qkv(seq_len: int, batch: int = 1, heads: int = 4, kv_heads: int = 2, dim: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_len, heads, dim, generator=gen)
    k = torch.randn(batch, seq_len, kv_heads, dim, generator=gen)
    v = torch.randn(batch, seq_len, kv_heads, dim, generator=gen)
    return q, k, v


def _sdpa(q, k, v, scale=None):
    """torch's causal sdpa on ``[B, S, H, D]`` tensors (GQA), one sequence per row."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True, scale=scale
    )
    return out.transpose(1, 2)


def test_sequence_ids_start_where_positions_restart():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 5, 6]])
    assert sequence_ids(pos).tolist() == [[1, 1, 1, 2, 2, 3, 4, 4, 5, 5]]


def test_packed_kernel_equals_sdpa_on_each_sequence_alone():
    q, k, v = _qkv(sum(LENGTHS))
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    out = varlen_causal_attention(q, k, v, None, q.shape[1], position_ids=pos, softmax_scale=0.3)
    assert out.shape == q.shape
    bounds = torch.tensor([0, *LENGTHS]).cumsum(0).tolist()
    want = torch.cat(
        [_sdpa(*(t[:, a:b] for t in (q, k, v)), scale=0.3) for a, b in zip(bounds[:-1], bounds[1:], strict=True)], dim=1
    )
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
    # sdpa over the whole packed row (causal only) attends across sequences: a different function
    assert (_sdpa(q, k, v, scale=0.3) - want).abs().max() > 1e-2


def test_padded_kernel_equals_sdpa_on_the_real_tokens():
    lengths = [3, 6, 1]
    q, k, v = _qkv(6, batch=3)
    mask = torch.zeros(3, 6, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, 6 - n :] = 1  # left padding, as verl's prompts
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    out = varlen_causal_attention(q, k, v, mask, 6, position_ids=pos)
    assert torch.isfinite(out).all()  # padding queries see themselves: no empty softmax row
    for b, n in enumerate(lengths):
        want = _sdpa(*(t[b : b + 1, 6 - n :] for t in (q, k, v)))
        torch.testing.assert_close(out[b : b + 1, 6 - n :], want, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sliding_window": 4}, "sliding_window"),
        ({"softcap": 30.0}, "softcap"),
        ({"is_causal": False}, "causal only"),
    ],
)
def test_the_kernel_refuses_what_it_does_not_implement(kwargs, match):
    q, k, v = _qkv(4)
    with pytest.raises(NotImplementedError, match=match):
        varlen_causal_attention(q, k, v, None, 4, **kwargs)


def test_the_kernel_has_no_kv_cache():
    q, k, v = _qkv(6)
    with pytest.raises(NotImplementedError, match="no KV cache"):
        varlen_causal_attention(q[:, -1:], k, v, None, 1)


def _tiny_model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).eval()


def test_a_packed_model_forward_with_the_kernel_equals_unpacked_sdpa_forwards():
    """verl's packed (use_remove_padding) forward at sp=1: one row, positions restarting, no cache, no mask."""
    attention.register_attention()
    model = _tiny_model()
    ids = torch.randint(1, 64, (sum(LENGTHS),), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    attention.CALLS.clear()
    with torch.no_grad():
        unpacked = torch.cat([model(input_ids=s[None], use_cache=False).logits[0] for s in ids.split(LENGTHS)])
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        packed = model(input_ids=ids[None], position_ids=pos, use_cache=False).logits[0]
        # with a cache transformers skips its packed-sequence detection: causal over the whole row, across samples
        model.set_attn_implementation("sdpa")
        leaking = model(input_ids=ids[None], position_ids=pos, use_cache=True).logits[0]
        # verl's forward passes use_cache=False: there transformers' sdpa detects packing itself
        packed_sdpa = model(input_ids=ids[None], position_ids=pos, use_cache=False).logits[0]
    assert attention.CALLS["direct"] == 2  # once per layer: verl's patch is not installed in this process
    torch.testing.assert_close(packed, unpacked, rtol=0, atol=1e-5)
    assert (leaking - unpacked).abs().max() > 1e-2
    torch.testing.assert_close(packed_sdpa, unpacked, rtol=0, atol=1e-5)


def test_the_attention_function_calls_verls_patched_flash_entry(monkeypatch):
    """Where verl's Ulysses patch replaced transformers' flash-attention entry, the registered function goes through
    it (the all-to-all lives there); the kernel it calls is the one :func:`install_ulysses_kernel` put in verl."""
    from transformers.integrations import flash_attention

    seen = []

    def patched(query, key, value, attention_mask, query_length, *args, position_ids=None, **kwargs):
        seen.append((tuple(query.shape), query_length, position_ids.tolist()))
        return varlen_causal_attention(query, key, value, attention_mask, query_length, position_ids=position_ids)

    monkeypatch.setattr(flash_attention, "_flash_attention_forward", patched)
    q, k, v = _qkv(5)
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    out, weights = attention.attention_forward(
        torch.nn.Module(), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, position_ids=pos
    )
    assert weights is None and seen == [((1, 5, 4, 8), 5, [[0, 1, 2, 0, 1]])]
    torch.testing.assert_close(out, varlen_causal_attention(q, k, v, None, 5, position_ids=pos))


def test_verls_kernel_is_replaced_for_cpu_tensors_only(monkeypatch):
    from verl.models.transformers import monkey_patch

    calls = []

    def original(query, *args, **kwargs):
        calls.append(query.device.type)
        return query

    monkeypatch.setattr(monkey_patch, "_flash_attention_forward", original)
    assert attention.install_ulysses_kernel() == [f"ulysses_kernel:{ATTN_IMPLEMENTATION}"]
    kernel = monkey_patch._flash_attention_forward
    assert kernel is not original and kernel.__verl_stable_original__ is original
    attention.install_ulysses_kernel()  # idempotent: not wrapped twice
    assert monkey_patch._flash_attention_forward is kernel
    q, k, v = _qkv(3)
    before = attention.CALLS["ulysses"]
    torch.testing.assert_close(kernel(q, k, v, None, 3), _sdpa(q, k, v))
    assert attention.CALLS["ulysses"] == before + 1 and calls == []
    meta = torch.empty(1, 3, 4, 8, device="meta")
    assert kernel(meta, meta, meta, None, 3) is meta and calls == ["meta"]  # an accelerator's tensors: verl's kernel


def test_register_only_where_the_cpu_platform_is_selected(monkeypatch):
    from transformers import AttentionInterface
    from verl.models.transformers import monkey_patch

    from verl_stable.compat.import_hooks import hooks_restored

    monkeypatch.setattr(monkey_patch, "_flash_attention_forward", monkey_patch._flash_attention_forward)
    monkeypatch.setenv("VERL_PLATFORM", "cuda")
    assert attention.register() == []
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    with hooks_restored():
        # both modules are imported here, so both hooks fire at once
        assert attention.register() == [f"attention:{ATTN_IMPLEMENTATION}", f"ulysses_kernel:{ATTN_IMPLEMENTATION}"]
    assert AttentionInterface._global_mapping[ATTN_IMPLEMENTATION] is attention.attention_forward
    assert hasattr(monkey_patch._flash_attention_forward, "__verl_stable_original__")


def test_contracts_hold_on_installed_verl():
    results = attention.check_contracts()
    assert [r.name for r in results] == ["ulysses_hook_point", "attention_interface"]
    assert all(r.ok for r in results), [r.detail for r in results]
