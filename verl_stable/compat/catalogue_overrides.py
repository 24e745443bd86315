"""The catalogue's second table: every private verl method a verl-stable subclass overrides.

verl may rename or re-sign a private method in any release; the subclass would then silently stop being called. Each
entry pins the method's parameters in verl 0.9.1; ``verl-stable doctor`` checks them against the installed verl
(:func:`verl_stable.compat.catalogue_check.check`), and a test walks verl-stable's subclasses of verl classes for an
overridden private method not listed here. The run-time patches are the first table,
:data:`verl_stable.compat.catalogue.PATCHES`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OVERRIDES", "Override"]


@dataclass(frozen=True)
class Override:
    """One private verl method a verl-stable subclass overrides.

    Attributes:
        base: dotted path of the verl class that defines the method.
        method: the method's name.
        params: its parameter names in verl 0.9.1 (``self`` first); a change means the override must be revisited.
        owner: the verl-stable class (and module) that overrides it.
        why: what the override adds.
        remove_when: the upstream hook that would replace it.
        requires: the distribution that must be installed for ``base`` to import (``None``: verl alone).
    """

    base: str
    method: str
    params: tuple[str, ...]
    owner: str
    why: str
    remove_when: str
    requires: str | None = None


_TQ_WORKER = "verl.trainer.ppo.v1.agent_loop_tq.AgentLoopWorkerTQ"
_PPO = "verl.trainer.ppo.v1.trainer_base.PPOTrainer"
_VLLM_SERVER = "verl.workers.rollout.vllm_rollout.vllm_async_server.vLLMHttpServer"
_TRAINER = "verl_stable.integration.trainer.StabilityMonitorMixin"
_WORKER = "verl_stable.integration.rollout.agent_loop.CompactRoutingAgentLoopWorkerTQ"
_GUARD_ACTIONS = "verl_stable.integration.guard_actions.GuardActionsMixin"

OVERRIDES: tuple[Override, ...] = (
    Override(
        _PPO,
        "_save_checkpoint",
        ("self",),
        _GUARD_ACTIONS,
        "writes the guard's run state (rollbacks, escalations, action records) beside verl's checkpoint",
        "a public checkpoint hook for trainer-side state",
    ),
    Override(
        _PPO,
        "_load_checkpoint",
        ("self",),
        _GUARD_ACTIONS,
        "reads the guard's run state back on resume (max_rollbacks per run, escalations re-applied)",
        "a public checkpoint hook for trainer-side state",
    ),
    Override(
        _PPO,
        "_update_actor",
        ("self", "batch", "metrics"),
        _TRAINER,
        "taps the update's unreduced per-mini-step metrics; does not apply it when a skip_update rule fires",
        "a public per-update metrics hook",
    ),
    Override(
        _PPO,
        "_compute_old_log_prob",
        ("self", "batch", "metrics"),
        _TRAINER,
        "marks the batch's extra_info with whether this step measures the actor's replay metrics "
        "(stable.monitor.replay_metrics_interval), then verl's pass",
        "a public per-step hook onto the actor's batch",
    ),
    Override(
        "verl.trainer.ppo.v1.trainer_separate_async.PPOTrainerSeparateAsync",
        "_compute_old_log_prob",
        ("self", "batch", "metrics"),
        _TRAINER,
        "the same mark, before separate_async's own version (which restores pi_old's weights around verl's pass)",
        "a public per-step hook onto the actor's batch",
    ),
    Override(
        _PPO,
        "_compute_ref_log_prob",
        ("self", "batch", "metrics"),
        _TRAINER,
        "the same mark for the reference pass",
        "a public per-step hook onto the actor's batch",
    ),
    Override(
        _PPO,
        "_compute_metrics",
        ("self", "batch", "metrics", "timing_raw", "global_steps", "epoch"),
        _TRAINER,
        "the stable/ metrics and the guard's verdict at each step",
        "a public per-step metrics hook",
    ),
    Override(
        _PPO,
        "_build_replay_buffer",
        ("self",),
        _TRAINER,
        "wraps the buffer's sample in dispatch order (stable_sync)",
        "verl samples in dispatch order",
    ),
    Override(
        _TQ_WORKER,
        "_agent_loop_postprocess",
        ("self", "output", "validate", "_ray_trace_ctx", "kwargs"),
        _WORKER,
        "validates and compacts each sample's routing before verl pads it",
        "a routing post-process hook in verl's agent loop",
    ),
    Override(
        "verl.experimental.agent_loop.agent_loop.AgentLoopWorker",
        "_run_agent_loop",
        ("self", "sampling_params", "trajectory", "agent_name", "trace", "_ray_trace_ctx", "kwargs"),
        _WORKER,
        "a sampling seed per sample from its identity",
        "verl seeds each sample's sampling itself",
    ),
    Override(
        _TQ_WORKER,
        "_run_prompt",
        ("self", "prompt", "sampling_params", "trajectory", "trace", "_ray_trace_ctx"),
        _WORKER,
        "puts a group's shared prompt rows before its samples, and samples in dispatch order",
        "verl's TransferQueue worker offers per-group side entries",
    ),
    Override(
        "verl.experimental.agent_loop.agent_loop.AgentLoopManager",
        "_init_agent_loop_workers",
        ("self",),
        "verl_stable.integration.rollout.agent_loop.CompactRoutingAgentLoopManagerTQ",
        "hands its workers the dispatch turns (reproducible order across workers)",
        "verl's manager orders puts across workers",
    ),
    Override(
        "verl.experimental.agent_loop.tool_agent_loop.ToolAgentLoop",
        "_handle_generating_state",
        ("self", "agent_data", "sampling_params", "ignore_termination"),
        "verl_stable.toy.interactions.UserSimulatorAgentLoop",
        "keeps the response log-probs of a simulated user's turns",
        "verl's tool agent loop keeps them",
    ),
    Override(
        _VLLM_SERVER,
        "_get_worker_extension_cls",
        ("self",),
        "verl_stable.backends.vllm_cpu.rollout.CpuVllmHttpServer",
        "installs the CPU weight-reload worker extension",
        "vLLM's CPU build reloads weights in place",
        requires="vllm-cpu",
    ),
    Override(
        _VLLM_SERVER,
        "_preprocess_engine_kwargs",
        ("self", "engine_kwargs"),
        "verl_stable.backends.vllm_cpu.rollout.CpuVllmHttpServer",
        "reads and removes verl-stable's own key (routing fault injection) before vLLM sees the engine kwargs",
        "verl passes unknown engine kwargs to extensions",
        requires="vllm-cpu",
    ),
    Override(
        "verl.utils.megatron.router_replay_patch.RouterReplay",
        "get_replay_topk",
        ("self", "scores", "topk", "num_groups", "group_topk", "default_compute_topk"),
        "verl_stable.integration.megatron_audit.NativeChoiceTap",
        "shadowed per instance during a measured pass (patch megatron_router_native_choice): calls verl's method "
        "with a default_compute_topk that keeps the router's own top-k verl computes for its replay mask (or runs it "
        "once where verl does not)",
        "verl's RouterReplay keeps the native top-k it replaces",
        requires="megatron-core",
    ),
)
"""Every private verl method a verl-stable class overrides (or, for an object-scoped patch, shadows)."""
