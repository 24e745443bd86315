"""The doctor's answer to "can this checkpoint's routing be captured and replayed?" (``verl-stable doctor --model``).

:func:`describe_model_routing` reads a config, a checkpoint folder or a model through :mod:`verl_stable.routing.families`
and reports the family, the MoE-layer map and what a routing trace costs per token; :func:`format_routing_report`
renders it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from verl_stable.routing.errors import UnsupportedModelError
from verl_stable.routing.families import (
    _check_config_sizes,
    _find_config,
    bind_model,
    family_for,
    layout_from_config,
    read_config_json,
)

__all__ = ["describe_model_routing", "format_routing_report"]


def describe_model_routing(config_or_path: Any) -> dict[str, Any]:
    """Answer "can this checkpoint's routing be captured and replayed?".

    Args:
        config_or_path: a transformers config, a dict with ``model_type``, a local checkpoint directory (or its
            ``config.json``), or an instantiated model (then its modules are checked too).

    Returns:
        A report dict: ``replayable`` (bool), ``reason`` (why not, or None), ``family``, ``model_type``,
        ``num_hidden_layers``, ``moe_layers`` (absolute indices), ``dense_layers``, ``top_k``, ``num_experts``,
        ``trace_dtype``, ``bytes_per_token`` and ``notes``. ``format_routing_report`` renders it.
    """
    report: dict[str, Any] = {"replayable": False, "reason": None, "model_type": None, "notes": []}
    try:
        model = config_or_path if isinstance(config_or_path, nn.Module) else None
        config = _load_config(config_or_path) if model is None else _find_config(model)
        report["model_type"] = getattr(config, "model_type", None)
        layout = layout_from_config(config)
        if model is not None:
            layout = bind_model(model, config).layout
    except (UnsupportedModelError, OSError, ValueError) as exc:
        report["reason"] = str(exc)
        return report
    spec = family_for(config)
    moe = set(layout.moe_layers)  # once, not per layer
    report.update(
        replayable=True,
        family=layout.family,
        num_hidden_layers=layout.num_hidden_layers,
        moe_layers=list(layout.moe_layers),
        dense_layers=[i for i in range(layout.num_hidden_layers) if i not in moe],
        top_k=layout.top_k,
        num_experts=layout.num_experts,
        trace_dtype=str(layout.trace_dtype).removeprefix("torch."),
        bytes_per_token=layout.bytes_per_token,
        notes=list(spec.notes),
    )
    return report


def _load_config(source: Any) -> Any:
    if isinstance(source, dict):
        from transformers import AutoConfig

        if not isinstance(source.get("model_type"), str):
            raise UnsupportedModelError(
                f"config dict has no string 'model_type' (got {source.get('model_type')!r:.80})"
            )
        _check_config_sizes(source)
        kwargs = {k: v for k, v in source.items() if k != "model_type"}
        try:
            return AutoConfig.for_model(source["model_type"], **kwargs)
        except (TypeError, KeyError, AttributeError) as exc:  # transformers' own errors on odd values
            raise UnsupportedModelError(f"config dict does not build a config: {type(exc).__name__}: {exc}") from exc
    if isinstance(source, (str, Path)):
        from transformers import AutoConfig

        path = Path(source)
        if path.is_file():
            path = path.parent
        if not (path / "config.json").is_file():
            raise UnsupportedModelError(f"no config.json under {str(source)!r}")
        # read here first: transformers would recurse without bound and expand an absurd layer count (see above)
        try:
            raw = read_config_json(path / "config.json")
        except (json.JSONDecodeError, UnicodeDecodeError):
            raw = None  # not JSON at all: transformers reports that in its own words, as before
        if isinstance(raw, Mapping):
            _check_config_sizes(raw)
        return AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    return source


def format_routing_report(report: dict[str, Any]) -> str:
    """Human-readable lines for ``verl-stable doctor --model``."""
    if not isinstance(report, dict) or not {"replayable", "reason"} <= report.keys():
        raise ValueError(f"expected a describe_model_routing report dict, got {type(report).__name__}")
    if not report["replayable"]:
        return f"routing replay: NOT supported ({report['reason']})"
    lines = [
        f"routing replay: supported (family {report['family']}, model_type {report['model_type']})",
        f"  MoE layers: {len(report['moe_layers'])} of {report['num_hidden_layers']} decoder layers "
        f"(dense: {report['dense_layers'] or 'none'})",
        f"  top_k {report['top_k']} of {report['num_experts']} experts; trace dtype {report['trace_dtype']}, "
        f"{report['bytes_per_token']} bytes/token",
    ]
    lines += [f"  note: {note}" for note in report["notes"]]
    return "\n".join(lines)
