#!/usr/bin/env bash
# Qwen3-30B-A3B on verl's Megatron engine with vLLM rollout, in one verl-stable regime, with the
# paper's setup (arXiv 2512.01374): mini-batch 64 prompts x 16 samples, N mini-batches per rollout
# batch, 32k tokens per sequence, FP8 inference (vLLM) and BF16 training. Routing replay uses verl's
# own Megatron implementation (actor.megatron.router_replay.mode).
#
#   bash recipes/launch/qwen3_30b_a3b_megatron.sh REGIME [hydra overrides ...]
#   REGIME: minirl_onpolicy | minirl_n2_r2 | minirl_n4_r3 | vespo
#
# Needs: verl 0.9.1 with its Megatron extras (megatron-core, mbridge), vLLM 0.24, a Ray cluster of
# NNODES x GPUS_PER_NODE GPUs (defaults: 4 x 8 x 80 GB). Extra hydra overrides are appended and win.
set -xeuo pipefail

REGIME=${1:?usage: $0 REGIME [hydra overrides ...]}
shift
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "${HERE}/_regime.sh"
source "${HERE}/_qwen3_30b_a3b.sh"

# Megatron parallelism for 48 layers x 128 experts (top-8): experts over 8 GPUs, context parallel for 32k
TP=${TP:-2}
PP=${PP:-1}
CP=${CP:-2}
EP=${EP:-8}
ETP=${ETP:-1}
TRAIN_TOKENS_PER_GPU=${TRAIN_TOKENS_PER_GPU:-$((SEQ_LEN * 2))}
OFFLOAD=${OFFLOAD:-True}
GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION:-0.65}

LOGPROB_TOKENS_PER_GPU=${TRAIN_TOKENS_PER_GPU}
EXPERIMENT=${EXPERIMENT:-qwen3_30b_a3b_megatron_${REGIME}_n${N}}
source "${HERE}/_common.sh"

export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron overlaps communication with computation

python3 -m verl.trainer.main_ppo \
    --config-path="$(dirname "${HERE}")/megatron" \
    --config-name="${REGIME}" \
    "${COMMON_ARGS[@]}" \
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size="${TP}" \
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size="${PP}" \
    actor_rollout_ref.actor.megatron.context_parallel_size="${CP}" \
    actor_rollout_ref.actor.megatron.expert_model_parallel_size="${EP}" \
    actor_rollout_ref.actor.megatron.expert_tensor_parallel_size="${ETP}" \
    actor_rollout_ref.actor.megatron.param_offload="${OFFLOAD}" \
    actor_rollout_ref.actor.megatron.optimizer_offload="${OFFLOAD}" \
    +actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_dtype=fp32 \
    actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform \
    actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full \
    actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers=1 \
    actor_rollout_ref.rollout.max_num_batched_tokens="${SEQ_LEN}" \
    "$@"
