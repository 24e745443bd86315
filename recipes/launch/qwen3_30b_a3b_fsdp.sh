#!/usr/bin/env bash
# Qwen3-30B-A3B on verl's FSDP engine with vLLM rollout, in one verl-stable regime, with the paper's
# setup (arXiv 2512.01374): mini-batch 64 prompts x 16 samples, N mini-batches per rollout batch,
# 32k tokens per sequence, FP8 inference (vLLM) and BF16 training.
#
#   bash recipes/launch/qwen3_30b_a3b_fsdp.sh REGIME [hydra overrides ...]
#   REGIME: minirl_onpolicy | minirl_n2_r2 | minirl_n4_r3 | vespo
#   N=8 bash recipes/launch/qwen3_30b_a3b_fsdp.sh minirl_n4_r3      # 8 mini-batches per rollout
#
# Needs: pip install verl-stable[vllm] (verl 0.9.1, vLLM 0.24 for routed-expert export), a Ray
# cluster of NNODES x GPUS_PER_NODE GPUs (defaults: 4 x 8 x 80 GB), parquet data in verl's RL
# format with a reward. Extra hydra overrides are appended last and win.
set -xeuo pipefail

REGIME=${1:?usage: $0 REGIME [hydra overrides ...]}
shift
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "${HERE}/_regime.sh"
source "${HERE}/_qwen3_30b_a3b.sh"

# training: FSDP2, Ulysses sequence parallel for 32k sequences, a token budget per GPU for dynamic micro-batches
SP_SIZE=${SP_SIZE:-4}
TRAIN_TOKENS_PER_GPU=$((SEQ_LEN * SP_SIZE / 2))
LOGPROB_TOKENS_PER_GPU=$((SEQ_LEN * SP_SIZE))
OFFLOAD=${OFFLOAD:-True}
GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION:-0.7}

EXPERIMENT=${EXPERIMENT:-qwen3_30b_a3b_fsdp_${REGIME}_n${N}}
source "${HERE}/_common.sh"

python3 -m verl.trainer.main_ppo \
    --config-path="$(dirname "${HERE}")/fsdp" \
    --config-name="${REGIME}" \
    "${COMMON_ARGS[@]}" \
    "${FSDP_ARGS[@]}" \
    actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size="${SP_SIZE}" \
    actor_rollout_ref.rollout.max_num_batched_tokens="${SEQ_LEN}" \
    "$@"
