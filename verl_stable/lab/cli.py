"""``verl-stable lab``: run the CPU comparison of the paper's variants with verl's own trainer and write the report.

    verl-stable lab                       # default preset: R3 vs no replay at N = 4, 6 seeds (<= 10 min on 2 cores)
    verl-stable lab --preset evidence --out ./lab_evidence   # the full comparison, 6 seeds (<= 60 min)
    verl-stable lab --seeds 6 7 8 9 10 11 --out ./lab_rerun  # the same question on other seeds
    verl-stable lab --preset baselines --out ./lab_baselines  # MiniRL + R3 vs verl's TIS, DPPO, GRPO at N = 1, 4, 8
    verl-stable lab --preset stability --out ./lab_stability  # N = 8, 24 steps: where MiniRL without clipping fails
    verl-stable lab --variants minirl_r3 verl_tis dppo vanilla_grpo --staleness 8   # these variants, at N = 8
    verl-stable lab --list                # presets and variants
    verl-stable lab --report-only --out ./lab   # re-render the report from the runs on disk

Re-running with the same ``--out`` skips runs that are already complete (resumable); results already in ``--out``
are never deleted or truncated (see :mod:`verl_stable.lab.sweep`). A run that fails while starting is retried once;
the output and the report name every retried and every failed run with the first error line of its log. Every argument is checked before any work starts:
an unknown ``--only`` prefix, a ``--steps`` or ``--jobs`` below 1, a negative or repeated seed, a ``--timeout`` that is
not a positive number, an ``--out`` that is a file or in a symlink loop, or a ``report.md`` in ``--out`` that is a
directory is refused with exit code 2. Results in ``--out`` that cannot be read back (a line that is not a JSON
object, a row whose ``variant`` is not a string or whose ``staleness``, ``seed`` or ``step`` is not an integer, a
``metrics.jsonl`` that is a directory) are refused with exit code 1 and the file, line and key, before any run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace

from verl_stable.argtypes import non_negative_float, positive_float, positive_int, positive_seconds, resolve_path
from verl_stable.lab import timing
from verl_stable.lab.presets import LAB_PRECISION, MAX_SEED
from verl_stable.lab.variants import PRECISIONS, STALENESS_CHOICES, VARIANTS
from verl_stable.toy.launch import ENGINES


def _seed(text: str) -> int:
    """argparse type: an integer in [0, 2**32) (verl seeds numpy and torch generators with it)."""
    expected = f"expected an integer in [0, {MAX_SEED}]"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{expected}, got {text!r}") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"{expected}, got {value}")
    return value


def _list(out: Callable[[str], None]) -> None:
    from verl_stable.lab.sweep import PRESETS

    out("presets:")
    for p in PRESETS.values():
        runs = ", ".join(f"{v}@N{n}" for v, n in p.runs)
        noise = f" router_noise={p.router_noise}" if p.router_noise else ""
        noise += f" lr={p.lr:g}" if p.lr is not None else ""
        out(
            f"  {p.name:<9} steps={p.steps} seeds={list(p.seeds)} task={p.task} top_k={p.top_k} "
            f"precision={p.precision}{noise}: {runs}"
        )
    out("variants:")
    for v in VARIANTS.values():
        sw = ", ".join(f"{k.rsplit('.', 1)[-1]}={val}" for k, val in v.switches.items()) or "(recipe as is)"
        out(f"  {v.name:<16} recipe={v.recipe:<16} {sw}")


def main(argv: Sequence[str] | None = None, out: Callable[[str], None] = print) -> int:
    """Entry point of ``verl-stable lab``; returns 0 when every run succeeded and the report was written.

    Raises:
        SystemExit: code 2 for a bad argument, before anything is built or run (argparse's convention).
    """
    from verl_stable.lab import report, sweep

    parser = argparse.ArgumentParser(prog="verl-stable lab", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="default", choices=sorted(sweep.PRESETS))
    parser.add_argument("--out", default="./verl_stable_lab", help="output directory (runs, cache, report)")
    parser.add_argument("--steps", type=positive_int, help="override the preset's RL steps per run")
    parser.add_argument("--seeds", type=_seed, nargs="+", help="override the preset's seeds (distinct, in [0, 2**32))")
    parser.add_argument("--engine", choices=ENGINES, help="rollout engine (default hf; vllm: vLLM's CPU build)")
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        help=f"rollout precision (hf: the preset's, {LAB_PRECISION} in the shipped ones; vllm: bf16, fp32)",
    )
    parser.add_argument(
        "--top-k", type=positive_int, help="experts per token of the tiny MoE (of 16; preset's default)"
    )
    parser.add_argument(
        "--router-noise",
        type=non_negative_float,
        help="hf rollout: sigma of the inference-only router perturbation (0: off; a labelled stand-in, not a format)",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        metavar="VARIANT",
        help="run these variants instead of the preset's, at the preset's N (or --staleness); see --list",
    )
    parser.add_argument(
        "--staleness",
        nargs="+",
        type=int,
        choices=STALENESS_CHOICES,
        metavar="N",
        help=f"run the preset's variants (or --variants) at these N instead of the preset's; of {STALENESS_CHOICES}",
    )
    parser.add_argument("--lr", type=positive_float, help="the actor's learning rate (default: the CPU runtime's 1e-3)")
    parser.add_argument("--only", nargs="+", help="run names starting with these (e.g. minirl_r3__N4)")
    parser.add_argument("--timeout", type=positive_seconds, help="per-run wall-clock limit in seconds")
    parser.add_argument(
        "--jobs", type=positive_int, help="runs at once (default: 2 on a host with >= 2 cores and 12 GiB)"
    )
    parser.add_argument("--report-only", action="store_true", help="only re-render the report from --out")
    parser.add_argument("--list", action="store_true", help="list presets and variants, then exit")
    args = parser.parse_args(argv)
    if args.list:
        _list(out)
        return 0
    preset = sweep.PRESETS[args.preset]
    changes = {
        "steps": args.steps,
        "seeds": tuple(args.seeds) if args.seeds else None,
        "engine": args.engine,
        # vLLM's CPU build serves fp32 / bf16: an engine switch without --precision takes bf16 (hf: the preset's)
        "precision": args.precision or ("bf16" if args.engine == "vllm" else None),
        "top_k": args.top_k,
        # the router perturbation is an hf-backend stand-in; vLLM brings its own mismatch
        "router_noise": 0.0 if args.engine == "vllm" and args.router_noise is None else args.router_noise,
        "lr": args.lr,
    }
    regrid = bool(args.variants or args.staleness)
    try:
        preset = replace(preset, **{k: v for k, v in changes.items() if v is not None})
        preset = preset.regrid(args.variants, args.staleness)
        specs = preset.select(args.only)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        out_dir = resolve_path(args.out, "--out")
    except ValueError as exc:
        parser.error(str(exc))
    if out_dir.exists() and not out_dir.is_dir():
        parser.error(f"--out {out_dir} is a file; expected a directory (created if missing)")
    if not args.report_only:
        from verl_stable import recipes

        try:
            recipes.check_output_dir(out_dir, "--out")
        except ValueError as exc:
            parser.error(str(exc))
    try:
        existing = sweep.load_rows(out_dir)
    except ValueError as exc:
        # the sweep merges into this file at the end: refuse now rather than after minutes of runs
        print(f"cannot read the results already in --out: {exc}", file=sys.stderr)
        return 1
    if not args.report_only:
        try:
            sweep.check_sweep(out_dir, preset, only=args.only, jobs=args.jobs, timeout_s=args.timeout)
        except (ValueError, FileNotFoundError) as exc:
            parser.error(str(exc))
    failed = 0
    if args.report_only:
        rows = existing
        if not rows:
            print(f"no metrics to report: {out_dir / 'metrics.jsonl'} is missing or empty", file=sys.stderr)
            return 1
    else:
        jobs = args.jobs or sweep.default_jobs()
        estimate = timing.estimate_seconds(len(specs), preset.steps, [s.staleness for s in specs], jobs)
        out(
            f"{len(specs)} run(s) of {preset.steps} steps, {jobs} at a time: about {estimate / 60:.0f} min on 2 cores "
            "(runs already complete in --out are skipped; the report gives the measured time)"
        )

        def announce(pending: Sequence[sweep.RunSpec]) -> None:
            if len(pending) < len(specs):  # a resumed sweep: the estimate above counted runs it will not start
                left = timing.estimate_seconds(len(pending), preset.steps, [s.staleness for s in pending], jobs)
                out(
                    f"{len(specs) - len(pending)} of the {len(specs)} run(s) already complete in --out: "
                    f"{len(pending)} to run, about {left / 60:.0f} min"
                )

        outcomes = sweep.run_sweep(
            out_dir, preset, timeout_s=args.timeout, only=args.only, jobs=args.jobs, announce=announce
        )
        for o in outcomes:
            if o.retried:
                print(
                    f"run {o.spec.name}: the first attempt failed while starting ({o.retried}); "
                    f"{'retried, failed again' if o.failed else 'retried, finished'}",
                    file=sys.stderr,
                )
            if o.guard_stopped:
                print(f"run {o.spec.name}: stopped by the guard ({o.guard_stopped})", file=sys.stderr)
            elif o.failed:
                failed += 1
                print(
                    f"run {o.spec.name} failed (exit {o.returncode}, {len(o.rows)} steps, {o.attempts} attempt(s)): "
                    f"{o.error or 'no error line in its log'}; log: {o.log}",
                    file=sys.stderr,
                )
        # the report covers every run in --out (earlier sweeps' too), as --report-only would
        rows = sweep.load_rows(out_dir)
        if not rows:
            print(f"no metrics to report: none of {len(specs)} run(s) logged a step", file=sys.stderr)
            return 1
    header = {
        "preset": preset.name
        + (
            f" (runs set by --variants / --staleness: {', '.join(f'{v}@N{n}' for v, n in preset.runs)})"
            if regrid
            else ""
        ),
        "task": f"{preset.task} (exact-match binary reward)",
        "model": f"tiny Qwen3-MoE, 4 layers, 16 experts, top-{preset.top_k}",
        "rollout": (
            f"hf backend, {preset.precision} numerics"
            + (
                f", routers perturbed by sigma = {preset.router_noise} at inference only (a stand-in for a large MoE's "
                "routing mismatch, not a numeric format)"
                if preset.router_noise
                else ""
            )
            + "; training engine fp32"
            if preset.engine == "hf"
            else f"verl's vLLM rollout (vLLM CPU build), {preset.precision}; training engine fp32"
        ),
        "geometry": f"{preset.mini_batch_prompts} prompts x {preset.group_size} samples per mini-batch, N per step",
        "steps per run": str(preset.steps) + (f", learning rate {preset.lr:g}" if preset.lr is not None else ""),
        "cold start": sweep.coldstart_line(out_dir),
    }
    try:
        path = report.write_report(rows, out_dir, header)
    except ValueError as exc:
        print(f"cannot report {out_dir / 'metrics.jsonl'}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # report.md a directory, an unwritable --out, a full disk: one line, not a traceback
        print(f"cannot write the report: {exc}", file=sys.stderr)
        return 1
    out(f"report: {path}\nmetrics: {out_dir / 'metrics.jsonl'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
