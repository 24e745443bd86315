"""RoutingTrace: the compact, ragged record of which experts every token used in every MoE layer.

A trace holds, for ``N`` tokens (the concatenation of one or more responses), ``L`` MoE layers and top-``K``
routing, the expert ids ``ids[n, l, :]`` chosen for token ``n`` in the ``l``-th MoE layer (MoE-layer ordinal,
not the absolute decoder layer; ``layer_indices`` maps ordinals to absolute decoder layers when known).

Storage is the smallest unsigned dtype holding ``num_experts - 1`` (uint8 up to 256 experts, uint16 up to 65536,
int32 beyond), with no padding: ``lengths[i]`` tokens belong to response ``i``. Rows without routing data (an
engine returned nothing, a prefix gap) are marked in the optional boolean ``valid[n, l]``; they are never
replayed, the model keeps its own routing there. In the dense tensor form (``to_tensor``/``from_tensor``) such
rows are the sentinel ``-1``; the dense form carries ids only, so pass ``lengths`` and ``layer_indices`` back to
``from_tensor`` (``RoutingTrace.from_tensor(t.to_tensor(), t.num_experts, t.lengths, t.layer_indices)``) or use
``state_dict`` / ``from_state_dict``, which keep everything.

Every constructor validates before it narrows: ids in ``[0, num_experts)``, distinct within each valid row,
integer counts and layer indices; a :class:`RoutingTraceError` names what was expected and received. The checks
(``require_int``, ``require_layers``, ``first_repeated_row``, ...) live in :mod:`verl_stable.routing.checks` and the
error in :mod:`verl_stable.routing.errors`, both importable from here as before; this module owns the trace, the
layout and ``storage_dtype``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from verl_stable.routing.checks import (
    check_distinct_ids,
    check_id_range,
    check_valid_mask,
    dense_ids,
    first_repeated_row,
    ids_already_checked,
    ids_checked,
    require_int,
    require_layers,
    trace_lengths,
)
from verl_stable.routing.errors import RoutingTraceError

__all__ = [
    "MISSING",
    "RoutingLayout",
    "RoutingTrace",
    "RoutingTraceError",
    "first_repeated_row",
    "require_int",
    "require_layers",
    "storage_dtype",
]

MISSING = -1
"""Sentinel for a (token, layer) row without routing data in the dense tensor form."""


def storage_dtype(num_experts: int) -> torch.dtype:
    """Smallest dtype holding expert ids ``0 .. num_experts - 1``.

    Args:
        num_experts: number of routed experts E (>= 1).

    Returns:
        ``torch.uint8`` if E <= 256, ``torch.uint16`` if E <= 65536, else ``torch.int32``.
    """
    num_experts = require_int(num_experts, "num_experts", minimum=1)
    if num_experts > np.iinfo(np.int32).max:
        raise RoutingTraceError(f"num_experts must be <= {np.iinfo(np.int32).max}, got {num_experts}")
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 65536:
        return torch.uint16
    return torch.int32


@dataclass(frozen=True)
class RoutingLayout:
    """What a model's routing looks like; a trace must match it to be replayed.

    Attributes:
        family: routing family name (see ``families.SUPPORTED_FAMILIES``).
        model_type: the checkpoint's ``config.model_type``.
        num_hidden_layers: number of decoder layers (absolute indexing at engine boundaries).
        moe_layers: absolute decoder-layer index of every MoE layer, ascending; its position is the MoE ordinal.
        top_k: experts per token.
        num_experts: routed experts per MoE layer.

    Construction checks the fields (integers, ``1 <= top_k <= num_experts``, at least one MoE layer, MoE layers
    strictly ascending inside ``[0, num_hidden_layers)``) and raises :class:`RoutingTraceError` otherwise.
    """

    family: str
    model_type: str
    num_hidden_layers: int
    moe_layers: tuple[int, ...]
    top_k: int
    num_experts: int

    def __post_init__(self) -> None:
        for name in ("family", "model_type"):
            if not isinstance(getattr(self, name), str):
                raise RoutingTraceError(f"RoutingLayout.{name} must be a str, got {type(getattr(self, name)).__name__}")
        hidden = require_int(self.num_hidden_layers, "RoutingLayout.num_hidden_layers", minimum=1)
        experts = require_int(self.num_experts, "RoutingLayout.num_experts", minimum=1)
        storage_dtype(experts)
        top_k = require_int(self.top_k, "RoutingLayout.top_k", minimum=1)
        if top_k > experts:
            raise RoutingTraceError(f"RoutingLayout.top_k={top_k} exceeds num_experts={experts}")
        moe = require_layers(self.moe_layers, "RoutingLayout.moe_layers")
        if not moe or moe[-1] >= hidden:
            raise RoutingTraceError(
                f"RoutingLayout.moe_layers must name at least one decoder layer in [0, {hidden}), got {list(moe)}"
            )
        for name, value in (("num_hidden_layers", hidden), ("num_experts", experts), ("top_k", top_k)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "moe_layers", moe)

    @property
    def num_moe_layers(self) -> int:
        """Number of MoE layers L (the trace's second dimension)."""
        return len(self.moe_layers)

    @property
    def trace_dtype(self) -> torch.dtype:
        """Storage dtype of a trace for this model."""
        return storage_dtype(self.num_experts)

    @property
    def bytes_per_token(self) -> int:
        """Trace bytes per token: L * K * itemsize."""
        return self.num_moe_layers * self.top_k * self.trace_dtype.itemsize


@dataclass(frozen=True, eq=False)
class RoutingTrace:
    """Top-k expert ids of every token in every MoE layer, ragged over responses.

    Attributes:
        ids: ``[N, L, K]`` expert ids in ``storage_dtype(num_experts)``; entries of rows marked invalid are 0 and
            meaningless.
        num_experts: routed experts per layer E; every valid id is in ``[0, E)``.
        lengths: ``[num_sequences]`` int64 token counts per response, summing to N.
        valid: optional ``[N, L]`` bool; False marks a row without routing data. None means all rows are valid.
        layer_indices: optional absolute decoder-layer index of each of the L MoE layers.
    """

    ids: torch.Tensor
    num_experts: int
    lengths: torch.Tensor = field(default=None)  # type: ignore[assignment]
    valid: torch.Tensor | None = None
    layer_indices: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        ids = self.ids
        if not isinstance(ids, torch.Tensor) or ids.is_nested or ids.dim() != 3:
            shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) and not ids.is_nested else type(ids).__name__
            raise RoutingTraceError(f"ids must be a [tokens, moe_layers, top_k] tensor, got {shape}")
        num_experts = require_int(self.num_experts, "num_experts", minimum=1)
        object.__setattr__(self, "num_experts", num_experts)
        dtype = storage_dtype(num_experts)
        if ids.dtype != dtype:
            raise RoutingTraceError(
                f"ids dtype must be {dtype} for {num_experts} experts, got {ids.dtype} (use from_tensor)"
            )
        if ids.shape[1] < 1 or ids.shape[2] < 1:
            raise RoutingTraceError(f"a trace needs >= 1 MoE layer and top_k >= 1, got shape {tuple(ids.shape)}")
        scan = not ids_already_checked()
        if scan:
            check_id_range(ids, num_experts)
        object.__setattr__(self, "lengths", trace_lengths(self.lengths, ids.shape[0]))
        valid = check_valid_mask(self.valid, ids)
        object.__setattr__(self, "valid", valid)
        if scan:
            check_distinct_ids(ids, valid)
        if self.layer_indices is not None:
            layer_indices = require_layers(self.layer_indices, "layer_indices")
            if len(layer_indices) != ids.shape[1]:
                raise RoutingTraceError(
                    f"layer_indices names {len(layer_indices)} layers but ids has {ids.shape[1]} MoE layers"
                )
            object.__setattr__(self, "layer_indices", layer_indices)

    # ------------------------------------------------------------------ shape
    @property
    def num_tokens(self) -> int:
        """Token rows N."""
        return int(self.ids.shape[0])

    @property
    def num_layers(self) -> int:
        """MoE layers L."""
        return int(self.ids.shape[1])

    @property
    def top_k(self) -> int:
        """Experts per token K."""
        return int(self.ids.shape[2])

    @property
    def num_sequences(self) -> int:
        """Number of responses (entries of ``lengths``)."""
        return int(self.lengths.numel())

    @property
    def num_missing(self) -> int:
        """(token, layer) rows without routing data."""
        return 0 if self.valid is None else int((~self.valid).sum())

    @property
    def nbytes(self) -> int:
        """Bytes held by ids (+ valid mask)."""
        extra = 0 if self.valid is None else self.valid.numel()
        return self.ids.numel() * self.ids.element_size() + extra

    # ------------------------------------------------------------ conversion
    @classmethod
    def from_tensor(
        cls,
        ids: torch.Tensor,
        num_experts: int,
        lengths: Sequence[int] | torch.Tensor | None = None,
        layer_indices: Sequence[int] | None = None,
    ) -> RoutingTrace:
        """Build a trace from a dense integer tensor.

        Args:
            ids: integer ``[N, L, K]``; a row ``ids[n, l]`` that is entirely ``-1`` has no routing data.
            num_experts: E; every other entry must be in ``[0, E)`` and distinct within its row.
            lengths: tokens per response (default: one response of N tokens).
            layer_indices: absolute decoder layer of each MoE layer, if known.

        Returns:
            The compact trace (ids on CPU in ``storage_dtype(E)``).
        """
        num_experts = require_int(num_experts, "num_experts", minimum=1)
        ids, row_missing = dense_ids(ids, num_experts, missing=MISSING)
        valid = None if not bool(row_missing.any()) else ~row_missing
        # in range, so narrowing is exact; the constructor refuses repeated ids in rows with data
        compact = ids.clamp_min(0).to(storage_dtype(num_experts))
        return cls(ids=compact, num_experts=num_experts, lengths=lengths, valid=valid, layer_indices=layer_indices)

    def to_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Dense int64 ``[N, L, K]`` ids, ``-1`` in every slot of a row without data."""
        out = self.ids.to(dtype=torch.long)
        if self.valid is not None:
            out = out.masked_fill(~self.valid.unsqueeze(-1), MISSING)
        return out if device is None else out.to(device)

    def valid_mask(self) -> torch.Tensor:
        """``[N, L]`` bool, True where the row has routing data."""
        if self.valid is None:
            return torch.ones(self.ids.shape[:2], dtype=torch.bool, device=self.ids.device)
        return self.valid

    # ------------------------------------------------------------- sequences
    def offsets(self) -> torch.Tensor:
        """``[num_sequences + 1]`` start offsets (CSR) of each response's rows."""
        return torch.cat([torch.zeros(1, dtype=torch.long), self.lengths.cumsum(0)])

    def sequence(self, i: int) -> RoutingTrace:
        """The trace of response ``i`` alone."""
        n = self.num_sequences
        i = require_int(i, "sequence index", error=TypeError)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for a trace of {n} sequences")
        i %= n
        off = self.offsets()
        lo, hi = int(off[i]), int(off[i + 1])
        return self.slice_tokens(lo, hi)

    def split(self) -> list[RoutingTrace]:
        """One trace per response."""
        return [self.sequence(i) for i in range(self.num_sequences)]

    def slice_tokens(self, start: int, stop: int) -> RoutingTrace:
        """Rows ``start:stop`` (``0 <= start <= stop <= num_tokens``) as a single-response trace."""
        start = require_int(start, "start", error=TypeError)
        stop = require_int(stop, "stop", error=TypeError)
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token rows [{start}, {stop}) out of range for a trace of {self.num_tokens} rows")
        valid = None if self.valid is None else self.valid[start:stop]
        with ids_checked():  # rows of a checked trace
            return RoutingTrace(self.ids[start:stop], self.num_experts, None, valid, self.layer_indices)

    @classmethod
    def cat(cls, traces: Sequence[RoutingTrace]) -> RoutingTrace:
        """Concatenate responses of traces with equal layers, top-k and expert count."""
        traces = list(traces)
        if not traces:
            raise RoutingTraceError("cat needs at least one trace")
        for t in traces:
            _require_trace(t, "cat")
        first = traces[0]
        for t in traces[1:]:
            first.check_compatible(t)
        valid = torch.cat([t.valid_mask() for t in traces]) if any(t.valid is not None for t in traces) else None
        ids, lengths = torch.cat([t.ids for t in traces]), torch.cat([t.lengths for t in traces])
        with ids_checked():  # rows of checked traces with one expert count
            return cls(ids, first.num_experts, lengths, valid, first.layer_indices)

    # ------------------------------------------------------------ validation
    def check_compatible(self, other: RoutingTrace) -> None:
        """Raise unless ``other`` has the same MoE layers, top-k and expert count."""
        _require_trace(other, "check_compatible")
        for name, mine, theirs in (
            ("MoE layers", self.num_layers, other.num_layers),
            ("top_k", self.top_k, other.top_k),
            ("num_experts", self.num_experts, other.num_experts),
        ):
            if mine != theirs:
                raise RoutingTraceError(f"traces differ in {name}: expected {mine}, received {theirs}")
        if self.layer_indices is not None and other.layer_indices is not None:
            if self.layer_indices != other.layer_indices:
                raise RoutingTraceError(
                    f"traces differ in MoE layer indices: expected {list(self.layer_indices)}, "
                    f"received {list(other.layer_indices)}"
                )

    def validate_for(self, layout: RoutingLayout) -> None:
        """Raise a RoutingTraceError naming expected and received values unless the trace fits ``layout``."""
        if not isinstance(layout, RoutingLayout):
            raise TypeError(f"validate_for needs a RoutingLayout, got {type(layout).__name__}")
        if self.num_layers != layout.num_moe_layers:
            raise RoutingTraceError(
                f"trace has {self.num_layers} MoE layers but the {layout.model_type} model has "
                f"{layout.num_moe_layers} (decoder layers {list(layout.moe_layers)})"
            )
        if self.top_k != layout.top_k:
            raise RoutingTraceError(f"trace has top_k={self.top_k} but the model routes top_k={layout.top_k}")
        if self.num_experts != layout.num_experts:
            raise RoutingTraceError(
                f"trace was built for num_experts={self.num_experts} but the model has {layout.num_experts} experts"
            )
        if self.layer_indices is not None and self.layer_indices != layout.moe_layers:
            raise RoutingTraceError(
                f"trace covers decoder layers {list(self.layer_indices)} but the model's MoE layers are "
                f"{list(layout.moe_layers)}"
            )

    # --------------------------------------------------------- serialisation
    def state_dict(self) -> dict[str, object]:
        """Plain tensors and ints, e.g. for torch.save or a Ray object."""
        return {
            "ids": self.ids,
            "num_experts": self.num_experts,
            "lengths": self.lengths,
            "valid": self.valid,
            "layer_indices": None if self.layer_indices is None else list(self.layer_indices),
        }

    def __getstate__(self) -> dict[str, object]:
        state = self.state_dict()
        if self.ids.dtype == torch.uint16:  # torch pickles no uint16 tensor (torch.save does): carry the bits as int16
            state.update(ids=self.ids.view(torch.int16), uint16_ids=True)
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        """Unpickling (e.g. out of the Ray object store) validates like the constructor."""
        fields = {name: state.get(name) for name in _FIELDS}
        if state.get("uint16_ids") and isinstance(fields["ids"], torch.Tensor):
            fields["ids"] = fields["ids"].view(torch.uint16)
        self.__dict__.update(fields)
        self.__post_init__()

    @classmethod
    def from_state_dict(cls, state: dict[str, object]) -> RoutingTrace:
        """Inverse of ``state_dict``; missing or malformed fields raise a RoutingTraceError."""
        if not isinstance(state, Mapping):
            raise RoutingTraceError(f"routing trace state must be a mapping, got {type(state).__name__}")
        missing = [k for k in ("ids", "num_experts", "lengths") if k not in state]
        if missing:
            raise RoutingTraceError(f"routing trace state is missing fields {missing}")
        return cls(**{name: state.get(name) for name in _FIELDS})  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return (
            f"RoutingTrace(tokens={self.num_tokens}, sequences={self.num_sequences}, moe_layers={self.num_layers}, "
            f"top_k={self.top_k}, num_experts={self.num_experts}, dtype={self.ids.dtype}, missing={self.num_missing})"
        )


_FIELDS = ("ids", "num_experts", "lengths", "valid", "layer_indices")


def _require_trace(value: Any, what: str) -> None:
    if not isinstance(value, RoutingTrace):
        raise TypeError(f"{what} needs RoutingTrace objects, got {type(value).__name__}")
