"""What the FSDP actor pays per call to turn the compact transport's fields into replay targets.

Two paths from the same batch of compact fields (uint8 ids over MoE layers, one span per sample), each ending in the
rows the replay engine aligns (MoE layers, a mask of rows with data):

* ``verl form``: :func:`~verl_stable.transport.expansion.expand_compact_routing` (verl's jagged int16 over all
  decoder layers), then the engine's ``select_layers`` + ``check_id_range`` -- the FSDP path up to session 16 and
  still the path of verl's own ``routed_experts`` (no compact transport);
* ``MoE rows``: :func:`~verl_stable.transport.expansion.attach_moe_routing` (the MoE-layer rows in uint8, checked
  once), read as they are -- the FSDP path now.

Prints the median milliseconds per call over interleaved rounds, the ratio, and the bytes of the routing field each
path leaves in the batch (which verl's micro-batch split then indexes). Model shapes: Qwen3-30B-A3B (every layer
MoE: only the dtype differs) and DeepSeek-V3 (3 dense layers of 61, 256 experts). No verl trainer; torch only.

    python benchmarks/bench_actor_routing.py [--samples 16] [--prompt 1024] [--response 2048] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from tensordict import TensorDict

from verl_stable.routing import alignment
from verl_stable.routing.checks import check_id_range
from verl_stable.routing.trace import RoutingLayout
from verl_stable.transport.expansion import MOE_ROUTING_FIELD, attach_moe_routing, expand_compact_routing
from verl_stable.transport.fields import IDS_FIELD, SPAN_FIELD

SHAPES = {
    "Qwen3-30B-A3B (48 MoE layers, top-8 of 128)": RoutingLayout(
        "qwen3_moe", "qwen3_moe", 48, tuple(range(48)), 8, 128
    ),
    "DeepSeek-V3 (58 MoE of 61 layers, top-8 of 256)": RoutingLayout(
        "deepseek_v3", "deepseek_v3", 61, tuple(range(3, 61)), 8, 256
    ),
}


def compact_batch(layout: RoutingLayout, samples: int, prompt: int, response: int, seed: int) -> TensorDict:
    """A batch as the agent-loop workers store it: routing for every position but the last sampled token."""
    rng = np.random.default_rng(seed)
    lengths = [prompt + int(rng.integers(response // 2, response + 1)) for _ in range(samples)]
    ids, spans, tokens = [], [], []
    for length in lengths:
        rows = length - 1
        scores = rng.random((rows, layout.num_moe_layers, layout.num_experts), dtype=np.float32)
        ids.append(
            torch.from_numpy(np.argpartition(scores, -layout.top_k, axis=-1)[..., -layout.top_k :]).to(torch.uint8)
        )
        spans.append(torch.tensor([0, rows]))
        tokens.append(torch.ones(length, dtype=torch.long))
    return TensorDict(
        {
            "input_ids": torch.nested.as_nested_tensor(tokens, layout=torch.jagged),
            IDS_FIELD: torch.nested.as_nested_tensor(ids, layout=torch.jagged),
            SPAN_FIELD: torch.stack(spans),
        },
        batch_size=[samples],
    )


def verl_form(batch: TensorDict, layout: RoutingLayout) -> tuple[torch.Tensor, int]:
    expand_compact_routing(batch, layout)
    field = batch["routed_experts"]
    moe = alignment.select_layers(field.values(), layout.moe_layers)
    check_id_range(moe, layout.num_experts)
    alignment.rows_with_data(moe)
    return moe, field.values().nbytes


def moe_rows(batch: TensorDict, layout: RoutingLayout) -> tuple[torch.Tensor, int]:
    attach_moe_routing(batch, layout)
    field = batch[MOE_ROUTING_FIELD]
    moe = field.values()
    alignment.rows_with_data(moe)
    return moe, field.values().nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--response", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name, layout in SHAPES.items():
        base = compact_batch(layout, args.samples, args.prompt, args.response, seed=0)
        old_moe, old_bytes = verl_form(base.clone(), layout)
        new_moe, new_bytes = moe_rows(base.clone(), layout)
        if not torch.equal(old_moe.long(), new_moe.long()):
            raise SystemExit(f"{name}: the two paths disagree")
        times: dict[str, list[float]] = {"verl form": [], "MoE rows": []}
        for r in range(args.rounds):
            order = (("verl form", verl_form), ("MoE rows", moe_rows))
            for label, path in order if r % 2 == 0 else order[::-1]:  # alternate the order: no path always first
                batch = base.clone()
                t0 = time.perf_counter()
                path(batch, layout)
                times[label].append(time.perf_counter() - t0)
        old_ms, new_ms = (1e3 * statistics.median(times[k]) for k in ("verl form", "MoE rows"))
        print(
            f"{name}, {args.samples} samples, {int(base['input_ids'].offsets()[-1])} tokens: "
            f"verl form {old_ms:.1f} ms, MoE rows {new_ms:.1f} ms per call ({new_ms / old_ms:.2f}x); "
            f"routing field {old_bytes / 2**20:.1f} MiB -> {new_bytes / 2**20:.1f} MiB ({new_bytes / old_bytes:.2f}x)"
        )


if __name__ == "__main__":
    main()
