"""Input checks and result container shared by the token-level policy losses (pure torch).

Every loss in :mod:`verl_stable.algos` works on padded ``(batch, response_len)`` tensors plus a response mask.
Bad input is handled by one policy, implemented here:

- shapes must agree exactly (a :class:`ValueError` names the tensors and their shapes);
- a non-finite value at a *valid* position (mask = 1) is an error (a :class:`ValueError` naming the tensor and
  how many such positions it has);
- values at *masked* positions never reach the loss, the gradients or the metrics: when any input holds a
  non-finite value anywhere, masked positions are selected away with :func:`torch.where` (multiplying by the
  mask would turn ``NaN * 0`` into NaN).

Two device read-backs per loss: :meth:`MaskedTokens.zero_masked` reads the inputs' sums to choose between a
fast path (every value finite: zero masked positions by multiplication) and a safe one (:func:`torch.where`);
:meth:`PolicyLossTerms.scalars` reads the metrics and the remaining checks in one transfer and raises on bad
input. verl's ``vanilla`` loss reads back three times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


def check_same_shape(reference_name: str, reference: torch.Tensor, **others: torch.Tensor | None) -> None:
    """Raise a :class:`ValueError` unless every tensor in ``others`` has the shape of ``reference``.

    Args:
        reference_name: Name of the reference tensor, used in the message.
        reference: The tensor whose shape the others must match; must be 2-D ``(batch, response_len)``.
        **others: Further tensors by name; ``None`` entries are skipped (optional inputs).

    Raises:
        ValueError: If ``reference`` is not 2-D or any other tensor's shape differs from it.
    """
    if reference.dim() != 2:
        raise ValueError(f"{reference_name} must be 2-D (batch, response_len), got shape {tuple(reference.shape)}")
    for name, tensor in others.items():
        if tensor is not None and tensor.shape != reference.shape:
            raise ValueError(
                f"shape mismatch: {name} has shape {tuple(tensor.shape)} but {reference_name} has shape "
                f"{tuple(reference.shape)}; all token tensors must be (batch, response_len) and aligned"
            )


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """Precision the losses compute in: the input's when it is at least float32, else float32."""
    return torch.promote_types(tensor.dtype, torch.float32)


