"""Make verl's replay-buffer poll interval configurable (it is a fixed 2 s in verl 0.9.1).

verl's V1 trainer waits for rollouts by polling TransferQueue every ``ReplayBuffer.poll_interval`` seconds, a
constructor argument the trainer never passes, so every step pays up to 2 s of idle waiting -- most of a tiny CPU
step. :func:`poll_interval` is a context manager that makes new ``ReplayBuffer`` instances use another interval and
restores verl's constructor on exit. :func:`register` applies it for the life of the process when the environment
variable ``VERL_STABLE_POLL_INTERVAL_S`` is set (the CPU launcher sets it; the task runner process builds the replay
buffer and inherits the variable).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Iterator
from typing import Any

from verl_stable import env_vars
from verl_stable.compat import contracts
from verl_stable.compat.contracts import Contract, ContractError, ContractResult

ENV_POLL_INTERVAL = env_vars.POLL_INTERVAL_S.name
_INSTALLED = contextlib.ExitStack()


@contextlib.contextmanager
def poll_interval(seconds: float) -> Iterator[None]:
    """Within the block, ``ReplayBuffer`` (and subclasses) default to ``poll_interval=seconds``.

    An explicit ``poll_interval=`` argument still wins. Raises ``ValueError`` for an interval that is not a finite
    number > 0.
    """
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    seconds = float(seconds)
    if not (math.isfinite(seconds) and seconds > 0):  # an infinite interval would wait for a rollout forever
        raise ValueError(f"poll interval must be a finite number of seconds > 0, got {seconds}")
    original = ReplayBuffer.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        kwargs.setdefault("poll_interval", seconds)
        original(self, *args, **kwargs)

    __init__.__verl_stable_poll__ = seconds  # type: ignore[attr-defined]
    # patch: replay_buffer_poll (verl_stable.compat.catalogue)
    ReplayBuffer.__init__ = __init__
    try:
        yield
    finally:
        ReplayBuffer.__init__ = original


def uninstall() -> None:
    """Undo what :func:`register` installed."""
    _INSTALLED.close()


def register() -> list[str]:
    """Apply ``VERL_STABLE_POLL_INTERVAL_S`` to verl's replay buffer in this process (idempotent, opt-in).

    Raises:
        ValueError: a value :data:`verl_stable.env_vars.POLL_INTERVAL_S` refuses (not a finite number > 0).
    """
    seconds = env_vars.POLL_INTERVAL_S.read()
    if seconds is None:
        return []
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    current = getattr(ReplayBuffer.__init__, "__verl_stable_poll__", None)
    if current is None:
        _INSTALLED.enter_context(poll_interval(seconds))
    return [f"replay_buffer_poll_interval:{seconds}s"]


# ---------------------------------------------------------------------------------------------------------------------
# Contracts: the verl interface the poll interval relies on, checked by name (``verl-stable doctor``).


def _replay_buffer_poll() -> str:
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    if "poll_interval" not in inspect.signature(ReplayBuffer.__init__).parameters:
        raise ContractError("ReplayBuffer.__init__ has no poll_interval argument")
    if "self.poll_interval" not in inspect.getsource(ReplayBuffer._wait_for_next_poll):
        raise ContractError("ReplayBuffer._wait_for_next_poll no longer sleeps self.poll_interval")
    return "ReplayBuffer(poll_interval=...)"


CONTRACTS: tuple[Contract, ...] = (Contract("replay_buffer_poll", "ReplayBuffer poll_interval", _replay_buffer_poll),)


def check_contracts(names: tuple[str, ...] | list[str] | None = None) -> list[ContractResult]:
    """Run the poll interval's contracts (all by default); never raises."""
    return contracts.check(CONTRACTS, names)
