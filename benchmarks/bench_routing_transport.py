"""Bytes per real token and peak host memory to move a batch's rollout routing through Ray's object store.

Shape: Qwen3-30B-A3B traffic (48 decoder layers, all MoE, top-8 of 128 experts), scaled down to ``--groups`` prompts
x ``--n`` responses with prompt lengths U[P/4, P] and response lengths U[R/64, R], then extrapolated linearly to
8192 responses at ``32k`` tokens. Compared, interleaved in one run:

* ``verl-padded``: verl 0.9.1 legacy agent loop, int16 ``[B, P + R, 48, 8]`` zero-padded;
* ``verl-jagged``: verl 0.9.1 V1 (TransferQueue), int16 ``[P_i + R_i, 48, 8]`` per sample, no padding;
* ``stable-fields``: verl-stable's per-sample V1 fields (uint8, MoE layers, recorded rows only), sharing off
  (``+verl_stable.routing.share_prompt_rows=false``): prompt rows once per *sample*;
* ``stable-shared``: what verl-stable's V1 agent-loop workers put by default: the per-sample fields without the
  prompt rows of a group (``+ stable_routing_prompt_ref``) plus one side entry of prompt rows per group
  (:func:`~verl_stable.transport.sharing.shared_sample_fields`), for the groups whose sharing saves at least
  ``--share-min-bytes`` (default 2 MiB, the workers' ``share_prompt_rows_min_bytes``; here a prompt of >= 781
  tokens at n = 8); the others keep their rows per sample;
* ``stable-packed``: verl-stable's :class:`PackedRouting` (one object per batch, prompt rows once per group).

Each payload is ``ray.put`` by the driver and fetched by a Ray task in another process, which checks its size;
"object bytes" is the pickle-5 size Ray stores (in-band + out-of-band buffers). Peak host memory is the driver's
peak RSS increase (``ru_maxrss``) while building + putting + getting back the payload, each measurement in a fresh
process connected to the same Ray cluster.

Run: ``RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/bench_routing_transport.py``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import resource
import statistics
import subprocess
import sys
import time

import numpy as np
import psutil
import torch

from verl_stable.routing.codecs import decode_vllm
from verl_stable.routing.trace import RoutingLayout
from verl_stable.transport.boundary import BOUNDARY_COLUMNS
from verl_stable.transport.fields import IDS_FIELD, sample_fields
from verl_stable.transport.options import DEFAULT_SHARE_MIN_BYTES
from verl_stable.transport.packed import PackedRouting
from verl_stable.transport.sharing import PromptRowSharing, shared_sample_fields

LAYOUT = RoutingLayout("qwen3_moe", "qwen3_moe", 48, tuple(range(48)), 8, 128)


def engine_outputs(rng: np.random.Generator, groups: int, n: int, max_prompt: int, max_response: int):
    """vLLM-layout routing per sample (prompt rows identical within a group) + lengths."""
    samples = []
    for _ in range(groups):
        p = int(rng.integers(max_prompt // 4, max_prompt + 1))
        # distinct top-8 of 128 cheaply: r + 16 k (mod 128) for k < 8
        prompt_rows = (rng.integers(0, 128, (p, 48, 1)) + 16 * np.arange(8)) % 128
        for _ in range(n):
            r = int(rng.integers(max(1, max_response // 64), max_response + 1))
            resp_rows = (rng.integers(0, 128, (r - 1, 48, 1)) + 16 * np.arange(8)) % 128
            samples.append((np.concatenate([prompt_rows, resp_rows]).astype(np.uint8), p, r))
    return samples


def object_bytes(obj: object) -> int:
    buffers: list[pickle.PickleBuffer] = []
    inband = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return len(inband) + sum(memoryview(b).nbytes for b in buffers)


def build(kind: str, samples, max_prompt: int, max_response: int):
    if kind == "verl-padded":  # verl's legacy _agent_loop_postprocess: left-padded prompt, right-padded response
        out = torch.zeros(len(samples), max_prompt + max_response, 48, 8, dtype=torch.int16)
        for i, (rows, p, _) in enumerate(samples):
            start = max_prompt - p
            out[i, start : start + rows.shape[0]] = torch.from_numpy(rows.astype(np.int16))
        return out
    if kind == "verl-jagged":  # verl's AgentLoopOutput.as_dict, one row per sample in TransferQueue
        per = []
        for rows, p, r in samples:
            t = torch.zeros(p + r, 48, 8, dtype=torch.int16)
            t[: rows.shape[0]] = torch.from_numpy(rows.astype(np.int16))
            per.append(t)
        return per
    decoded = [decode_vllm(rows, prompt_len=p, response_len=r, layout=LAYOUT) for rows, p, r in samples]
    if kind == "stable-fields":
        return [sample_fields(d, LAYOUT) for d in decoded]
    if kind == "stable-shared":  # per-sample entries, then one side entry per group, as the V1 workers put them
        sharing, entries, sides = PromptRowSharing(ARGS.share_min_bytes), [], []
        for i, (d, (_, p, _)) in enumerate(zip(decoded, samples, strict=True)):
            fields, share = shared_sample_fields(
                d, LAYOUT, sharing, prompt_len=p, uid=f"g{i // ARGS.n}", group_size=ARGS.n
            )
            entries.append(fields)
            if share.side is not None:
                sides.append({IDS_FIELD: share.side.ids})
        return entries + sides
    groups = [i // ARGS.n for i in range(len(samples))]
    return PackedRouting.pack(decoded, [p for _, p, _ in samples], groups, LAYOUT)


def payload_nbytes(obj: object) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, PackedRouting):
        return obj.nbytes
    if isinstance(obj, list) and obj and isinstance(obj[0], dict):
        return sum(v.numel() * v.element_size() for d in obj for v in d.values())
    return sum(t.numel() * t.element_size() for t in obj)


def measure(kind: str) -> dict[str, float]:
    """Child process: build one payload, move it through the running Ray cluster, report sizes and peak RSS."""
    import ray

    torch.set_num_threads(1)
    samples = engine_outputs(np.random.default_rng(0), ARGS.groups, ARGS.n, ARGS.prompt, ARGS.response)
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)

    @ray.remote
    def receive(obj: object) -> int:
        return payload_nbytes(obj)

    assert ray.get(receive.remote(torch.zeros(4))) == 16  # warm the task path outside the measurement
    gc.collect()
    base_kib = psutil.Process().memory_info().rss / 1024
    t0 = time.perf_counter()
    obj = build(kind, samples, ARGS.prompt, ARGS.response)
    ref = ray.put(obj)
    received = ray.get(receive.remote(ref))
    back = ray.get(ref)
    seconds = time.perf_counter() - t0
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    nbytes = payload_nbytes(obj)
    assert received == nbytes == payload_nbytes(back), (kind, received, nbytes)
    return {"bytes": nbytes, "obj": object_bytes(obj), "peak": (peak_kib - base_kib) * 1024, "sec": seconds}


def main() -> None:
    import ray

    samples = engine_outputs(np.random.default_rng(0), ARGS.groups, ARGS.n, ARGS.prompt, ARGS.response)
    real_tokens = sum(p + r for _, p, r in samples)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    context = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    env = {**os.environ, "RAY_ADDRESS": context.address_info["address"]}
    kinds = ["verl-padded", "verl-jagged", "stable-fields", "stable-shared", "stable-packed"]
    results: dict[str, dict[str, list[float]]] = {k: {"bytes": [], "obj": [], "peak": [], "sec": []} for k in kinds}
    argv = [f"--groups={ARGS.groups}", f"--n={ARGS.n}", f"--prompt={ARGS.prompt}", f"--response={ARGS.response}"]
    argv.append(f"--share-min-bytes={ARGS.share_min_bytes}")
    for _ in range(ARGS.rounds):
        for kind in kinds:  # interleaved, one fresh process per measurement so peaks do not mask each other
            out = subprocess.run(
                [sys.executable, __file__, *argv, f"--child={kind}"], env=env, capture_output=True, text=True
            )
            if out.returncode:
                raise RuntimeError(out.stderr[-3000:])
            for key, value in json.loads(out.stdout.strip().splitlines()[-1]).items():
                results[kind][key].append(value)
    ray.shutdown()
    packed = build("stable-packed", samples, ARGS.prompt, ARGS.response)
    fields = build("stable-fields", samples, ARGS.prompt, ARGS.response)
    padded_rows = len(samples) * (ARGS.prompt + ARGS.response)
    scale = (8192 / len(samples)) * (32768 / (ARGS.prompt + ARGS.response))
    print(
        f"batch: {ARGS.groups} prompts x n={ARGS.n} = {len(samples)} responses, {real_tokens} real tokens "
        f"({padded_rows} padded rows), 48 layers top-8 of 128 experts; {ARGS.rounds} interleaved rounds (median)"
    )
    print(
        f"{'layout':<14} {'B/real token':>13} {'object MiB':>11} {'peak MiB':>9} {'put+get s':>10} "
        f"{'vs verl-padded':>15} {'extrapolated GiB':>17}"
    )
    base = statistics.median(results["verl-padded"]["obj"]) / real_tokens
    for kind in kinds:
        obj = statistics.median(results[kind]["obj"])
        print(
            f"{kind:<14} {obj / real_tokens:>13.1f} {obj / 2**20:>11.1f} "
            f"{statistics.median(results[kind]['peak']) / 2**20:>9.1f} {statistics.median(results[kind]['sec']):>10.3f} "
            f"{obj / real_tokens / base:>14.3f}x {obj * scale / 2**30:>17.1f}"
        )
    pad_bytes = sum(t.numel() * t.element_size() for d in fields for t in [d[IDS_FIELD]]) - sum(
        (p + r - 1) * 48 * 8 for _, p, r in samples
    )
    print(
        f"stable padding bytes: {pad_bytes} (fields), prompt rows stored {packed.stats.prompt_rows_stored} of "
        f"{packed.stats.prompt_rows} (once per group: {packed.stats.prompt_rows_stored == sum(s[1] for s in samples[:: ARGS.n])})"
    )
    shared = build("stable-shared", samples, ARGS.prompt, ARGS.response)
    counters = 8 * len(BOUNDARY_COLUMNS)  # the per-sample boundary counters travel on both V1 paths
    per_sample = payload_nbytes(fields) + counters * len(samples)
    per_group = payload_nbytes(shared) + counters * len(samples)
    jagged = payload_nbytes(build("verl-jagged", samples, ARGS.prompt, ARGS.response))
    print(
        f"V1 path bytes/real token (fields + counters): per sample {per_sample / real_tokens:.1f}, per group "
        f"{per_group / real_tokens:.1f} ({per_sample / per_group:.2f}x less); verl V1 {jagged / real_tokens:.1f} "
        f"(per group = {per_group / jagged:.3f}x verl)"
    )
    print(
        f"target <= 0.5x verl bytes/real token: stable-shared (V1) "
        f"{statistics.median(results['stable-shared']['obj']) / real_tokens / base:.3f}x, stable-packed "
        f"{statistics.median(results['stable-packed']['obj']) / real_tokens / base:.3f}x"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1024, help="max prompt length (verl prompt_length)")
    parser.add_argument("--response", type=int, default=4096, help="max response length (verl response_length)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--share-min-bytes",
        type=int,
        default=DEFAULT_SHARE_MIN_BYTES,
        help="verl_stable.routing.share_prompt_rows_min_bytes of stable-shared (default: the workers' default)",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ARGS = parser.parse_args()
    if ARGS.child:
        print(json.dumps(measure(ARGS.child)))
    else:
        main()
