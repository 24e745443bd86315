"""megatron-core's CUDA RNG tracker on the host generator: fix 1 of the Megatron CPU probe.

``megatron.core.tensor_parallel.random`` keeps named RNG states (the model-parallel state that gives each tensor-
parallel rank its own dropout masks, the expert-parallel one, ...) and swaps them in and out of the *device*
generator: ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` (module functions every tracker method calls by name)
and ``CudaRNGStatesTracker.add`` (which calls ``torch.cuda.get_rng_state`` / ``torch.cuda.manual_seed``). A CPU build
of torch has no CUDA generator (``torch.cuda.get_rng_state`` asserts). On the host the device generator *is* torch's
default CPU generator (every op megatron would have run on the GPU draws from it), so the tracker's states become
its states: the two module functions are replaced, and ``torch.cuda``'s three RNG entry points answer with the
default CPU generator. ``torch.cuda.manual_seed_all`` is left alone: ``torch.manual_seed`` calls it, and on a CPU
build it is already a harmless deferred call.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from verl_stable.compat.contracts import Contract, ContractError
from verl_stable.cpu.megatron.patching import AttributePatcher

MODULE = "megatron.core.tensor_parallel.random"


def get_host_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """``_get_cuda_rng_state`` on the host: the default CPU generator's state (always a fresh tensor)."""
    return torch.default_generator.get_state()


def set_host_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """``_set_cuda_rng_state`` on the host: set the default CPU generator's state."""
    torch.default_generator.set_state(new_state)


def _cuda_get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.default_generator.get_state()


def _cuda_set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.default_generator.set_state(new_state)


def _cuda_manual_seed(seed: int) -> None:
    # the generator itself, not torch.manual_seed: that one would call torch.cuda.manual_seed_all again
    torch.default_generator.manual_seed(int(seed))


CUDA_RNG_STUBS: dict[str, Any] = {
    "get_rng_state": _cuda_get_rng_state,
    "set_rng_state": _cuda_set_rng_state,
    "manual_seed": _cuda_manual_seed,
}
"""``torch.cuda`` RNG attribute -> its host answer while the runtime is installed."""


def apply_cuda_rng_stubs(patcher: AttributePatcher) -> None:
    """Point ``torch.cuda``'s RNG entry points at the default CPU generator (restored by ``patcher``)."""
    for name, stub in CUDA_RNG_STUBS.items():
        # patch: torch_cuda_rng_stubs (verl_stable.compat.catalogue)
        patcher.set(torch.cuda, name, stub)


def apply_tracker_fix(patcher: AttributePatcher) -> None:
    """Point megatron's RNG-state functions at the host generator (needs ``MODULE`` imported)."""
    import megatron.core.tensor_parallel.random as random

    # patch: megatron_get_cuda_rng_state (verl_stable.compat.catalogue)
    patcher.set(random, "_get_cuda_rng_state", get_host_rng_state)
    # patch: megatron_set_cuda_rng_state (verl_stable.compat.catalogue)
    patcher.set(random, "_set_cuda_rng_state", set_host_rng_state)


# ----------------------------------------------------------------------------------------------------- contracts
def _params(func: Any) -> tuple[str, ...]:
    return tuple(inspect.signature(func).parameters)


def _rng_state_functions() -> str:
    import megatron.core.tensor_parallel.random as random

    expected = {
        "_get_cuda_rng_state": ("device", "clone", "graph_safe"),
        "_set_cuda_rng_state": ("new_state", "device", "graph_safe"),
    }
    for name, params in expected.items():
        func = getattr(random, name, None)
        if func is None:
            raise ContractError(f"{MODULE}.{name} missing")
        if func not in (get_host_rng_state, set_host_rng_state) and _params(func) != params:
            raise ContractError(f"{MODULE}.{name} now takes {_params(func)}, patched for {params}")
    return f"{MODULE}._get_cuda_rng_state / _set_cuda_rng_state (device, clone|new_state, graph_safe)"


def _tracker_uses_them() -> str:
    import megatron.core.tensor_parallel.random as random

    tracker = random.CudaRNGStatesTracker
    fork, add = inspect.getsource(tracker.fork), inspect.getsource(tracker.add)
    if "_get_cuda_rng_state(" not in fork or "_set_cuda_rng_state(" not in fork:
        raise ContractError("CudaRNGStatesTracker.fork no longer swaps states through _get/_set_cuda_rng_state")
    if "torch.cuda.get_rng_state()" not in add or "torch.cuda.manual_seed(" not in add:
        raise ContractError("CudaRNGStatesTracker.add no longer seeds through torch.cuda.get_rng_state / manual_seed")
    return "CudaRNGStatesTracker.fork / add go through the patched functions and torch.cuda's RNG calls"


CONTRACTS: tuple[Contract, ...] = (
    Contract("megatron_rng_state_functions", "megatron's _get/_set_cuda_rng_state signatures", _rng_state_functions),
    Contract("megatron_rng_tracker", "CudaRNGStatesTracker swaps states through those functions", _tracker_uses_them),
)
