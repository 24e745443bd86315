"""The user's fallback policy at the engine boundary: raise on malformed routing, or skip the sample and count it.

:func:`decode_with_policy` runs any ``decode_*`` codec; under ``on_invalid="skip_sample"`` a
:class:`~verl_stable.routing.codecs.common.RoutingFormatError` becomes ``None`` (the sample trains with the model's
own routing) and is counted by class in :class:`BoundaryStats` (``stable/routing/*`` metrics).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from verl_stable.routing.codecs.common import RoutedRows, RoutingFormatError

_logger = logging.getLogger("verl_stable.routing")


ON_INVALID = ("raise", "skip_sample")


@dataclass
class BoundaryStats:
    """Counts kept by :func:`decode_with_policy` (logged by the caller, exported as ``stable/routing/*`` metrics).

    Attributes:
        samples: samples decoded (or found without routing).
        skipped_samples: samples whose routing was refused under ``on_invalid="skip_sample"``.
        errors: refusals by error class name.
        truncated_samples: samples whose response the agent loop cut at its length limit, so that their routing
            carried rows past the last trained token; counted by the caller that trims them (the rollout boundary).
        trimmed_rows: the rows trimmed from those samples.
    """

    samples: int = 0
    skipped_samples: int = 0
    errors: dict[str, int] | None = None
    truncated_samples: int = 0
    trimmed_rows: int = 0

    def as_metrics(self, prefix: str = "stable/routing/") -> dict[str, float]:
        """Flat float metrics; the truncation counts only when a sample was truncated."""
        out = {f"{prefix}samples": float(self.samples), f"{prefix}skipped_samples": float(self.skipped_samples)}
        if self.truncated_samples:
            out[f"{prefix}truncated_samples"] = float(self.truncated_samples)
            out[f"{prefix}trimmed_rows"] = float(self.trimmed_rows)
        for name, count in (self.errors or {}).items():
            out[f"{prefix}error/{name}"] = float(count)
        return out


def decode_with_policy(
    decode: Any, *args: Any, on_invalid: str = "raise", stats: BoundaryStats | None = None, **kwargs: Any
) -> RoutedRows | None:
    """Run a ``decode_*`` codec under the user's fallback policy.

    ``on_invalid="raise"`` (default) propagates every :class:`RoutingFormatError`. ``"skip_sample"`` returns
    ``None`` instead (the sample is then trained with the model's own routing, never with guessed routes),
    counts the error class in ``stats`` and logs a warning. Every malformed payload the codecs see raises a
    :class:`RoutingFormatError`; other exceptions (a wrong ``layout`` argument, a bug) always propagate.
    """
    if not isinstance(on_invalid, str) or on_invalid not in ON_INVALID:
        raise ValueError(f"on_invalid must be one of {ON_INVALID}, got {on_invalid!r}")
    if not callable(decode):
        raise TypeError(f"decode must be a decode_* function, got {type(decode).__name__}")
    if stats is not None and not isinstance(stats, BoundaryStats):
        raise TypeError(f"stats must be a BoundaryStats or None, got {type(stats).__name__}")
    if stats is not None:
        stats.samples += 1
    try:
        return decode(*args, **kwargs)
    except RoutingFormatError as exc:
        if on_invalid == "raise":
            raise
        if stats is not None:
            stats.skipped_samples += 1
            stats.errors = stats.errors or {}
            name = type(exc).__name__
            stats.errors[name] = stats.errors.get(name, 0) + 1
        _logger.warning("verl-stable: routing of one sample dropped (on_invalid=skip_sample): %s", exc)
        return None
