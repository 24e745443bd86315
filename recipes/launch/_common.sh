# Sourced by the GPU launch scripts once they have set the model, data, length, parallelism and rollout
# variables: the hydra overrides every verl-stable launch on vLLM shares (data, the paper's batch geometry
# from _regime.sh, rollout, monitor, trainer). Each script adds its backend's own overrides after these.

PROJECT=${PROJECT:-verl_stable}
LOGGER=${LOGGER:-'["console","wandb"]'}

COMMON_ARGS=(
    data.train_files="${TRAIN_FILES}"
    data.val_files="${VAL_FILES}"
    data.train_batch_size="${TRAIN_BATCH_SIZE}"
    data.max_prompt_length="${MAX_PROMPT_LENGTH}"
    data.max_response_length="${MAX_RESPONSE_LENGTH}"
    data.filter_overlong_prompts=True
    data.truncation=error
    actor_rollout_ref.model.path="${MODEL_PATH}"
    actor_rollout_ref.actor.optim.lr="${LR:-1e-6}"
    actor_rollout_ref.actor.ppo_mini_batch_size="${MINI_BATCH_PROMPTS}"
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu="${TRAIN_TOKENS_PER_GPU}"
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.n="${GROUP_SIZE}"
    actor_rollout_ref.rollout.quantization="${ROLLOUT_QUANTIZATION}"
    actor_rollout_ref.rollout.tensor_model_parallel_size="${ROLLOUT_TP}"
    actor_rollout_ref.rollout.gpu_memory_utilization="${GPU_MEMORY_UTILIZATION}"
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu="${LOGPROB_TOKENS_PER_GPU}"
    stable.monitor.num_experts="${NUM_EXPERTS}"
    trainer.nnodes="${NNODES}"
    trainer.n_gpus_per_node="${GPUS_PER_NODE}"
    trainer.project_name="${PROJECT}"
    trainer.experiment_name="${EXPERIMENT}"
    trainer.logger="${LOGGER}"
    trainer.val_before_train=False
    trainer.test_freq=10
    trainer.save_freq=10
    trainer.total_training_steps="${TOTAL_STEPS}"
)

# verl's FSDP engine (FSDP2, padding removed, activation checkpointing; OFFLOAD moves params and optimizer to host)
FSDP_ARGS=(
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.strategy=fsdp2
    actor_rollout_ref.actor.fsdp_config.param_offload="${OFFLOAD}"
    actor_rollout_ref.actor.fsdp_config.optimizer_offload="${OFFLOAD}"
)
