"""A gloo process group with megatron-core's model-parallel groups on it, for a block: what runs a Megatron model on CPU
outside verl's workers (the probe's Megatron forward, the runtime's tests)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def gloo_megatron_world(
    rank: int, world_size: int, store: str, tp: int = 1, ep: int = 1, seed: int = 1234
) -> Iterator[None]:
    """torch.distributed (gloo, a file store at path ``store``) and megatron's groups for ``tp`` x ``ep``, seeded as
    verl's engine seeds them (``model_parallel_cuda_manual_seed``); both torn down on exit.

    Raises:
        RuntimeError: torch.distributed is already initialised in this process.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
        try:
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
            yield
        finally:
            mpu.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
