"""R3 replay's cost in verl's real Megatron engine (CPU), and the routing bytes per token that reach the actors.

Part 1, time. verl 0.9.1's ``MegatronEngineWithLMHead`` built through ``EngineRegistry`` on the Megatron CPU
runtime (tiny Qwen3-MoE of the toy assets: 4 layers, top-4 of 16 experts, bf16 -- verl's Megatron engine takes
bf16 or fp16 only), one batch of packed sequences, two passes through ``forward_backward_batch``:

* ``forward``: ``infer_batch`` in eval mode, what ``compute_log_prob`` runs;
* ``update``: forward + backward in train mode (no optimizer step, so every round sees the same weights).

Variants, interleaved every round (``off``, ``idle`` and the pair ``R3`` / ``R3+metrics`` in shuffled order, the pair
run twice in ABBA order, so that the pass after the other process's -- which finds the caches cold -- falls on each
of the two equally often):

* ``off``: an engine built with ``router_replay.mode=disabled``, in a process where verl's router patch
  (``apply_router_replay_patch``, class-wide on megatron's ``TopKRouter``) was never applied: megatron's own routing;
* ``idle``: an engine built with ``mode=R3`` (verl applies the patch at construction: the mode cannot be switched on
  later), batch flag ``enable_routing_replay=False``: the patched routing, nothing replayed;
* ``R3``: the same R3 engine replaying routes (``routed_experts`` + ``enable_routing_replay=True``) through verl's
  own ``forward_backward_batch``. The routes are the model's own native choices, read from the ``off`` engine's
  routers, so the expert work is identical to ``off``; the script checks that replay reproduces ``off``'s log-probs
  (and that random routes move them, so the replay is really on);
* ``R3+metrics``: the same through the engine class the project registers (verl's engine with the replay metrics of
  ``verl_stable.integration.megatron_replay``), i.e. replay as a verl-stable run does it. With ``--interval N`` a
  round stands for a training step and the metrics measure one round in N, as
  ``stable.monitor.replay_metrics_interval=N`` does (the other rounds' batches say ``stable_replay_metrics=False``;
  ``R3`` runs on that same batch object): printed besides, the ratio per block of N rounds and the measured and
  sampled-out rounds apart.

The patch is process-wide, so ``off`` lives in one spawned process and ``idle`` / ``R3`` in another (two gloo
worlds of one rank each); the parent sends one pass at a time, so the two never run at once. Each pass's time is
the CPU time of the child's compute thread (``--threads 1`` by default: load on a shared host inflates it less
than wall time) and its wall time; per round the ratios to ``off`` (and ``R3`` to ``idle``, and ``R3+metrics`` to
``R3``, the same engine); printed: median and IQR over the rounds. Because those ratios scatter by several percent on
a loaded host, the script also counts the thread CPU time spent inside verl's replay code (:func:`count_replay_work`)
as a share of each ``R3`` pass, and inside verl-stable's replay metrics (:func:`count_metrics_work`) as a share of
each ``R3+metrics`` pass, which load does not inflate the same way: the metrics' cost is ``1 / (1 - share)``.

Part 2, bytes. Routing per real token as the actors read it from TransferQueue, for the tiny model at the CPU
recipe's lengths and at long lengths, and for Qwen3-30B-A3B's shape (48 layers, all MoE, top-8 of 128):

* ``verl V1``: verl's agent loop puts int16 ``[P + R, num_layers, top_k]`` per sample (``AgentLoopOutput.as_dict``
  pads the rollout's ``P + R - 1`` recorded rows with one zero row); ``verl legacy``: the same zero-padded to
  ``max_prompt + max_response`` for every sample;
* ``compact``: verl-stable's per-sample fields (:func:`~verl_stable.transport.fields.sample_fields`: ids in the
  smallest unsigned dtype -- uint8 -- over MoE layers, recorded rows only, plus an int64 span), without prompt-row
  sharing; ``compact shared``: what the V1 agent-loop workers put by default
  (:func:`~verl_stable.transport.sharing.shared_sample_fields`, a 24-byte prompt reference per sample, a group's
  prompt rows once in a side entry when that saves at least ``share_prompt_rows_min_bytes``), and the same with every
  group sharing. The per-sample boundary counters go to the driver's monitor only and are not counted.

Each pass also reports the thread CPU time spent in Python's garbage collector (a collection lands on whichever pass
allocates past the threshold, whoever made the garbage).

Run: ``python benchmarks/bench_megatron_replay.py [--rounds 20] [--threads 1] [--interval 1] [--bytes-only]``
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing as mp
import os
import random
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from verl_stable.routing.codecs import decode_vllm
from verl_stable.routing.trace import RoutingLayout
from verl_stable.toy.assets import AssetSpec
from verl_stable.transport.fields import sample_fields
from verl_stable.transport.options import DEFAULT_SHARE_MIN_BYTES
from verl_stable.transport.sharing import PromptRowSharing, shared_sample_fields

QWEN3_30B_A3B = RoutingLayout("qwen3_moe", "qwen3_moe", 48, tuple(range(48)), 8, 128)
VARIANTS = ("off", "idle", "R3", "R3+metrics")
PHASES = ("forward", "update")


# ================================================================================================== part 2: bytes
def tiny_layout(spec: AssetSpec) -> RoutingLayout:
    """The toy assets' routing layout (every decoder layer is MoE: ``decoder_sparse_step=1``)."""
    layers = spec.num_hidden_layers
    return RoutingLayout(
        "qwen3_moe", "qwen3_moe", layers, tuple(range(layers)), spec.num_experts_per_tok, spec.num_experts
    )


