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

from verl_stable.routing.codecs import ON_INVALID

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
DEFAULT_SHARE_MIN_BYTES = 1 << 21
"""Default ``share_prompt_rows_min_bytes`` (2 MiB): below what the bytes a shared group saves are worth its side
entry's round trips, measured on TransferQueue's SimpleStorage (docs/benchmarks.md, "Side entries: break-even")."""


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
        if self.on_invalid not in ON_INVALID:
            raise ValueError(f"{OPTIONS_SECTION}.on_invalid must be one of {ON_INVALID}, got {self.on_invalid!r}")
        minimum = self.share_prompt_rows_min_bytes
        if isinstance(minimum, bool) or not isinstance(minimum, int) or minimum < 0:
            raise ValueError(
                f"{OPTIONS_SECTION}.share_prompt_rows_min_bytes must be an int >= 0 (bytes), got {minimum!r}"
            )

    @classmethod
    def from_config(cls, config: Any) -> RolloutRoutingOptions:
        """From the whole trainer config (DictConfig or mapping); missing section = defaults.

        Raises:
            ValueError: the section holds a key that is not an option (named, with the known ones), is not a
                mapping, or a value is out of range.
        """
        section = config.get("verl_stable", None) if isinstance(config, Mapping) or hasattr(config, "get") else None
        routing = section.get("routing", None) if section is not None else None
        if routing is None:
            return cls()
        if not (isinstance(routing, Mapping) or hasattr(routing, "keys")):
            raise ValueError(f"{OPTIONS_SECTION} must be a mapping of options, got {type(routing).__name__}")
        known = tuple(f.name for f in dataclasses.fields(cls))
        unknown = sorted(str(k) for k in routing.keys() if k not in known)
        if unknown:
            raise ValueError(
                f"{OPTIONS_SECTION} has unknown key(s) {', '.join(unknown)}; known keys: {', '.join(known)}"
            )
        share = routing.get("share_prompt_rows", True)
        if not isinstance(share, bool):
            raise ValueError(f"{OPTIONS_SECTION}.share_prompt_rows must be true or false, got {share!r}")
        return cls(
            on_invalid=str(routing.get("on_invalid", "raise")),
            share_prompt_rows=share,
            share_prompt_rows_min_bytes=routing.get("share_prompt_rows_min_bytes", DEFAULT_SHARE_MIN_BYTES),
        )


DEFAULT_OPTIONS = RolloutRoutingOptions()
"""The options of a config without a ``verl_stable.routing`` section (frozen, so one instance serves as default)."""
