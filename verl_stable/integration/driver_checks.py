"""verl-stable's config checks inside verl's own ``validate_config``: refused in the driver, before ``ray.init``.

A user who launches ``python -m verl.trainer.main_ppo --config-path recipes/fsdp ...`` never passes through
``verl-stable run``'s preflight. verl's ``main`` calls ``verl.utils.config.validate_config`` first thing, before
Ray, the workers and the rollout start; this module extends that function, for every caller, with the checks
preflight makes on verl-stable's keys and their cross-field rules
(:func:`verl_stable.recipes.validate.option_problems`: the schema of each section, a guard that could not act,
rollout-correction settings verl judges only at step 1, replay without the rollout's routing, parallel sizes that do
not divide the world). verl's own checks run first and keep their messages.

``main_ppo`` binds ``validate_config`` by ``from verl.utils.config import validate_config`` after ``import verl`` has
loaded the plugin, so the module attribute is what it gets; the wrap is installed when verl first imports
``verl.utils.config`` (:func:`~verl_stable.compat.import_hooks.when_imported`).
"""

from __future__ import annotations

import functools
from typing import Any

from verl_stable.compat.import_hooks import when_imported

CONFIG_MODULE = "verl.utils.config"
MARKER = "_verl_stable_checks"


class VerlStableConfigError(ValueError):
    """A configuration verl-stable refuses in verl's ``validate_config`` (one message per problem, joined)."""


def check(config: Any) -> None:
    """Raise :class:`VerlStableConfigError` for any problem :func:`~verl_stable.recipes.validate.option_problems`
    finds in a composed trainer config."""
    from verl_stable.recipes.validate import option_problems

    problems = option_problems(config)
    if problems:
        raise VerlStableConfigError("verl-stable refuses the config: " + "; ".join(problems))


def _install() -> list[str]:
    import verl.utils.config as module

    original = module.validate_config
    if getattr(original, MARKER, False):
        return ["validate_config: verl-stable checks"]

    @functools.wraps(original)
    def validate_config(config: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(config, *args, **kwargs)
        check(config)
        return result

    setattr(validate_config, MARKER, True)
    # patch: validate_config_checks (verl_stable.compat.catalogue)
    module.validate_config = validate_config
    return ["validate_config: verl-stable checks"]


def register() -> list[str]:
    """Extend ``validate_config`` now, or when verl imports :data:`CONFIG_MODULE` (idempotent)."""
    hook = when_imported(CONFIG_MODULE, _install, deferred_errors="log")
    return hook.result if hook.fired else [f"validate_config: verl-stable checks (when {CONFIG_MODULE} is imported)"]


def unregister() -> None:
    """Restore verl's own ``validate_config`` (tests)."""
    import sys

    module = sys.modules.get(CONFIG_MODULE)
    current = getattr(module, "validate_config", None)
    if current is not None and getattr(current, MARKER, False):
        module.validate_config = current.__wrapped__
