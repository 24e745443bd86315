"""``verl-stable recipe``: list, show, check or run the recipes (``python -m verl_stable.recipes`` runs it too).

``list``, ``path`` and ``command`` read the regime table and the recipe files; ``show`` composes a recipe on verl's
config with overrides; ``check`` composes, converts to verl's dataclasses and checks the regime, one line per problem
(exit 1 when there is one); ``run-cpu`` runs a recipe (fsdp or megatron) with verl's trainer on the CPU runtime
(:func:`verl_stable.toy.launch.run_recipe`), the rollout on the ``hf`` backend or (``--engine vllm``) vLLM's CPU build. Names, numbers and overrides are checked (syntax, composition,
:func:`verl_stable.recipes.preflight`) before anything is composed, built or run; a bad one is answered with exit
code 2 and a message.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

from verl_stable.argtypes import positive_int
from verl_stable.recipes import (
    BACKENDS,
    REGIMES,
    check_override_syntax,
    compose_recipe,
    list_recipes,
    main_ppo_command,
    option_problems,
    parse_recipe_name,
    recipe_path,
    regime_mismatches,
    unknown_gained_keys,
    unknown_recipe_keys,
    verl_configs,
)
from verl_stable.recipes.strict_yaml import RecipeFileError, read_recipe_file
from verl_stable.toy import launch


def _cmd_list(out: Callable[[str], None]) -> int:
    """``list``: one line per shipped recipe with its N, replay mode, summary and path."""
    for backend, name, path in list_recipes():
        r = REGIMES[name]
        out(f"{backend + '/' + name:<26} N={r.staleness:<2} replay={r.router_replay:<8} {r.summary}  ({path})")
    return 0


def _cmd_check(name: str, overrides: Sequence[str], out: Callable[[str], None]) -> int:
    """``check``: every problem of the recipe with ``overrides`` as one line, then the verdict; 1 when any."""
    backend, regime = parse_recipe_name(name)
    path = recipe_path(backend, regime)
    cfg = None
    try:
        problems = [f"unknown key {k} (not in verl's {BACKENDS[backend]})" for k in unknown_recipe_keys(path)]
    except RecipeFileError as exc:  # the file itself is malformed: composing it would only say so again
        problems = [f"cannot read the recipe {exc}"]
    except Exception as exc:  # noqa: BLE001 - a recipe from $VERL_STABLE_RECIPES may be any file
        problems = [f"cannot read the recipe {path}: {type(exc).__name__}: {exc}"]
    else:
        try:
            cfg = compose_recipe(backend, regime, overrides)
        except Exception as exc:  # noqa: BLE001 - hydra's refusal (a key not in verl's config ...) is the answer
            problems.append(f"the overrides do not compose on the recipe: {type(exc).__name__}: {exc}")
    if cfg is not None:
        problems += [
            f"unknown key {k} (added by an override; expected a key of verl's {BACKENDS[backend]} or of verl-stable)"
            for k in unknown_gained_keys(compose_recipe(backend, regime), cfg, backend)
        ]
        problems += regime_mismatches(cfg, regime)
        options = option_problems(cfg)
        problems += options
        try:
            # verl's conversion reads verl-stable's sections again: after a refusal there it would only repeat it
            if not options:
                verl_configs(cfg, validate=True)
        except Exception as exc:  # noqa: BLE001 - any failure of verl's conversion is the answer
            problems.append(f"verl rejects the config: {type(exc).__name__}: {exc}")
    for p in problems:
        out(f"  - {p}")
    out(f"{backend}/{regime}: " + ("OK" if not problems else f"{len(problems)} problem(s)"))
    return 1 if problems else 0


def main(argv: Sequence[str] | None = None, out: Callable[[str], None] = print) -> int:
    """``verl-stable recipe list | path | command | show | check | run-cpu``.

    NAME is ``<backend>/<regime>`` (``fsdp/minirl_n2_r2``) or a bare regime (FSDP). ``check`` returns 1 when it finds
    a problem (one line each).

    Raises:
        SystemExit: code 2 for an unknown name, a malformed override, a bad ``--steps`` or ``--workdir``, or (``show``,
            ``run-cpu``) overrides that do not compose or that :func:`verl_stable.recipes.preflight` refuses; before
            anything is built.
    """
    parser = argparse.ArgumentParser(prog="verl-stable recipe", description="the verl-stable recipes")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="every recipe with its regime")
    for action, text in (
        ("path", "the recipe file"),
        ("command", "the main_ppo command that runs it"),
        ("show", "the composed config (YAML), with overrides"),
        ("check", "compose, convert to verl's dataclasses, check the regime; exit 1 on any problem"),
    ):
        p = sub.add_parser(action, help=text)
        p.add_argument("name")
        if action in ("show", "check"):
            p.add_argument("overrides", nargs="*")
    p = sub.add_parser("run-cpu", help="run a recipe with verl's trainer on the CPU runtime (tiny MoE)")
    p.add_argument("name")
    p.add_argument("--workdir", default="./verl_stable_recipe_run")
    p.add_argument("--steps", type=positive_int, default=2)
    p.add_argument("--engine", default="hf", choices=launch.ENGINES, help="rollout engine (vllm: vLLM's CPU build)")
    p.add_argument("overrides", nargs="*")
    # overrides may follow options (``run-cpu NAME --steps 3 key=value``): argparse leaves those to parse_known_args
    args, extra = parser.parse_known_args(argv)
    unknown_options = [a for a in extra if a.startswith("-")]
    if unknown_options or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        if args.action == "list":
            return _cmd_list(out)
        backend, regime = parse_recipe_name(args.name)
        path = recipe_path(backend, regime)
        check_override_syntax(getattr(args, "overrides", ()))
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    if args.action == "path":
        out(str(path))
        return 0
    if args.action == "command":
        out(" ".join(main_ppo_command(backend, regime)))
        return 0
    if args.action == "run-cpu":
        try:
            rc = launch.run_recipe(
                regime, args.workdir, args.overrides, steps=args.steps, backend=backend, engine=args.engine
            )
        except ValueError as exc:  # refused by the checks made before anything is built
            parser.error(str(exc))
        run = Path(args.workdir).resolve() / "run"
        out(f"main_ppo exited {rc}; log: {run / 'main_ppo.log'}; metrics: {run / 'metrics.jsonl'}")
        return rc
    if args.action == "show":
        from omegaconf import OmegaConf

        try:
            read_recipe_file(path)
        except RecipeFileError as exc:
            parser.error(f"cannot read the recipe {exc}")
        try:
            cfg = compose_recipe(backend, regime, args.overrides)
        except Exception as exc:  # noqa: BLE001 - hydra's refusal is reported, not raised
            parser.error(f"the overrides do not compose on {backend}/{regime}: {type(exc).__name__}: {exc}")
        out(OmegaConf.to_yaml(cfg))
        return 0
    return _cmd_check(args.name, args.overrides, out)


if __name__ == "__main__":
    raise SystemExit(main())
