"""Tiny randomly initialised MoE models of every supported family, built from configs (no hub download)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 96
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
_FAMILY_KWARGS: dict[str, dict] = {
    # layer 1 dense via mlp_only_layers: absolute index != MoE ordinal from layer 2 on
    "qwen3_moe": dict(
        num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1]
    ),
    "qwen3_5_moe_text": dict(
        num_hidden_layers=2,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    ),
    # every second layer sparse: layers 1 and 3 are MoE
    "qwen2_moe": dict(
        num_hidden_layers=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        decoder_sparse_step=2,
        norm_topk_prob=False,
    ),
    "mixtral": dict(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2),
    "olmoe": dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    "deepseek_v3": dict(
        num_hidden_layers=3,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        kv_lora_rank=8,
        q_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        head_dim=4,
        num_key_value_heads=4,
        routed_scaling_factor=2.5,
    ),
    "glm4_moe": dict(
        num_hidden_layers=3,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        routed_scaling_factor=1.5,
    ),
    "gpt_oss": dict(
        num_hidden_layers=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}
FAMILY_MODEL_TYPES = tuple(_FAMILY_KWARGS)


def tiny_config(model_type: str, **overrides):
    """Config of a tiny model of ``model_type`` (eager attention, no dropout)."""
    cfg = AutoConfig.for_model(model_type, **{**_COMMON, **_FAMILY_KWARGS[model_type], **overrides})
    cfg._attn_implementation = "eager"
    return cfg


def tiny_model(model_type: str, seed: int = 0, router_std: float = 1.0, **overrides) -> torch.nn.Module:
    """A tiny fp32 model in eval mode; routers get a larger init so that routing is decisive and varied."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                p.normal_(0.0, router_std)
            elif name.endswith("mlp.router.bias"):
                p.normal_(0.0, 0.5)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.3)
    return model.eval()


def padded_batch(lengths: list[int], width: int, seed: int = 1, left: bool = True):
    """``input_ids`` and 0/1 ``attention_mask`` of a padded batch (left padding by default)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        tok = torch.randint(3, VOCAB, (n,), generator=g)
        sl = slice(width - n, width) if left else slice(0, n)
        ids[i, sl] = tok
        mask[i, sl] = 1
    return ids, mask


_EXPERT_ATTR = {
    "qwen3_moe": "num_experts",
    "qwen3_5_moe_text": "num_experts",
    "qwen2_moe": "num_experts",
    "olmoe": "num_experts",
    "mixtral": "num_local_experts",
    "deepseek_v3": "n_routed_experts",
    "glm4_moe": "n_routed_experts",
    "gpt_oss": "num_local_experts",
}


def mismatch_model(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A wider tiny model (64 hidden, top-4 of 16 experts, peaked init) whose bf16 copy routes some tokens
    differently from the fp32 original."""
    overrides = {_EXPERT_ATTR[model_type]: 16, "num_experts_per_tok": 4, "initializer_range": 0.1}
    overrides.update(hidden_size=64, num_attention_heads=8)
    if model_type == "deepseek_v3":
        overrides["num_key_value_heads"] = 8
    if model_type in ("deepseek_v3", "glm4_moe"):
        overrides.update(n_group=4, topk_group=2)
    return tiny_model(model_type, seed=seed, router_std=0.1, **overrides)
