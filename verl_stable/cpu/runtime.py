"""The CPU runtime's registration step: platform, FSDP engines, ``hf`` and ``vllm`` rollout backends, poll interval.

``register()`` is what ``verl_stable.integration.plugin`` runs in every process verl starts. The platform is always
registered but only *selected* when the run asks for CPU (``VERL_PLATFORM=cpu`` or ``trainer.device=cpu``); the
engines are registered only in processes that selected it.
"""

from __future__ import annotations

from verl_stable.cpu import engines, hf_rollout, platform, polling, vllm_rollout


def register() -> list[str]:
    """Run every CPU-runtime registration (idempotent); returns what was registered in this process."""
    done = platform.register()
    done += engines.register()
    done += hf_rollout.register()
    done += polling.register()
    done += vllm_rollout.register()
    return done


def doctor() -> list:
    """What ``verl-stable doctor`` reports for the CPU runtime: every verl contract plus this process's registrations.

    Returns:
        ``list[ContractResult]``; the runtime is usable with the installed verl iff all are ``ok``.
    """
    from verl_stable.cpu.contracts import ContractResult, check_contracts

    results = check_contracts()
    try:
        from verl.plugin.platform import PlatformRegistry
        from verl.workers.rollout import base
        from verl.workers.rollout.replica import RolloutReplicaRegistry

        missing = []
        if PlatformRegistry.get(platform.PLATFORM_NAME) is None:
            missing.append("platform 'cpu'")
        if hf_rollout.BACKEND not in RolloutReplicaRegistry._registry:
            missing.append("rollout replica 'hf'")
        if (hf_rollout.BACKEND, "async") not in base._ROLLOUT_REGISTRY:
            missing.append("rollout adapter ('hf', 'async')")
        detail = "registered in this process" if not missing else f"not registered: {missing} (plugin step missing?)"
        results.append(ContractResult("cpu_runtime_registered", not missing, detail))
    except Exception as exc:  # noqa: BLE001 - doctor reports, never raises
        results.append(ContractResult("cpu_runtime_registered", False, f"{type(exc).__name__}: {exc}"))
    return results
