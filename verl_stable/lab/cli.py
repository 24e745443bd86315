"""``verl-stable lab``: run the CPU comparison of the paper's variants with verl's own trainer and write the report.

    verl-stable lab                       # default preset: ~8.5 min on 2 cores, no GPU, no download
    verl-stable lab --preset replay       # R2 vs R3 vs no replay at N = 2 and 4 (~9 min)
    verl-stable lab --preset full --out ./lab_full
    verl-stable lab --list                # presets and variants
    verl-stable lab --report-only --out ./lab   # re-render the report from the runs on disk

Re-running with the same ``--out`` skips runs that are already complete (resumable).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path


def _list(out) -> None:
    from verl_stable.lab.sweep import PRESETS
    from verl_stable.lab.variants import VARIANTS

    out("presets:")
    for p in PRESETS.values():
        runs = ", ".join(f"{v}@N{n}" for v, n in p.runs)
        out(f"  {p.name:<8} steps={p.steps} seeds={list(p.seeds)} task={p.task} precision={p.precision}: {runs}")
    out("variants:")
    for v in VARIANTS.values():
        sw = ", ".join(f"{k.rsplit('.', 1)[-1]}={val}" for k, val in v.switches.items()) or "(recipe as is)"
        out(f"  {v.name:<16} recipe={v.recipe:<16} {sw}")


def main(argv: Sequence[str] | None = None, out=print) -> int:
    """Entry point of ``verl-stable lab``; returns 0 when every run succeeded and the report was written."""
    from verl_stable.lab import report, sweep

    parser = argparse.ArgumentParser(prog="verl-stable lab", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="default", choices=sorted(sweep.PRESETS))
    parser.add_argument("--out", default="./verl_stable_lab", help="output directory (runs, cache, report)")
    parser.add_argument("--steps", type=int, help="override the preset's RL steps per run")
    parser.add_argument("--seeds", type=int, nargs="+", help="override the preset's seeds")
    parser.add_argument("--precision", choices=("fp8", "bf16", "fp16", "fp32"), help="rollout precision")
    parser.add_argument("--only", nargs="+", help="run names starting with these (e.g. minirl_r3__N4)")
    parser.add_argument("--timeout", type=float, help="per-run wall-clock limit in seconds")
    parser.add_argument("--jobs", type=int, help="runs at once (default: 2 on a host with >= 2 cores and 12 GiB)")
    parser.add_argument("--report-only", action="store_true", help="only re-render the report from --out")
    parser.add_argument("--list", action="store_true", help="list presets and variants, then exit")
    args = parser.parse_args(argv)
    if args.list:
        _list(out)
        return 0
    preset = sweep.PRESETS[args.preset]
    changes = {"steps": args.steps, "seeds": tuple(args.seeds) if args.seeds else None, "precision": args.precision}
    preset = replace(preset, **{k: v for k, v in changes.items() if v is not None})
    out_dir = Path(args.out).resolve()
    if args.report_only:
        rows = sweep.load_rows(out_dir)
        failed = 0
    else:
        outcomes = sweep.run_sweep(out_dir, preset, timeout_s=args.timeout, only=args.only, jobs=args.jobs)
        rows = [r for o in outcomes for r in o.rows]
        failed = 0
        for o in outcomes:
            if o.returncode != 0 or len(o.rows) < preset.steps:
                failed += 1
                print(
                    f"run {o.spec.name} failed (exit {o.returncode}, {len(o.rows)} steps); log: {o.log}",
                    file=sys.stderr,
                )
    if not rows:
        print("no metrics to report", file=sys.stderr)
        return 1
    header = {
        "preset": preset.name,
        "task": f"{preset.task} (exact-match binary reward)",
        "rollout": f"hf backend, {preset.precision} weights; training engine fp32",
        "geometry": f"{preset.mini_batch_prompts} prompts x {preset.group_size} samples per mini-batch, N per step",
        "steps per run": str(preset.steps),
        "cold start": sweep.coldstart_line(out_dir),
    }
    path = report.write_report(rows, out_dir, header)
    out(f"report: {path}\nmetrics: {out_dir / 'metrics.jsonl'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
