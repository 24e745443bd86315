"""Uneven tensor-parallel gathers and reduce-scatters on gloo: the expert-tensor-parallel exchange of routed tokens.

Under expert-tensor parallelism > 1 the alltoall token dispatcher gathers the tokens routed to a rank's experts
over the expert-tensor group (``gather_from_sequence_parallel_region(..., output_split_sizes=...)``) and combines
them back with ``reduce_scatter_to_sequence_parallel_region(..., input_split_sizes=...)``; the backward passes swap
the two. The split sizes are how many (token, expert) pairs each rank routed there, which differ whenever the ranks'
tokens route differently: with expert parallelism (the ranks' shares of the experts receive different counts) and
under R2 (verl replays a zero route, one expert instead of top-k, on each packing pad row, and the sequence-parallel
halves hold different numbers of them). megatron-core's ``_gather_along_first_dim`` and
``_reduce_scatter_along_first_dim`` then call ``torch.distributed.all_gather`` / ``reduce_scatter`` with lists of
tensors of different sizes, which NCCL takes and gloo refuses (``ProcessGroupGloo::allgather: invalid tensor
size``).

:func:`even_gather` and :func:`even_reduce_scatter` replace the two in ``megatron.core.tensor_parallel.mappings`` (the
autograd functions look them up there at each call): where the split sizes differ they pad every rank's part with
zero rows to the largest size, run the even collective megatron-core itself uses without split sizes, and cut the
padding off again. The rows that are not padding are the same values in the same reduction order, so the result is
bit for bit the uneven collective's; equal split sizes (or none) go to megatron-core's function unchanged.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from verl_stable.compat.contracts import Contract, ContractError
from verl_stable.cpu.megatron.patching import AttributePatcher

MODULE = "megatron.core.tensor_parallel.mappings"
GATHER = "_gather_along_first_dim"
REDUCE_SCATTER = "_reduce_scatter_along_first_dim"


def _uneven(sizes: list[int] | None, group: Any) -> bool:
    return sizes is not None and group is not None and group.size() > 1 and len(set(sizes)) > 1


def _padded(part: torch.Tensor, rows: int) -> torch.Tensor:
    out = part.new_zeros((rows, *part.shape[1:]))
    out[: part.shape[0]] = part
    return out


def even_gather(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``_gather_along_first_dim`` whose uneven ``output_split_sizes`` travel as one even all-gather."""

    @functools.wraps(original)
    def gather(
        input_: torch.Tensor, group: Any, output_split_sizes: list[int] | None = None, use_global_buffer: bool = False
    ) -> torch.Tensor:
        if not _uneven(output_split_sizes, group):
            return original(input_, group, output_split_sizes, use_global_buffer)
        width = max(output_split_sizes)
        gathered = original(_padded(input_, width).contiguous(), group, None, False)
        return torch.cat([gathered[i * width : i * width + n] for i, n in enumerate(output_split_sizes)])

    gather.__verl_stable_wrapped__ = original  # type: ignore[attr-defined]
    return gather


def even_reduce_scatter(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``_reduce_scatter_along_first_dim`` whose uneven ``input_split_sizes`` travel as one even reduce-scatter."""

    @functools.wraps(original)
    def reduce_scatter(
        input_: torch.Tensor, group: Any, input_split_sizes: list[int] | None = None, use_global_buffer: bool = False
    ) -> torch.Tensor:
        if not _uneven(input_split_sizes, group):
            return original(input_, group, input_split_sizes, use_global_buffer)
        width = max(input_split_sizes)
        parts = torch.split(input_, input_split_sizes, dim=0)
        padded = torch.cat([_padded(part, width) for part in parts]).contiguous()
        reduced = original(padded, group, None, False)
        return reduced[: input_split_sizes[group.rank()]].contiguous()

    reduce_scatter.__verl_stable_wrapped__ = original  # type: ignore[attr-defined]
    return reduce_scatter


def apply(patcher: AttributePatcher) -> None:
    """Make the uneven gathers and reduce-scatters of ``MODULE`` even (needs ``MODULE`` imported)."""
    import megatron.core.tensor_parallel.mappings as mappings

    def original(name: str) -> Callable[..., torch.Tensor]:
        current = getattr(mappings, name)
        return getattr(current, "__verl_stable_wrapped__", current)

    # patch: megatron_uneven_tp_gather (verl_stable.compat.catalogue)
    patcher.set(mappings, GATHER, even_gather(original(GATHER)))
    # patch: megatron_uneven_tp_reduce_scatter (verl_stable.compat.catalogue)
    patcher.set(mappings, REDUCE_SCATTER, even_reduce_scatter(original(REDUCE_SCATTER)))


# ----------------------------------------------------------------------------------------------------- contracts
def _collectives() -> str:
    import megatron.core.tensor_parallel.mappings as mappings

    for name, sizes in ((GATHER, "output_split_sizes"), (REDUCE_SCATTER, "input_split_sizes")):
        params = tuple(inspect.signature(getattr(mappings, name)).parameters)
        if params != ("input_", "group", sizes, "use_global_buffer"):
            raise ContractError(f"{MODULE}.{name} now takes {params}")
    # the sequence-parallel autograd functions call the two through the module's globals, where the patch sits
    for cls, name in (
        (mappings._GatherFromSequenceParallelRegion, GATHER),
        (mappings._ReduceScatterToSequenceParallelRegion, REDUCE_SCATTER),
    ):
        if f"{name}(" not in inspect.getsource(cls.forward):
            raise ContractError(f"{cls.__name__}.forward no longer calls {name}")
    return "sequence-parallel gathers / reduce-scatters with split sizes go through the module's two functions"


CONTRACTS: tuple[Contract, ...] = (
    Contract("megatron_uneven_tp_collectives", "uneven tensor-parallel gathers through mappings", _collectives),
)