class MaskedTokens:
    """A response mask plus the masked reductions the losses need, computed without reading data back.

    Masked statistics here take tensors that are already 0 at masked positions (see :meth:`zero_masked`), so a
    mean is a plain sum over the count of valid positions and min / max push masked positions out of range with
    a large additive pad; both avoid :func:`torch.where`, which is several times slower than arithmetic on CPU.

    Args:
        response_mask: 1 / True at valid positions.
        dtype: Floating dtype of the computation.
    """

    #: Added to (subtracted from) masked positions before a min (max); far above any finite statistic here.
    PAD = 1e30

    def __init__(self, response_mask: torch.Tensor, dtype: torch.dtype) -> None:
        self.mask = response_mask.bool()
        self.maskf = self.mask.to(dtype)
        self.count = self.maskf.sum()
        self.denominator = self.count.clamp(min=1.0)
        self.any = self.count > 0
        self._pad: torch.Tensor | None = None

    def zero_masked(self, **tensors: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Cast to the computation dtype and set masked positions to 0; keeps autograd for inputs that have it.

        One device read-back decides the path: when every input is finite everywhere (the normal case), masked
        positions are zeroed by multiplying with the mask; otherwise by :func:`torch.where`, so that garbage at
        masked positions cannot leak, and the zeroed tensors are returned for :meth:`PolicyLossTerms.scalars`
        to check at valid positions.

        Args:
            **tensors: Inputs by name; ``None`` entries are dropped.

        Returns:
            ``(zeroed, to_check)``: zeroed tensors by name, and the detached ones whose valid positions must still
            be checked for finiteness (empty when the inputs were finite everywhere).
        """
        present = {name: t.to(self.maskf.dtype) for name, t in tensors.items() if t is not None}
        if not present:
            return {}, {}
        sums = torch.stack([t.detach().sum() for t in present.values()])
        if bool(torch.isfinite(sums).all()):
            return {name: t * self.maskf for name, t in present.items()}, {}
        zeroed = {name: torch.where(self.mask, t, 0.0) for name, t in present.items()}
        return zeroed, {name: t.detach() for name, t in zeroed.items()}

    def mean(self, zeroed: torch.Tensor) -> torch.Tensor:
        """Mean over valid positions of a tensor that is 0 at masked positions (0 when none is valid)."""
        return zeroed.sum() / self.denominator

    def fraction(self, condition: torch.Tensor) -> torch.Tensor:
        """Fraction of valid positions where ``condition`` (0 / False at masked positions) holds."""
        return condition.sum().to(self.denominator.dtype) / self.denominator

    def min_max(self, zeroed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Min and max over valid positions of a finite tensor that is 0 at masked positions (0, 0 when empty)."""
        if self._pad is None:
            self._pad = (1.0 - self.maskf) * self.PAD
        zero = zeroed.new_zeros(())
        vmin = torch.where(self.any, (zeroed + self._pad).amin(), zero)
        vmax = torch.where(self.any, (zeroed - self._pad).amax(), zero)
        return vmin, vmax

    def stats(self, zeroed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(mean, min, max)`` over valid positions, see :meth:`mean` and :meth:`min_max`."""
        return (self.mean(zeroed), *self.min_max(zeroed))


@dataclass
class PolicyLossTerms:
    """What a pure policy loss returns before aggregation.

    Attributes:
        loss_mat: Per-token loss, ``(batch, response_len)``, exactly 0 at masked positions; aggregate it with
            verl's ``agg_loss`` (or any reduction that sums over valid tokens).
        metrics: Detached 0-d tensors by metric name (not yet read back).
        finite_checks: Detached inputs (0 at masked positions) whose valid positions must be finite, by name.
        nonnegative_checks: Detached inputs (0 at masked positions) that must also be ``>= 0``, by name.
    """

    loss_mat: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    finite_checks: dict[str, torch.Tensor] = field(default_factory=dict)
    nonnegative_checks: dict[str, torch.Tensor] = field(default_factory=dict)

    def scalars(self) -> dict[str, float]:
        """Read metrics and input checks back in one device transfer; raise on bad input.

        Returns:
            The metrics as Python floats.

        Raises:
            ValueError: If an input held a non-finite value (or a negative importance weight) at a valid
                position; the message names each such input and how many positions.
        """
        probes = [t.sum() for t in self.finite_checks.values()]
        probes += [t.amin() if t.numel() else t.new_zeros(()) for t in self.nonnegative_checks.values()]
        tensors = [t.detach().reshape(()).double() for t in probes + list(self.metrics.values())]
        values = torch.stack(tensors).tolist() if tensors else []
        n_finite, n_probes = len(self.finite_checks), len(probes)
        bad: dict[str, int] = {}
        # Only on the error path: exact counts (a finite-but-overflowing sum gives a count of 0 and no error).
        for (name, t), v in zip(self.finite_checks.items(), values[:n_finite], strict=True):
            if not math.isfinite(v):
                count = int((~torch.isfinite(t)).sum().item())
                if count:
                    bad[name] = count
        for (name, t), v in zip(self.nonnegative_checks.items(), values[n_finite:n_probes], strict=True):
            if not v >= 0.0:
                count = int(((t < 0) | ~torch.isfinite(t)).sum().item())
                if count:
                    bad[name] = max(bad.get(name, 0), count)
        if bad:
            detail = ", ".join(f"{name}: {count} position(s)" for name, count in bad.items())
            raise ValueError(
                f"invalid values at valid (response_mask=1) positions -> {detail}. Log-probs, advantages and "
                "importance weights must be finite there (weights also >= 0); values at masked positions are "
                "ignored."
            )
        return dict(zip(self.metrics, values[n_probes:], strict=True))
