"""What one measured Megatron replay pass records: per-micro-batch count vectors and the router taps that fill them.

:class:`~verl_stable.integration.megatron_replay.MegatronReplayMetricsMixin` opens an :class:`Audit` for each
``forward_backward_batch`` it measures. Each replaying router gets a forward hook (:func:`router_hook`) that adds its
counts to the vector of the micro-batch being forwarded, and a :class:`NativeChoiceTap` that keeps the router's own
top-k choice of the same call (verl's replay discards it). Layout of a count vector (int64): per MoE layer
``[replayed, differ, with data, own choice differs]`` (:data:`PER_LAYER` entries), then the coverage counts in the
order of :data:`~verl_stable.metric_names.COVERAGE_COUNTS`, then three counters (router calls measured, calls without
a row map, calls whose row map did not fit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from verl_stable.metric_names import COVERAGE_COUNTS
from verl_stable.routing.disagreement import expert_sets_differ
from verl_stable.routing.replay_audit import coverage_row_counts, rows_with_data, used_vs_target

__all__ = ["COVERAGE_WIDTH", "EXTRA", "PER_LAYER", "Audit", "NativeChoiceTap", "router_hook"]

# Per micro-batch count vector: per MoE layer [replayed, differ, with data, router's own choice differs], then the
# coverage counts, then three counters.
PER_LAYER = 4
COVERAGE_WIDTH = len(COVERAGE_COUNTS)
EXTRA = 3  # router calls measured, calls without a row map (no response_mask), calls whose row map did not fit


@dataclass
class Audit:
    """One ``forward_backward_batch``'s measurements: per micro-batch count vectors, and the hooks that fill them.

    Attributes:
        ordinals: router ``layer_number`` (1-based, global) -> MoE-layer ordinal.
        device: where the count vectors live (the model's device).
        counts: micro-batch slot -> count vector (int64).
        calls: model chunk (``id``) -> ``forward_step`` calls so far: the slot of a chunk's next micro-batch.
        slot: the micro-batch being forwarded.
        rows: its token class per router input row (``None``: unknown, no coverage).
        handles: the router hooks and wrapped replay objects, removed at the end of the pass.
        native: ``id(RouterReplay)`` -> the top-k ids its router chose itself in the call being replayed.
    """

    ordinals: dict[int, int]
    device: torch.device
    counts: dict[int, torch.Tensor] = field(default_factory=dict)
    calls: dict[int, int] = field(default_factory=dict)
    slot: int = 0
    rows: torch.Tensor | None = None
    handles: list[Any] = field(default_factory=list)
    native: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def width(self) -> int:
        return PER_LAYER * len(self.ordinals) + COVERAGE_WIDTH + EXTRA

    def begin(self, chunk: Any, rows: torch.Tensor | None) -> None:
        """The next micro-batch of ``chunk`` is about to be forwarded, its router rows classified as ``rows``."""
        self.slot = self.calls.get(id(chunk), 0)
        self.calls[id(chunk)] = self.slot + 1
        self.rows = rows

    def vector(self) -> torch.Tensor:
        if self.slot not in self.counts:
            self.counts[self.slot] = torch.zeros(self.width, dtype=torch.long, device=self.device)
        return self.counts[self.slot]

    def table(self) -> torch.Tensor:
        """``[micro-batches, width]``: every slot any chunk forwarded, zeros where this rank measured nothing."""
        slots = max(self.calls.values(), default=0)
        table = torch.zeros(slots, self.width, dtype=torch.long, device=self.device)
        for slot, vector in self.counts.items():
            table[slot] += vector
        return table


class NativeChoiceTap:
    """Records the router's own top-k choice in each replayed forward of one verl ``RouterReplay`` (until removed).

    verl's ``RouterReplay.get_replay_topk(scores, topk, ..., default_compute_topk)`` returns the replayed ids in
    place of what ``default_compute_topk`` (verl's routing function on the same scores) would choose; the tap runs
    that function once more, without gradient, and keeps its ids in ``native[id(replay)]`` for the router's forward
    hook. The instance attribute it sets shadows verl's method on this one object only; :meth:`remove` deletes it.
    """

    def __init__(self, replay: Any, native: dict[int, torch.Tensor]) -> None:
        from verl.utils.megatron.router_replay_patch import RouterReplayAction

        self._replay = replay
        original = type(replay).get_replay_topk.__get__(replay)

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            if (
                replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD
                and replay.target_topk_idx is not None
                and default_compute_topk is not None
            ):
                with torch.no_grad():
                    _, ids = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                native[id(replay)] = ids
            return original(
                scores, topk, num_groups=num_groups, group_topk=group_topk, default_compute_topk=default_compute_topk
            )

        # patch: megatron_router_native_choice (verl_stable.compat.catalogue)
        replay.get_replay_topk = get_replay_topk

    def remove(self) -> None:
        self._replay.__dict__.pop("get_replay_topk", None)


def router_hook(audit: Audit) -> Callable[..., None]:
    """The forward hook of one replaying router, counting into ``audit``.

    In each replayed forward (not the backward's recomputation) it adds the router's used experts against verl's
    targets, its own choice against them, and the coverage of its rows to the count vector of the micro-batch being
    forwarded (the layout of the module docstring).
    """
    from verl.utils.megatron.router_replay_patch import RouterReplayAction

    def hook(router: Any, args: Any, output: Any) -> None:
        replay = router.router_replay
        if replay.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
            return  # recording (R2 pi_old) or the backward's recomputation: counted once, in the forward
        routing_map = output[1]
        rows = routing_map.shape[0]
        vector = audit.vector()
        vector[-3] += 1
        mask = replay.target_replay_mask
        native = audit.native.pop(id(replay), None)
        with torch.no_grad():
            if replay.target_topk_idx is None:  # verl falls back to the router's own choice
                covered = torch.zeros(rows, dtype=torch.bool, device=routing_map.device)
            else:
                target = replay.target_topk_idx.to(routing_map.device)
                replayed, differ = used_vs_target(routing_map, target, mask)
                base = PER_LAYER * audit.ordinals[router.layer_number]
                vector[base] += replayed
                vector[base + 1] += differ
                # a replayed zero row (a token the rollout did not route) forced expert 0: not covered
                covered = rows_with_data(target)
                if mask is not None:
                    covered &= mask.to(routing_map.device).bool()
                if native is not None and native.shape == target.shape:
                    own_differs = expert_sets_differ(native.to(torch.long), target.to(torch.long)) & covered
                    vector[base + 2] += covered.sum()
                    vector[base + 3] += own_differs.sum()
            if audit.rows is None:
                vector[-2] += 1
            elif audit.rows.shape[0] != rows:
                vector[-1] += 1
            else:
                start = PER_LAYER * len(audit.ordinals)
                vector[start : start + COVERAGE_WIDTH] += coverage_row_counts(audit.rows, covered)

    return hook
