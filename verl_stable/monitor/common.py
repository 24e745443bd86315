"""What every metric function of the monitor shares: metric name prefixes, input checks and overflow-safe means.

The metric functions take untrusted tensors (whatever verl's batch holds), so they all validate them here the same
way, each error naming what was expected and what was received:

* an argument that is not a tensor, a tensor of the wrong dtype, or a parameter of the wrong Python type raises
  ``TypeError``;
* mismatched shapes or devices, a mask holding anything but 0 and 1, or a parameter out of range raise
  ``ValueError``.

Which non-finite inputs are *values* and which are *unusable* (excluded from the statistics and counted in a
``.../nonfinite_frac`` entry) depends on what the input means:

* log-probabilities: ``-inf`` is probability zero, a value (its log ratio against a finite log-prob is infinite);
  NaN, ``+inf`` (a probability above 1), and ``-inf`` on both sides of a log ratio (0/0) are unusable;
* importance weights: ``+inf`` is a value (a weight beyond float range); NaN is unusable; negatives raise;
* entropies and generic values (:func:`masked_mean`): every non-finite value is unusable.

Means go through :func:`safe_mean` and :func:`mean_from_logs`, which overflow to ``inf`` only when the mean itself
lies beyond the float64 range, not when an intermediate sum or term does. This module does not import verl.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence

import torch

from verl_stable.metric_names import ENTROPY, IS_WEIGHTS, PREFIX, ROUTING, STALENESS, TRAIN_INF  # noqa: F401 - shared

_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def type_name(value: object) -> str:
    """The bare class name of ``value`` for error messages (``list``, ``ndarray``, ``NoneType``)."""
    return type(value).__name__


def check_tensor(name: str, x: object, floating: bool = False) -> torch.Tensor:
    """``x`` itself if it is a tensor (of a real floating dtype when ``floating``), else ``TypeError``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type_name(x)}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating point tensor, got dtype {x.dtype}")
    return x


def check_like(name: str, x: object, ref_name: str, ref: torch.Tensor, floating: bool = False) -> torch.Tensor:
    """``x`` checked by :func:`check_tensor` and for the shape and device of ``ref``."""
    x = check_tensor(name, x, floating)
    if x.shape != ref.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)} but {ref_name} has shape {tuple(ref.shape)}")
    if x.device != ref.device:
        raise ValueError(f"{name} is on {x.device} but {ref_name} is on {ref.device}")
    return x


def valid_mask(mask: object, ref_name: str, ref: torch.Tensor, name: str = "mask") -> torch.Tensor:
    """``mask`` as a bool tensor, checked for the shape and device of ``ref`` and for 0/1 values.

    A bool mask is used as is. A float or integer mask must hold only 0 and 1: anything else (2, 0.5, NaN) is more
    likely a wrong tensor than a mask, so it raises instead of being read as ``!= 0``. Checking the values of a
    non-bool mask reads one flag back to the host.
    """
    mask = check_like(name, mask, ref_name, ref)
    if mask.dtype == torch.bool:
        return mask
    if not (mask.is_floating_point() or mask.dtype in _INTEGER_DTYPES):
        raise TypeError(f"{name} must be a bool, integer or floating point tensor, got dtype {mask.dtype}")
    bad = (mask != 0) & (mask != 1)
    if bool(bad.any()):
        raise ValueError(f"{name} must hold only 0 and 1 (or be bool), got {mask[bad].reshape(-1)[0].item():g}")
    return mask != 0


def check_real(name: str, value: object) -> float:
    """``value`` as a float if it is a real number (numpy scalars included, bool excluded), else ``TypeError``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type_name(value)} {value!r}")
    return float(value)


def check_int(name: str, value: object) -> int:
    """``value`` as an int if it is an integer (numpy integers included, bool excluded), else ``TypeError``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type_name(value)} {value!r}")
    return int(value)


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is a bool, else ``TypeError`` (a string such as ``"false"`` would read as true)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (true/false), got {type_name(value)} {value!r}")
    return value


def check_number_sequence(name: str, values: object) -> Sequence[object]:
    """``values`` if it is a sequence (not a string or mapping), else ``TypeError``; elements are not checked."""
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of numbers, got {type_name(values)}")
    return values


