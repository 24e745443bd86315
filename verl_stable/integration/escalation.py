"""The guard's ``escalate`` action in verl: move a running trainer to a stricter rollout correction.

verl's V1 trainer reads ``config.algorithm.rollout_correction`` afresh at every step, in the task runner, when it
computes the IS weights and the rejection mask from the rollout's and pi_old's log-probs (``rollout_corr_helper
.compute_rollout_correction_and_add_to_batch``, before the advantages and the update). Changing that section of the
trainer's own config therefore changes every later step and nothing before: no worker is touched, nothing is
patched. What can change is the schema's :class:`~verl_stable.schema.EscalationOptions` (IS level and threshold,
batch normalisation, rejection sampling and its threshold).

:func:`check` runs verl's own rollout-correction code once on three tokens with the escalated settings, so a name or
threshold verl would refuse fails before the run starts (the trainer's constructor and ``preflight`` call it), not at
the step the guard fires. :func:`apply` sets the values and returns what changed, for the log and the run summary.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from verl_stable.schema import ESCALATION_KEYS

SECTION = "algorithm.rollout_correction"
# verl's defaults for keys a config may leave out (compute_rollout_correction_and_add_to_batch's .get fallbacks)
_VERL_DEFAULTS: dict[str, Any] = {
    "rollout_is": None,
    "rollout_is_threshold": 2.0,
    "rollout_is_batch_normalize": False,
    "rollout_rs": None,
    "rollout_rs_threshold": None,
}


def _section(config: Any) -> Any:
    algorithm = config.get("algorithm") if hasattr(config, "get") else None
    return None if algorithm is None else algorithm.get("rollout_correction")


def effective(config: Any, changes: Mapping[str, Any] | Iterable[tuple[str, Any]] = ()) -> dict[str, Any]:
    """The rollout-correction settings verl would use: the config's section (verl's defaults where it is silent),
    with ``changes`` on top."""
    section = _section(config)
    current = {key: (section.get(key, default) if section is not None else default) for key, default in
               _VERL_DEFAULTS.items()}  # fmt: skip
    return {**current, **dict(changes)}


def check(config: Any, changes: Mapping[str, Any] | Iterable[tuple[str, Any]], where: str) -> None:
    """Refuse an escalation verl would refuse, or one that could not act in this run.

    Raises:
        ValueError: a key outside :data:`~verl_stable.schema.ESCALATION_KEYS`; verl's bypass mode (the trainer then
            computes no rollout correction, so nothing would change); verl's rollout-correction code raising on the
            escalated settings (its message is kept).
    """
    changes = dict(changes)
    unknown = sorted(set(changes) - set(ESCALATION_KEYS))
    if unknown:
        raise ValueError(f"{where}: escalate_to keys {unknown} are not among {ESCALATION_KEYS}")
    section = _section(config)
    if section is not None and section.get("bypass_mode", False):
        raise ValueError(
            f"{where}: escalate changes {SECTION}, which verl ignores in bypass mode ({SECTION}.bypass_mode=true): "
            "the trainer computes no IS weights or rejection mask there"
        )
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    settings = effective(config, changes)
    old = torch.zeros(1, 3)
    rollout = torch.tensor([[0.0, -0.5, 0.5]])  # ratios e^0, e^0.5, e^-0.5: both sides of 1
    try:
        compute_rollout_correction_and_rejection_mask(old, rollout, torch.ones(1, 3), **settings)
    except Exception as exc:  # noqa: BLE001 - verl raises several types; each is a refusal of the settings
        raise ValueError(
            f"{where}: verl's rollout correction refuses {settings}: {type(exc).__name__}: {exc}"
        ) from None


def apply(config: Any, changes: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> list[str]:
    """Set ``changes`` on the trainer config's ``algorithm.rollout_correction`` (created if absent).

    Returns:
        ``"<key>: <before> -> <after>"`` for each key whose value changed.
    """
    from omegaconf import OmegaConf, open_dict

    before = effective(config)
    with open_dict(config):
        if _section(config) is None:
            config.algorithm.rollout_correction = OmegaConf.create({})
        with open_dict(config.algorithm.rollout_correction):
            for key, value in dict(changes).items():
                config.algorithm.rollout_correction[key] = value
    after = effective(config)
    return [f"{key}: {before[key]!r} -> {after[key]!r}" for key in ESCALATION_KEYS if before[key] != after[key]]
