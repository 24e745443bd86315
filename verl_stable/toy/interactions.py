"""A deterministic user simulator for multi-turn rollouts of the toy tasks -- a test asset, not a training feature.

verl 0.9.1 has no interaction (user-simulator) support: its ``ToolAgentLoop`` goes on to a further turn only when its
tool parser finds a tool call in the model's output, which the tiny word-level tokenizer cannot spell. This module adds
the missing turn at the project's edge: :class:`UserSimulatorAgentLoop` is verl's ``ToolAgentLoop`` whose assistant
turns without a tool call are answered by a simulated user, who asks the prompt's question once more (the task's
words are in the tokenizer's vocabulary) and then lets the conversation end. Everything else -- the per-turn
requests to the server, the token bookkeeping (assistant tokens in the response mask, the user turn's tokens out of
it), ``num_turns``, the routed experts of the last request -- is verl's own.

Register it with verl through ``actor_rollout_ref.rollout.agent.agent_loop_config_path`` (a file written by
:func:`write_agent_loop_config`) and select it with ``actor_rollout_ref.rollout.agent.default_agent_loop``
(:func:`multi_turn_overrides` gives both); the dataset rows stay as they are.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

AGENT_NAME = "toy_user_sim_agent"
AGENT_FQN = "verl_stable.toy.interactions.UserSimulatorAgentLoop"
USER_TURNS = 1  # the simulated user's replies per conversation (``multi_turn.max_user_turns`` overrides it)
TOKENS_PER_TURN = 4  # each assistant turn's ``max_tokens``: a conversation fits in one response


def simulated_reply(messages: list[dict[str, Any]]) -> str:
    """The user's reply: the conversation's first user message again (always spellable by the toy tokenizer)."""
    return next(str(m["content"]) for m in messages if m.get("role") == "user")


def write_agent_loop_config(path: str | os.PathLike) -> Path:
    """Write the agent-loop registry file verl reads from ``rollout.agent.agent_loop_config_path``; returns it."""
    path = Path(path)
    path.write_text(f"- name: {AGENT_NAME}\n  _target_: {AGENT_FQN}\n")
    return path


def multi_turn_overrides(config_path: str | os.PathLike, *, user_turns: int = USER_TURNS) -> list[str]:
    """Hydra overrides that make every sample a conversation with the simulated user (``user_turns`` replies)."""
    return [
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={write_agent_loop_config(config_path)}",
        f"actor_rollout_ref.rollout.agent.default_agent_loop={AGENT_NAME}",
        f"actor_rollout_ref.rollout.multi_turn.max_user_turns={user_turns}",
    ]


def _loop_class() -> type:
    from verl.experimental.agent_loop.tool_agent_loop import AgentState, ToolAgentLoop

    class UserSimulatorAgentLoop(ToolAgentLoop):
        """verl's ``ToolAgentLoop`` with the simulated user answering assistant turns that call no tool."""

        async def _handle_generating_state(
            self, agent_data: Any, sampling_params: dict[str, Any], ignore_termination: bool = False
        ) -> Any:
            params = {**sampling_params, "max_tokens": TOKENS_PER_TURN}
            state = await super()._handle_generating_state(agent_data, params, ignore_termination)
            if state != AgentState.TERMINATED or agent_data.tool_calls:
                return state
            max_user_turns = self.max_user_turns if self.max_user_turns is not None else USER_TURNS
            if len(agent_data.response_mask) >= self.response_length or agent_data.user_turns >= max_user_turns:
                return state
            if self.max_assistant_turns and agent_data.assistant_turns >= self.max_assistant_turns:
                return state
            # verl's tool state appends its messages the same way: merge the new context, mask it out
            previous = list(agent_data.messages)
            agent_data.messages.append({"role": "user", "content": simulated_reply(agent_data.messages)})
            merged, mask, logprobs = await self.ct_merge_context_msg(
                previous,
                agent_data.messages,
                agent_data.prompt_ids,
                agent_data.response_mask,
                agent_data.response_logprobs or None,
                tools=getattr(agent_data, "_active_tool_schemas", self.tool_schemas),
            )
            if len(mask) >= self.response_length:
                return AgentState.TERMINATED
            agent_data.prompt_ids, agent_data.response_mask = merged.token_ids, mask
            if agent_data.response_logprobs:
                agent_data.response_logprobs = logprobs or []
            agent_data.user_turns += 1
            return AgentState.GENERATING

    UserSimulatorAgentLoop.__module__ = __name__
    UserSimulatorAgentLoop.__qualname__ = "UserSimulatorAgentLoop"
    return UserSimulatorAgentLoop


def __getattr__(name: str) -> Any:
    # verl (and Ray) are imported only when the loop is first used, as verl's worker instantiates it by its path
    if name == "UserSimulatorAgentLoop":
        cls = _loop_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
