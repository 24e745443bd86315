"""Shared fixtures for the CPU-runtime tests: a tiny random Qwen3-MoE and locally built assets."""

from __future__ import annotations

import pytest
import torch


def tiny_qwen3_moe_config(**overrides):
    from transformers import Qwen3MoeConfig

    kwargs = dict(
        vocab_size=48,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    kwargs.update(overrides)
    return Qwen3MoeConfig(**kwargs)


@pytest.fixture
def moe_config_factory():
    return tiny_qwen3_moe_config


@pytest.fixture
def tiny_moe():
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(tiny_qwen3_moe_config()).float().eval()


@pytest.fixture(scope="session")
def cpu_assets(tmp_path_factory):
    from verl_stable.toy.assets import AssetSpec, ensure_assets

    spec = AssetSpec(num_train=8, num_val=4, hidden_size=32, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
    return ensure_assets(tmp_path_factory.mktemp("assets"), spec)
