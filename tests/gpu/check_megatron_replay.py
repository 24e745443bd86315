"""Device check: R3 / R2 router replay in verl's real Megatron engine (tiny Qwen3-MoE, one device).

Builds verl's ``MegatronEngineWithLMHead`` through verl's ``EngineRegistry`` as verl's worker does (model from a
saved Hugging Face checkpoint through the bridge, Megatron DDP, distributed optimizer, bf16: verl's Megatron engine
takes nothing else). On a GPU node with verl's defaults there: Transformer Engine, Megatron-Bridge when it is
installed, else the legacy mbridge (``vanilla_mbridge=True``). With ``--device cpu``, the project's CPU runtime and
the overrides of ``verl_stable.cpu.megatron.options.TRANSFORMER_CONFIG`` (local spec, packed attention, no fusions).

The experts each MoE layer *used* are read independently of verl's replay code: a forward hook on every megatron
``TopKRouter`` records its ``routing_map`` (token row -> the experts the dispatcher sends it to). The packed rows of a
micro-batch are its samples' tokens back to back (world size 1: no tensor / context parallel padding; the row count is
checked). Checks, printing PASS / FAIL per line:

* the registry builds verl's Megatron engine, one ``RouterReplay`` per MoE layer;
* R3 ``compute_log_prob`` (``infer_batch``) with random distinct top-k routes: on every replayed row (verl's R3 mask:
  all but each sequence's last row) the used experts equal the given ones, in every MoE layer; the native routers
  would have chosen otherwise; log-probs change;
* R3 replaying the model's own native routing reproduces its log-probs;
* R3 update (forward + backward): used = given on replayed rows; the routers receive gradients;
* R2 ``compute_log_prob`` records ``routed_experts`` [tokens, num_layers, top_k] per sample, equal to the experts
  used in that pass; after perturbing every router (native routing now differs) the R2 update and an R2 forward
  replay the recorded experts on every row.

Run (one GPU):   python tests/gpu/check_megatron_replay.py
Run (CPU, slow): python tests/gpu/check_megatron_replay.py --device cpu
Exit code 0 iff every check passed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

RESULTS: list[tuple[str, bool, str]] = []
MICRO_BATCH = 2
LENGTHS = [7, 12, 5, 9]
RESPONSE = [3, 5, 2, 4]  # response tokens at the end of each sequence (R3's replay mask reads their count)


def check(name: str, ok: bool, detail: str = "") -> None:
    """Record and print one check's result."""
    RESULTS.append((name, bool(ok), detail))
    print(f"[{'PASS' if ok else 'FAIL'}] {name}{(' - ' + detail) if detail else ''}", flush=True)


def free_port() -> int:
    """A free local TCP port (a fixed one could collide with another job's process group on a shared host)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(device: str) -> None:
    """One rank: torch.distributed (nccl / gloo); verl's engine initializes megatron's parallel state on it."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    if device == "cuda":
        torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)


def megatron_bridge_installed() -> bool:
    """Whether NVIDIA's Megatron-Bridge (verl's default bridge, ``vanilla_mbridge=False``) is importable."""
    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.bridge") is not None


def build_engine(model_dir: Path, mode: str, device: str) -> Any:
    """verl's Megatron language-model engine for router replay ``mode``, built and initialized as verl's worker does."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import EngineRouterReplayConfig, HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.engine.base import EngineRegistry

    settings: dict[str, Any] = {}
    if device == "cpu":
        from verl_stable.cpu.megatron.options import TRANSFORMER_CONFIG

        # mbridge 0.15.1 with the project's local-spec bridges; TP = 1, so no sequence parallelism
        settings = dict(
            vanilla_mbridge=True, sequence_parallel=False, override_transformer_config=dict(TRANSFORMER_CONFIG)
        )
    else:
        settings = dict(vanilla_mbridge=not megatron_bridge_installed())
    engine_config = McoreEngineConfig(
        strategy="megatron",
        router_replay=EngineRouterReplayConfig(mode=mode),
        use_dynamic_bsz=False,  # micro-batches of consecutive samples: the hook rows map to tokens in order
        micro_batch_size_per_gpu=MICRO_BATCH,
        infer_micro_batch_size_per_gpu=MICRO_BATCH,
        **settings,
    )
    engine = EngineRegistry.new(
        model_type="language_model",
        backend="megatron",
        model_config=HFModelConfig(path=str(model_dir)),
        engine_config=engine_config,
        optimizer_config=McoreOptimizerConfig(lr=1e-3, total_training_steps=10),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine


def routers(engine: Any) -> list[tuple[str, torch.nn.Module]]:
    """``(name, TopKRouter)`` of every MoE layer of the engine's (single) model chunk, in layer order."""
    return [(n, m) for n, m in engine.module[0].named_modules() if type(m).__name__ == "TopKRouter"]