def rollout_rows(
    layout: RoutingLayout, groups: int, n: int, max_prompt: int, max_response: int, seed: int = 0
) -> list[tuple[np.ndarray, int, int, int]]:
    """vLLM-layout routing per sample (prompt rows identical within a group): ``(rows, prompt, response, group)``.

    Lengths as ``bench_routing_transport.py`` draws them: prompts U[P/4, P], responses U[R/64, R] (at least 1).
    """
    rng = np.random.default_rng(seed)
    layers, top_k, experts = layout.num_hidden_layers, layout.top_k, layout.num_experts
    spread = experts // top_k * np.arange(top_k)  # r + (E/K) k mod E: K distinct ids per row, cheaply
    samples = []
    for g in range(groups):
        p = int(rng.integers(max(1, max_prompt // 4), max_prompt + 1))
        prompt_rows = (rng.integers(0, experts, (p, layers, 1)) + spread) % experts
        for _ in range(n):
            r = int(rng.integers(max(1, max_response // 64), max_response + 1))
            resp_rows = (rng.integers(0, experts, (r - 1, layers, 1)) + spread) % experts
            samples.append((np.concatenate([prompt_rows, resp_rows]).astype(np.uint8), p, r, g))
    return samples


def tensor_bytes(fields: dict[str, torch.Tensor]) -> int:
    """Bytes of a sample's tensors."""
    return sum(t.numel() * t.element_size() for t in fields.values())


def routing_bytes(
    layout: RoutingLayout, groups: int, n: int, max_prompt: int, max_response: int
) -> tuple[int, dict[str, int]]:
    """Real tokens of a synthetic batch and the routing bytes of each layout for it."""
    samples = rollout_rows(layout, groups, n, max_prompt, max_response)
    real = sum(p + r for _, p, r, _ in samples)
    width = 2 * layout.num_hidden_layers * layout.top_k  # int16 per (token, decoder layer, k)
    decoded = [decode_vllm(rows, prompt_len=p, response_len=r, layout=layout) for rows, p, r, _ in samples]
    out = {
        "verl V1": sum((p + r) * width for _, p, r, _ in samples),
        "verl legacy": len(samples) * (max_prompt + max_response) * width,
        "compact": sum(tensor_bytes(sample_fields(d, layout)) for d in decoded),
    }
    for name, minimum in (("compact shared", DEFAULT_SHARE_MIN_BYTES), ("compact shared, every group", 0)):
        sharing, total = PromptRowSharing(minimum), 0
        for d, (_, p, _, g) in zip(decoded, samples, strict=True):
            fields, share = shared_sample_fields(d, layout, sharing, prompt_len=p, uid=f"g{g}", group_size=n)
            total += tensor_bytes(fields)
            if share.side is not None:  # the group's side entry, read once per data-parallel rank that holds it
                total += share.side.ids.numel() * share.side.ids.element_size()
        out[name] = total
    return real, out


def print_bytes(spec: AssetSpec, long_groups: int) -> None:
    """Part 2's table."""
    cases = [
        ("tiny, CPU recipe lengths", tiny_layout(spec), 4, 4, 16, 4),
        ("tiny, prompts <= 1k, responses <= 4k", tiny_layout(spec), long_groups, 8, 1024, 4096),
        ("Qwen3-30B-A3B, prompts <= 1k, responses <= 4k", QWEN3_30B_A3B, long_groups, 8, 1024, 4096),
    ]
    print("[bytes] routing bytes per real token the actors read (TransferQueue payload per sample, side entries)")
    for label, layout, groups, n, prompt, response in cases:
        real, sizes = routing_bytes(layout, groups, n, prompt, response)
        print(
            f"  {label}: {layout.num_hidden_layers} layers, top-{layout.top_k} of {layout.num_experts}; "
            f"{groups} prompts x n={n}, {real} real tokens"
        )
        base = sizes["verl V1"]
        for name, nbytes in sizes.items():
            print(f"    {name:<28} {nbytes / real:9.2f} B/token  {nbytes / base:7.3f}x verl V1")


# =================================================================================================== part 1: time
def free_port() -> int:
    """A free local TCP port for a child's gloo world (fixed ports collide with other jobs on a shared host)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_engine(model_dir: str, mode: str, micro_batch: int) -> Any:
    """verl's Megatron language-model engine on the CPU runtime, initialized (model, DDP, optimizer)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import EngineRouterReplayConfig, HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.engine.base import EngineRegistry

    from verl_stable.cpu.megatron.options import TRANSFORMER_CONFIG

    engine = EngineRegistry.new(
        model_type="language_model",
        backend="megatron",
        model_config=HFModelConfig(path=model_dir),
        engine_config=McoreEngineConfig(
            strategy="megatron",
            vanilla_mbridge=True,
            sequence_parallel=False,
            override_transformer_config=dict(TRANSFORMER_CONFIG),
            router_replay=EngineRouterReplayConfig(mode=mode),
            use_dynamic_bsz=False,
            micro_batch_size_per_gpu=micro_batch,
            infer_micro_batch_size_per_gpu=micro_batch,
        ),
        optimizer_config=McoreOptimizerConfig(lr=1e-3, total_training_steps=10),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine


def lengths_of(args: argparse.Namespace) -> list[int]:
    """The batch's sequence lengths (fixed by ``--seed``)."""
    rng = random.Random(args.seed)
    return [rng.randint(args.min_len, args.max_len) for _ in range(args.batch)]


def make_batch(args: argparse.Namespace, vocab: int, routes: torch.Tensor | None, measured: bool = True) -> Any:
    """The TensorDict verl's Megatron engine receives: jagged ids / positions / masks, optional routes; ``measured``
    False marks it as a step the monitored trainer samples out (``stable.monitor.replay_metrics_interval``)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    from verl_stable.integration.megatron_replay import REPLAY_METRICS_FLAG

    lengths = lengths_of(args)
    responses = [max(1, n // 2) for n in lengths]
    gen = torch.Generator().manual_seed(args.seed)
    nested = torch.nested.nested_tensor_from_jagged

    def offsets(sizes: list[int]) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()])

    total = sum(lengths)
    fields = {
        "input_ids": nested(torch.randint(1, vocab, (total,), generator=gen), offsets=offsets(lengths)),
        "position_ids": nested(torch.cat([torch.arange(n) for n in lengths]), offsets=offsets(lengths)),
        "loss_mask": nested(torch.ones(total, dtype=torch.int64), offsets=offsets(lengths)),
        "response_mask": nested(torch.ones(sum(responses), dtype=torch.int64), offsets=offsets(responses)),
    }
    if routes is not None:
        fields["routed_experts"] = nested(routes, offsets=offsets(lengths))
    td = TensorDict(fields, batch_size=[len(lengths)])
    tu.assign_non_tensor(
        td,
        use_remove_padding=True,
        temperature=1.0,
        pad_token_id=0,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=args.micro_batch,
        return_model_output=True,
        enable_routing_replay=routes is not None,
    )
    if not measured:
        tu.assign_non_tensor(td, **{REPLAY_METRICS_FLAG: False})
    return td


def sum_logp_loss(model_output: dict, data: Any, dp_group: Any = None) -> tuple[torch.Tensor, dict]:
    """A loss reaching every log-prob, so the backward runs through every expert and router."""
    return -model_output["log_probs"].values().float().sum(), {}


def own_routes(engine: Any, data: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's native top-k ids per (token, MoE layer), read from its routers' outputs, and its log-probs."""
    found = [m for m in engine.module[0].modules() if type(m).__name__ == "TopKRouter"]
    maps: list[list[torch.Tensor]] = [[] for _ in found]
    handles = [r.register_forward_hook(lambda m, a, o, i=i: maps[i].append(o[1].detach())) for i, r in enumerate(found)]
    try:
        with engine.eval_mode():
            out = engine.infer_batch(data, loss_function=None)
    finally:
        for handle in handles:
            handle.remove()
    top_k = engine.tf_config.moe_router_topk
    # world size 1: a micro-batch's router rows are its samples' tokens back to back, micro-batches in order
    layers = [torch.cat(m) for m in maps]
    ids = [m.nonzero()[:, 1].view(m.shape[0], top_k) for m in layers]
    return torch.stack(ids, dim=1).to(torch.int16), out["model_output"]["log_probs"].values().float()


# verl's replay steps, as transformer_impl's forward_step calls them (names bound in that module)
REPLAY_FUNCTIONS = (
    "align_r3_router_replay_data",
    "build_r3_replay_mask",
    "set_router_replay_data",
    "set_model_router_replay_action",
)


def count_replay_work(spent: list[float]) -> None:
    """Add the thread CPU time spent inside verl's replay code to ``spent[0]`` from now on (this process).

    Counted: the route alignment, R3 mask, target packing / scatter and action switches of ``forward_step``, and each
    router's ``get_replay_topk`` while it replays (which computes the native top-k too, for the mask, then gathers the
    replayed scores). Not counted: verl's patched routing around it, which ``idle`` measures.
    """
    import verl.workers.engine.megatron.transformer_impl as impl
    from verl.utils.megatron.router_replay_patch import RouterReplay, RouterReplayAction

    def timed(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.thread_time() - start

        return wrapper

    for name in REPLAY_FUNCTIONS:
        setattr(impl, name, timed(getattr(impl, name)))
    original, replaying = RouterReplay.get_replay_topk, timed(RouterReplay.get_replay_topk)
    actions = (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD)

    def get_replay_topk(self: Any, *args: Any, **kwargs: Any) -> Any:
        return (replaying if self.router_replay_action in actions else original)(self, *args, **kwargs)

    RouterReplay.get_replay_topk = get_replay_topk


def count_metrics_work(spent: list[float]) -> None:
    """Add the thread CPU time spent inside verl-stable's replay metrics to ``spent[0]`` from now on (this process).

    Counted (outermost call only, so nested calls count once): the per-pass hook set-up and report
    (``_attach_hooks``, ``_report`` with its group sums), each micro-batch's token classes (``_router_rows`` and the
    row layout it returns), the audit's ``begin`` / ``flush`` / ``table``, and every router hook and model-chunk
    pre-hook call. Not counted: the native-choice tap's wrapper around verl's ``get_replay_topk`` (a closure and a
    dict entry per router call; verl's own work inside it is ``count_replay_work``'s).
    """
    from verl_stable.integration import megatron_audit, megatron_replay

    depth = [0]

    def timed(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            start = time.thread_time()
            try:
                result = fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    spent[0] += time.thread_time() - start
            return timed(result) if callable(result) and fn.__name__ in TIMED_FACTORIES else result

        return wrapper

    mixin = megatron_replay.MegatronReplayMetricsMixin
    for name in ("_attach_hooks", "_report", "_router_rows", "_capture_packing"):
        setattr(mixin, name, timed(getattr(mixin, name)))
    for name in ("begin", "flush", "table"):
        setattr(megatron_audit.Audit, name, timed(getattr(megatron_audit.Audit, name)))
    megatron_replay.router_hook = timed(megatron_audit.router_hook)


def count_gc_work(spent: list[float]) -> None:
    """From now on add the thread CPU time of every garbage collection in this process to ``spent[0]``, and count
    the full (oldest-generation) ones in ``spent[1]``: a collection falls on whichever pass allocates past the
    threshold, whichever code made the garbage."""
    import gc

    started: list[float] = [0.0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.thread_time()
        else:
            spent[0] += time.thread_time() - started[0]
            spent[1] += info["generation"] == 2

    gc.callbacks.append(callback)


# the functions that return a callable the metrics call later (a hook, the row layout): that callable is timed too
TIMED_FACTORIES = ("router_hook", "_router_rows", "_capture_packing")


def forward_backward(engine: Any, data: Any, phase: str, audit: bool) -> dict:
    """One pass through ``forward_backward_batch``: ``forward`` as ``infer_batch`` runs it, ``update`` with backward.

    ``audit=False`` calls verl's own ``forward_backward_batch`` past the project's replay-metrics mixin (which measures
    around it; it is a no-op without replay), inside the Megatron CPU runtime as the CPU engine class's methods are.
    """
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from verl_stable.cpu.megatron.runtime import megatron_cpu_runtime

    forward_only = phase == "forward"
    loss = None if forward_only else sum_logp_loss
    with contextlib.ExitStack() as stack:
        stack.enter_context(engine.eval_mode() if forward_only else engine.train_mode())
        if forward_only:
            stack.enter_context(torch.no_grad())  # as verl's infer_batch
        if audit:
            out = engine.forward_backward_batch(data, loss, forward_only=forward_only)
        else:
            with megatron_cpu_runtime():
                out = MegatronEngineWithLMHead.forward_backward_batch(engine, data, loss, forward_only=forward_only)
        if not forward_only:
            engine.optimizer_zero_grad()
    return out


def child(conn: Any, modes: tuple[str, ...], model_dir: str, log: str, args: argparse.Namespace) -> None:
    """A process holding one engine per mode in ``modes``; runs the passes the parent asks for, one at a time."""
    with open(log, "w") as out:  # megatron and verl print a lot while building; kept for a failure's diagnosis
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    os.environ["VERL_PLATFORM"] = "cpu"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.set_num_threads(args.threads)
    from verl_stable.cpu import runtime

    runtime.register()  # verl's Megatron engines for device cpu, under the Megatron CPU runtime
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    engines = {mode: build_engine(model_dir, mode, args.micro_batch) for mode in modes}
    inside, metrics, collected = [0.0], [0.0], [0.0, 0.0]
    count_gc_work(collected)
    if "R3" in modes:
        count_replay_work(inside)
        count_metrics_work(metrics)
    vocab = int(next(iter(engines.values())).model_config.hf_config.vocab_size)
    batches: dict[str, Any] = {"plain": make_batch(args, vocab, None)}
    conn.send("ready")
    while True:
        request = conn.recv()
        if request[0] == "stop":
            break
        if request[0] == "own_routes":
            conn.send(own_routes(engines[request[1]], batches["plain"]))
        elif request[0] == "routes":  # ("routes", batch name, routes, measured)
            batches[request[1]] = make_batch(args, vocab, request[2], request[3])
            conn.send("ok")
        else:  # ("run", mode, batch name, phase, audit)
            _, mode, batch, phase, audit = request
            inside[0] = metrics[0] = collected[0] = collected[1] = 0.0
            start, wall = time.thread_time(), time.perf_counter()
            out = forward_backward(engines[mode], batches[batch], phase, audit)
            spent, wall = time.thread_time() - start, time.perf_counter() - wall
            logp = out["model_output"]["log_probs"].values().float() if phase == "forward" else None
            conn.send((spent, wall, logp, inside[0], metrics[0], collected[0], collected[1]))
    torch.distributed.destroy_process_group()


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """25th, 50th, 75th percentiles."""
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[1], q[2]


def time_replay(spec: AssetSpec, args: argparse.Namespace) -> None:
    """Part 1: build the engines in two spawned processes, interleave the passes, print ratios."""
    from verl_stable.toy.assets import ensure_assets

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_megatron_replay_"))
    model_dir = str(ensure_assets(workdir / "assets", spec).model_dir)
    ctx = mp.get_context("spawn")
    procs, conns, logs = {}, {}, {}
    for name, modes in (("plain", ("disabled",)), ("replay", ("R3",))):
        parent, child_end = ctx.Pipe()
        logs[name] = str(workdir / f"{name}.log")
        procs[name] = ctx.Process(target=child, args=(child_end, modes, model_dir, logs[name], args), daemon=True)
        procs[name].start()
        conns[name] = parent
    where = {  # variant -> process, (mode, batch, audit)
        "off": ("plain", ("disabled", "plain", False)),
        "idle": ("replay", ("R3", "plain", False)),
        "R3": ("replay", ("R3", "own", False)),
        "R3+metrics": ("replay", ("R3", "own", True)),
    }

    def ask(name: str, request: tuple) -> Any:
        conns[name].send(request)
        try:
            return conns[name].recv()
        except EOFError:
            raise RuntimeError(f"the {name} engine process died; its output: {logs[name]}") from None

    def run(variant: str, phase: str, measured: bool = True) -> tuple[Any, ...]:
        name, (mode, batch, audit) = where[variant]
        if variant in ("R3", "R3+metrics") and not measured:
            # R3 (verl's replay alone) ignores the flag; it gets the same batch object all the same: a pass over
            # another copy of the same batch measured ~1 % apart (where its tensors sit in memory)
            batch = "own_unmeasured"
        return ask(name, ("run", mode, batch, phase, audit))

    try:
        for name in procs:
            try:
                ready = conns[name].recv()
            except EOFError:
                ready = None
            if ready != "ready":
                raise RuntimeError(f"the {name} engine process failed to start; its output: {logs[name]}")
        routes, off_logp = ask("plain", ("own_routes", "disabled"))
        ask("replay", ("routes", "own", routes, True))
        ask("replay", ("routes", "own_unmeasured", routes, False))
        # random distinct top-k: proves the R3 variant replays (log-probs move), not only that it runs
        gen = torch.Generator().manual_seed(args.seed)
        experts = spec.num_experts
        random_routes = torch.rand(*routes.shape[:2], experts, generator=gen).argsort(-1)[..., : routes.shape[2]]
        ask("replay", ("routes", "random", random_routes.to(torch.int16), True))
        logps = {v: run(v, "forward")[2] for v in VARIANTS}
        moved = ask("replay", ("run", "R3", "random", "forward", False))[2]
        rng = random.Random(args.seed)
        kinds = ("cpu", "wall", "inside", "metrics", "gc", "gc_full")
        times = {(v, p, k): [] for v in VARIANTS for p in PHASES for k in kinds}
        for round_ in range(args.warmup + args.rounds):
            for phase in PHASES:
                # the two variants of the same engine back to back, twice, in ABBA (BAAB every other round) order: the
                # pass that follows the other process's pass finds its caches cold, and ABBA gives each variant that
                # pass equally often within a round
                pair = ["R3", "R3+metrics"] if round_ % 2 == 0 else ["R3+metrics", "R3"]
                blocks = [["off"], ["idle"], pair + pair[::-1]]
                rng.shuffle(blocks)
                # per variant its passes' (CPU, wall, replay share, metrics share, GC time, full collections)
                passes: dict[str, list[tuple[float, ...]]] = {v: [] for v in VARIANTS}
                # a round is a training step: with --interval N, the metrics measure one round in N (the first)
                measured = (round_ - args.warmup) % args.interval == 0
                for variant in (v for block in blocks for v in block):
                    spent, wall, _, inside, metrics, gc_spent, gc_full = run(variant, phase, measured)
                    passes[variant].append((spent, wall, inside, metrics, gc_spent, gc_full))
                if round_ < args.warmup:
                    continue
                for variant, done in passes.items():  # per variant the mean of its passes in this round
                    spent, wall, inside, metrics, gc_spent, gc_full = (
                        sum(x) / len(done) for x in zip(*done, strict=True)
                    )
                    times[(variant, phase, "gc")].append(gc_spent)
                    times[(variant, phase, "gc_full")].append(gc_full)
                    times[(variant, phase, "cpu")].append(spent)
                    times[(variant, phase, "wall")].append(wall)
                    times[(variant, phase, "inside")].append(inside / spent)
                    times[(variant, phase, "metrics")].append(metrics / spent)
    finally:
        for name in procs:
            if procs[name].is_alive():
                conns[name].send(("stop",))
            procs[name].join(timeout=60)
    lengths = lengths_of(args)
    print(
        f"[time] verl MegatronEngineWithLMHead on CPU (megatron-core local spec, bf16), tiny Qwen3-MoE "
        f"({spec.num_hidden_layers} layers, top-{spec.num_experts_per_tok} of {spec.num_experts}, hidden "
        f"{spec.hidden_size}); {len(lengths)} sequences, {sum(lengths)} tokens, micro-batch {args.micro_batch}; "
        f"{args.threads} thread(s); {args.rounds} interleaved rounds after {args.warmup} warm-up"
    )
    same = ", ".join(f"{v} {float((logps[v] - off_logp).abs().max()):.3g}" for v in VARIANTS[1:])
    print(f"  max |d logp| vs off, replaying the model's own routes: {same}")
    print(f"  R3 replaying random routes instead: max |d logp| {float((moved - off_logp).abs().max()):.3g}")
    for phase in PHASES:
        for kind, label in (("cpu", "thread CPU"), ("wall", "wall")):
            base = times[("off", phase, kind)]
            print(f"  {phase:<7} {label:<10} off median {statistics.median(base) * 1e3:7.1f} ms")
            pairs = (("idle", "off"), ("R3", "off"), ("R3+metrics", "off"), ("R3", "idle"), ("R3+metrics", "R3"))
            for variant, ref in pairs:
                num, den = times[(variant, phase, kind)], times[(ref, phase, kind)]
                lo, mid, hi = quartiles([x / b for x, b in zip(num, den, strict=True)])
                print(f"    {variant + ' / ' + ref:<18} median {mid:.3f}x  IQR {lo:.3f} - {hi:.3f}x")
            if args.interval > 1:  # per N rounds (one measured): the cost per step of the sampled metrics
                n = args.interval
                num, den = times[("R3+metrics", phase, kind)], times[("R3", phase, kind)]
                blocks = [sum(num[i : i + n]) / sum(den[i : i + n]) for i in range(0, len(num) - n + 1, n)]
                lo, mid, hi = quartiles(blocks)
                print(
                    f"    {'R3+metrics / R3':<18} per {n} rounds (one measured): median {mid:.3f}x  IQR {lo:.3f} - "
                    f"{hi:.3f}x over {len(blocks)} blocks; all rounds {sum(num) / sum(den):.3f}x"
                )
                ratios = [x / b for x, b in zip(num, den, strict=True)]
                for label, part in (
                    ("measured", ratios[::n]),
                    ("sampled out", [r for i, r in enumerate(ratios) if i % n]),
                ):
                    lo, mid, hi = quartiles(part)
                    print(f"      {label + ' rounds':<20} median {mid:.3f}x  IQR {lo:.3f} - {hi:.3f}x ({len(part)})")
        gc_line = ", ".join(
            f"{v} {statistics.mean(times[(v, phase, 'gc')]) * 1e3:.2f} ms "
            f"({statistics.mean(times[(v, phase, 'gc_full')]):.2f} full)"
            for v in VARIANTS
        )
        print(f"    in Python's garbage collector per pass (mean; full collections per pass): {gc_line}")
        lo, mid, hi = quartiles(times[("R3", phase, "inside")])
        print(f"    CPU time inside verl's replay code: {mid:.2%} of an R3 pass (IQR {lo:.2%} - {hi:.2%})")
        shares = times[("R3+metrics", phase, "metrics")][:: args.interval]  # the measured rounds
        lo, mid, hi = quartiles(shares)
        print(
            f"    CPU time inside verl-stable's replay metrics: {mid:.2%} of a measured R3+metrics pass (IQR {lo:.2%} - "
            f"{hi:.2%}): R3+metrics / R3 = {1 / (1 - mid):.3f}x by that share"
            + (
                f", {1 + mid / (1 - mid) / args.interval:.3f}x per step at --interval {args.interval}"
                if args.interval > 1
                else ""
            )
        )
    try:
        print(f"  load average at the end (1/5/15 min): {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    except OSError:
        pass


def main() -> None:
    """Parse arguments, print part 2 then part 1."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each engine process")
    parser.add_argument("--batch", type=int, default=8, help="sequences per batch")
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=192, help="at most the toy model's 256 positions")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument(
        "--interval",
        type=int,
        default=1,
        help="R3+metrics measures one round in N, as stable.monitor.replay_metrics_interval=N measures one step in N",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--long-groups", type=int, default=4, help="prompts of the long-length byte cases (n = 8)")
    parser.add_argument("--workdir", default=None, help="where the toy assets are built (default: a temp dir)")
    parser.add_argument("--bytes-only", action="store_true", help="only part 2 (no engine)")
    args = parser.parse_args()
    if args.interval < 1:
        parser.error("--interval must be >= 1 (one round in N measured)")
    spec = AssetSpec(task="copy")
    print_bytes(spec, args.long_groups)
    if not args.bytes_only:
        time_replay(spec, args)


if __name__ == "__main__":
    main()
