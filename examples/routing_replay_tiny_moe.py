"""Capture the routing of a bf16 copy of a tiny Qwen3-MoE and replay it in the fp32 model (what R3 does).

Run: .venv/bin/python examples/routing_replay_tiny_moe.py
"""

import copy

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from verl_stable.routing import capture, replay, routing_disagreement

torch.manual_seed(0)
config = Qwen3MoeConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=16,
    num_experts_per_tok=4,
)
fp32 = Qwen3MoeForCausalLM(config).eval()
bf16 = copy.deepcopy(fp32).to(torch.bfloat16)  # the "inference engine": same weights, other numerics
input_ids = torch.randint(0, config.vocab_size, (8, 32))
mask = torch.ones_like(input_ids)

with torch.no_grad():
    with capture(bf16) as rollout:
        logits_bf16 = bf16(input_ids, attention_mask=mask).logits.float()
    with capture(fp32) as training:
        logits_fp32 = fp32(input_ids, attention_mask=mask).logits
    with replay(fp32, rollout.trace) as rp, capture(fp32) as replayed:
        logits_r3 = fp32(input_ids, attention_mask=mask).logits


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p, q = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


before = routing_disagreement(rollout.trace, training.trace)
after = routing_disagreement(rollout.trace, replayed.trace)
print(
    f"routing trace: {tuple(rollout.trace.to_tensor().shape)} (tokens, MoE layers, top-k), {rollout.trace.nbytes} bytes"
)
print(f"(token, layer) decisions that differ: {before['overall']:.3%} -> {after['overall']:.3%} with replay")
print(f"KL(bf16 || fp32): {kl(logits_bf16, logits_fp32):.2e} -> {kl(logits_bf16, logits_r3):.2e} with replay")
print(f"replayed rows: {rp.stats}")
