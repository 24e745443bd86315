"""What one measured Megatron replay pass records: per-micro-batch count vectors and the router taps that fill them.

:class:`~verl_stable.integration.megatron_replay.MegatronReplayMetricsMixin` opens an :class:`Audit` for each
``forward_backward_batch`` it measures. Each replaying router gets a forward hook (:func:`router_hook`) that keeps
references to what the call routed (its ``routing_map``, verl's targets and replay mask), and a
:class:`NativeChoiceTap` that keeps the router's own top-k choice of the same call (verl's replay discards it). When
the micro-batch's forward is done, :meth:`Audit.flush` counts every MoE layer of it at once
(:func:`~verl_stable.routing.replay_audit.layer_counts`): the per-call work is a list append, and the counting a
fixed number of tensor operations per micro-batch instead of per router call -- on a model with few tokens per
micro-batch the operations' launch cost, not their arithmetic, is what the metrics cost.

Layout of a count vector (int64): per MoE layer ``[replayed, differ, with data, own choice differs]``
(:data:`PER_LAYER` entries), then the coverage counts in the order of :data:`~verl_stable.metric_names.COVERAGE_COUNTS`,
then three counters (router calls measured, calls without a row map, calls whose row map did not fit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from verl_stable.metric_names import COVERAGE_COUNTS
from verl_stable.routing.replay_audit import RowRuns, coverage_row_counts, layer_counts, run_coverage_counts

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
        counts: micro-batch slot -> count vector (int64), without its three counters.
        counters: micro-batch slot -> the three counters of the module docstring, as Python integers.
        layer_index: MoE-layer ordinals of a group of calls -> the same as an index tensor on ``device``.
        calls: model chunk (``id``) -> ``forward_step`` calls so far: the slot of a chunk's next micro-batch.
        slot: the micro-batch being forwarded.
        rows: the token class per router input row of the micro-batch being forwarded, computed when it is
            counted: a callable taking ``packed`` and returning the classes as runs or ``[rows]`` codes, or ``None``
            (unknown: no coverage).
        packed: verl's ``PackedSeqParams`` of the micro-batch being forwarded (the model chunk's pre-hook).
        handles: the router hooks and wrapped replay objects, removed at the end of the pass.
        native: ``id(RouterReplay)`` -> the top-k ids its router chose itself in the call being replayed.
        pending: the current micro-batch's replayed router calls, counted by :meth:`flush`: ``(MoE-layer ordinal,
            routing map, target ids or None, replay mask or None, the router's own ids or None)``.
    """

    ordinals: dict[int, int]
    device: torch.device
    counts: dict[int, torch.Tensor] = field(default_factory=dict)
    calls: dict[int, int] = field(default_factory=dict)
    slot: int = 0
    rows: Callable[[Any], RowRuns | torch.Tensor | None] | None = None
    packed: Any = None
    handles: list[Any] = field(default_factory=list)
    native: dict[int, torch.Tensor] = field(default_factory=dict)
    counters: dict[int, list[int]] = field(default_factory=dict)
    layer_index: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)
    pending: list[tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]] = field(
        default_factory=list
    )

    @property
    def width(self) -> int:
        return PER_LAYER * len(self.ordinals) + COVERAGE_WIDTH + EXTRA

    def begin(self, chunk: Any, rows: Callable[[Any], RowRuns | torch.Tensor | None] | None) -> None:
        """The next micro-batch of ``chunk`` is about to be forwarded, its router rows classified by
        ``rows(packed)``."""
        self.flush()
        self.slot = self.calls.get(id(chunk), 0)
        self.calls[id(chunk)] = self.slot + 1
        self.rows, self.packed = rows, None

    def vector(self) -> torch.Tensor:
        if self.slot not in self.counts:
            self.counts[self.slot] = torch.zeros(self.width - EXTRA, dtype=torch.long, device=self.device)
        return self.counts[self.slot]

    def flush(self) -> None:
        """Count the router calls of the micro-batch forwarded since :meth:`begin` into its vector, the MoE layers
        that saw the same rows in one :func:`~verl_stable.routing.replay_audit.layer_counts` (a call without
        targets, where verl fell back to the router's own choice, counts as measured and not covered).

        The three counters stay Python integers until :meth:`table`, and each group of calls is stacked once, moved
        once: every tensor operation here is paid once per micro-batch, whatever the number of MoE layers."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        vector = self.vector()
        counters = self.counters.setdefault(self.slot, [0, 0, 0])
        counters[0] += len(pending)
        groups: dict[int, list[int]] = {}  # rows -> the calls that saw that many rows
        for i, call in enumerate(pending):
            groups.setdefault(call[1].shape[0], []).append(i)
        per_layer = vector[: PER_LAYER * len(self.ordinals)].view(-1, PER_LAYER)
        # (calls, their rows, [calls, rows] covered or None: none covered)
        coverage: list[tuple[int, int, torch.Tensor | None]] = []
        for size, calls in groups.items():
            chosen = [pending[i] for i in calls if pending[i][2] is not None]
            if len(chosen) < len(calls):
                coverage.append((len(calls) - len(chosen), size, None))
            if not chosen:
                continue
            masks, natives = [c[3] for c in chosen], [c[4] for c in chosen]
            targets = torch.stack([c[2] for c in chosen]).to(self.device)
            counts, covered = layer_counts(
                torch.stack([c[1] for c in chosen]),
                targets,
                None if any(m is None for m in masks) else torch.stack(masks).to(self.device),
                None if any(n is None or n.shape != targets.shape[1:] for n in natives) else torch.stack(natives),
            )
            per_layer.index_add_(0, self._layer_index(tuple(c[0] for c in chosen)), counts)
            coverage.append((len(chosen), size, covered))
        rows = self.rows(self.packed) if self.rows is not None else None
        if rows is None:
            counters[1] += len(pending)
            return
        row_count = rows.rows if isinstance(rows, RowRuns) else rows.shape[0]
        start = PER_LAYER * len(self.ordinals)
        for calls, size, covered in coverage:
            if size != row_count:
                counters[2] += calls
                continue
            if covered is None:
                covered = torch.zeros(calls, size, dtype=torch.bool, device=self.device)
            if isinstance(rows, RowRuns):
                vector[start : start + COVERAGE_WIDTH] += run_coverage_counts(rows, covered)
            else:
                vector[start : start + COVERAGE_WIDTH] += coverage_row_counts(rows, covered)

    def _layer_index(self, ordinals: tuple[int, ...]) -> torch.Tensor:
        """The MoE-layer ordinals of a group of calls as an index tensor on the device (made once per group shape)."""
        if ordinals not in self.layer_index:
            self.layer_index[ordinals] = torch.tensor(ordinals, device=self.device)
        return self.layer_index[ordinals]

    def table(self) -> torch.Tensor:
        """``[micro-batches, width]``: every slot any chunk forwarded, zeros where this rank measured nothing."""
        self.flush()
        slots = max(self.calls.values(), default=0)
        table = torch.zeros(slots, self.width, dtype=torch.long, device=self.device)
        for slot, vector in self.counts.items():
            table[slot, :-EXTRA] += vector
        for slot, counters in self.counters.items():
            if any(counters):
                table[slot, -EXTRA:] += torch.tensor(counters, device=self.device)
        return table


class NativeChoiceTap:
    """Records the router's own top-k choice in each replayed forward of one verl ``RouterReplay`` (until removed).

    verl's ``RouterReplay.get_replay_topk(scores, topk, ..., default_compute_topk)`` returns the replayed ids in
    place of what ``default_compute_topk`` (verl's routing function on the same scores) would choose. Under a replay
    mask (R3: verl keeps each sequence's final row native) verl computes that choice itself; the tap passes verl a
    ``default_compute_topk`` that keeps the ids it returns, so the choice is read, not computed again. Without a mask
    (R2's update passes) verl never computes it, and the tap runs the function once, without gradient. The ids land
    in ``native[id(replay)]`` for the router's forward hook. The instance attribute the tap sets shadows verl's method
    on this one object only; :meth:`remove` deletes it.
    """

    def __init__(self, replay: Any, native: dict[int, torch.Tensor]) -> None:
        from verl.utils.megatron.router_replay_patch import RouterReplayAction

        self._replay = replay
        original = type(replay).get_replay_topk.__get__(replay)

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            if (
                replay.router_replay_action != RouterReplayAction.REPLAY_FORWARD
                or replay.target_topk_idx is None
                or default_compute_topk is None
            ):
                return original(
                    scores,
                    topk,
                    num_groups=num_groups,
                    group_topk=group_topk,
                    default_compute_topk=default_compute_topk,
                )
            seen: list[torch.Tensor] = []

            def compute_topk(*args: Any, **kwargs: Any) -> Any:
                probs, ids = default_compute_topk(*args, **kwargs)
                seen.append(ids)
                return probs, ids

            result = original(
                scores, topk, num_groups=num_groups, group_topk=group_topk, default_compute_topk=compute_topk
            )
            if not seen:  # no replay mask: verl did not compute the router's own choice
                with torch.no_grad():
                    seen.append(default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)[1])
            native[id(replay)] = seen[-1]
            return result

        # patch: megatron_router_native_choice (verl_stable.compat.catalogue)
        replay.get_replay_topk = get_replay_topk

    def remove(self) -> None:
        self._replay.__dict__.pop("get_replay_topk", None)


def router_hook(audit: Audit) -> Callable[..., None]:
    """The forward hook of one replaying router: in each replayed forward (not the backward's recomputation) it keeps
    what :meth:`Audit.flush` counts when the micro-batch's forward is done -- the router's ``routing_map``, verl's
    targets and replay mask, and the router's own choice from its :class:`NativeChoiceTap`."""
    from verl.utils.megatron.router_replay_patch import RouterReplayAction

    def hook(router: Any, args: Any, output: Any) -> None:
        replay = router.router_replay
        if replay.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
            return  # recording (R2 pi_old) or the backward's recomputation: counted once, in the forward
        native = audit.native.pop(id(replay), None)
        audit.pending.append(
            (audit.ordinals[router.layer_number], output[1], replay.target_topk_idx, replay.target_replay_mask, native)
        )

    return hook
