"""GPU check: ``verl-stable probe`` with vLLM's CUDA build as the rollout engine and the training forward on the GPU.

Not collected by pytest (needs CUDA and vLLM). Run on a GPU node with vLLM (>= 0.24, routed-experts export) installed:

    python tests/gpu/check_probe.py                                # the toy MoE, built here (nothing downloaded)
    python tests/gpu/check_probe.py --model /ckpt/Qwen3-30B-A3B --data train.parquet --samples 64 --max-tokens 256

One probe per rollout setting (one vLLM start each), printing PASS / FAIL per check and the probe's answer:

1. ``fp32`` rollout vs ``fp32`` actor (the toy only: a large model is not served in fp32 here): the engines agree --
   routing flips <= ``--max-fp32-flips`` (vLLM's CUDA kernels sum in another order than transformers' sdpa), KL k3
   < 1e-4;
2. ``bf16`` rollout vs ``bf16`` actor (verl's defaults) and ``fp8`` rollout (vLLM's dynamic W8A8, on GPUs with fp8:
   compute capability >= 8.9) vs ``bf16`` actor: the report is written, R3 leaves exactly 0 disagreement, every
   number is finite;

and for every setting: the routed experts came back (compared rows > 0) and the report's three files exist. The
flip rates and KL are printed for the record (docs/probe.md asks for them from a real model). Exit code 0 iff every
check passed; it prints SKIP and exits 0 without CUDA or vLLM.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import tempfile
from pathlib import Path

FAILURES: list[str] = []


def check(ok: bool, what: str) -> None:
    print(("[PASS] " if ok else "[FAIL] ") + what, flush=True)
    if not ok:
        FAILURES.append(what)


def settings(toy: bool, fp8: bool) -> list[tuple[str, str]]:
    """(rollout precision, train dtype) pairs to probe."""
    out = [("fp32", "fp32")] if toy else []
    out.append(("bf16", "bf16"))
    if fp8:
        out.append(("fp8", "bf16"))
    return out


def probe_once(model: Path, data: Path | None, precision: str, train: str, args, out: Path) -> dict | None:
    from verl_stable.probe import cli

    argv = ["--model", str(model), "--engine", "vllm", "--rollout-precision", precision, "--train-dtype", train,
            "--samples", str(args.samples), "--per-prompt", str(args.per_prompt), "--max-tokens",
            str(args.max_tokens), "--device", "cuda", "--out", str(out), "--no-progress"]  # fmt: skip
    if data is not None:
        argv += ["--data", str(data)]
    code = cli.main(argv)
    check(code == 0, f"{precision} vs {train}: verl-stable probe exited {code}")
    if code != 0:
        return None
    check(all((out / name).is_file() for name in ("probe.md", "probe.json", "probe.png")), "report files written")
    return json.loads((out / "probe.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="HF MoE checkpoint; default: the toy MoE")
    parser.add_argument("--data", type=Path, default=None, help="verl parquet; default: the toy's (or built-in)")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--per-prompt", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-fp32-flips", type=float, default=0.02)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 0
    if importlib.util.find_spec("vllm") is None:
        print("SKIP: vLLM is not installed")
        return 0
    from verl_stable.probe.checks import vllm_cpu_build, vllm_exports_routing

    check(not vllm_cpu_build(), "the installed vLLM is a GPU build")
    check(vllm_exports_routing(), "vLLM exports routed experts (enable_return_routed_experts)")
    tmp = Path(tempfile.mkdtemp(prefix="check_probe_"))
    model, data, toy = args.model, args.data, args.model is None
    if toy:
        from verl_stable.toy.assets import ensure_assets
        from verl_stable.toy.launch import asset_spec

        assets = ensure_assets(tmp / "toy", asset_spec("vllm"))
        model, data = assets.model_dir, data or assets.train_file
    fp8 = torch.cuda.get_device_capability() >= (8, 9)
    for precision, train in settings(toy, fp8):
        report = probe_once(model, data, precision, train, args, tmp / f"{precision}_{train}")
        if report is None:
            continue
        none, r3 = report["metrics"]["none"], report["metrics"].get("r3")
        label = f"{precision} vs {train}"
        if r3 is None:
            check(report["model_kind"] == "dense", f"{label}: no R3 column only for a dense model")
            continue
        flips, kl = none["stable/routing/disagreement"], none["stable/train_inf/kl_k3"]
        print(f"  {label}: flips {flips:.4f} (tokens {none['stable/routing/disagreement/token_any_layer']:.3f}), "
              f"KL k3 {kl:.3e} -> with R3 {r3['stable/train_inf/kl_k3']:.3e}")  # fmt: skip
        print(f"  answer: {report['advice']['summary']}")
        check(none["probe/disagreement_rows"] > 0, f"{label}: vLLM's routed experts came back and were compared")
        check(r3["stable/routing/disagreement"] == 0.0, f"{label}: R3 replays vLLM's routing exactly (0 flips)")
        finite = all(v is None or math.isfinite(v) for m in (none, r3) for v in m.values())
        check(finite, f"{label}: every number is finite (NaN is written as null)")
        if precision == train == "fp32":
            check(flips <= args.max_fp32_flips, f"{label}: flips {flips:.4f} <= {args.max_fp32_flips}")
            check(kl < 1e-4, f"{label}: KL k3 {kl:.2e} < 1e-4")
    print("PASS" if not FAILURES else f"{len(FAILURES)} FAILURES")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
