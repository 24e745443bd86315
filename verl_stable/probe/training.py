"""The training side of the probe: the forward verl's FSDP actor runs on the sampled tokens, without replay and with
R3 replay of the rollout's routing.

The actor's numerics: the checkpoint loaded in fp32 with sdpa attention (the CPU runtime's attention; flash attention
on a GPU node differs in summation order only), then, at ``--train-dtype bf16``, its parameters cast to bf16 and the
forward run under ``torch.autocast(bf16)`` -- what verl's FSDP2 engine does with its default ``mixed_precision``
(``param_dtype`` bf16, ``MixedPrecisionPolicy`` + autocast); at ``fp32`` neither (``param_dtype: fp32``, the lab's
actor). One sequence per forward, ``prompt + response``, no padding.

Per sampled token ``y_t`` (position ``P + t``) the log-prob is ``log pi(y_t) = log_softmax(z_{P+t-1})[y_t]`` from the
fp32 upcast of the logits, as verl's ``logprobs_from_logits`` computes it.

Routing (a MoE only), per pass, through :mod:`verl_stable.routing`:

* no replay: one :func:`~verl_stable.routing.capture` records the experts the router chooses and uses, ``[P + R,
  moe_layers, top_k]``;
* R3: the rollout's rows (positions ``[0, P + R - 1)``) are replayed with :func:`~verl_stable.routing.replay`; the
  last token's row has none and keeps the model's own routing (it feeds no log-prob). A capture installed before the
  replayer sees the router's own choice (what replay hides: verl's ``router_disagreement``), one installed after it
  the experts actually used (verl's ``disagreement`` under replay: 0 when replay is exact), as verl-stable's replay
  engine installs them (:class:`verl_stable.routing.replay_pass.ReplayPass`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from verl_stable.probe.inference import Rollout, load_checkpoint

if TYPE_CHECKING:
    from verl_stable.routing import RoutingLayout, RoutingRecorder, RoutingTrace

__all__ = ["TRAIN_DTYPES", "Scored", "TrainingForward", "autocast_context"]

TRAIN_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""``--train-dtype``: verl's ``actor.fsdp_config.mixed_precision.param_dtype`` (verl's default: bf16)."""


@dataclass
class Scored:
    """The training forward of one rollout.

    Attributes:
        logp: ``[R]`` fp32 ``log pi`` of the sampled tokens.
        natural: ``[P + R, moe_layers, top_k]`` int64 experts the router chose (None for a dense model).
        used: ``[P + R, moe_layers, top_k]`` int64 experts the layer used (the replayed ones under R3; without
            replay the router's own: ``natural``).
    """

    logp: torch.Tensor
    natural: torch.Tensor | None
    used: torch.Tensor | None


def autocast_context(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """verl's ``forward_step`` autocast: none at fp32, ``torch.autocast(device, dtype)`` otherwise."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def replay_trace(rows: np.ndarray, num_tokens: int, layout: RoutingLayout) -> RoutingTrace:
    """The rollout's ``[P + R - 1, M, K]`` rows as a :class:`~verl_stable.routing.RoutingTrace` of ``num_tokens = P + R``
    rows, the last one without data (``-1``)."""
    from verl_stable.routing import RoutingTrace

    ids = torch.full((num_tokens, rows.shape[1], rows.shape[2]), -1, dtype=torch.long)
    ids[: rows.shape[0]] = torch.from_numpy(np.asarray(rows, dtype=np.int64))
    return RoutingTrace.from_tensor(ids, layout.num_experts, layer_indices=layout.moe_layers)


class TrainingForward:
    """The actor's forward on rollouts (module docstring).

    Args:
        model_dir: the checkpoint.
        train_dtype: a key of :data:`TRAIN_DTYPES`.
        device: where the forward runs (``cpu`` or ``cuda``).
        moe: whether to capture (and replay) routing.
    """

    def __init__(self, model_dir: str | Path, train_dtype: str, device: str = "cpu", moe: bool = True) -> None:
        if train_dtype not in TRAIN_DTYPES:
            raise ValueError(f"train_dtype must be one of {sorted(TRAIN_DTYPES)}, got {train_dtype!r}")
        self.dtype = TRAIN_DTYPES[train_dtype]
        self.device = torch.device(device)
        self.model = load_checkpoint(model_dir).to(device=self.device, dtype=self.dtype).eval()
        self.routing = None
        if moe:
            from verl_stable.routing import bind_model

            self.routing = bind_model(self.model)

    @property
    def layout(self) -> RoutingLayout | None:
        """The model's routing layout (None for a dense model)."""
        return None if self.routing is None else self.routing.layout

    @contextlib.contextmanager
    def _sessions(
        self, replay_rows: np.ndarray | None, num_tokens: int
    ) -> Iterator[tuple[RoutingRecorder | None, RoutingRecorder | None]]:
        """``(natural, used)`` recorders, with the replayer between them under R3 (module docstring)."""
        from verl_stable.routing import capture, replay

        if self.routing is None:
            yield None, None
            return
        with capture(self.model) as natural:
            if replay_rows is None:
                yield natural, natural
                return
            trace = replay_trace(replay_rows, num_tokens, self.routing.layout)
            with replay(self.model, trace), capture(self.model) as used:
                yield natural, used

    @torch.no_grad()
    def score(self, rollout: Rollout, replay: bool = False) -> Scored:
        """``log pi`` of the rollout's sampled tokens and the routing of the pass; ``replay``: R3 with its routing.

        Raises:
            ValueError: ``replay`` for a rollout without routing (a dense model, an engine without export).
        """
        if replay and rollout.routing is None:
            raise ValueError("R3 replay needs the rollout's routed experts; this rollout has none")
        tokens = list(rollout.prompt_ids) + list(rollout.response_ids)
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        prompt_len = len(rollout.prompt_ids)
        with self._sessions(rollout.routing if replay else None, len(tokens)) as (natural, used):
            with autocast_context(self.device, self.dtype):
                logits = self.model(input_ids=ids, use_cache=False).logits[0]
            logp = torch.log_softmax(logits[prompt_len - 1 : -1].float(), dim=-1)
            logp = logp.gather(-1, ids[0, prompt_len:, None]).squeeze(-1).cpu()
        if natural is None:
            return Scored(logp, None, None)
        return Scored(logp, natural.trace.to_tensor(), used.trace.to_tensor())
