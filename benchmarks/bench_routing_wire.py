"""Bytes and CPU time of rollout routing on verl's wire, as the two upstream diffs store it.

Measures what ``patches/verl-0.9.1-compact-routing-encoding.diff`` (``rollout.routed_experts_encoding=compact``) and
``patches/verl-0.9.1-routing-prompt-rows-once.diff`` (``rollout.routing_prompt_rows_once``) store per real token,
against verl 0.9.1's own formats, by running the patched verl's code on real tensors:

* ``verl legacy int16 padded``: the legacy agent loop's ``routed_experts``, int16 over every decoder layer,
  zero-padded to ``prompt_length + response_length`` (what verl's main does too, since its PR 7407);
* ``verl V1 int16``: ``AgentLoopOutput.as_dict()`` as verl 0.9.1 ships it, int16 over every decoder layer and token
  position, per sample (the V1 / TransferQueue agent loop);
* ``compact``: ``as_dict(routing_layout=...)`` of the encoding diff: uint8 (<= 256 experts) MoE layers only, the fed
  rows only, plus its int32 layout field;
* ``+ prompt rows once``: the prompt-rows diff's ``PromptRowsSharing.share_`` on top (int16 or compact): the group's
  prompt rows once, each sample its later rows plus a 24-byte reference; with the default minimum (a group shares
  only when it saves >= 2 MiB) and with every group shared.

It copies the installed verl 0.9.1 to a temporary directory, applies the two diffs' ``verl/`` parts there with
``git apply`` and imports that copy (it prints the path), so it measures the diffs, not a re-implementation. The
routing is synthetic but real-shaped: distinct expert ids per (token, MoE layer) row, zero rows in dense layers, the
group's ``n`` samples share their prompt rows (one prompt, as a deterministic engine routes it).

CPU time per step: encoding (validation + compaction in the agent loop, every sample of the batch), decoding (the
actor's expansion back to int16 ``routed_experts`` for the batch), verl's own int16 ``as_dict`` conversion as the
baseline, and the prompt-rows split / re-attach (without the TransferQueue round trips, which
``benchmarks/bench_side_entry_cost.py`` measures). Median of ``--reps`` runs, one thread.

    python benchmarks/bench_routing_wire.py [--groups 4] [--n 8] [--reps 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PATCHES = Path(__file__).resolve().parents[1] / "patches"
DIFFS = ("verl-0.9.1-compact-routing-encoding.diff", "verl-0.9.1-routing-prompt-rows-once.diff")
MIB = 1 << 20


@dataclass(frozen=True)
class Shape:
    """A model's routing shape."""

    name: str
    layers: int
    first_dense: int
    top_k: int
    experts: int


SHAPES = (
    Shape("Qwen3-30B-A3B (48 layers, all MoE, top-8 of 128)", 48, 0, 8, 128),
    Shape("DeepSeek-V3 (61 layers, 58 MoE, top-8 of 256)", 61, 3, 8, 256),
)
# (prompt tokens, response tokens, varied): every sample at those lengths, or (varied) each group's prompt and each
# sample's response drawn uniformly from [1/8, 1] of them; the padded legacy width is always their sum
BATCHES = ((1024, 4096, False), (1024, 4096, True), (4096, 1024, False), (256, 4096, False))


