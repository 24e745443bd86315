"""The ``verl-stable`` command line: ``doctor``, ``run`` (verl on CPU) and ``lab``."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import sys
from collections.abc import Callable, Sequence

from verl_stable import SUPPORTED_VERL_VERSION

_VERSIONED_PACKAGES = ("torch", "verl", "transformers", "ray", "tensordict", "vllm", "sglang")


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _entry_point_installed() -> bool:
    return any(ep.value.startswith("verl_stable.") for ep in md.entry_points(group="verl.plugins"))


def doctor(model: str | None = None, out: Callable[[str], None] = print) -> int:
    """Print versions and registration state; return a non-zero exit code when anything is broken.

    verl swallows plugin import errors at DEBUG level, so this is the place where a broken registration
    becomes visible.
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

    if model is not None:
        problems.extend(_check_model(model, out))

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


def _check_model(model: str, out: Callable[[str], None]) -> list[str]:
    from verl_stable.routing.families import describe_model_routing, format_routing_report

    report = describe_model_routing(model)
    out(f"  {model}:")
    for line in format_routing_report(report).splitlines():
        out(f"    {line}")
    return [] if report["replayable"] else [f"routing of {model} cannot be replayed: {report['reason']}"]


# Subcommands that own their argument parsing: (module, help).
_DELEGATED = {
    "run": ("verl_stable.cpu.launch", "run verl's own trainer (main_ppo) on CPU with tiny local assets"),
    "recipe": ("verl_stable.recipes", "list, show, check or run the verl-stable recipes"),
    "lab": ("verl_stable.lab.cli", "the CPU lab: the paper's comparison with verl's own trainer, and a report"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATED:
        module = importlib.import_module(_DELEGATED[argv[0]][0])
        return module.main(argv[1:])
    parser = argparse.ArgumentParser(prog="verl-stable", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_doc = sub.add_parser("doctor", help="versions, registrations and contracts with the installed verl")
    p_doc.add_argument("--model", help="a HF checkpoint dir: can its MoE routing be captured and replayed?")
    for name, (_, help_text) in _DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    args = parser.parse_args(argv)
    return doctor(model=args.model)


if __name__ == "__main__":
    sys.exit(main())
