"""The CPU runtime's even collectives (:mod:`verl_stable.cpu.megatron.collectives`) on two gloo ranks.

Reference: the parts each rank holds, concatenated (gather) or summed over the ranks (reduce-scatter) by plain tensor
operations in the test; megatron-core's own functions, unpatched, refuse the same uneven sizes on gloo (what the
patch exists for). Through megatron's sequence-parallel autograd functions, the backward of the uneven gather is the
uneven reduce-scatter of the gradient and vice versa.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from testkit.spawn import report, spawn_and_collect

pytest.importorskip("megatron.core")

WORLD = 2
SIZES = [3, 5]  # rows on rank 0 and rank 1
WIDTH = 4


def part(rank: int, rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(100 * seed + rank))


def _body(rank: int, tmp: str) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", WORLD), rank=rank, world_size=WORLD)
    import megatron.core.tensor_parallel.mappings as mappings

    from verl_stable.cpu.megatron.runtime import megatron_cpu_runtime

    group = dist.new_group(list(range(WORLD)))
    out: dict = {}
    with megatron_cpu_runtime():
        # megatron-core's own function (the runtime's other fixes on: it allocates on "cuda")
        original = mappings._gather_along_first_dim.__verl_stable_wrapped__
        try:
            original(part(rank, SIZES[rank], 0), group, SIZES)
        except RuntimeError as exc:
            out["unpatched_gather"] = str(exc)
        out["gather"] = mappings._gather_along_first_dim(part(rank, SIZES[rank], 0), group, SIZES)
        # rank r receives the sum over the ranks of their r-th part
        whole = part(rank, sum(SIZES), 1)
        out["reduce_scatter"] = mappings._reduce_scatter_along_first_dim(whole, group, SIZES)
        # equal sizes: megatron-core's own path, unchanged
        out["even_gather"] = mappings._gather_along_first_dim(part(rank, 2, 2), group, [2, 2])
        # autograd: the sequence-parallel gather with split sizes, and its backward (the uneven reduce-scatter)
        x = part(rank, SIZES[rank], 3).requires_grad_(True)
        y = mappings.gather_from_sequence_parallel_region(x, group=group, output_split_sizes=SIZES)
        (y * torch.arange(1, y.shape[0] + 1, dtype=y.dtype)[:, None]).sum().backward()
        out["grad"] = x.grad.clone()
    dist.destroy_process_group()
    return out


def _rank(rank: int, tmp: str, results) -> None:
    report(results, {"rank": rank}, lambda: _body(rank, tmp), f"{tmp}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    tmp = tempfile.mkdtemp(prefix="megatron_collectives_")
    spawn_and_collect(_rank, [(r, tmp) for r in range(WORLD)], timeout=300, what="collectives rank")
    return [torch.load(f"{tmp}/rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_megatron_cores_uneven_gather_fails_on_gloo_unpatched(ranks):
    assert all("invalid tensor size" in r.get("unpatched_gather", "") for r in ranks), [r.keys() for r in ranks]


def test_the_uneven_gather_is_every_ranks_part_in_rank_order(ranks):
    expected = torch.cat([part(r, SIZES[r], 0) for r in range(WORLD)])
    for r in ranks:
        assert torch.equal(r["gather"], expected)
        assert torch.equal(r["even_gather"], torch.cat([part(q, 2, 2) for q in range(WORLD)]))


def test_the_uneven_reduce_scatter_gives_each_rank_the_sum_of_its_parts(ranks):
    bounds = [0, SIZES[0], sum(SIZES)]
    for rank, r in enumerate(ranks):
        expected = sum(part(q, sum(SIZES), 1)[bounds[rank] : bounds[rank + 1]] for q in range(WORLD))
        assert r["reduce_scatter"].shape == (SIZES[rank], WIDTH)
        torch.testing.assert_close(r["reduce_scatter"], expected, rtol=0, atol=1e-6)


def test_the_gathers_backward_sums_each_ranks_rows_gradient_over_the_ranks(ranks):
    # d/dx of sum(row_index * y) on every rank: each rank's rows get (their global row index + 1) from every rank
    start = 0
    for rank, r in enumerate(ranks):
        index = torch.arange(start + 1, start + SIZES[rank] + 1, dtype=torch.float32)[:, None].expand(-1, WIDTH)
        torch.testing.assert_close(r["grad"], WORLD * index, rtol=0, atol=0)
        start += SIZES[rank]
