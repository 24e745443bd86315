"""megatron-core's MoE layer without Transformer Engine and without CUDA: fixes 2 and 5 of the Megatron CPU probe.

* Fix 5. ``megatron.core.transformer.moe.moe_utils`` imports ``te_general_gemm`` and the ``fused_*`` kernels from its
  Transformer Engine extension inside ``try: ... except ImportError``; without TE the names are never bound, yet the
  router's ``RouterGatingLinearFunction`` tests ``te_general_gemm is not None`` (``NameError`` at the first forward).
  Every name of that import that is missing is bound to ``None``, which is the code's own "no TE" fallback (plain
  ``torch.mm``); the names removed again on restore.
* Fix 2. The alltoall token dispatcher moves its split sizes device-to-host at a sync point with
  ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which only converts CUDA tensors; on the host the splits would
  stay tensors, which ``all_to_all_single`` and ``sum(output_splits)`` do not take as the numpy arrays the GPU path
  hands them. The dispatcher module's reference to that helper is replaced by :func:`host_move_to_cpu`, which converts
  host tensors too and otherwise delegates. (The dispatcher's side stream is a ``torch.cuda.Stream``: answered by
  :class:`verl_stable.cpu.megatron.device.NullStream`, set on the class.)
"""

from __future__ import annotations

import ast
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from verl_stable.compat.contracts import Contract, ContractError
from verl_stable.cpu.megatron.patching import AttributePatcher

MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
TE_EXTENSION = "megatron.core.extensions.transformer_engine"


def te_import_names() -> tuple[str, ...]:
    """The names ``moe_utils`` imports from the TE extension in its top-level ``try`` (from its source)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    tree = ast.parse(inspect.getsource(moe_utils))
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Try):
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom) and stmt.module == TE_EXTENSION:
                    names += [alias.asname or alias.name for alias in stmt.names]
    return tuple(names)


def apply_te_fallback(patcher: AttributePatcher) -> None:
    """Bind every TE name ``moe_utils`` lacks to ``None`` (needs ``MOE_UTILS`` imported)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    for name in te_import_names():
        # patch: megatron_moe_te_fallback (verl_stable.compat.catalogue)
        patcher.set_default(moe_utils, name, None)


def host_move_to_cpu(original: Callable[..., Any]) -> Callable[..., Any]:
    """``maybe_move_tensor_to_cpu`` that also converts host tensors to numpy when asked (the GPU path's result)."""

    @functools.wraps(original)
    def move(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            # a copy, as the device-to-host transfer gives: the dispatcher may reuse its tensor
            return tensor.detach().clone().numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    move.__verl_stable_wrapped__ = original  # type: ignore[attr-defined]
    return move


def apply_dispatcher_fix(patcher: AttributePatcher) -> None:
    """Give the alltoall dispatcher numpy split sizes on the host (needs ``DISPATCHER`` imported)."""
    import megatron.core.transformer.moe.token_dispatcher as dispatcher

    from verl_stable.cpu.megatron.device import NullStream

    current = dispatcher.maybe_move_tensor_to_cpu
    original = getattr(current, "__verl_stable_wrapped__", current)
    # patch: megatron_dispatcher_host_splits (verl_stable.compat.catalogue)
    patcher.set(dispatcher, "maybe_move_tensor_to_cpu", host_move_to_cpu(original))
    # set here rather than created by the first dispatcher from the torch.cuda stub, so that restoring puts back
    # the class's own None instead of leaving a stub stream behind
    # patch: megatron_dispatcher_stream (verl_stable.compat.catalogue)
    patcher.set(dispatcher.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", NullStream())


# ----------------------------------------------------------------------------------------------------- contracts
def _te_fallback() -> str:
    import megatron.core.transformer.moe.moe_utils as moe_utils

    names = te_import_names()
    if "te_general_gemm" not in names:
        raise ContractError(f"{MOE_UTILS} no longer imports te_general_gemm from {TE_EXTENSION} in a try block")
    source = inspect.getsource(moe_utils.RouterGatingLinearFunction)
    if "te_general_gemm is not None" not in source:
        raise ContractError("RouterGatingLinearFunction no longer falls back on `te_general_gemm is None`")
    return f"{len(names)} TE names of moe_utils fall back to None (te_general_gemm -> torch.mm)"


def _dispatcher_splits() -> str:
    import megatron.core.transformer.moe.token_dispatcher as dispatcher

    params = tuple(inspect.signature(dispatcher.maybe_move_tensor_to_cpu).parameters)
    if params != ("tensor", "as_numpy", "record_stream"):
        raise ContractError(f"maybe_move_tensor_to_cpu now takes {params}")
    source = inspect.getsource(dispatcher.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize)
    if "maybe_move_tensor_to_cpu(" not in source or "as_numpy=True" not in source:
        raise ContractError("_maybe_dtoh_and_synchronize no longer moves split sizes with maybe_move_tensor_to_cpu")
    if "cuda_dtoh_stream" not in vars(dispatcher.MoEAlltoAllTokenDispatcher):
        raise ContractError("MoEAlltoAllTokenDispatcher.cuda_dtoh_stream (a torch.cuda.Stream) is gone")
    return "alltoall dispatcher converts split sizes through the module's maybe_move_tensor_to_cpu"


CONTRACTS: tuple[Contract, ...] = (
    Contract("megatron_moe_te_fallback", "moe_utils' TE names and their None fallback", _te_fallback),
    Contract("megatron_dispatcher_splits", "alltoall dispatcher's device-to-host split sizes", _dispatcher_splits),
)
