"""Rollout side of R3 in verl: validated, compact routing from the inference server to the actors.

The agent-loop manager :class:`CompactRoutingAgentLoopManagerTQ`, selected with
``+actor_rollout_ref.rollout.agent.agent_loop_manager_class=verl_stable.integration.rollout.CompactRoutingAgentLoopManagerTQ``,
starts agent-loop workers that validate each sample's routing at the boundary, store only its MoE layers in the
smallest unsigned dtype (prompt rows once per group) with the sample's boundary counters, and the actors rebuild
verl's form from them. One module per concern; every name is importable from this package, which is the API:

* :mod:`.config`: the manager's dotted path, :func:`uses_compact_routing` and the ``verl_stable.routing`` options
  (:class:`RolloutRoutingOptions`, unknown keys refused);
* :mod:`.boundary`: validating and compacting one sample's routing, its counters and the
  ``stable/routing/transport/*`` metrics, the fixed SGLang reader;
* :mod:`.sharing`: the prompt-rows-once-per-group protocol (keys, references, the side partition, re-attaching on
  the actor, clearing);
* :mod:`.actor`: a batch's compact fields back to a :class:`~verl_stable.routing.trace.RoutingTrace` or to verl's
  ``routed_experts``;
* :mod:`.seeding`: each sample's sampling seed from its identity (run seed, step, prompt, index in its group), so
  that what is sampled does not depend on batching or arrival order;
* :mod:`.agent_loop`: verl's agent-loop output, worker and manager subclasses and
  :func:`compact_agent_loop_output`.

verl imports this package (the plugin calls :func:`register`) in every process it starts, so importing it stays
light: :mod:`.agent_loop`, which imports verl's agent loop, TransferQueue and Ray, is imported only when one of its
names is first read from here (:data:`_LAZY`), which is also how the dotted path above resolves in a Ray worker.
"""

from __future__ import annotations

import importlib
from typing import Any

from verl_stable.integration.rollout.actor import (
    COMPACT_FIELDS,
    expand_compact_routing,
    routing_trace_from_batch,
    without_compact_fields,
)
from verl_stable.integration.rollout.boundary import (
    BOUNDARY_COLUMNS,
    BOUNDARY_ERRORS,
    BOUNDARY_FIELD,
    TRANSPORT_METRIC_PREFIX,
    boundary_counters,
    compact_token_routing,
    fetch_transport_metrics,
    generated_extent,
    read_sglang_routed_experts,
    transport_metrics,
)
from verl_stable.integration.rollout.config import (
    DEFAULT_SHARE_MIN_BYTES,
    MANAGER_CONFIG_KEY,
    MANAGER_FQN,
    RolloutRoutingOptions,
    uses_compact_routing,
)
from verl_stable.integration.rollout.sharing import (
    PROMPT_PARTITION,
    PROMPT_REF_FIELD,
    SIDE_READ_COUNTS,
    SOURCE_PARTITIONS,
    PromptRowSharing,
    ShareDecision,
    SharedPrompt,
    SharedPromptRowsError,
    SharedRowReader,
    StaleSweep,
    async_clear_stale_prompt_rows,
    attach_shared_prompt_rows,
    clear_stale_prompt_rows,
    key_of_ref,
    prompt_ref,
    prompt_rows_key,
    shared_sample_fields,
    stale_prompt_entries,
)

__all__ = [  # noqa: F822 - the names of _LAZY are resolved by the module __getattr__
    "BOUNDARY_COLUMNS",
    "BOUNDARY_ERRORS",
    "BOUNDARY_FIELD",
    "COMPACT_FIELDS",
    "DEFAULT_SHARE_MIN_BYTES",
    "MANAGER_CONFIG_KEY",
    "MANAGER_FQN",
    "PROMPT_PARTITION",
    "PROMPT_REF_FIELD",
    "SIDE_READ_COUNTS",
    "SOURCE_PARTITIONS",
    "TRANSPORT_METRIC_PREFIX",
    "CompactRoutingAgentLoopManagerTQ",
    "CompactRoutingAgentLoopOutput",
    "CompactRoutingAgentLoopWorkerTQ",
    "PromptRowSharing",
    "RolloutRoutingOptions",
    "ShareDecision",
    "SharedPrompt",
    "SharedPromptRowsError",
    "SharedRowReader",
    "StaleSweep",
    "async_clear_stale_prompt_rows",
    "attach_shared_prompt_rows",
    "boundary_counters",
    "clear_stale_prompt_rows",
    "compact_agent_loop_output",
    "compact_token_routing",
    "expand_compact_routing",
    "fetch_transport_metrics",
    "generated_extent",
    "key_of_ref",
    "prompt_ref",
    "prompt_rows_key",
    "read_sglang_routed_experts",
    "register",
    "routing_trace_from_batch",
    "shared_sample_fields",
    "stale_prompt_entries",
    "transport_metrics",
    "uses_compact_routing",
    "without_compact_fields",
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
