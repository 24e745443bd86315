"""The options of the ``hf`` rollout backend: ``actor_rollout_ref.rollout.engine_kwargs.hf``, read and checked.

The schema (:class:`HFOptions`) and its reader (:func:`resolve_options`) are all that a config check needs of the
backend, so they live apart from the server and the replica: :mod:`verl_stable.recipes` checks a composed config with
them before any run starts, without importing torch or verl's rollout classes.

Options: ``precision`` (fp32 | bf16 | fp16 | fp8 | fp8_w8a8 | int4, see :mod:`verl_stable.cpu.precision`; default
from ``rollout.dtype``, or fp8 when ``rollout.quantization=fp8``), ``router_noise`` (default 0: off; sigma of the
fixed inference-only router-weight perturbation of :func:`verl_stable.cpu.precision.router_perturbation`, a stand-in
for a large MoE's routing mismatch, not a numeric format), ``sync_weights`` (default true; false keeps the rollout at its initial weights -- a
deliberate-drift control), ``num_threads`` (torch threads in the server, default: torch's), ``max_batch_size``
(default 64: concurrent requests with prompts of one length are sampled as one batch, see
:mod:`verl_stable.cpu.batching`; 1 samples one request at a time).

Fault injection, for tests only: ``corrupt_routing_every`` (default 0, off) makes every k-th request's exported
routing malformed (expert ids out of range, see :func:`verl_stable.cpu.hf_routing.corrupt_routing_payload`), as
an engine that silently loses routing would; the rollout boundary then refuses it, or skips that sample's routing
under ``+verl_stable.routing.on_invalid=skip_sample``, and replay falls back to the model's own routing there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BACKEND = "hf"
PRECISIONS = ("fp8", "bf16", "fp16", "fp32", "fp8_w8a8", "int4")
"""Rollout precisions the ``hf`` backend serves, in the order the command lines offer them."""

_DTYPE_TO_PRECISION = {"float32": "fp32", "fp32": "fp32", "bfloat16": "bf16", "bf16": "bf16"}
_DTYPE_TO_PRECISION.update({"float16": "fp16", "fp16": "fp16", "half": "fp16"})


@dataclass(frozen=True)
class HFOptions:
    """Resolved ``engine_kwargs.hf`` options."""

    precision: str = "bf16"
    sync_weights: bool = True
    num_threads: int | None = None
    max_batch_size: int = 64
    corrupt_routing_every: int = 0  # FAULT INJECTION for tests: every k-th request returns malformed routing
    router_noise: float = 0.0  # inference-only router perturbation (sigma relative to the router weight's rms)


def resolve_options(config: Any) -> HFOptions:
    """Read the ``hf`` backend options from a rollout config (dataclass or DictConfig).

    Raises:
        ValueError: unknown precision or option names.
    """
    # precision.py imports torch at module level; a config check should not pay for it unless a precision is named
    from verl_stable.cpu.precision import canonical_precision

    engine_kwargs = dict(_get(config, "engine_kwargs", {}) or {})
    raw = dict(engine_kwargs.get(BACKEND, {}) or {})
    unknown = set(raw) - set(HFOptions.__dataclass_fields__)
    if unknown:
        raise ValueError(
            f"unknown rollout.engine_kwargs.hf options {sorted(unknown)}; known: {sorted(HFOptions.__dataclass_fields__)}"
        )
    if raw.get("precision") is not None:
        precision = canonical_precision(raw["precision"])
    elif str(_get(config, "quantization", None) or "").lower() == "fp8":
        precision = "fp8"
    else:
        dtype = str(_get(config, "dtype", "bfloat16")).lower()
        if dtype not in _DTYPE_TO_PRECISION:
            raise ValueError(
                f"rollout.dtype={dtype!r} is not supported by the hf backend; use one of {sorted(_DTYPE_TO_PRECISION)}"
            )
        precision = _DTYPE_TO_PRECISION[dtype]
    threads = raw.get("num_threads")
    max_batch = int(raw.get("max_batch_size", HFOptions.max_batch_size))
    if max_batch < 1:
        raise ValueError(f"rollout.engine_kwargs.hf.max_batch_size must be >= 1, got {max_batch}")
    corrupt_every = raw.get("corrupt_routing_every", HFOptions.corrupt_routing_every)
    if isinstance(corrupt_every, bool) or not isinstance(corrupt_every, int) or corrupt_every < 0:
        raise ValueError(
            "rollout.engine_kwargs.hf.corrupt_routing_every (fault injection) must be an int >= 0 (0: off), got "
            f"{corrupt_every!r}"
        )
    noise = raw.get("router_noise", HFOptions.router_noise)
    if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not 0 <= noise < float("inf"):
        raise ValueError(f"rollout.engine_kwargs.hf.router_noise must be a finite number >= 0 (0: off), got {noise!r}")
    return HFOptions(
        precision,
        bool(raw.get("sync_weights", True)),
        int(threads) if threads else None,
        max_batch,
        corrupt_routing_every=corrupt_every,
        router_noise=float(noise),
    )


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(key, default)
    if hasattr(obj, "get") and not hasattr(obj, key):
        return obj.get(key, default)
    return getattr(obj, key, default)
