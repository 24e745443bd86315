#!/usr/bin/env bash
# A small MoE on ONE node: OLMoE-1B-7B (16 layers, 64 experts, top-8; 1.3B active of 6.9B) on verl's
# FSDP engine with vLLM rollout, in one verl-stable regime, with the paper's batch geometry
# (mini-batch 64 prompts x 16 samples, N mini-batches per rollout batch) and shorter sequences.
# The quickest way to see a regime's dynamics (entropy, train-inference KL, routing disagreement) on GPUs.
#
#   bash recipes/launch/small_moe_fsdp.sh REGIME [hydra overrides ...]
#   REGIME: minirl_onpolicy | minirl_n2_r2 | minirl_n4_r3 | vespo
#   MODEL_PATH=Qwen/Qwen1.5-MoE-A2.7B-Chat bash recipes/launch/small_moe_fsdp.sh minirl_n2_r2
#
# Needs: verl 0.9.1, vLLM 0.24, GPUS_PER_NODE GPUs (default 8 x 80 GB; 4 work with OFFLOAD=True).
set -xeuo pipefail

REGIME=${1:?usage: $0 REGIME [hydra overrides ...]}
shift
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "${HERE}/_regime.sh"

MODEL_PATH=${MODEL_PATH:-allenai/OLMoE-1B-7B-0125-Instruct}
TRAIN_FILES=${TRAIN_FILES:-${HOME}/data/gsm8k/train.parquet}
VAL_FILES=${VAL_FILES:-${HOME}/data/gsm8k/test.parquet}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-1024}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-3072}
SEQ_LEN=$((MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH))
TRAIN_TOKENS_PER_GPU=$((SEQ_LEN * 4))
OFFLOAD=${OFFLOAD:-False}

ROLLOUT_TP=${ROLLOUT_TP:-1}
# bf16 by default on the small model; ROLLOUT_QUANTIZATION=fp8 reproduces the paper's precision gap
ROLLOUT_QUANTIZATION=${ROLLOUT_QUANTIZATION:-null}
GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION:-0.6}

NNODES=1
LOGPROB_TOKENS_PER_GPU=${TRAIN_TOKENS_PER_GPU}
NUM_EXPERTS=64
TOTAL_STEPS=${TOTAL_STEPS:-300}
EXPERIMENT=${EXPERIMENT:-small_moe_fsdp_${REGIME}_n${N}}
source "${HERE}/_common.sh"

python3 -m verl.trainer.main_ppo \
    --config-path="$(dirname "${HERE}")/fsdp" \
    --config-name="${REGIME}" \
    "${COMMON_ARGS[@]}" \
    "${FSDP_ARGS[@]}" \
    "$@"
