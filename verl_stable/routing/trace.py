"""RoutingTrace: the compact, ragged record of which experts every token used in every MoE layer.

A trace holds, for ``N`` tokens (the concatenation of one or more responses), ``L`` MoE layers and top-``K``
routing, the expert ids ``ids[n, l, :]`` chosen for token ``n`` in the ``l``-th MoE layer (MoE-layer ordinal,
not the absolute decoder layer; ``layer_indices`` maps ordinals to absolute decoder layers when known).

Storage is the smallest unsigned dtype holding ``num_experts - 1`` (uint8 up to 256 experts, uint16 up to 65536,
int32 beyond), with no padding: ``lengths[i]`` tokens belong to response ``i``. Rows without routing data (an
engine returned nothing, a prefix gap) are marked in the optional boolean ``valid[n, l]``; they are never
replayed, the model keeps its own routing there. In the dense tensor form (``to_tensor``/``from_tensor``) such
rows are the sentinel ``-1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

MISSING = -1
"""Sentinel for a (token, layer) row without routing data in the dense tensor form."""


class RoutingTraceError(ValueError):
    """A trace is malformed or does not match the model / another trace it is used with."""


def storage_dtype(num_experts: int) -> torch.dtype:
    """Smallest dtype holding expert ids ``0 .. num_experts - 1``.

    Args:
        num_experts: number of routed experts E (>= 1).

    Returns:
        ``torch.uint8`` if E <= 256, ``torch.uint16`` if E <= 65536, else ``torch.int32``.
    """
    if num_experts < 1:
        raise RoutingTraceError(f"num_experts must be >= 1, got {num_experts}")
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
    """

    family: str
    model_type: str
    num_hidden_layers: int
    moe_layers: tuple[int, ...]
    top_k: int
    num_experts: int

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


