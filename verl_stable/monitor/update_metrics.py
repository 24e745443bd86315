"""verl's unreduced ``update_actor`` metrics turned into per-update-mini-step values and per-step counts. No verl import.

verl 0.9.1 reduces the update's metrics over its mini-steps before the trainer sees them; the monitored trainers tap
the unreduced output (:mod:`verl_stable.integration.trainer`) and hand it here: :func:`per_update_metrics` splits the
metrics of :data:`PER_UPDATE_METRICS` into ``<group>/update_<i>/<name>``, and :func:`coverage_totals` sums the counts
of :data:`SUMMED_UPDATE_COUNTS` (replay coverage rows, the actors' side reads) over the mini-steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from verl_stable.metric_names import COVERAGE, COVERAGE_COUNTS, SIDE_READ_COUNTS, TRANSPORT
from verl_stable.monitor import metrics as M

__all__ = ["PER_UPDATE_METRICS", "SUMMED_UPDATE_COUNTS", "coverage_totals", "per_update_metrics"]


#: Metrics logged once per update mini-step (their verl key is ``actor/<name>``, or ``<name>`` from the engine).
PER_UPDATE_METRICS: tuple[str, ...] = (
    *(f"{M.STALENESS}/{name}" for name in M.STALENESS_NAMES),
    f"{M.ROUTING}/r2_drift",
    f"{M.ROUTING}/router_disagreement",
    f"{M.ROUTING}/disagreement",
)


SUMMED_UPDATE_COUNTS: tuple[str, ...] = (
    *(f"{COVERAGE}/{name}" for name in COVERAGE_COUNTS),
    *(TRANSPORT + name for name in (*SIDE_READ_COUNTS, "side_reads_per_rank")),
)
"""Counts the replay engine returns per update mini-step that add up over a step (replay coverage rows, side reads)."""


def coverage_totals(raw: Mapping[str, Any], keys: Sequence[str] = SUMMED_UPDATE_COUNTS) -> dict[str, float]:
    """The counts ``keys`` of verl's unreduced ``update_actor`` metrics, summed over the update mini-steps.

    Each per-mini-step value is already the sum over that mini-step's micro-batches and data-parallel ranks (see
    :mod:`verl_stable.integration.fsdp_replay`), so the result is the count of the whole ``update_actor`` call.

    Args:
        raw: the ``metrics`` of ``update_actor``'s output (lists, one value per mini-step, or plain numbers).
        keys: the counts to sum (default: replay coverage rows and the actors' side reads).

    Returns:
        ``{key: total}`` for the counts present (e.g. ``stable/routing/coverage/<count>``); empty when replay did
        not run.

    Raises:
        ValueError: If a value is not a number.
    """
    out: dict[str, float] = {}
    for key in keys:
        values = raw.get(key, raw.get(f"actor/{key}"))
        if values is None:
            continue
        values = list(values) if isinstance(values, (list, tuple)) else [values]
        for value in values:
            if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
                raise ValueError(f"count {key!r} holds a {type(value).__name__}, not a number")
        out[key] = float(sum(float(v) for v in values))
    return out


def per_update_metrics(
    raw: Mapping[str, Any], first_update: int = 0, names: Sequence[str] = PER_UPDATE_METRICS
) -> tuple[dict[str, float], int]:
    """Split verl's unreduced ``update_actor`` metrics into one value per update mini-step.

    verl 0.9.1's ``TrainingWorker.train_mini_batch`` returns, for every metric that reached it as a ``Metric``
    (all loss metrics, and the replay engine's), a list with one value per mini-step (``ppo_epochs`` x mini-batches,
    in order), each the aggregate over that mini-step's micro-batches and data-parallel ranks. For each metric
    ``<group>/<name>`` in ``names`` present as such a list, this returns ``<group>/update_<first_update + i>/<name>``.

    Args:
        raw: the ``metrics`` of ``update_actor``'s output, keys as the worker wrote them (``actor/`` prefix or not).
        first_update: index of the first of these mini-steps within the logged step.
        names: the metrics to split, without the ``actor/`` prefix.

    Returns:
        The per-update metrics and the number of mini-steps seen (0 when none of ``names`` is present).

    Raises:
        ValueError: If the metrics disagree on the number of mini-steps, or a value is not a number.
    """
    wanted = set(names)
    out: dict[str, float] = {}
    lengths: dict[str, int] = {}
    for key, values in raw.items():
        name = key.removeprefix("actor/")
        if name not in wanted or not isinstance(values, (list, tuple)):
            continue
        group, leaf = name.rsplit("/", 1)
        lengths[name] = len(values)
        for i, value in enumerate(values):
            if not isinstance(value, (int, float, np.number)):
                raise ValueError(f"update metric {key!r} holds a {type(value).__name__} at mini-step {i}, not a number")
            out[f"{group}/update_{first_update + i}/{leaf}"] = float(value)
    if len(set(lengths.values())) > 1:
        raise ValueError(f"update metrics disagree on the number of mini-steps: {lengths}")
    return out, next(iter(lengths.values()), 0)
