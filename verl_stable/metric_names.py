"""Every metric name and prefix verl-stable logs, in one place (no imports; below every other module).

The reference with meanings is docs/reference/metrics.md. Where a name goes:

* the trainer's monitor logs ``stable/...`` directly (train-inference, IS effects, staleness, entropy, routing,
  guard);
* the actor logs through verl's engine, which prefixes ``actor/``: the losses' own names (``actor/MiniRL/...``,
  ``actor/vespo/...``) keep it; the replay engine's routing names (``stable/routing/...``) arrive as
  ``actor/stable/routing/...`` and the stable trainers move them back under ``stable/`` (:data:`ACTOR`);
* verl reduces a logged list by substring (a name containing ``min`` or ``max`` is reduced by min / max), so the
  count names below contain neither.
"""

from __future__ import annotations

PREFIX = "stable"
"""Root of every metric the monitor computes."""
TRAIN_INF = f"{PREFIX}/train_inf"
"""Training-inference discrepancy: KL(mu || pi_old), extreme-token fractions F(tau)."""
IS_WEIGHTS = f"{PREFIX}/is"
"""Effects of the truncated importance weights (clipped share, ESS)."""
STALENESS = f"{PREFIX}/staleness"
"""pi_theta / pi_old inside the update (policy staleness)."""
ENTROPY = f"{PREFIX}/entropy"
"""Token entropy of the rollouts."""
ROUTING = f"{PREFIX}/routing"
"""Expert routing: disagreement, load balance, coverage, transport."""
COVERAGE = f"{ROUTING}/coverage"
"""Replay coverage (counts and fractions)."""
TRANSPORT = f"{ROUTING}/transport/"
"""Rollout routing at the boundary and on its way to the actors (per-sample counters, side-entry reads)."""
GUARD = f"{PREFIX}/guard/"
"""One 0 / 1 entry per guard rule: whether it fired this step."""
ENGINE_ROUTING = f"{ROUTING}/"
"""What the replay engine logs from inside verl's actor (arrives as ``actor/stable/routing/...``)."""

ACTOR = "actor/"
"""verl's prefix for everything the actor's engine logs."""
MINIRL = f"{ACTOR}MiniRL"
"""The MiniRL loss's metrics. Capitalised because verl reduces by substring: ``minirl`` contains ``min``."""
VESPO = f"{ACTOR}vespo"
"""The VESPO loss's metrics."""

COVERAGE_COUNTS: tuple[str, ...] = (
    "response_rows",
    "response_replayed_rows",
    "prompt_rows",
    "prompt_replayed_rows",
    "not_needed_rows",
    "padding_rows",
)
"""Replay-coverage row counts, ``stable/routing/coverage/<name>``, in (token, MoE layer) rows."""
SIDE_READ_COUNTS: tuple[str, ...] = ("side_reads", "side_read_entries", "side_read_reused", "side_read_bytes")
"""What re-attaching shared prompt rows cost an actor rank (``stable/routing/transport/<name>``): TransferQueue reads
issued, entries fetched by them, entries served from the rank's held entries instead, bytes fetched."""
