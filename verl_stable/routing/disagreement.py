"""Routing disagreement between two traces of the same tokens.

For tokens ``n`` and MoE layers ``l`` with routing data in both traces, a decision differs when the expert *sets*
differ: ``d[n, l] = 1[set(a[n, l]) != set(b[n, l])]`` (order of the top-k columns is ignored). Reported:

* ``per_layer[l] = sum_n d[n, l] / #compared rows of layer l``
* ``overall = sum_{n,l} d[n, l] / #compared (token, layer) rows``
* ``layer_max = max_l per_layer[l]`` over the layers with a compared row (0 when none): where routing drifts most,
  so a drift confined to one layer is not averaged away by ``overall``;
* ``token_any_layer = #tokens with d[n, l] = 1 for some l / #tokens compared in at least one layer``

Inputs are checked first: both traces must be :class:`RoutingTrace` objects with equal layers, top-k, expert count
and token count; raw id tensors (:func:`expert_sets_differ`) must be integer tensors of one shape ``[..., K]``, since
a float "id" would compare by value (NaN never equals itself and would count as a flip).
"""

from __future__ import annotations

from typing import Any

import torch

from verl_stable.routing.checks import require_id_tensor
from verl_stable.routing.errors import RoutingTraceError
from verl_stable.routing.trace import RoutingTrace


def expert_sets_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` integer ids -> ``[...]`` bool, True where the two id sets differ (order-insensitive).

    Any integer values compare (``-1`` rows without data included; mask them out afterwards); floats, bools and
    0-d tensors raise a :class:`RoutingTraceError`, as do shapes that differ.
    """
    require_id_tensor(a, "expert_sets_differ a")
    require_id_tensor(b, "expert_sets_differ b")
    if a.shape != b.shape:
        raise RoutingTraceError(f"routing shapes differ: expected {tuple(a.shape)}, received {tuple(b.shape)}")
    return (a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1)


def routing_disagreement(a: RoutingTrace, b: RoutingTrace) -> dict[str, Any]:
    """Fraction of (token, MoE layer) decisions whose expert sets differ between two traces.

    Args:
        a: reference trace.
        b: trace of the same tokens (same N, L, K and expert count).

    Returns:
        ``{"per_layer": list[float], "layer_max": float, "overall": float, "token_any_layer": float,
        "compared_rows": int, "tokens": int}``; rows missing in either trace are excluded from numerators and denominators.
    """
    for name, trace in (("a", a), ("b", b)):
        if not isinstance(trace, RoutingTrace):
            raise TypeError(f"routing_disagreement needs RoutingTrace objects, got {type(trace).__name__} for {name}")
    a.check_compatible(b)
    if a.num_tokens != b.num_tokens:
        raise RoutingTraceError(
            f"traces cover different token counts: expected {a.num_tokens}, received {b.num_tokens}"
        )
    both = a.valid_mask() & b.valid_mask()
    differ = expert_sets_differ(a.ids.to(torch.long), b.ids.to(torch.long)) & both
    compared_per_layer = both.sum(dim=0)
    per_layer_t = differ.sum(dim=0).double() / compared_per_layer.clamp_min(1).double()
    compared_layers = compared_per_layer > 0
    layer_max = float(per_layer_t[compared_layers].max()) if bool(compared_layers.any()) else 0.0
    per_layer = per_layer_t.tolist()
    compared = int(both.sum())
    tokens = int(both.any(dim=1).sum())
    return {
        "per_layer": per_layer,
        "layer_max": layer_max,
        "overall": float(differ.sum()) / max(compared, 1),
        "token_any_layer": float(differ.any(dim=1).sum()) / max(tokens, 1),
        "compared_rows": compared,
        "tokens": tokens,
    }
