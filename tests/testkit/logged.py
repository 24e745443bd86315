"""The metric catalogue against a real run: what verl logged equals what the run's configuration predicts.

:mod:`verl_stable.monitor.logged` says, from a configuration alone, which metrics a run logs; the guard's preflight
refuses a rule on any other. :func:`catalogue_mismatches` holds that claim against the metrics a real verl run wrote,
both ways: every logged name of verl-stable's own (``stable/...``, the losses' ``actor/MiniRL`` and ``actor/vespo``)
is one the shape predicts, and every family the shape predicts for every run was logged at least once. The
end-to-end tests call it on their runs' rows (no verl start of its own).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

OURS = ("stable/", "actor/MiniRL", "actor/vespo")


def compose_run_config(overrides: Sequence[str], backend: str = "fsdp") -> Any:
    """The config ``main_ppo`` composes from a run's argument list (``--config-path`` / ``--config-name`` or verl's
    own ``backend`` config)."""
    from verl_stable.recipes.compose import compose_base, compose_file

    path = name = None
    rest = []
    for item in overrides:
        if item.startswith("--config-path="):
            path = item.split("=", 1)[1]
        elif item.startswith("--config-name="):
            name = item.split("=", 1)[1]
        else:
            rest.append(item)
    if path is not None and name is not None:
        return compose_file(os.path.join(path, f"{name}.yaml"), rest)
    return compose_base(backend, rest)


def catalogue_mismatches(cfg: Any, rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """Where the run's logged metrics and the catalogue's prediction for its config differ (empty: they agree)."""
    from verl_stable.monitor import logged
    from verl_stable.recipes.cross_checks import run_shape

    shape = run_shape(cfg)
    keys = set().union(*(set(r) for r in rows)) - {"step"}
    problems = [
        f"logged {k!r}, which the catalogue does not predict for this run ({logged.not_logged_reason(k, shape)})"
        for k in sorted(keys)
        if k.startswith(OURS) and not logged.logged_by(k, shape)
    ]
    for family in logged.FAMILIES:
        if family.pattern.startswith("stable/guard/") or not (family.every_run and family.needs(shape)):
            continue
        if not any(family.matches_in(k, shape) for k in keys):
            problems.append(f"the catalogue predicts {family.pattern!r} in every such run, but none was logged")
    for rule, _ in shape.rules:
        if f"{logged.GUARD_PREFIX}{rule}" not in keys:
            problems.append(f"the guard's rule {rule!r} is active, but stable/guard/{rule} was not logged")
    return problems
