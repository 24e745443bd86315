"""Fixtures of the probe's tests: the project's tiny Qwen3-MoE with its tokenizer and toy-task data (built from a
config, nothing downloaded), and a tiny dense model with the same tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_stable.toy.assets import AssetSpec, ensure_assets


@pytest.fixture(scope="session")
def toy(tmp_path_factory):
    """The toy MoE (4 layers, top-4 of 16 experts, hidden 64) and a 32-prompt copy-task parquet."""
    return ensure_assets(tmp_path_factory.mktemp("probe_toy"), AssetSpec(num_train=32, num_val=4))


@pytest.fixture(scope="session")
def dense_model(tmp_path_factory) -> Path:
    """A tiny dense Qwen3 (model_type ``qwen3``: no routed experts) with the toy tokenizer."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from verl_stable.toy.assets import EOS, build_tokenizer

    out = tmp_path_factory.mktemp("probe_dense")
    tokenizer = build_tokenizer(out)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False,
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS), pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).float().save_pretrained(str(out))
    return out
