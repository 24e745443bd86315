"""How a verl config selects and configures the compact-routing rollout path.

Owns the manager's dotted path (:data:`MANAGER_FQN`, what YAML recipes and overrides name), the test of whether a
config runs it (:func:`uses_compact_routing`) and the user options under ``verl_stable.routing``
(:class:`RolloutRoutingOptions`), which refuse unknown keys: the section is read by the agent-loop workers long after
the run has started, so a misspelt option would otherwise be dropped without a word.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from verl_stable.schema import DEFAULT_SHARE_MIN_BYTES, RoutingOptions, VerlStableSection, parse

__all__ = [
    "DEFAULT_OPTIONS",
    "DEFAULT_SHARE_MIN_BYTES",
    "MANAGER_CONFIG_KEY",
    "MANAGER_FQN",
    "OPTIONS_SECTION",
    "RolloutRoutingOptions",
    "uses_compact_routing",
]

MANAGER_FQN = "verl_stable.integration.rollout.CompactRoutingAgentLoopManagerTQ"
"""The dotted path recipes name; the package resolves it lazily (see :mod:`verl_stable.integration.rollout`)."""
MANAGER_CONFIG_KEY = "actor_rollout_ref.rollout.agent.agent_loop_manager_class"
OPTIONS_SECTION = "verl_stable.routing"


def uses_compact_routing(config: Any) -> bool:
    """Whether a verl config runs the compact-routing agent-loop manager with rollout routing export on."""
    from omegaconf import OmegaConf

    fqn = OmegaConf.select(config, MANAGER_CONFIG_KEY, default=None)
    export = OmegaConf.select(config, "actor_rollout_ref.rollout.enable_rollout_routing_replay", default=False)
    return bool(export) and isinstance(fqn, str) and fqn.rsplit(".", 1)[-1] == "CompactRoutingAgentLoopManagerTQ"


@dataclass(frozen=True)
class RolloutRoutingOptions:
    """User options, read from ``verl_stable.routing`` in the trainer config (``+verl_stable.routing.on_invalid=...``).

    The field names are the only keys the section accepts (``verl_stable.recipes`` reads them from here too).

    Attributes:
        on_invalid: ``"raise"`` (default) or ``"skip_sample"`` (train that sample with the model's own routing,
            count it in ``stable/routing/*`` and log a warning).
        share_prompt_rows: store the prompt rows once per group in the side partition (default on;
            ``+verl_stable.routing.share_prompt_rows=false`` keeps them with every sample).
        share_prompt_rows_min_bytes: share a group's prompt rows only when that saves at least this many bytes,
            ``(n - 1) x`` the group's prompt rows (default :data:`DEFAULT_SHARE_MIN_BYTES`; 0 shares every group
            of more than one sample). Below it a side entry costs more than it saves: one TransferQueue put and a
            share of one read cost what ~2 MB of rows cost to move (``benchmarks/bench_side_entry_cost.py``).
    """

    on_invalid: str = "raise"
    share_prompt_rows: bool = True
    share_prompt_rows_min_bytes: int = DEFAULT_SHARE_MIN_BYTES

    def __post_init__(self) -> None:
        # the schema's check whether built from the config or in code
        parse(RoutingOptions, dataclasses.asdict(self), OPTIONS_SECTION)

    @classmethod
    def from_config(cls, config: Any) -> RolloutRoutingOptions:
        """From the whole trainer config (DictConfig or mapping); missing section = defaults.

        The ``verl_stable`` section is read with the schema (:class:`verl_stable.schema.VerlStableSection`).

        Raises:
            verl_stable.schema.ConfigError: (a ``ValueError``) the section is not a mapping, holds a key that is
                not an option, or a value of the wrong type or out of range; the message names the key.
        """
        section = config.get("verl_stable", None) if isinstance(config, Mapping) or hasattr(config, "get") else None
        options = parse(VerlStableSection, section, "verl_stable").routing
        return cls(**options.model_dump())


DEFAULT_OPTIONS = RolloutRoutingOptions()
"""The options of a config without a ``verl_stable.routing`` section (frozen, so one instance serves as default)."""
