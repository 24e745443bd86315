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
integer counts and layer indices; a :class:`RoutingTraceError` names what was expected and received.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

MISSING = -1
"""Sentinel for a (token, layer) row without routing data in the dense tensor form."""


class RoutingTraceError(ValueError):
    """A trace is malformed or does not match the model / another trace it is used with."""


def require_int(value: Any, what: str, *, minimum: int | None = None, error: type = RoutingTraceError) -> int:
    """``value`` as a Python int: an int, numpy integer or 0-d integer tensor (never a bool, float or string).

    Raises ``error`` naming ``what`` and the expected range; floats are refused rather than truncated.
    """
    if isinstance(value, torch.Tensor) and value.dim() == 0 and _is_integer_dtype(value.dtype):
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise error(f"{what} must be an integer, got {type(value).__name__} {value!r:.80}")
    out = int(value)
    if minimum is not None and out < minimum:
        raise error(f"{what} must be >= {minimum}, got {out}")
    return out


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def require_layers(values: Any, what: str, *, error: type = RoutingTraceError) -> tuple[int, ...]:
    """Decoder-layer indices as a tuple of strictly ascending non-negative ints."""
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, (Sequence, torch.Tensor, np.ndarray)):
        raise error(f"{what} must be a sequence of decoder-layer indices, got {type(values).__name__}")
    out = tuple(require_int(v, f"{what} entry", minimum=0, error=error) for v in list(values))
    if any(b <= a for a, b in zip(out, out[1:], strict=False)):
        raise error(f"{what} must be strictly ascending decoder-layer indices, got {list(out)}")
    return out


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


def _as_lengths(lengths: Sequence[int] | torch.Tensor | None, num_tokens: int) -> torch.Tensor:
    if lengths is None:
        return torch.tensor([num_tokens], dtype=torch.long)
    try:
        out = torch.as_tensor(lengths if isinstance(lengths, torch.Tensor) else list(lengths) or [], dtype=None)
        out = out.long() if out.numel() == 0 else out
    except (TypeError, ValueError, RuntimeError) as exc:
        raise RoutingTraceError(f"lengths must be integer token counts, got {type(lengths).__name__}: {exc}") from exc
    if not _is_integer_dtype(out.dtype) or out.dim() > 1:
        raise RoutingTraceError(f"lengths must be a 1-D integer sequence, got {out.dtype} {tuple(out.shape)}")
    out = out.to(dtype=torch.long, device="cpu").reshape(-1)
    if (out < 0).any():
        raise RoutingTraceError(f"lengths must be >= 0, got {out.tolist()}")
    total = int(out.sum())
    if total != num_tokens:
        raise RoutingTraceError(f"lengths sum to {total} but the trace has {num_tokens} token rows")
    return out


_DUP_CHUNK_ROWS = 8192
_IDS_CHECKED: ContextVar[bool] = ContextVar("verl_stable_routing_ids_checked", default=False)


@contextmanager
def _ids_checked() -> Iterator[None]:
    """Inside, ``RoutingTrace(...)`` skips its id scan (range, distinct ids; every other field is still checked): for
    ids validated already, as slices / concatenations of traces and ``rows_to_trace`` after ``validate_ids`` are."""
    token = _IDS_CHECKED.set(True)
    try:
        yield
    finally:
        _IDS_CHECKED.reset(token)


def first_repeated_row(ids: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[int, int] | None:
    """``(token, layer)`` of the first row of ``ids [N, L, K]`` that repeats an expert id (rows with ``valid``
    False are ignored), or None. Pairwise compares for small K (faster than a sort), chunked to bound memory."""
    k = ids.shape[2]
    if k < 2 or ids.numel() == 0:
        return None
    for lo in range(0, ids.shape[0], _DUP_CHUNK_ROWS):
        chunk = ids[lo : lo + _DUP_CHUNK_ROWS]
        chunk = chunk.to(torch.int32) if chunk.dtype == torch.uint16 else chunk
        if k <= 16:
            cols = chunk.permute(2, 0, 1).contiguous()
            dup = torch.zeros(chunk.shape[:2], dtype=torch.bool, device=chunk.device)
            for i in range(k - 1):
                for j in range(i + 1, k):
                    dup |= cols[i] == cols[j]
        else:
            ordered = chunk.sort(dim=-1).values
            dup = (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1)
        if valid is not None:
            dup &= valid[lo : lo + _DUP_CHUNK_ROWS].to(dup.device)
        if bool(dup.any()):
            n, layer = dup.nonzero()[0].tolist()
            return lo + n, layer
    return None


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
        scan = ids.numel() and not _IDS_CHECKED.get()
        if scan:
            # uint16 lacks reductions in torch; widen for the range check only
            hi = int(ids.max()) if ids.dtype != torch.uint16 else int(ids.to(torch.int32).max())
            lo = int(ids.min()) if ids.dtype == torch.int32 else 0
            if hi >= num_experts or lo < 0:
                raise RoutingTraceError(
                    f"expert id {hi if hi >= num_experts else lo} out of range: expected ids in [0, {num_experts})"
                )
        object.__setattr__(self, "lengths", _as_lengths(self.lengths, ids.shape[0]))
        valid = self.valid
        if valid is not None:
            is_tensor = isinstance(valid, torch.Tensor) and not valid.is_nested
            if not is_tensor or valid.dtype != torch.bool or tuple(valid.shape) != tuple(ids.shape[:2]):
                got = f"{valid.dtype} {tuple(valid.shape)}" if is_tensor else type(valid).__name__
                raise RoutingTraceError(f"valid must be a bool tensor of shape {tuple(ids.shape[:2])}, got {got}")
            if valid.device != ids.device:
                raise RoutingTraceError(f"valid is on {valid.device} but ids are on {ids.device}")
            if bool(valid.all()):
                object.__setattr__(self, "valid", valid := None)
        repeated = first_repeated_row(ids, valid) if scan else None
        if repeated is not None:
            n, layer = repeated
            raise RoutingTraceError(
                f"token {n}, MoE layer {layer} repeats an expert id ({ids[n, layer].tolist()}): top-k ids must be "
                "distinct in every row with routing data"
            )
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
        if not isinstance(ids, torch.Tensor) or ids.is_nested:
            raise RoutingTraceError(f"ids must be a dense torch.Tensor, got {type(ids).__name__}")
        if not _is_integer_dtype(ids.dtype):
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
        with _ids_checked():  # rows of a checked trace
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
        with _ids_checked():  # rows of checked traces with one expert count
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
