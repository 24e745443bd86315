"""The typed errors of the routing package, each a ``ValueError`` that names what was expected and received.

* :class:`RoutingTraceError`: a trace or layout is malformed, or does not match the model / another trace
  (``trace``, ``replay``, ``disagreement``).
* :class:`RoutingFormatError` and its subclasses :class:`LayerMapError`, :class:`RowCountError`,
  :class:`ExpertIdRangeError`, :class:`DuplicateExpertError`, :class:`ZeroRoutingError`: routing payloads from an
  engine or the transport that cannot be trusted (``codecs``, ``transport``); ``codecs.decode_with_policy`` counts
  and skips them under ``on_invalid="skip_sample"``.
* :class:`UnsupportedModelError`: a model or config whose routing cannot be captured or replayed (``families``).

They are raised by the checks in :mod:`verl_stable.routing.checks` and importable from the modules that raised them
before (``trace``, ``codecs``, ``families``, ``verl_stable.routing``).
"""

from __future__ import annotations


class RoutingTraceError(ValueError):
    """A trace is malformed or does not match the model / another trace it is used with."""


class RoutingFormatError(ValueError):
    """Routing data that cannot be trusted: replaying it would misroute tokens."""


class LayerMapError(RoutingFormatError):
    """Layer count / top-k differ from the model, or a layer declared dense carries routing."""


class RowCountError(RoutingFormatError):
    """The number of routed rows does not match the tokens they claim to cover."""


class ExpertIdRangeError(RoutingFormatError):
    """An expert id outside ``[0, num_experts)``, or a dtype too narrow to hold every id of the model."""


class DuplicateExpertError(RoutingFormatError):
    """The same expert id twice in one (token, layer) row: top-k selects distinct experts."""


class ZeroRoutingError(RoutingFormatError):
    """All-zero rows in a MoE layer: the engine returned no routing (a known failure mode)."""


class UnsupportedModelError(ValueError):
    """The model's routing cannot be captured or replayed (unknown family, replaced MoE block, ...)."""
