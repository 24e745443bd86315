"""``verl-stable probe``: which switch does *my* model need? The training-inference mismatch of a checkpoint, measured
before a run.

    verl-stable probe --model /ckpt/Qwen3-30B-A3B --engine vllm --rollout-precision fp8 --train-dtype bf16 \\
        --data train.parquet --samples 64 --max-tokens 256 --out ./probe
    verl-stable probe --toy --rollout-precision int4 --train-dtype fp32     # the lab's tiny MoE, built here
    verl-stable probe --toy --rollout-precision int4 --train-dtype fp32 --train-engine megatron  # verl's Megatron actor

Writes ``probe.md``, ``probe.json`` and ``probe.png`` into ``--out`` and prints the answer (docs/probe.md). Exit codes:
0 the report was written; 2 a bad input, answered in one line before anything is loaded (a dense model is no bad
input: its report measures KL and says that replay does not apply); 1 the rollout engine failed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from verl_stable.argtypes import non_negative_int, positive_int, resolve_path

__all__ = ["PROG", "build_parser", "main"]

PROG = "verl-stable probe"
PRECISION_CHOICES = ("fp32", "bf16", "fp16", "fp8", "fp8_w8a8", "int4")
DEVICES = ("auto", "cpu", "cuda")


def build_parser() -> argparse.ArgumentParser:
    """The command's arguments (docs/probe.md, "Options")."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Which switch does my model need? Measure a checkpoint's training-inference mismatch -- routing "
        "flips per MoE layer, KL(mu||pi) without replay and with R3 -- before a run, and what it means for the recipes.",
        epilog="Writes probe.md, probe.json and probe.png into --out (docs/probe.md). Exit codes: 0 report written, "
        "2 an input the probe cannot measure (one line, nothing loaded), 1 the rollout engine failed.",
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", type=Path, help="a Hugging Face checkpoint directory (model + tokenizer)")
    what.add_argument(
        "--toy",
        action="store_true",
        help="build the project's tiny Qwen3-MoE and its toy-task data under OUT/toy_assets and probe it",
    )
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="rollout engine (default: %(default)s)")
    parser.add_argument(
        "--rollout-precision",
        choices=PRECISION_CHOICES,
        default="bf16",
        help="the rollout's numerics: hf all of them, vLLM fp32/bf16 (CPU build) or fp32/bf16/fp16/fp8 (GPU)",
    )
    parser.add_argument(
        "--train-dtype",
        choices=("fp32", "bf16"),
        default="bf16",
        help="the actor's parameter dtype: fsdp_config.mixed_precision.param_dtype, or megatron.dtype (verl: bf16)",
    )
    parser.add_argument(
        "--train-engine",
        choices=("fsdp", "megatron"),
        default="fsdp",
        help="whose forward scores the samples: verl's FSDP actor (the HF model) or its Megatron actor (mbridge + "
        "megatron-core, on CPU; qwen3 / qwen3_moe) (default: %(default)s)",
    )
    parser.add_argument(
        "--data", type=Path, help="a verl RL parquet file (data.train_files); default: built-in prompts"
    )
    parser.add_argument("--prompt-key", default="prompt", help="its chat column (data.prompt_key, default: prompt)")
    parser.add_argument("--samples", type=positive_int, default=32, help="completions sampled (default: %(default)s)")
    parser.add_argument(
        "--per-prompt", type=positive_int, default=1, help="samples per prompt (verl's rollout.n; default: 1)"
    )
    parser.add_argument(
        "--max-tokens", type=positive_int, default=64, help="tokens per completion at most (data.max_response_length)"
    )
    parser.add_argument("--seed", type=non_negative_int, default=0, help="sampling seed (default: %(default)s)")
    parser.add_argument("--device", choices=DEVICES, default="auto", help="where the models run (auto: cuda if any)")
    parser.add_argument("--out", default="./verl_stable_probe", help="report folder (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


def _device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device")
    return choice


def _progress_bar(enabled: bool) -> tuple[Callable[[int, int, str], None], Callable[[], None]]:
    """tqdm on stderr (on a terminal; ``enabled=False`` never): ``update(done, total, stage)`` and ``close()``."""
    from tqdm import tqdm

    bar = tqdm(total=0, unit="sample", file=sys.stderr, disable=not enabled or None, dynamic_ncols=True)

    def update(done: int, total: int, stage: str) -> None:
        bar.total = total
        bar.set_description(stage, refresh=False)
        bar.update(done - bar.n)

    return update, bar.close


def main(argv: Sequence[str] | None = None, out: Callable[[str], None] = print) -> int:
    """Entry point of ``verl-stable probe`` (exit codes in the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)

    def refuse(message: str) -> int:
        print(f"{PROG}: {message}", file=sys.stderr)
        return 2

    try:
        out_dir = resolve_path(args.out, "--out")
        if out_dir.exists() and not out_dir.is_dir():
            return refuse(f"--out {args.out} is a file; expected a folder for the report")
        device = _device(args.device)
    except ValueError as exc:
        return refuse(str(exc))
    model, data = args.model, args.data
    if args.toy:
        from verl_stable.probe.inference import quiet_transformers
        from verl_stable.toy.assets import ensure_assets
        from verl_stable.toy.launch import asset_spec

        with quiet_transformers():
            assets = ensure_assets(out_dir / "toy_assets", asset_spec(args.engine))
        model, data = assets.model_dir, data or assets.train_file
        out(f"toy MoE: {model} (data {data})")

    from verl_stable.probe.checks import ProbeInputError
    from verl_stable.probe.report import summary_lines, write_report
    from verl_stable.probe.runner import ProbeOptions, run_probe
    from verl_stable.probe.vllm_engine import ProbeEngineError

    options = ProbeOptions(
        model=Path(model), engine=args.engine, rollout_precision=args.rollout_precision,
        train_dtype=args.train_dtype, train_engine=args.train_engine, data=data, prompt_key=args.prompt_key,
        samples=args.samples, per_prompt=args.per_prompt, max_tokens=args.max_tokens, seed=args.seed, device=device,
    )  # fmt: skip
    update, close = _progress_bar(enabled=not args.no_progress)
    try:
        result = run_probe(options, progress=update)
    except ProbeInputError as exc:
        close()
        return refuse(str(exc))
    except ProbeEngineError as exc:
        close()
        print(f"{PROG}: the rollout engine failed: {exc}", file=sys.stderr)
        return 1
    close()
    paths = write_report(result, out_dir)
    for line in summary_lines(result):
        out(line)
    out(f"report: {paths[0]} (also {paths[1].name}, {paths[2].name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
