"""Device check: R2 / R3 router replay in verl's real FSDP engine (FSDP2-sharded tiny Qwen3-MoE, one device).

Builds ``FSDPEngineWithLMHeadReplay`` through verl's ``EngineRegistry`` exactly as verl's worker does (model from a
saved checkpoint, FSDP2 wrap, optimizer, bf16 autocast on GPU) and checks, printing PASS / FAIL per line:

* R2 ``compute_log_prob`` (``infer_batch``) returns ``routed_experts`` [tokens, num_hidden_layers, top_k] per sample,
  with unchanged log-probs (vs the same engine with replay disabled);
* R2 update (``train_batch``) replays that routing: used-vs-recorded disagreement 0, rows replayed, router grads;
* R3 replaying the engine's own recorded routing reproduces its log-probs (max |diff| printed, 0 expected);
* R3 replaying random routing: disagreement 0, router disagreement > 0, log-probs change;
* the reference engine (``forward_only=True``) with R3 configured never replays.

Run (one GPU):   python tests/gpu/check_fsdp_replay.py
Run (CPU, slow): VERL_PLATFORM=cpu python tests/gpu/check_fsdp_replay.py --device cpu
Exit code 0 iff every check passed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

RESULTS: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    RESULTS.append((name, bool(ok), detail))
    print(f"[{'PASS' if ok else 'FAIL'}] {name}{(' - ' + detail) if detail else ''}", flush=True)


def init_distributed(device: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if device == "cuda":
        torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)


def build_engine(model_dir: Path, mode: str, forward_only: bool = False):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import EngineRouterReplayConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.base import EngineRegistry

    model_config = HFModelConfig(
        path=str(model_dir),
        use_remove_padding=True,
        enable_gradient_checkpointing=True,
        override_config={"attn_implementation": "sdpa"},
    )
    engine_config = FSDPEngineConfig(
        strategy="fsdp2",
        router_replay=EngineRouterReplayConfig(mode=mode),
        forward_only=forward_only,
        use_torch_compile=False,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=2,
        infer_micro_batch_size_per_gpu=2,
        use_remove_padding=True,
    )
    engine = EngineRegistry.new(
        model_type="language_model",
        backend="fsdp2",
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=FSDPOptimizerConfig(lr=1e-3),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine


def make_batch(lengths: list[int], vocab: int, routed: torch.Tensor | None = None, seed: int = 0):
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    nested = torch.nested.nested_tensor_from_jagged
    fields = {
        "input_ids": nested(torch.randint(1, vocab, (total,), generator=gen), offsets=offsets),
        "position_ids": nested(torch.cat([torch.arange(n) for n in lengths]), offsets=offsets),
        "loss_mask": nested(torch.ones(total, dtype=torch.int64), offsets=offsets),
    }
    if routed is not None:
        fields["routed_experts"] = nested(routed, offsets=offsets)
    td = TensorDict(fields, batch_size=[len(lengths)])
    tu.assign_non_tensor(
        td,
        use_remove_padding=True,
        temperature=1.0,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=2,
        return_model_output=True,
    )
    return td


def sum_logp_loss(model_output, data, dp_group=None):
    return -model_output["log_probs"].values().float().sum(), {}


def infer(engine, data):
    with engine.eval_mode():
        out = engine.infer_batch(data, loss_function=None)
    return out["model_output"], out["metrics"]


def train(engine, data):
    with engine.train_mode():
        out = engine.forward_backward_batch(data, loss_function=sum_logp_loss, forward_only=False)
        router_grad = 0.0
        for name, param in engine.module.named_parameters():
            if name.endswith("mlp.gate.weight") and param.grad is not None:
                grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
                router_grad += float(grad.abs().sum())
        engine.optimizer_zero_grad()
    return out["metrics"], router_grad


def metric(metrics: dict, name: str) -> list[float]:
    value = metrics.get(f"stable/routing/{name}")
    if value is None:
        return []
    return [float(v) for v in (value if isinstance(value, list) else [value])]


def random_routing(total: int, num_layers: int, moe_layers, experts: int, top_k: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    rows = torch.zeros(total, num_layers, top_k, dtype=torch.int16)
    for layer in moe_layers:
        rows[:, layer] = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(total)]).to(
            torch.int16
        )
    return rows


def run(device: str, workdir: Path) -> None:
    from verl_stable.integration import fsdp_engine as fe
    from verl_stable.toy.assets import AssetSpec, ensure_assets

    if device == "cpu":
        from verl_stable.cpu import runtime

        runtime.register()
    init_distributed(device)
    fe.register_engine()
    assets = ensure_assets(workdir / "assets", AssetSpec(task="copy"))

    # Every engine loads the same checkpoint, so they hold identical weights (no optimizer step is taken).
    r2 = build_engine(assets.model_dir, "R2")
    check("registry selects the replay engine", isinstance(r2, fe.RouterReplayMixin), type(r2).__name__)
    layout = r2._model_routing.layout
    vocab = int(r2.module.config.vocab_size)
    lengths = [7, 12, 5, 9]
    total = sum(lengths)

    recorded, metrics = infer(r2, make_batch(lengths, vocab))
    routed = recorded.get("routed_experts")
    check("R2 compute_log_prob returns routed_experts", routed is not None)
    if routed is None:
        return
    values = routed.values()
    check(
        "R2 routing shape [tokens, num_hidden_layers, top_k]",
        tuple(values.shape) == (total, layout.num_hidden_layers, layout.top_k),
        str(tuple(values.shape)),
    )
    check("R2 recorded every MoE row", metric(metrics, "recorded_rows") != [], str(metric(metrics, "recorded_rows")))

    plain = build_engine(assets.model_dir, "disabled")
    natural, _ = infer(plain, make_batch(lengths, vocab))
    diff = (natural["log_probs"].values() - recorded["log_probs"].values()).abs().max().item()
    check("recording leaves log-probs unchanged", diff == 0.0, f"max |diff| {diff:.3g}")

    r3 = build_engine(assets.model_dir, "R3")
    own, metrics = infer(r3, make_batch(lengths, vocab, routed=values.cpu()))
    diff = (own["log_probs"].values() - recorded["log_probs"].values()).abs().max().item()
    check("R3 replaying the model's own routing reproduces log-probs", diff <= 1e-6, f"max |diff| {diff:.3g}")
    check(
        "R3 own routing: disagreement 0",
        metric(metrics, "disagreement") == [0.0] * len(metric(metrics, "disagreement")),
    )

    forced = random_routing(total, layout.num_hidden_layers, layout.moe_layers, layout.num_experts, layout.top_k)
    out, metrics = infer(r3, make_batch(lengths, vocab, routed=forced))
    dis, router_dis = metric(metrics, "disagreement"), metric(metrics, "router_disagreement")
    check("R3 random routing: used experts = rollout experts", bool(dis) and max(dis) == 0.0, str(dis))
    check("R3 random routing: router would disagree", bool(router_dis) and min(router_dis) > 0.0, str(router_dis))
    diff = (out["log_probs"].values() - recorded["log_probs"].values()).abs().max().item()
    check("R3 random routing changes log-probs", diff > 1e-4, f"max |diff| {diff:.3g}")

    metrics, router_grad = train(r2, make_batch(lengths, vocab, routed=values.cpu()))
    dis = metric(metrics, "disagreement")
    check("R2 update replays pi_old routing (disagreement 0)", bool(dis) and max(dis) == 0.0, str(dis))
    check("R2 update replayed rows", sum(metric(metrics, "replayed_rows")) > 0, str(metric(metrics, "replayed_rows")))
    check("router receives gradients under replay", router_grad > 0.0, f"sum |grad| {router_grad:.3g}")

    if device == "cpu":
        # verl gives a forward-only FSDP2 engine CPUOffloadPolicy(pin_memory=True), which needs an accelerator.
        print("[SKIP] reference engine check (FSDP2 reference offload pins memory: GPU only)")
        return
    ref = build_engine(assets.model_dir, "R3", forward_only=True)
    ref_out, metrics = infer(ref, make_batch(lengths, vocab, routed=forced))
    check("reference engine never replays", not any(k.startswith("stable/routing/") for k in metrics))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("[FAIL] no CUDA device")
        return 1
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="check_fsdp_replay_"))
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