def _as_lengths(lengths: Sequence[int] | torch.Tensor | None, num_tokens: int) -> torch.Tensor:
    if lengths is None:
        return torch.tensor([num_tokens], dtype=torch.long)
    out = torch.as_tensor(lengths).to(dtype=torch.long, device="cpu").reshape(-1)
    if (out < 0).any():
        raise RoutingTraceError(f"lengths must be >= 0, got {out.tolist()}")
    total = int(out.sum())
    if total != num_tokens:
        raise RoutingTraceError(f"lengths sum to {total} but the trace has {num_tokens} token rows")
    return out


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
        if not isinstance(ids, torch.Tensor) or ids.dim() != 3:
            shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise RoutingTraceError(f"ids must be a [tokens, moe_layers, top_k] tensor, got {shape}")
        dtype = storage_dtype(int(self.num_experts))
        if ids.dtype != dtype:
            raise RoutingTraceError(
                f"ids dtype must be {dtype} for {self.num_experts} experts, got {ids.dtype} (use from_tensor)"
            )
        if ids.shape[1] < 1 or ids.shape[2] < 1:
            raise RoutingTraceError(f"a trace needs >= 1 MoE layer and top_k >= 1, got shape {tuple(ids.shape)}")
        if ids.numel():
            # uint16 lacks reductions in torch; widen for the range check only
            hi = int(ids.max()) if ids.dtype != torch.uint16 else int(ids.to(torch.int32).max())
            lo = int(ids.min()) if ids.dtype == torch.int32 else 0
            if hi >= self.num_experts or lo < 0:
                raise RoutingTraceError(
                    f"expert id {hi if hi >= self.num_experts else lo} out of range: expected ids in "
                    f"[0, {self.num_experts})"
                )
        object.__setattr__(self, "lengths", _as_lengths(self.lengths, ids.shape[0]))
        if self.valid is not None:
            if self.valid.dtype != torch.bool or tuple(self.valid.shape) != tuple(ids.shape[:2]):
                raise RoutingTraceError(
                    f"valid must be a bool tensor of shape {tuple(ids.shape[:2])}, "
                    f"got {self.valid.dtype} {tuple(self.valid.shape)}"
                )
            if bool(self.valid.all()):
                object.__setattr__(self, "valid", None)
        if self.layer_indices is not None:
            layer_indices = tuple(int(i) for i in self.layer_indices)
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
        if not isinstance(ids, torch.Tensor):
            raise RoutingTraceError(f"ids must be a torch.Tensor, got {type(ids).__name__}")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise RoutingTraceError(f"ids must be an integer tensor, got {ids.dtype}")
        if ids.dim() != 3:
            raise RoutingTraceError(f"ids must be [tokens, moe_layers, top_k], got shape {tuple(ids.shape)}")
        ids = ids.detach().to(device="cpu", dtype=torch.long)
        missing = ids == MISSING
        row_missing = missing.all(dim=-1)
        if bool((missing.any(dim=-1) & ~row_missing).any()):
            n, layer = (missing.any(dim=-1) & ~row_missing).nonzero()[0].tolist()
            raise RoutingTraceError(
                f"row (token {n}, layer {layer}) mixes -1 with expert ids {ids[n, layer].tolist()}; "
                "a missing row must be -1 in every top-k slot"
            )
        present = ids[~row_missing]
        if present.numel():
            lo, hi = int(present.min()), int(present.max())
            if lo < 0 or hi >= num_experts:
                bad = lo if lo < 0 else hi
                raise RoutingTraceError(
                    f"expert id {bad} out of range: expected ids in [0, {num_experts}) (or -1 for a missing row)"
                )
            if ids.shape[-1] > 1:
                srt = present.sort(dim=-1).values
                if bool((srt[:, 1:] == srt[:, :-1]).any()):
                    raise RoutingTraceError("a token row repeats an expert id; top-k ids must be distinct")
        valid = None if not bool(row_missing.any()) else ~row_missing
        compact = ids.clamp_min(0).to(storage_dtype(num_experts))
        return cls(
            ids=compact,
            num_experts=int(num_experts),
            lengths=lengths,  # type: ignore[arg-type]
            valid=valid,
            layer_indices=tuple(layer_indices) if layer_indices is not None else None,
        )

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
        """Rows ``start:stop`` as a single-response trace."""
        return RoutingTrace(
            ids=self.ids[start:stop],
            num_experts=self.num_experts,
            lengths=None,
            valid=None if self.valid is None else self.valid[start:stop],
            layer_indices=self.layer_indices,
        )

    @classmethod
    def cat(cls, traces: Sequence[RoutingTrace]) -> RoutingTrace:
        """Concatenate responses of traces with equal layers, top-k and expert count."""
        if not traces:
            raise RoutingTraceError("cat needs at least one trace")
        first = traces[0]
        for t in traces[1:]:
            first.check_compatible(t)
        valid = None
        if any(t.valid is not None for t in traces):
            valid = torch.cat([t.valid_mask() for t in traces])
        return cls(
            ids=torch.cat([t.ids for t in traces]),
            num_experts=first.num_experts,
            lengths=torch.cat([t.lengths for t in traces]),
            valid=valid,
            layer_indices=first.layer_indices,
        )

    # ------------------------------------------------------------ validation
    def check_compatible(self, other: RoutingTrace) -> None:
        """Raise unless ``other`` has the same MoE layers, top-k and expert count."""
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

    @classmethod
    def from_state_dict(cls, state: dict[str, object]) -> RoutingTrace:
        """Inverse of ``state_dict``; missing fields raise a RoutingTraceError."""
        missing = [k for k in ("ids", "num_experts", "lengths") if k not in state]
        if missing:
            raise RoutingTraceError(f"routing trace state is missing fields {missing}")
        return cls(
            ids=state["ids"],  # type: ignore[arg-type]
            num_experts=int(state["num_experts"]),  # type: ignore[arg-type]
            lengths=state["lengths"],  # type: ignore[arg-type]
            valid=state.get("valid"),  # type: ignore[arg-type]
            layer_indices=state.get("layer_indices"),  # type: ignore[arg-type]
        )

    def __repr__(self) -> str:
        return (
            f"RoutingTrace(tokens={self.num_tokens}, sequences={self.num_sequences}, moe_layers={self.num_layers}, "
            f"top_k={self.top_k}, num_experts={self.num_experts}, dtype={self.ids.dtype}, missing={self.num_missing})"
        )