@dataclass
class RouterMaps:
    """What the routers of one pass did, per MoE layer: the experts used and those the router itself would pick.

    Attributes:
        used: per layer, the ``routing_map`` ([rows, experts] bool) of each router call, in call order.
        native: per layer, the router's own top-k on the same input (its gating logits), as a bool map.
    """

    used: list[list[torch.Tensor]]
    native: list[list[torch.Tensor]]

    def cat(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each layer's maps over all calls (micro-batches), in token-row order."""
        return [torch.cat(m) for m in self.used], [torch.cat(m) for m in self.native]


@contextmanager
def router_maps(engine: Any) -> Iterator[RouterMaps]:
    """Record each router call's used and native experts while the block runs (one call per micro-batch forward).

    The native choice is the top-k of the router's own gating logits on its input (softmax is monotonic, no expert
    bias in Qwen3-MoE): what it would have picked without replay, on the hidden states of this very pass.
    """
    found = routers(engine)
    maps = RouterMaps([[] for _ in found], [[] for _ in found])

    def hook(module: torch.nn.Module, args: tuple, out: tuple, i: int) -> None:
        with torch.no_grad():
            logits = module.gating(args[0]).view(-1, module.config.num_moe_experts)
            native = torch.zeros_like(logits, dtype=torch.bool)
            native.scatter_(1, logits.topk(module.topk, dim=-1).indices, True)
        maps.used[i].append(out[1].detach().to("cpu", torch.bool).clone())
        maps.native[i].append(native.cpu())

    handles = [
        router.register_forward_hook(lambda m, a, o, i=i: hook(m, a, o, i)) for i, (_, router) in enumerate(found)
    ]
    try:
        yield maps
    finally:
        for handle in handles:
            handle.remove()


def make_batch(vocab: int, routed: torch.Tensor | None, replay: bool, seed: int = 0) -> Any:
    """A TensorDict as verl's Megatron engine receives it: jagged input ids, positions, masks, optional routes."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    gen = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    nested = torch.nested.nested_tensor_from_jagged
    fields = {
        "input_ids": nested(torch.randint(1, vocab, (total,), generator=gen), offsets=offsets),
        "position_ids": nested(torch.cat([torch.arange(n) for n in LENGTHS]), offsets=offsets),
        "loss_mask": nested(torch.ones(total, dtype=torch.int64), offsets=offsets),
        # verl's V1 layout: one mask entry per response token (R3's replay mask needs only their count)
        "response_mask": nested(
            torch.ones(sum(RESPONSE), dtype=torch.int64),
            offsets=torch.tensor([0, *torch.tensor(RESPONSE).cumsum(0).tolist()]),
        ),
    }
    if routed is not None:
        fields["routed_experts"] = nested(routed, offsets=offsets)
    td = TensorDict(fields, batch_size=[len(LENGTHS)])
    tu.assign_non_tensor(
        td,
        use_remove_padding=True,
        temperature=1.0,
        pad_token_id=0,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=MICRO_BATCH,
        return_model_output=True,
        enable_routing_replay=replay,
    )
    return td


def sum_logp_loss(model_output: dict, data: Any, dp_group: Any = None) -> tuple[torch.Tensor, dict]:
    """A loss that reaches every log-prob (and so every router's probabilities)."""
    return -model_output["log_probs"].values().float().sum(), {}


def infer(engine: Any, data: Any) -> tuple[dict, list[torch.Tensor], list[torch.Tensor]]:
    """``compute_log_prob``'s pass: the model output and each MoE layer's used and native maps over all rows."""
    with router_maps(engine) as maps, engine.eval_mode():
        out = engine.infer_batch(data, loss_function=None)
    return out["model_output"], *maps.cat()


def update(engine: Any, data: Any) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
    """An update's forward + backward (no optimizer step): used and native maps, the routers' summed |grad|."""
    with router_maps(engine) as maps, engine.train_mode():
        engine.forward_backward_batch(data, loss_function=sum_logp_loss, forward_only=False)
        grad = 0.0
        for _, router in routers(engine):
            # Megatron's DDP accumulates into main_grad (its grad buffer); .grad stays None
            g = getattr(router.weight, "main_grad", None)
            g = router.weight.grad if g is None else g
            grad += 0.0 if g is None else float(g.float().abs().sum())
        engine.optimizer_zero_grad()
    return *maps.cat(), grad


def as_maps(routes: torch.Tensor, experts: int) -> torch.Tensor:
    """``[rows, layers, top_k]`` expert ids -> ``[layers, rows, experts]`` bool (the sets, order ignored)."""
    rows, layers, _ = routes.shape
    out = torch.zeros(layers, rows, experts, dtype=torch.bool)
    out.scatter_(2, routes.long().permute(1, 0, 2), True)
    return out


def replay_rows() -> torch.Tensor:
    """verl's R3 replay mask over the packed rows: every row but each sequence's last (``build_r3_replay_mask``)."""
    return torch.cat([torch.arange(n) < n - 1 for n in LENGTHS])


def mismatch(used: list[torch.Tensor], target: torch.Tensor, rows: torch.Tensor) -> tuple[float, str]:
    """Fraction of (row, layer) decisions on ``rows`` whose used expert set differs from ``target``; a shape note."""
    if any(u.shape != target.shape[1:] for u in used) or len(used) != target.shape[0]:
        return 1.0, f"router rows {[tuple(u.shape) for u in used]} vs tokens {tuple(target.shape)}"
    differ = torch.stack([(u != t).any(-1)[rows] for u, t in zip(used, target, strict=True)])
    return float(differ.float().mean()), ""


def random_routes(total: int, layers: int, experts: int, top_k: int, seed: int = 1) -> torch.Tensor:
    """Distinct random top-k per (token, layer), int16 as verl's rollout stores them."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(total, layers, experts, generator=gen).argsort(-1)[..., :top_k].to(torch.int16)


def logp_diff(a: dict, b: dict) -> float:
    """Largest |log-prob difference| between two model outputs."""
    return float((a["log_probs"].values().float() - b["log_probs"].values().float()).abs().max())


def run(device: str, workdir: Path) -> None:
    """Build the engines and run every check."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from verl_stable.toy.assets import AssetSpec, ensure_assets

    if device == "cpu":
        from verl_stable.cpu import runtime

        runtime.register()  # registers verl's Megatron engines for device cpu, under the Megatron CPU runtime
    init_distributed(device)
    assets = ensure_assets(workdir / "assets", AssetSpec(task="copy"))

    # Every engine loads the same checkpoint, so they hold identical weights until the R2 routers are perturbed.
    r3 = build_engine(assets.model_dir, "R3", device)
    check(
        "registry builds verl's MegatronEngineWithLMHead", isinstance(r3, MegatronEngineWithLMHead), type(r3).__name__
    )
    found = routers(r3)
    tf = r3.tf_config
    layers, experts, top_k = tf.num_layers, tf.num_moe_experts, tf.moe_router_topk
    replayers = [r for _, r in found if getattr(r, "router_replay", None) is not None]
    check("one RouterReplay per MoE layer", len(found) == layers and len(replayers) == layers, f"{len(found)} routers")
    vocab = int(r3.model_config.hf_config.vocab_size)
    total = sum(LENGTHS)
    rows = replay_rows()

    native_out, native_used, native_own = infer(r3, make_batch(vocab, None, replay=False))
    frac, note = mismatch(native_used, torch.stack(native_own), torch.ones(total, dtype=torch.bool))
    check("without replay the hooks' native top-k = the experts used", frac == 0.0, note or f"{frac:.1%} differ")
    given = random_routes(total, layers, experts, top_k)
    target = as_maps(given, experts)
    out, used, native = infer(r3, make_batch(vocab, given, replay=True))
    frac, note = mismatch(used, target, rows)
    check("R3 compute_log_prob: used experts = given routes on replayed rows", frac == 0.0, note or f"{frac:.3g}")
    frac, _ = mismatch(used, as_maps(given.roll(1, dims=0), experts), rows)
    check("R3: the comparison catches routes shifted by one token", frac > 0.5, f"{frac:.1%} differ")
    frac, _ = mismatch(native, target, rows)
    check("R3: the routers' own choice differs from the given routes", frac > 0.0, f"{frac:.1%} of decisions")
    frac, note = mismatch(used, torch.stack(native), ~rows)
    check("R3: each sequence's last row keeps the native routing", frac == 0.0, note or f"{frac:.1%} differ")
    diff = logp_diff(out, native_out)
    check("R3 random routes change log-probs", diff > 1e-3, f"max |diff| {diff:.3g}")

    # the experts the model picked natively, as top-k ids per (token, layer): replaying them must change nothing
    own = torch.stack([m.nonzero()[:, 1].view(m.shape[0], top_k) for m in native_used], dim=1).to(torch.int16)
    own_out, _, _ = infer(r3, make_batch(vocab, own, replay=True))
    diff = logp_diff(own_out, native_out)
    check("R3 replaying the model's own routing reproduces log-probs", diff <= 1e-6, f"max |diff| {diff:.3g}")

    used, _, grad = update(r3, make_batch(vocab, given, replay=True))
    frac, note = mismatch(used, target, rows)
    check("R3 update: used experts = given routes on replayed rows", frac == 0.0, note or f"{frac:.3g}")
    check("R3 update: routers receive gradients", grad > 0.0, f"sum |grad| {grad:.3g}")

    r2 = build_engine(assets.model_dir, "R2", device)
    recorded_out, used, _ = infer(r2, make_batch(vocab, None, replay=True))
    recorded = recorded_out.get("routed_experts")
    check("R2 compute_log_prob returns routed_experts", recorded is not None)
    if recorded is None:
        return
    values = recorded.values().cpu()
    check(
        "R2 routing shape [tokens, num_layers, top_k]",
        tuple(values.shape) == (total, layers, top_k),
        str(tuple(values.shape)),
    )
    every = torch.ones(total, dtype=torch.bool)
    target = as_maps(values, experts)
    frac, note = mismatch(used, target, every)
    check("R2 recorded = experts used while recording", frac == 0.0, note or f"{frac:.3g}")

    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _, router in routers(r2):
            router.weight.copy_(torch.randn(router.weight.shape, generator=gen).to(router.weight) * 0.5)
    used, native, grad = update(r2, make_batch(vocab, values, replay=True))
    frac, _ = mismatch(native, target, every)
    check("R2: the perturbed routers' own choice differs from the recording", frac > 0.1, f"{frac:.1%} of decisions")
    frac, note = mismatch(used, target, every)
    check("R2 update replays the recorded experts on every row", frac == 0.0, note or f"{frac:.3g}")
    check("R2 update: routers receive gradients", grad > 0.0, f"sum |grad| {grad:.3g}")
    _, used, _ = infer(r2, make_batch(vocab, values, replay=True))
    frac, note = mismatch(used, target, every)
    check("R2 forward with routed_experts replays them", frac == 0.0, note or f"{frac:.3g}")


def main() -> int:
    """Run the checks; 0 iff all passed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--workdir", default=None, help="where the tiny model's assets are built (default: a temp dir)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("[FAIL] no CUDA device")
        return 1
    if args.device == "cpu":
        os.environ.setdefault("VERL_PLATFORM", "cpu")  # read when verl is first imported (below, in run)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="check_megatron_replay_"))
    try:
        run(args.device, workdir)
    except Exception:  # noqa: BLE001 - a device check reports every failure as FAIL and exits non-zero
        traceback.print_exc()
        check("script ran to completion", False)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    failed = [name for name, ok, _ in RESULTS if not ok]
    print(f"{len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed" + (f"; FAILED: {failed}" if failed else ""))
    return 0 if RESULTS and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
