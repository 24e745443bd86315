# Sourced by the Qwen3-30B-A3B launch scripts: the model, data and the paper's 32k-token sequences
# (48 layers, 128 experts, top-8), on NNODES x GPUS_PER_NODE GPUs.

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-30B-A3B}
NUM_EXPERTS=128
TRAIN_FILES=${TRAIN_FILES:-${HOME}/data/math/train.parquet}
VAL_FILES=${VAL_FILES:-${HOME}/data/math/test.parquet}
NNODES=${NNODES:-4}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
TOTAL_STEPS=${TOTAL_STEPS:-500}

# 32k tokens per sequence
MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-2048}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-30720}
SEQ_LEN=$((MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH))

# inference: vLLM with FP8 weights (the paper's FP8 inference), tensor parallel within a node
ROLLOUT_TP=${ROLLOUT_TP:-4}
ROLLOUT_QUANTIZATION=${ROLLOUT_QUANTIZATION:-fp8}
