"""The vLLM worker extension that makes verl's weight sync work on vLLM's CPU build.

vLLM imports this module inside its worker process (verl names the class through the server's
``worker_extension_cls``, see :mod:`verl_stable.backends.vllm_cpu.rollout`), so importing it imports vLLM and verl's vLLM
utilities; only :mod:`verl_stable.backends.vllm_cpu.probe` imports it outside vLLM (its reload check runs the same code).

Why the extension: vLLM's CPU build repacks linear and MoE expert weights into kernel layouts once after loading, so
the parameters of a running engine no longer carry the ``weight_loader`` that verl's ``model.load_weights`` relies on
(``'Parameter' object has no attribute 'weight_loader'``). vLLM's layerwise reload restores each layer's original
parameters on the meta device, buffers the incoming weights until a layer is complete, re-runs that layer's
post-load processing and copies the result into the kernel tensors the engine already uses. The update is therefore:
``initialize_layerwise_reload`` -> ``load_weights`` per received bucket -> ``finalize_layerwise_reload``.

One more step is a fix of a vLLM bug on this path, measured: vLLM's unquantized MoE method treats every
``process_weights_after_loading`` after the first as an in-place update (``is_weight_update = self.moe_kernel is not
None``) and then skips the CPU experts' prepack into the grouped-GEMM layout, so the reloaded expert weights land
*unpacked* in storage the CPU kernel reads as *packed*. Parameters compare equal, but every expert output is wrong: on
the tiny Qwen3-MoE, 10 % of (token, layer) routing decisions differed from the same weights loaded from a checkpoint
and log-probs differed by up to 0.034 (the "7-9 % unexplained router disagreement" seen inside verl). Dropping each CPU
MoE layer's kernel before the reload makes vLLM process the layer as on its first load (pad, convert, prepack, build
the kernel); afterwards routing equals the checkpoint-loaded engine on 100 % of rows and log-probs agree within 3e-7
(``tests/cpu/test_vllm_rollout.py``, ``docs/explanation/cpu-runtime.md``).

verl's shared-memory bucket receiver (the CPU platform has no CUDA IPC) hands out views into one reused buffer, and the
layerwise reload keeps incoming tensors until their layer is complete: each received tensor is copied, or the next
bucket would overwrite it.

Weight names, at the edge (:func:`checkpoint_name_mapper`): transformers 5 names every MoE block of a decoder layer
``mlp`` -- Mixtral's included, whose checkpoints (and vLLM's model) call it ``block_sparse_moe``; transformers maps the
names only when it reads or writes a checkpoint. verl 0.9.1 streams the live module's names, its
``unfuse_moe_params`` splitting the packed experts into ``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``,
and ``convert_weight_keys`` does nothing (transformers 5 models have no ``_checkpoint_conversion_mapping``). vLLM
0.30's Mixtral maps ``gate_proj``/``up_proj``/``down_proj`` to its ``w1``/``w3``/``w2`` but not ``mlp`` to
``block_sparse_moe``, so the first bucket fails: "There is no module or parameter named 'layers.0.mlp' in
MixtralModel" (measured: ``python -m verl_stable.backends.vllm_cpu.probe --family mixtral --reload`` without the mapping).
Where the served model has ``block_sparse_moe`` blocks and no ``mlp`` ones, the extension renames the layer's ``mlp``
to ``block_sparse_moe`` before vLLM loads the weights; for every other model the names pass unchanged.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Iterator

import torch
from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload


def reset_cpu_moe_kernels(model: torch.nn.Module) -> int:
    """Drop the kernel of every MoE layer that runs vLLM's unquantized CPU experts; returns how many were dropped.

    The next ``process_weights_after_loading`` of such a layer then prepacks the new expert weights (see the module
    docstring) instead of copying them unpacked into the packed storage.
    """
    dropped = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        backend = getattr(method, "unquantized_backend", None)
        if getattr(method, "moe_kernel", None) is not None and getattr(backend, "name", None) == "CPU":
            # patch: vllm_cpu_moe_kernel_reset (verl_stable.compat.catalogue)
            method.moe_kernel = None
            dropped += 1
    return dropped


_LAYER_MLP = re.compile(r"(\.layers\.\d+)\.mlp\.")
_LAYER_MODULE = re.compile(r"\.layers\.\d+\.(mlp|block_sparse_moe)$")


def checkpoint_name_mapper(module_names: Iterable[str]) -> Callable[[str], str] | None:
    """How verl's weight names become names a served model's ``load_weights`` accepts; None when they already are.

    Args:
        module_names: the served model's module names (``name for name, _ in model.named_modules()``).

    A model whose decoder layers hold ``block_sparse_moe`` blocks and no ``mlp`` (vLLM's Mixtral) gets
    ``layers.L.mlp.*`` renamed to ``layers.L.block_sparse_moe.*`` (see the module docstring); vLLM's own mapper then
    takes the expert names the rest of the way.
    """
    kinds = {m.group(1) for name in module_names if (m := _LAYER_MODULE.search("." + name))}
    if kinds != {"block_sparse_moe"}:
        return None
    return lambda name: _LAYER_MLP.sub(r"\1.block_sparse_moe.", "." + name)[1:]


def checkpoint_names(
    weights: Iterable[tuple[str, torch.Tensor]], mapper: Callable[[str], str] | None
) -> list[tuple[str, torch.Tensor]]:
    """``weights`` renamed by ``mapper`` (:func:`checkpoint_name_mapper`; None: unchanged), each tensor copied."""
    return [(mapper(name) if mapper else name, tensor.clone()) for name, tensor in weights]


@contextlib.contextmanager
def layerwise_reload(models: list[tuple[torch.nn.Module, object]], *, reset_kernels: bool = True) -> Iterator[None]:
    """Within the block, ``model.load_weights`` buffers each layer's weights and processes the layer once complete.

    Args:
        models: ``(model, vllm_model_config)`` pairs served by this worker.
        reset_kernels: rebuild the CPU MoE kernels (see the module docstring); False only to show the bug.
    """
    for model, _ in models:
        if reset_kernels:
            reset_cpu_moe_kernels(model)
        initialize_layerwise_reload(model)
    try:
        yield
    finally:  # also after a failed transfer: layers that got no weights get their previous tensors back
        for model, model_config in models:
            finalize_layerwise_reload(model, model_config)


def reload_layerwise(
    models: list[tuple[torch.nn.Module, object]],
    buckets: Iterator[list[tuple[str, torch.Tensor]]],
    *,
    reset_kernels: bool = True,
) -> None:
    """Load ``buckets`` of ``(name, tensor)`` (verl's names, as its weight sync sends them) into running vLLM
    ``models``, renamed where the model needs it (:func:`checkpoint_name_mapper`)."""
    mappers = [checkpoint_name_mapper(name for name, _ in model.named_modules()) for model, _ in models]
    with layerwise_reload(models, reset_kernels=reset_kernels):
        for bucket in buckets:
            for (model, _), mapper in zip(models, mappers, strict=True):
                model.load_weights(checkpoint_names(bucket, mapper))


class CpuWeightReloadExtension(vLLMColocateWorkerExtension):
    """verl's colocate worker extension with a weight update that vLLM's CPU build accepts."""

    def update_weights_from_ipc(
        self, peft_config: dict | None = None, base_sync_done: bool = False, use_shm: bool = False
    ) -> None:
        """Receive the full policy weights from verl's trainer and reload them layer by layer.

        Raises:
            NotImplementedError: LoRA adapters and quantized rollouts, which this CPU path does not support.
        """
        if peft_config:
            raise NotImplementedError("LoRA weight sync is not supported on vLLM's CPU build by verl-stable")
        if self._is_qat_model or self._is_modelopt_qat:
            raise NotImplementedError("quantized (QAT) weight sync is not supported on vLLM's CPU build by verl-stable")
        if self.device is None:
            self.device = torch.device("cpu")

        # verl loads one list into every served model (a drafter only with MTP, which the CPU path does not run):
        # the served model decides the names
        mapper = checkpoint_name_mapper(name for name, _ in self.model_runner.model.named_modules())

        def on_bucket_received(weights: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
            owned = checkpoint_names(weights, mapper)
            self._update_weights(owned, peft_config=None, base_sync_done=base_sync_done)

        receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=self.device, use_shm=use_shm)
        with layerwise_reload(list(self._iter_all_models_with_config())):
            receiver.receive_weights(on_bucket_received=on_bucket_received)