def _load_patched_tree():
    """``patches/tools/patched_tree.py`` (copy verl, apply a diff), loaded by path: ``patches/tools`` is no package."""
    spec = importlib.util.spec_from_file_location("patched_tree", PATCHES / "tools" / "patched_tree.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def patched_verl(workdir: Path) -> Path:
    """A copy of the installed verl with the two diffs' verl/ parts applied; returns the directory holding verl/.

    The installed verl is located, not imported, so that ``main`` can import the patched copy afterwards.
    """
    pt = _load_patched_tree()
    try:
        return pt.patched_copy(workdir, [PATCHES / name for name in DIFFS], include="verl/*")
    except ModuleNotFoundError as exc:
        raise SystemExit(str(exc)) from exc
    except pt.DiffDoesNotApply as exc:
        raise SystemExit(f"{exc.diff.name} does not apply to the installed verl: {exc.applied.message}") from exc


def engine_rows(rng: np.random.Generator, rows: int, shape: Shape) -> np.ndarray:
    """vLLM layout ``[rows, layers, top_k]`` uint8: distinct ids per MoE (token, layer), dense layers zero."""
    out = np.zeros((rows, shape.layers, shape.top_k), dtype=np.uint8)
    moe = shape.layers - shape.first_dense
    base = rng.integers(0, shape.experts, size=(rows, moe, 1))
    step = rng.integers(1, shape.experts // shape.top_k + 1, size=(rows, moe, 1))
    # base + k * step (mod E) with k * step < E: top_k distinct ids
    out[:, shape.first_dense :] = (base + np.arange(shape.top_k) * step) % shape.experts
    return out


def median_ms(fn, reps: int) -> float:
    """Median wall time of ``reps`` calls of ``fn``, in ms."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(shape: Shape, max_prompt: int, max_response: int, varied: bool, groups: int, n: int, reps: int) -> None:
    """Print the bytes per real token of every format and the CPU time per step for one shape and batch."""
    import torch
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
    from verl.utils.rollout_routing import ROUTING_IDS_KEY, ROUTING_LAYOUT_KEY, RoutingLayout, expand_compact_routing_
    from verl.utils.routing_prompt_rows import DEFAULT_MIN_BYTES, PROMPT_REF_KEY, PromptRowsSharing, attach_prompt_rows_
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    rng = np.random.default_rng(0)
    layout = RoutingLayout(shape.layers, tuple(range(shape.first_dense, shape.layers)), shape.top_k, shape.experts)
    outputs, prompt_lens = [], []
    for _ in range(groups):
        prompt_len = int(rng.integers(max_prompt // 8, max_prompt + 1)) if varied else max_prompt
        prompt = engine_rows(rng, prompt_len, shape)
        for _ in range(n):
            response_len = int(rng.integers(max_response // 8, max_response + 1)) if varied else max_response
            prompt_lens.append(prompt_len)
            routing = np.concatenate([prompt, engine_rows(rng, response_len - 1, shape)])
            outputs.append(
                AgentLoopOutput(
                    prompt_ids=[1] * prompt_len,
                    response_ids=[2] * response_len,
                    response_mask=[1] * response_len,
                    routed_experts=routing,
                    metrics=AgentLoopMetrics(),
                )
            )
    lengths = [len(o.prompt_ids) + len(o.response_ids) for o in outputs]
    tokens = sum(lengths)
    padded = len(outputs) * (max_prompt + max_response) * shape.layers * shape.top_k * 2

    int16 = [o.as_dict() for o in outputs]
    compact = [o.as_dict(routing_layout=layout, response_length=max_response) for o in outputs]
    v1_bytes = sum(f["routed_experts"].nbytes for f in int16)
    compact_bytes = sum(f[ROUTING_IDS_KEY].nbytes + f[ROUTING_LAYOUT_KEY].nbytes for f in compact)

    def share_groups(stored: list[dict], min_bytes: int) -> tuple[list[dict], list]:
        """Each sample's tensor fields as stored with prompt rows once, and the side entries put (one per shared
        group)."""
        sharing, kept, entries = PromptRowsSharing(min_bytes), [], []
        for g in range(groups):
            sharing.open_group("train", f"g{g}", n)
            for s in range(n):
                fields = {k: v for k, v in stored[g * n + s].items() if isinstance(v, torch.Tensor)}
                entry = sharing.share_(fields, prompt_lens[g * n + s], "train", f"g{g}")
                if entry is not None:
                    entries.append(entry)
                kept.append(fields)
        return kept, entries

    def shared_bytes(stored: list[dict], min_bytes: int) -> tuple[int, int]:
        """Bytes stored with prompt rows once (samples' routing + layout + reference, plus the side entries)."""
        kept, entries = share_groups(stored, min_bytes)
        names = ("routed_experts", ROUTING_IDS_KEY, ROUTING_LAYOUT_KEY, PROMPT_REF_KEY)
        samples = sum(fields[name].nbytes for fields in kept for name in names if name in fields)
        return samples + sum(entry.rows.nbytes for entry in entries), len(entries)

    sizes = f"prompt U[{max_prompt // 8}, {max_prompt}] per group, response U[{max_response // 8}, {max_response}]"
    sizes = sizes if varied else f"prompt {max_prompt} + response {max_response}"
    print(f"\n{shape.name}; batch: {groups} groups x n={n}, {sizes} tokens ({tokens} real tokens)")
    print(f"{'format':58s} {'B/token':>9s} {'vs V1 int16':>12s} {'vs padded':>10s}  MiB/batch")

    def row(name: str, nbytes: int) -> None:
        per = nbytes / tokens
        print(f"{name:58s} {per:9.1f} {nbytes / v1_bytes:11.3f}x {nbytes / padded:9.3f}x  {nbytes / MIB:9.1f}")

    row("verl legacy int16 padded (prompt_length + response_length)", padded)
    row("verl V1 int16 per sample (0.9.1 as_dict)", v1_bytes)
    row("compact (routed_experts_encoding=compact)", compact_bytes)
    for label, stored in (("int16", int16), ("compact", compact)):
        for min_bytes in (DEFAULT_MIN_BYTES, 0):
            nbytes, shared = shared_bytes(stored, min_bytes)
            row(f"{label} + prompt rows once (min {min_bytes // MIB} MiB: {shared}/{groups} groups)", nbytes)

    torch.set_num_threads(1)
    batch = list_of_dict_to_tensordict([dict(f) for f in compact])
    batch["input_ids"] = torch.nested.as_nested_tensor(
        [torch.ones(n_, dtype=torch.int64) for n_ in lengths], layout=torch.jagged
    )
    t_int16 = median_ms(lambda: [o.as_dict() for o in outputs], reps)
    t_encode = median_ms(
        lambda: [o.as_dict(routing_layout=layout, response_length=max_response) for o in outputs], reps
    )
    t_decode = median_ms(lambda: expand_compact_routing_(batch.clone()), reps)

    side: dict[str, torch.Tensor] = {}

    def split_all() -> list[dict]:
        stored, entries = share_groups(compact, 0)
        side.update((entry.key, entry.rows) for entry in entries)
        return stored

    t_split = median_ms(split_all, reps)
    shared = list_of_dict_to_tensordict(split_all())

    def side_get(keys, partition_id, select_fields):  # TransferQueue's read, from memory: CPU work only
        return list_of_dict_to_tensordict([{"rows": side[key]} for key in keys])

    t_attach = median_ms(lambda: attach_prompt_rows_(shared.clone(), kv_batch_get=side_get), reps)
    print(
        f"CPU ms per step ({len(outputs)} samples, {tokens} tokens, 1 thread): verl int16 as_dict {t_int16:.0f}; "
        f"compact encode (validate + compact) {t_encode:.0f}, decode (expand to int16) {t_decode:.0f}; "
        f"prompt rows once: split {t_split:.0f}, re-attach {t_attach:.0f} (without the TransferQueue round trips)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=4, help="prompt groups per batch")
    parser.add_argument("--n", type=int, default=8, help="rollout.n")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions (median)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = patched_verl(Path(tmp))
        sys.path.insert(0, str(root))
        import verl

        print(f"patched verl: {Path(verl.__file__).parent} (diffs: {', '.join(DIFFS)})")
        for shape in SHAPES:
            for prompt_len, response_len, varied in BATCHES:
                measure(shape, prompt_len, response_len, varied, args.groups, args.n, args.reps)


if __name__ == "__main__":
    main()
