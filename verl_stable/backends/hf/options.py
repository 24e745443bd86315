"""The options of the ``hf`` rollout backend: ``actor_rollout_ref.rollout.engine_kwargs.hf``, read and checked.

The schema (:class:`HFOptions`) and its reader (:func:`resolve_options`) are all that a config check needs of the
backend, so they live apart from the server and the replica: :mod:`verl_stable.recipes` checks a composed config with
them before any run starts, without importing torch or verl's rollout classes.

Options: ``precision`` (fp32 | bf16 | fp16 | fp8 | fp8_w8a8 | int4, see :mod:`verl_stable.backends.hf.precision`; default
from ``rollout.dtype``, or fp8 when ``rollout.quantization=fp8``), ``router_noise`` (default 0: off; sigma of the
fixed inference-only router-weight perturbation of :func:`verl_stable.backends.hf.precision.router_perturbation`, a stand-in
for a large MoE's routing mismatch, not a numeric format), ``sync_weights`` (default true; false keeps the rollout at its initial weights -- a
deliberate-drift control), ``num_threads`` (torch threads in the server, default: torch's), ``max_batch_size``
(default 64: concurrent requests with prompts of one length are sampled as one batch, see
:mod:`verl_stable.backends.hf.batching`; 1 samples one request at a time).

Fault injection, for tests only: ``corrupt_routing_every`` (default 0, off) makes every k-th request's exported
routing malformed (expert ids out of range, see :func:`verl_stable.backends.hf.routing.corrupt_routing_payload`), as
an engine that silently loses routing would; the rollout boundary then refuses it, or skips that sample's routing
under ``+verl_stable.routing.on_invalid=skip_sample``, and replay falls back to the model's own routing there.
``nan_logprobs_at_versions`` (default empty, off) makes every log-prob the server returns NaN while its weights are
at one of the listed versions (verl's ``global_steps`` of the last weight sync: version ``k - 1`` serves step ``k`` of
verl's sync trainer), as a broken inference kernel would; the tokens are sampled as usual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl_stable.schema import HFEngineOptions, parse

BACKEND = "hf"
SECTION = f"actor_rollout_ref.rollout.engine_kwargs.{BACKEND}"
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
    nan_logprobs_at_versions: tuple[int, ...] = ()  # FAULT INJECTION for tests: NaN log-probs at these versions


def resolve_options(config: Any) -> HFOptions:
    """Read the ``hf`` backend options from a rollout config (dataclass or DictConfig).

    The section is read with the schema (:class:`verl_stable.schema.HFEngineOptions`: strict types, bounds).

    Raises:
        ValueError: unknown precision or ``rollout.dtype``; :class:`verl_stable.schema.ConfigError` (a
            ``ValueError``) for unknown option names or values of the wrong type or out of range, naming the key.
    """
    # precision.py imports torch at module level; a config check should not pay for it unless a precision is named
    from verl_stable.backends.hf.precision import canonical_precision

    engine_kwargs = _get(config, "engine_kwargs", None) or {}
    options = parse(HFEngineOptions, _get(engine_kwargs, BACKEND, None), SECTION)
    if options.precision is not None:
        precision = canonical_precision(options.precision)
    elif str(_get(config, "quantization", None) or "").lower() == "fp8":
        precision = "fp8"
    else:
        dtype = str(_get(config, "dtype", "bfloat16")).lower()
        if dtype not in _DTYPE_TO_PRECISION:
            raise ValueError(
                f"rollout.dtype={dtype!r} is not supported by the hf backend; use one of {sorted(_DTYPE_TO_PRECISION)}"
            )
        precision = _DTYPE_TO_PRECISION[dtype]
    return HFOptions(
        precision,
        options.sync_weights,
        options.num_threads,
        options.max_batch_size,
        corrupt_routing_every=options.corrupt_routing_every,
        router_noise=float(options.router_noise),
        nan_logprobs_at_versions=options.nan_logprobs_at_versions,
    )


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(key, default)
    if hasattr(obj, "get") and not hasattr(obj, key):
        return obj.get(key, default)
    return getattr(obj, key, default)
