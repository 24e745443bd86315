"""What a shared-prompt side entry costs against the bytes it saves: the break-even behind ``share_prompt_rows_min_bytes``.

A group that shares its prompt rows (:mod:`verl_stable.transport.sharing`) pays fixed costs: one
TransferQueue put of its side entry (awaited by its siblings) and a share of one read per actor rank and step. It
saves moving ``(n - 1) x`` its prompt rows' bytes in its samples' own puts and in every read of them (verl's V1
actors read a sample's routing for the old-log-prob pass and again for the update). Sharing pays when

    saved_bytes x (put_per_byte + reads x get_per_byte) >= put_fixed + get_fixed

(the read's fixed cost counted whole, as if a rank read one group: the conservative case). This script measures the
four terms on TransferQueue's own ``SimpleStorage`` as verl's trainer starts it, from a Ray actor in another process
(where the agent-loop workers and actor ranks sit): the median latency of ``async_kv_put`` and ``async_kv_batch_get``
of one uint8 entry at each size, the fixed cost (the median latency of entries up to 16 KiB) and the cost per MiB (the
slope over entries of 1 MiB and more), and the break-even saved bytes. The default ``share_prompt_rows_min_bytes`` (2
MiB) is the break-even measured on the 2-core host of docs/explanation/benchmarks.md rounded down to a power of two, so
a group at the default saves at least what it costs there.

    RAY_AUTH_MODE=disabled python benchmarks/bench_side_entry_cost.py [--reps 15] [--reads 2] [--max-mib 16]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np

MIB = 1 << 20


def sizes_up_to(max_mib: int) -> list[int]:
    """Entry sizes from 64 B to ``max_mib`` MiB, four per factor of 16."""
    out, size = [], 64
    while size <= max_mib * MIB:
        out.append(size)
        size *= 2
    return out


def cost_line(sizes: list[int], ms: list[float]) -> tuple[float, float]:
    """``(fixed ms, ms per MiB)``: the median latency of entries <= 16 KiB, and the least-squares slope over entries
    >= 1 MiB (below that the per-byte part is lost in the fixed one's noise)."""
    small = [t for s, t in zip(sizes, ms, strict=True) if s <= 16 * 1024]
    big = [(s / MIB, t) for s, t in zip(sizes, ms, strict=True) if s >= MIB]
    if not small or len(big) < 2:
        raise ValueError("need an entry <= 16 KiB and at least two >= 1 MiB (--max-mib >= 2)")
    x, y = (np.asarray(v, dtype=np.float64) for v in zip(*big, strict=True))
    return float(statistics.median(small)), float(np.polyfit(x, y, 1)[0])


def break_even_bytes(put: tuple[float, float], get: tuple[float, float], reads: int) -> float:
    """Saved bytes at which a side entry's fixed costs equal the per-byte costs it avoids (see the module doc)."""
    per_mib = put[1] + reads * get[1]
    return float("inf") if per_mib <= 0 else (put[0] + get[0]) / per_mib * MIB


def measure(sizes: list[int], reps: int) -> dict[int, tuple[float, float]]:
    """In a Ray actor: median put and get latency (ms) of one entry of each size, on the running TransferQueue."""
    import ray

    @ray.remote(num_cpus=0)
    class Prober:
        def run(self, sizes: list[int], reps: int) -> dict[int, tuple[float, float]]:
            import torch
            import transfer_queue as tq
            from tensordict import TensorDict

            tq.init()  # attaches to the driver's controller

            async def probe() -> dict[int, tuple[float, float]]:
                out, keys = {}, []
                for size in sizes:
                    puts, gets = [], []
                    for r in range(reps + 1):  # the first of each size warms the path
                        key = f"probe_{size}_{r}"
                        keys.append(key)
                        fields = TensorDict({"ids": torch.zeros(1, size, dtype=torch.uint8)}, batch_size=[1])
                        t0 = time.perf_counter()
                        await tq.async_kv_put(key=key, partition_id="probe", fields=fields, tag={"rows": size})
                        t1 = time.perf_counter()
                        got = await tq.async_kv_batch_get(keys=[key], partition_id="probe")
                        t2 = time.perf_counter()
                        assert got["ids"].numel() == size
                        if r:
                            puts.append((t1 - t0) * 1e3)
                            gets.append((t2 - t1) * 1e3)
                    out[size] = (statistics.median(puts), statistics.median(gets))
                await tq.async_kv_clear(keys=keys, partition_id="probe")
                return out

            return asyncio.run(probe())

    return ray.get(Prober.remote().run.remote(sizes, reps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15, help="timed puts and gets per size (median)")
    parser.add_argument("--reads", type=int, default=2, help="reads of a sample's routing per step")
    parser.add_argument("--max-mib", type=int, default=16, help="largest entry, MiB")
    args = parser.parse_args()

    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    # TransferQueue's controller and storage units are Ray actors that each ask for a CPU: on 2 cores a Ray that
    # counts only the cores would leave them pending (verl's CPU runtime also declares more logical CPUs)
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)
    try:
        # verl's trainer config (trainer/config/transfer_queue/transfer_queue.yaml) sizes SimpleStorage like this
        tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"total_storage_size": 100000}}}))
        sizes = sizes_up_to(args.max_mib)
        result = measure(sizes, args.reps)
    finally:
        ray.shutdown()
    print(f"{'entry bytes':>12} {'put ms':>8} {'get ms':>8}")
    for size in sizes:
        put_ms, get_ms = result[size]
        print(f"{size:>12} {put_ms:>8.2f} {get_ms:>8.2f}")
    put = cost_line(sizes, [result[s][0] for s in sizes])
    get = cost_line(sizes, [result[s][1] for s in sizes])
    print(f"put: {put[0]:.2f} ms + {put[1]:.2f} ms/MiB; get: {get[0]:.2f} ms + {get[1]:.2f} ms/MiB")
    even = break_even_bytes(put, get, args.reads)
    print(
        f"break-even saved bytes ({args.reads} reads per step): {even / MIB:.2f} MiB; "
        f"a power of two at or below it: {1 << max(int(np.floor(np.log2(even))), 0)} bytes"
    )


if __name__ == "__main__":
    main()
