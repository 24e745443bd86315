"""Sequence parallelism with the local (torch) norm: fix 7 of the Megatron CPU probe.

Without Transformer Engine or apex, megatron-core's local spec builds every norm (input / pre-MLP / final
layernorm, q/k-norm) through ``megatron.core.transformer.torch_norm.WrappedTorchNorm``, whose ``__new__`` asserts
``not config.sequence_parallel``; and MoE with tensor parallelism > 1 refuses to train without sequence parallelism.
Nothing in a norm depends on how the sequence is split: what sequence parallelism needs is that the norm's weight
gradients, computed on each rank's slice of the tokens, are summed across the tensor-parallel group. megatron does
that for every parameter tagged ``sequence_parallel`` (``finalize_model_grads``), which is what Transformer Engine's
norms do under sequence parallelism. :func:`sequence_parallel_norm` builds the same torch norm from a copy of the
config with the flag off and tags its parameters; without sequence parallelism the original constructor runs.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from verl_stable.compat.contracts import Contract, ContractError
from verl_stable.cpu.megatron.patching import AttributePatcher

MODULE = "megatron.core.transformer.torch_norm"


def sequence_parallel_norm(original_new: Callable[..., Any]) -> Callable[..., Any]:
    """A ``WrappedTorchNorm.__new__`` that accepts ``config.sequence_parallel`` (see the module docstring)."""

    @functools.wraps(original_new)
    def __new__(cls: type, config: Any, hidden_size: int, *args: Any, **kwargs: Any) -> torch.nn.Module:
        if not getattr(config, "sequence_parallel", False):
            return original_new(cls, config, hidden_size, *args, **kwargs)
        # a shallow copy: the dataclass's validation (__post_init__) does not run again
        local = copy.copy(config)
        local.sequence_parallel = False
        norm = original_new(cls, local, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    __new__.__verl_stable_wrapped__ = original_new  # type: ignore[attr-defined]
    return __new__


def apply(patcher: AttributePatcher) -> None:
    """Let ``WrappedTorchNorm`` build sequence-parallel norms (needs ``MODULE`` imported)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    current = vars(WrappedTorchNorm)["__new__"]
    current = current.__func__ if isinstance(current, staticmethod) else current
    original = getattr(current, "__verl_stable_wrapped__", current)
    # patch: megatron_torch_norm_sequence_parallel (verl_stable.compat.catalogue)
    patcher.set(WrappedTorchNorm, "__new__", staticmethod(sequence_parallel_norm(original)))


# ----------------------------------------------------------------------------------------------------- contracts
def _torch_norm() -> str:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    new = vars(WrappedTorchNorm).get("__new__")
    new = new.__func__ if isinstance(new, staticmethod) else new
    new = getattr(new, "__verl_stable_wrapped__", new)
    if new is None:
        raise ContractError("WrappedTorchNorm no longer builds its norm in __new__")
    params = tuple(inspect.signature(new).parameters)[:3]
    if params != ("cls", "config", "hidden_size"):
        raise ContractError(f"WrappedTorchNorm.__new__ now starts with {params}")
    if "config.sequence_parallel" not in inspect.getsource(new):
        raise ContractError("WrappedTorchNorm.__new__ no longer reads config.sequence_parallel")
    return "WrappedTorchNorm.__new__(cls, config, hidden_size, ...) refuses sequence_parallel (lifted)"


def _finalize_grads_tag() -> str:
    import importlib

    # the package re-exports the function under the module's name
    finalize_model_grads = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    source = inspect.getsource(finalize_model_grads._allreduce_non_tensor_model_parallel_grads)
    if 'getattr(param, "sequence_parallel", False)' not in source:
        raise ContractError("finalize_model_grads no longer all-reduces parameters tagged sequence_parallel")
    return "finalize_model_grads sums grads of parameters tagged sequence_parallel across tensor-parallel ranks"


CONTRACTS: tuple[Contract, ...] = (
    Contract("megatron_torch_norm", "WrappedTorchNorm.__new__ and its sequence-parallel refusal", _torch_norm),
    Contract("megatron_sequence_parallel_tag", "sequence_parallel-tagged grads summed across TP", _finalize_grads_tag),
)
