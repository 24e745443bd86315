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

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-30B-A3B}
TRAIN_FILES=${TRAIN_FILES:-${HOME}/data/math/train.parquet}
VAL_FILES=${VAL_FILES:-${HOME}/data/math/test.parquet}
NNODES=${NNODES:-4}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

# 32k tokens per sequence
MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-2048}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-30720}
SEQ_LEN=$((MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH))

# training: FSDP2, Ulysses sequence parallel for 32k sequences, a token budget per GPU for dynamic micro-batches
SP_SIZE=${SP_SIZE:-4}
TRAIN_TOKENS_PER_GPU=$((SEQ_LEN * SP_SIZE / 2))
LOGPROB_TOKENS_PER_GPU=$((SEQ_LEN * SP_SIZE))
OFFLOAD=${OFFLOAD:-True}

# inference: vLLM with FP8 weights (the paper's FP8 inference), tensor parallel within a node
ROLLOUT_TP=${ROLLOUT_TP:-4}
ROLLOUT_QUANTIZATION=${ROLLOUT_QUANTIZATION:-fp8}
GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION:-0.7}

PROJECT=${PROJECT:-verl_stable}
EXPERIMENT=${EXPERIMENT:-qwen3_30b_a3b_fsdp_${REGIME}_n${N}}

python3 -m verl.trainer.main_ppo \
    --config-path="$(dirname "${HERE}")/fsdp" \
    --config-name="${REGIME}" \
    data.train_files="${TRAIN_FILES}" \
    data.val_files="${VAL_FILES}" \
    data.train_batch_size="${TRAIN_BATCH_SIZE}" \
    data.max_prompt_length="${MAX_PROMPT_LENGTH}" \
    data.max_response_length="${MAX_RESPONSE_LENGTH}" \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    actor_rollout_ref.model.path="${MODEL_PATH}" \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.strategy=fsdp2 \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size="${MINI_BATCH_PROMPTS}" \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu="${TRAIN_TOKENS_PER_GPU}" \
    actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size="${SP_SIZE}" \
    actor_rollout_ref.actor.fsdp_config.param_offload="${OFFLOAD}" \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload="${OFFLOAD}" \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n="${GROUP_SIZE}" \
    actor_rollout_ref.rollout.quantization="${ROLLOUT_QUANTIZATION}" \
    actor_rollout_ref.rollout.tensor_model_parallel_size="${ROLLOUT_TP}" \
    actor_rollout_ref.rollout.gpu_memory_utilization="${GPU_MEMORY_UTILIZATION}" \
    actor_rollout_ref.rollout.max_num_batched_tokens="${SEQ_LEN}" \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu="${LOGPROB_TOKENS_PER_GPU}" \
    stable.monitor.num_experts=128 \
    trainer.nnodes="${NNODES}" \
    trainer.n_gpus_per_node="${GPUS_PER_NODE}" \
    trainer.project_name="${PROJECT}" \
    trainer.experiment_name="${EXPERIMENT}" \
    trainer.logger='["console","wandb"]' \
    trainer.val_before_train=False \
    trainer.test_freq=10 \
    trainer.save_freq=10 \
    trainer.total_training_steps="${TOTAL_STEPS:-500}" \
    "$@"
