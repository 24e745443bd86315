"""The tiny random Qwen3-MoE that the FSDP-engine tests run through verl's engine (no hub download)."""

from __future__ import annotations

import torch

# layers 0 and 2 MoE, layer 1 dense (mlp_only_layers), top-2 of 8 experts
NUM_LAYERS, MOE_LAYERS, EXPERTS, TOPK = 3, (0, 2), 8, 2


def engine_model(seed: int = 0):
    """``Qwen3MoeForCausalLM`` in eval mode, its weights drawn after ``torch.manual_seed(seed)``, sdpa attention."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=EXPERTS,
        num_experts_per_tok=TOPK,
        mlp_only_layers=[1],
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config).eval()