def to_float(x: torch.Tensor) -> float:
    """A 0-d tensor as a Python float (detached, through float64)."""
    return float(x.detach().double().item())


def safe_mean(x: torch.Tensor) -> float:
    """Mean of a non-empty tensor whose sum may overflow although its mean does not.

    ``mean(x) = 2^e * mean(x / 2^e)`` with ``2^e >= max|x|``. Scaling by a power of two is exact, so the result is
    the plain float64 mean whenever that does not overflow; it is ``inf`` only when the mean itself exceeds the
    float64 range. Infinite entries give ``+-inf`` (NaN when both signs occur), NaN entries give NaN.
    """
    x = x.detach().double().reshape(-1)
    peak = float(x.abs().max())
    _, exponent = math.frexp(peak)
    if not math.isfinite(peak) or exponent <= 1:
        return float(x.mean())  # |x| <= 2: no sum of a realistic token count can overflow
    # both factors are powers of two within float64 (exponent <= 1024); |scaled| < 2, so its sum cannot overflow,
    # and the last product overflows to inf only if the mean does
    return float((x * 2.0 ** (1 - exponent)).mean()) * 2.0 ** (exponent - 1)


def exp_or_inf(x: float) -> float:
    """``exp(x)`` as a float, ``inf`` beyond the float64 range (where ``math.exp`` raises ``OverflowError``)."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def mean_from_logs(log_terms: torch.Tensor) -> float:
    """``mean_i(exp(l_i))`` of non-negative terms given by their logs ``l_i``, without overflow.

    ``mean = exp(logsumexp(l) - log n)``: a term beyond the float64 range (``l_i > 709.78``) still has a finite
    log, so the mean is ``inf`` only when it exceeds the float64 range. ``l_i = -inf`` is a zero term and
    ``l_i = +inf`` an infinite one. Relative error ``~ 1e-16 * |log mean|``.
    """
    log_terms = log_terms.detach().double().reshape(-1)
    return exp_or_inf(float(torch.logsumexp(log_terms, 0)) - math.log(log_terms.numel()))


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float | None:
    """Mean of the finite ``values`` at the positions where ``mask`` is 1.

    ``sum(values[keep]) / |keep|`` with ``keep = mask & isfinite(values)``, computed by :func:`safe_mean`: a NaN
    or infinite value is excluded like a masked one (count them with ``mask & ~isfinite(values)`` if they matter).

    Args:
        values: real tensor of any shape (integer and bool values count as numbers).
        mask: 0/1 or bool tensor of the same shape and device.

    Returns:
        The mean as a float, or ``None`` when no position is both valid and finite.
    """
    values = check_tensor("values", values)
    if values.is_complex():
        raise TypeError(f"values must be a real tensor, got dtype {values.dtype}")
    keep = valid_mask(mask, "values", values) & torch.isfinite(values)
    if not bool(keep.any()):
        return None
    return safe_mean(values.double()[keep])


def selection(
    mask: torch.Tensor, ref_name: str, ref: torch.Tensor, usable: torch.Tensor
) -> tuple[torch.Tensor, int, float] | None:
    """Valid positions whose inputs are ``usable``, the valid count and the unusable fraction; ``None`` when empty.

    Args:
        mask: the caller's valid-token mask (checked by :func:`valid_mask` against ``ref``).
        ref_name: name of the reference tensor for error messages.
        ref: reference tensor (shape and device).
        usable: bool tensor of ``ref``'s shape, True where every input of a token is usable.
    """
    valid = valid_mask(mask, ref_name, ref)
    n_valid = int(valid.sum())
    if n_valid == 0:
        return None
    keep = valid & usable
    return keep, n_valid, (n_valid - int(keep.sum())) / n_valid


def usable_log_prob_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Where the log ratio ``a - b`` of two log-probabilities is defined (``-inf`` on at most one side)."""
    neg_inf = torch.isneginf(a) & torch.isneginf(b)
    return ~(torch.isnan(a) | torch.isnan(b) | torch.isposinf(a) | torch.isposinf(b) | neg_inf)
