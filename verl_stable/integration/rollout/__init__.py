"""The agent-loop extension point of R3: verl's agent-loop manager, worker and output subclasses.

The manager :class:`CompactRoutingAgentLoopManagerTQ` is selected with
``+actor_rollout_ref.rollout.agent.agent_loop_manager_class=verl_stable.integration.rollout.CompactRoutingAgentLoopManagerTQ``.
Its workers hand each sample's routing to :mod:`verl_stable.transport` (validate, compact, share prompt rows, seed)
and put the result in TransferQueue; the actors read it back through :mod:`verl_stable.transport.expansion`.

verl imports this package (the plugin calls :func:`register`) in every process it starts, so importing it stays
light: :mod:`.agent_loop`, which imports verl's agent loop, TransferQueue and Ray, is imported only when one of its
names is first read from here (:data:`_LAZY`), which is also how the dotted path above resolves in a Ray worker.
"""

from __future__ import annotations

import importlib
from typing import Any

from verl_stable.transport.options import MANAGER_FQN

__all__ = [  # noqa: F822 - the names of _LAZY are resolved by the module __getattr__
    "CompactRoutingAgentLoopManagerTQ",
    "CompactRoutingAgentLoopOutput",
    "CompactRoutingAgentLoopWorkerTQ",
    "compact_agent_loop_output",
    "register",
]

_LAZY = {
    name: "verl_stable.integration.rollout.agent_loop"
    for name in (
        "CompactRoutingAgentLoopManagerTQ",
        "CompactRoutingAgentLoopOutput",
        "CompactRoutingAgentLoopWorkerTQ",
        "compact_agent_loop_output",
    )
}
"""Names served from the heavy :mod:`.agent_loop` module, imported on first access."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later reads skip this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def register() -> list[str]:
    """Plugin step: check the verl interfaces this package relies on (cheaply); nothing is registered in verl.

    The manager is chosen by FQN in the config, so no verl registry is touched. The check runs at ``import verl``
    in every process, so it only inspects light modules.
    """
    from verl.workers.config.rollout import AgentLoopConfig
    from verl.workers.rollout.replica import TokenOutput

    if "routed_experts" not in TokenOutput.model_fields:
        raise RuntimeError("verl's TokenOutput has no routed_experts field: rollout routing export cannot work")
    if "agent_loop_manager_class" not in {f.name for f in AgentLoopConfig.__dataclass_fields__.values()}:
        raise RuntimeError("verl's AgentLoopConfig has no agent_loop_manager_class: cannot select the compact manager")
    return [
        f"rollout routing: {MANAGER_FQN} (select via +actor_rollout_ref.rollout.agent.agent_loop_manager_class, not in verl's yaml)"
    ]
