"""A tiny megatron-core GPT MoE and the gloo process groups to run it, for tests of the Megatron CPU runtime.

The model (:func:`build_model`): local spec (no Transformer Engine), 2 layers, hidden 64, 4 heads in 2 query groups,
8 experts top-2 on every layer (SequentialMLP, alltoall dispatcher), SwiGLU, RMSNorm with q/k-norm, RoPE, separate
output layer, fp32, ``use_cpu_initialization``; vocabulary 128, 16 tokens per sequence.

Parallel state: :func:`parallel_state` initialises torch.distributed (gloo, a file store) and megatron's model-parallel
groups for one rank and tears both down on exit; a world of one runs in the test process, larger worlds in processes
spawned with ``testkit.spawn.spawn_and_collect``. Every function that needs megatron-core runs inside
``verl_stable.cpu.megatron.runtime.megatron_cpu_runtime()`` (the caller opens it).

Comparing parallel layouts needs the same weights everywhere: :func:`full_weights` takes a world-size-1 model's
parameters and :func:`load_weights` puts them into a tensor- and/or expert-parallel model (each rank takes its shard:
its tensor-parallel slice along the parameter's ``partition_dim``, SwiGLU's gate and up halves sliced separately, and
only its own experts, renumbered locally).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from typing import Any

import torch

VOCAB = 128
SEQ = 16
HIDDEN = 64
LAYERS = 2
EXPERTS = 8
TOPK = 2
GLOBAL_BATCH = 4  # sequences; data-parallel ranks split it evenly


def tiny_config(tp: int = 1, ep: int = 1, sp: bool = False, **overrides: Any):
    """The tiny model's ``TransformerConfig`` for ``tp``-way tensor and ``ep``-way expert parallelism."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    kwargs: dict[str, Any] = dict(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        kv_channels=16,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=32,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        normalization="RMSNorm",
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        bf16=False,
        attention_backend=AttnBackend.local,  # megatron's own attention, as verl's CPU engine configures it
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        sequence_parallel=sp,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_model(config, seed: int = 0):
    """The tiny GPT MoE for ``config`` (parameters from ``seed``; use :func:`load_weights` to compare layouts)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
    )
    with _nvte_environment_restored():
        return GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            position_embedding_type="rope",
            share_embeddings_and_output_weights=False,
        )


@contextlib.contextmanager
def _nvte_environment_restored() -> Iterator[None]:
    """megatron's models export NVTE_*_ATTN for their attention backend and assert them on the next build; a test
    must not leave them to the next test (which may choose another backend)."""
    names = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
    saved = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def batch(sequences: slice = slice(None), seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows ``sequences`` of a fixed global batch (:data:`GLOBAL_BATCH` random sequences): tokens, positions, labels."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)
    positions = torch.arange(SEQ).expand(GLOBAL_BATCH, SEQ)
    return {
        "tokens": tokens[sequences, :-1].contiguous(),
        "position_ids": positions[sequences].contiguous(),
        "labels": tokens[sequences, 1:].contiguous(),
    }


def lm_loss(model, data: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross entropy of ``model`` on ``data`` (megatron's vocab-parallel loss, causal mask)."""
    per_token = model(data["tokens"], data["position_ids"], attention_mask=None, labels=data["labels"])
    return per_token.float().mean()


# --------------------------------------------------------------------------------------------------- parallel state
def parallel_state(
    rank: int, world_size: int, store: str, tp: int = 1, ep: int = 1, seed: int = 1234
) -> contextlib.AbstractContextManager[None]:
    """torch.distributed (gloo, file store at path ``store``) and megatron's groups for ``tp`` x ``ep``; torn down
    (:func:`verl_stable.cpu.megatron.world.gloo_megatron_world`)."""
    from verl_stable.cpu.megatron.world import gloo_megatron_world

    return gloo_megatron_world(rank, world_size, store, tp=tp, ep=ep, seed=seed)


def full_weights(model) -> dict[str, torch.Tensor]:
    """A world-size-1 model's parameters by name (detached copies)."""
    return {name: param.detach().clone() for name, param in model.named_parameters()}


_LOCAL_EXPERT = re.compile(r"(\.local_experts\.)(\d+)(\.)")


def load_weights(model, full: dict[str, torch.Tensor], config) -> None:
    """Copy :func:`full_weights` of a world-size-1 model into this rank's shard of ``model``."""
    from megatron.core import parallel_state as mpu

    tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    ep_rank = mpu.get_expert_model_parallel_rank()
    local_experts = config.num_moe_experts // mpu.get_expert_model_parallel_world_size()
    for name, param in model.named_parameters():
        source = _LOCAL_EXPERT.sub(lambda m: f"{m[1]}{ep_rank * local_experts + int(m[2])}{m[3]}", name)
        tensor = full[source]
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            dim = param.partition_dim
            if config.gated_linear_unit and "linear_fc1" in name:
                # SwiGLU's fc1 is [gate; up]; each rank holds [gate slice; up slice]
                tensor = torch.cat([half.chunk(tp, dim)[tp_rank] for half in tensor.chunk(2, dim)], dim)
            else:
                tensor = tensor.chunk(tp, dim)[tp_rank]
        if tensor.shape != param.shape:
            raise ValueError(f"{name}: shard {tuple(tensor.shape)} for parameter {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)


# ------------------------------------------------------------------------------------------------------- training
def ddp_and_optimizer(model, config, lr: float = 1e-2):
    """megatron's DDP around ``model`` and its distributed Adam optimizer (what verl's Megatron engine builds)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, use_distributed_optimizer=True, clip_grad=1.0, bf16=False),
        [ddp],
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    return ddp, optimizer


def train_step(ddp, optimizer, data: dict[str, torch.Tensor]) -> tuple[float, float]:
    """One forward/backward through megatron's schedule and one optimizer step; returns (loss, grad norm)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(iterator, model):
        item = next(iterator)
        output = model(item["tokens"], item["position_ids"], attention_mask=None, labels=item["labels"])

        def loss_func(per_token: torch.Tensor):
            loss = per_token.float().mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([data]),
        model=[ddp],
        num_microbatches=1,
        seq_length=SEQ,
        micro_batch_size=data["tokens"].shape[0],
        forward_only=False,
    )
    success, grad_norm, _ = optimizer.step()
    if not success:
        raise RuntimeError("megatron's optimizer skipped the step")
    return float(losses[0]["loss"]), float(grad_norm)
