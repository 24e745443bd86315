"""MoE routing metrics: naming of routing disagreement results, per-layer expert load balance, replay coverage.

The disagreement itself is computed by :mod:`verl_stable.routing.disagreement`; this module only names it under
``stable/routing/``. Expert ids are ``[tokens, layers, top_k]`` integer tensors as in verl's rollout routing
traces, where a dense layer's row is all zero. Symbols are defined in ``docs/reference/notation.md``; input checks are
those of :mod:`verl_stable.monitor.common`. Replay coverage (:func:`replay_coverage_metrics`) turns the row counts the
replay engine returns (:data:`COVERAGE_COUNTS`, counted by :func:`verl_stable.routing.replay_pass.coverage_counts`)
into fractions. This module does not import verl.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence

import torch

from verl_stable.metric_names import COVERAGE, COVERAGE_COUNTS
from verl_stable.monitor.common import ROUTING, check_bool, check_int, check_real, check_tensor, type_name, valid_mask


def _number_list(key: str, value: object) -> list[float]:
    """A 0-d or 1-D tensor, or a sequence of real numbers, as floats; anything else raises."""
    if isinstance(value, torch.Tensor):
        if value.dim() > 1:
            raise ValueError(f"routing disagreement entry {key!r} has {value.dim()} dimensions, expected 0 or 1")
        if value.is_complex():
            raise TypeError(f"routing disagreement entry {key!r} must be real, got dtype {value.dtype}")
        return value.detach().double().reshape(-1).tolist()
    return [check_real(f"routing disagreement entry {key!r}[{i}]", v) for i, v in enumerate(value)]


def routing_disagreement_metrics(disagreement: Mapping[str, object], name: str) -> dict[str, float]:
    """Name the result of :func:`verl_stable.routing.disagreement.routing_disagreement` under ``stable/routing``.

    Numbers and 0-d tensors ``key`` become ``stable/routing/{name}/{key}``; the per-layer sequence ``per_layer``
    becomes ``stable/routing/{name}/layer_{i}`` (i = MoE-layer ordinal); other 1-D sequences or tensors become
    ``stable/routing/{name}/{key}/{i}``. ``name`` says which pair was compared, e.g. ``rollout_vs_train`` (R3's
    signal) or ``r2_drift`` (old-logprob pass vs a later mini-step). Values are passed on as they are, non-finite
    ones included.

    Args:
        disagreement: mapping of non-empty str key to a real number, a 0-d or 1-D tensor, or a sequence of real
            numbers.
        name: a non-empty path segment without ``/``.

    Raises:
        TypeError: ``disagreement`` is not a mapping, ``name`` not a str, or a value of another type.
        ValueError: an empty name or one with ``/``, an empty key, or a tensor of more than one dimension.
    """
    if not isinstance(disagreement, Mapping):
        raise TypeError(f"disagreement must be a mapping of metric name to value, got {type_name(disagreement)}")
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type_name(name)} {name!r}")
    if not name or "/" in name:
        raise ValueError(f"name must be a non-empty path segment without '/', got {name!r}")
    out: dict[str, float] = {}
    for key, value in disagreement.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"routing disagreement keys must be non-empty str, got {key!r}")
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            value = float(value)
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            out[f"{ROUTING}/{name}/{key}"] = float(value)
        elif isinstance(value, torch.Tensor) or (isinstance(value, Sequence) and not isinstance(value, (str, bytes))):
            fmt = "layer_{i}" if key == "per_layer" else f"{key}/{{i}}"
            for i, v in enumerate(_number_list(key, value)):
                out[f"{ROUTING}/{name}/{fmt.format(i=i)}"] = v
        else:
            raise TypeError(
                f"routing disagreement entry {key!r} is neither a number nor a sequence: {type_name(value)} {value!r}"
            )
    return out


def expert_load_balance(
    ids: torch.Tensor,
    num_experts: int | None = None,
    row_mask: torch.Tensor | None = None,
    skip_all_zero_layers: bool = True,
) -> dict[str, float]:
    """Per-layer expert load balance of routed expert ids ``[tokens, layers, top_k]``.

    For each layer, ``load_e`` counts the (token, slot) assignments to expert ``e`` over the rows kept by
    ``row_mask``; with ``mean = tokens * top_k / num_experts``:

    * ``stable/routing/load/layer_{l}/max_over_mean = max_e load_e / mean`` (1 = perfectly balanced, up to
      ``num_experts`` when one expert takes everything);
    * ``stable/routing/load/layer_{l}/cv = std_e(load_e) / mean`` (population std);
    * ``stable/routing/load/max_over_mean`` and ``.../cv``: the worst layer.

    Layers whose ids are all zero are dense layers in verl's rollout traces (zero rows) and are skipped when
    ``skip_all_zero_layers``; the layer index ``l`` is the position in ``ids``.

    Args:
        ids: integer expert ids, ``[tokens, layers, top_k]``.
        num_experts: number of routed experts (an int >= 1); inferred as ``max(ids) + 1`` when ``None`` (a lower
            bound).
        row_mask: ``[tokens]`` 0/1 or bool mask of rows to count (e.g. rows that carry routing data).
        skip_all_zero_layers: skip layers with no non-zero id.

    Returns:
        The metrics above; empty when no row, layer or slot is left or every layer is skipped.
    """
    check_tensor("ids", ids)
    if ids.dim() != 3:
        raise ValueError(f"ids must be a [tokens, layers, top_k] tensor, got shape {tuple(ids.shape)}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"ids must be an integer tensor, got dtype {ids.dtype}")
    check_bool("skip_all_zero_layers", skip_all_zero_layers)
    if num_experts is not None:
        num_experts = check_int("num_experts", num_experts)
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if row_mask is not None:
        check_tensor("row_mask", row_mask)
        if row_mask.shape != ids.shape[:1]:
            raise ValueError(f"row_mask has shape {tuple(row_mask.shape)}, expected ({ids.shape[0]},)")
        rows = ids.new_empty(ids.shape[:1])  # a stand-in with the shape and device one row flag per token needs
        ids = ids[valid_mask(row_mask, "ids rows", rows, name="row_mask")]
    if ids.numel() == 0:
        return {}
    ids = ids.long()
    lo, hi = int(ids.min()), int(ids.max())
    if num_experts is None:
        num_experts = hi + 1
    if lo < 0 or hi >= num_experts:
        raise ValueError(f"expert ids must lie in [0, {num_experts}), got range [{lo}, {hi}]")
    tokens, layers, top_k = ids.shape
    mean_load = tokens * top_k / num_experts
    out: dict[str, float] = {}
    worst_mom, worst_cv = None, None
    for layer in range(layers):
        layer_ids = ids[:, layer, :].reshape(-1)
        if skip_all_zero_layers and not bool(layer_ids.any()):
            continue
        load = torch.bincount(layer_ids, minlength=num_experts).double()
        mom = float(load.max()) / mean_load
        cv = float(load.std(unbiased=False)) / mean_load
        out[f"{ROUTING}/load/layer_{layer}/max_over_mean"] = mom
        out[f"{ROUTING}/load/layer_{layer}/cv"] = cv
        worst_mom = mom if worst_mom is None else max(worst_mom, mom)
        worst_cv = cv if worst_cv is None else max(worst_cv, cv)
    if worst_mom is not None:
        out[f"{ROUTING}/load/max_over_mean"] = worst_mom
        out[f"{ROUTING}/load/cv"] = worst_cv
    return out


def replay_coverage_metrics(counts: Mapping[str, object]) -> dict[str, float]:
    """Replay-coverage fractions from the summed row counts of :data:`COVERAGE_COUNTS`.

    With ``R`` = ``response_rows``, ``P`` = ``prompt_rows``, ``N`` = ``not_needed_rows``, ``D`` = ``padding_rows``:

    * ``stable/routing/coverage/response_replayed = response_replayed_rows / R`` and ``response_fallback`` its
      complement (rows that kept the model's own routing although a trained log-prob depends on them);
    * ``prompt_replayed`` / ``prompt_fallback``: the same over ``P``;
    * ``not_needed = N / (R + P + N + D)`` and ``padding = D / (R + P + N + D)``: shares of all rows the routers saw.

    Ratios of sums, so the fractions are pooled over whatever the counts were summed over (micro-batches, ranks,
    update mini-steps), whatever the micro-batch sizes. A fraction whose denominator is 0 is left out (never NaN
    from an empty class); a non-finite count gives a non-finite fraction, which the guard then reports.

    Args:
        counts: ``{name: count}`` with every name of :data:`COVERAGE_COUNTS` (short names, or full
            ``stable/routing/coverage/<name>`` keys), real numbers >= 0.

    Raises:
        TypeError: ``counts`` is not a mapping or a count is not a real number.
        ValueError: a count is missing or negative, or more rows were replayed than a class holds.
    """
    if not isinstance(counts, Mapping):
        raise TypeError(f"coverage counts must be a mapping of name to count, got {type_name(counts)}")
    values: dict[str, float] = {}
    for name in COVERAGE_COUNTS:
        key = name if name in counts else f"{COVERAGE}/{name}"
        if key not in counts:
            raise ValueError(f"coverage counts lack {name!r} (need {list(COVERAGE_COUNTS)})")
        value = check_real(f"coverage count {name!r}", counts[key])
        if value < 0:
            raise ValueError(f"coverage count {name!r} must be >= 0, got {value}")
        values[name] = value
    out: dict[str, float] = {}
    for group in ("response", "prompt"):
        rows, replayed = values[f"{group}_rows"], values[f"{group}_replayed_rows"]
        if replayed > rows:
            raise ValueError(f"coverage counts replay {replayed} {group} rows of {rows}")
        if rows > 0 or not math.isfinite(rows):
            out[f"{COVERAGE}/{group}_replayed"] = replayed / rows
            out[f"{COVERAGE}/{group}_fallback"] = (rows - replayed) / rows
    total = values["response_rows"] + values["prompt_rows"] + values["not_needed_rows"] + values["padding_rows"]
    if total > 0 or not math.isfinite(total):
        out[f"{COVERAGE}/not_needed"] = values["not_needed_rows"] / total
        out[f"{COVERAGE}/padding"] = values["padding_rows"] / total
    return out
