"""The typed schema of every configuration key verl-stable defines, read alike by preflight and at run time.

verl-stable adds keys to verl's trainer config in six places. Each is one strict pydantic model here, and the code
that uses a section reads it through :func:`parse` with that model, so ``verl-stable recipe check`` / ``run``'s
preflight and the running trainer accept and refuse exactly the same values:

==============================================================  ==========================  ============================
key                                                             model                       read at run time by
==============================================================  ==========================  ============================
``stable`` (monitor and guard)                                  :class:`StableOptions`      the monitored trainers
``verl_stable.routing``                                         :class:`RoutingOptions`     the compact-routing workers
``actor_rollout_ref.rollout.engine_kwargs.hf``                  :class:`HFEngineOptions`    the ``hf`` rollout servers
``actor_rollout_ref.rollout.engine_kwargs.vllm`` (our key only) :class:`VllmEngineOptions`  the vLLM CPU servers
``actor_rollout_ref.actor.policy_loss.minirl``                  :class:`MiniRLOptions`      the ``minirl`` loss
``actor_rollout_ref.actor.policy_loss.vespo``                   :class:`VespoOptions`       the ``vespo`` loss
==============================================================  ==========================  ============================

Strict means a value of the wrong type is refused, never converted: the string ``'false'`` is not a bool (Python's
``bool('false')`` is true), ``'25'`` is not a list of numbers, ``2.9`` is not an int. An int is accepted where a
float is meant (YAML writes ``2`` for 2.0). Unknown keys are refused. Bounds are the ones the run time needs (a
window of ``10**20`` steps would pass a type check and fail when the deque is built). The one documented conversion
is a guard rule's numeric-string ``threshold`` (PyYAML reads ``1e-2`` as a string).

Switches. ``stable: false`` turns the monitor and the guard off, ``stable: true`` keeps the defaults; the same holds
for ``stable.monitor`` and ``stable.guard`` alone (``guard: false`` is ``guard: {enable: false}``).

Every refusal is a :class:`ConfigError` whose message names the full key (``stable.monitor.taus.0: ...``) and the
value it got. Nothing here imports verl or torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, TypeVar, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

__all__ = [
    "ConfigError",
    "DEFAULT_SHARE_MIN_BYTES",
    "ESCALATION_KEYS",
    "EscalationOptions",
    "GuardOptions",
    "HFEngineOptions",
    "MAX_WINDOW",
    "MiniRLOptions",
    "MonitorOptions",
    "RoutingOptions",
    "RuleOptions",
    "StableOptions",
    "VerlStableSection",
    "VespoOptions",
    "VllmEngineOptions",
    "parse",
    "to_plain",
]

MAX_WINDOW = 100_000
"""Largest window (in training steps) a monitor or guard option may name: far beyond any run, small enough to build."""
MAX_EXPERTS = 1 << 16
"""Largest expert count the routing traces store (uint16 ids)."""
DEFAULT_SHARE_MIN_BYTES = 1 << 21
"""Default ``verl_stable.routing.share_prompt_rows_min_bytes`` (2 MiB): below it a side entry's round trips cost more
than the bytes a shared group saves (docs/explanation/benchmarks.md, "Side entries: break-even")."""


class ConfigError(ValueError, TypeError):
    """A configuration value verl-stable refuses; the message names the key.

    Both a ``ValueError`` and a ``TypeError``: a wrong type is a bad value of the key, and callers written against
    either (``except ValueError`` in preflight, ``pytest.raises(TypeError)`` for a non-bool switch) keep working.
    """


def _as_tuple(value: Any) -> Any:
    # a YAML sequence arrives as a list (OmegaConf containers), and strict mode accepts only a tuple for a tuple
    return tuple(value) if isinstance(value, list) else value


def _names(value: Any) -> Any:
    # one metric name or a list of them (a preference order)
    return (value,) if isinstance(value, str) else _as_tuple(value)


NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveInt = Annotated[int, Field(ge=1)]
FiniteNonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Window = Annotated[int, Field(ge=1, le=MAX_WINDOW)]
Name = Annotated[str, Field(min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    switch_off: ClassVar[Mapping[str, Any] | None] = None
    """What ``false`` written for the whole section means (None: the section is no switch, a bool is refused)."""


def _switch(model: type[_Strict], value: Any) -> Any:
    """A section written as a bool, for a section that is a switch: ``false`` -> its :attr:`~_Strict.switch_off`,
    ``true`` -> its defaults; anything else as given (``stable: false`` means off, not a type error or "on")."""
    if model.switch_off is None or not isinstance(value, bool):
        return value
    return dict(model.switch_off) if value is False else {}


def _section(model: type[_Strict]) -> BeforeValidator:
    """The validator of a nested section: null -> defaults, a bool through :func:`_switch`."""
    return BeforeValidator(lambda v: {} if v is None else _switch(model, v))


class RoutingOptions(_Strict):
    """``verl_stable.routing``: the compact rollout -> actor routing transport.

    Attributes:
        on_invalid: ``raise`` (default) or ``skip_sample`` (that sample trains with the model's own routing and is
            counted under ``stable/routing/*``).
        share_prompt_rows: store a group's prompt rows once in a side entry (default true).
        share_prompt_rows_min_bytes: share only when that saves at least this many bytes, ``(n - 1) x`` the group's
            prompt rows (0: every group of more than one sample).
    """

    on_invalid: Literal["raise", "skip_sample"] = "raise"
    share_prompt_rows: bool = True
    share_prompt_rows_min_bytes: NonNegativeInt = DEFAULT_SHARE_MIN_BYTES


class VerlStableSection(_Strict):
    """The top-level ``verl_stable`` key (only ``routing`` below it)."""

    routing: Annotated[RoutingOptions, _section(RoutingOptions)] = RoutingOptions()


class HFEngineOptions(_Strict):
    """``actor_rollout_ref.rollout.engine_kwargs.hf``: the project's CPU ``hf`` rollout back end.

    Attributes:
        precision: fp32 | bf16 | fp16 | fp8 | fp8_w8a8 | int4 or an alias (checked by the back end's precision
            table); None: from ``rollout.dtype`` / ``rollout.quantization``.
        sync_weights: load the trainer's weights after each update (false: a deliberate-drift control).
        num_threads: torch threads of a server (None: torch's default).
        max_batch_size: concurrent requests sampled as one batch (1: one at a time).
        corrupt_routing_every: FAULT INJECTION for tests: every k-th request's routing is malformed (0: off).
        router_noise: sigma of the fixed inference-only router perturbation, relative to the weight's rms (0: off).
        nan_logprobs_at_versions: FAULT INJECTION for tests: the weight versions (verl's ``global_steps`` of the last
            weight sync; version ``k - 1`` serves step ``k`` of verl's sync trainer) at which every returned log-prob
            is NaN, as a broken inference kernel would return them (empty: off).
    """

    precision: Name | None = None
    sync_weights: bool = True
    num_threads: Annotated[int, Field(ge=1, le=4096)] | None = None
    max_batch_size: Annotated[int, Field(ge=1, le=1 << 20)] = 64
    corrupt_routing_every: NonNegativeInt = 0
    router_noise: FiniteNonNegative = 0.0
    nan_logprobs_at_versions: Annotated[tuple[NonNegativeInt, ...], BeforeValidator(_as_tuple)] = ()


class VllmEngineOptions(_Strict):
    """The key verl-stable adds to ``actor_rollout_ref.rollout.engine_kwargs.vllm`` (the rest is vLLM's).

    Attributes:
        corrupt_routing_every: FAULT INJECTION for tests: requests whose sampling seed is a multiple of k get
            malformed routed experts (0 or None: off).
    """

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    corrupt_routing_every: Annotated[NonNegativeInt, BeforeValidator(lambda v: 0 if v is None else v)] = 0


class MiniRLOptions(_Strict):
    """``actor_rollout_ref.actor.policy_loss.minirl``.

    Attributes:
        allow_missing_rollout_is_weights: accept ``rollout_is_weights=None`` and train with ``w = 1`` (only right
            when training reproduces the sampler's probabilities).
    """

    allow_missing_rollout_is_weights: bool = False


class VespoOptions(_Strict):
    """``actor_rollout_ref.actor.policy_loss.vespo``: constants of ``phi(W) = W^c1 * exp(c2 * (1 - W))``."""

    c1_pos: FiniteNonNegative = 2.0
    c2_pos: FiniteNonNegative = 3.0
    c1_neg: FiniteNonNegative = 3.0
    c2_neg: FiniteNonNegative = 2.0


DEFAULT_TAUS = (2.0, 5.0)


class MonitorOptions(_Strict):
    """``stable.monitor`` (see :class:`verl_stable.monitor.step.MonitorConfig` for what each does)."""

    switch_off: ClassVar[Mapping[str, Any]] = {"enable": False}

    enable: bool = True
    taus: Annotated[tuple[Annotated[float, Field(gt=1, allow_inf_nan=False)], ...], BeforeValidator(_as_tuple)] = (
        DEFAULT_TAUS
    )
    entropy_window: Annotated[int, Field(ge=2, le=MAX_WINDOW)] = 5
    routing_interval: NonNegativeInt = 1
    replay_metrics_interval: NonNegativeInt = 1
    num_experts: Annotated[int, Field(ge=1, le=MAX_EXPERTS)] | None = None
    train_routing_field: Name | None = None
    per_update: bool = True

    @field_validator("taus")
    @classmethod
    def _distinct_metric_names(cls, taus: tuple[float, ...]) -> tuple[float, ...]:
        # F(tau) is logged as extreme_frac_tau{tau:g}: two taus printing alike would overwrite one another
        names = [f"{t:g}" for t in taus]
        if len(set(names)) != len(names):
            raise ValueError(f"must print distinctly as extreme_frac_tau<tau:g> (they give {names})")
        return taus


def _numeric_string(value: Any) -> Any:
    # PyYAML reads `1e-2` (no dot) as a string; the guard has always accepted that one spelling of a number
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


class EscalationOptions(_Strict):
    """``escalate_to`` of an ``escalate`` rule: the stricter rollout correction the run moves to when the rule fires.

    The keys are fields of verl's ``algorithm.rollout_correction`` that verl's trainer reads afresh at every step (it
    computes the IS weights and the rejection mask from the rollout's and pi_old's log-probs before the update), so
    a change applies from the next step on; only the keys given are changed. The values are verl's own (checked with
    verl's own rollout-correction code before the run starts: ``rollout_rs`` names such as ``token_k3``, thresholds
    as numbers or ``"lower_upper"`` strings).
    """

    rollout_is: Literal["token", "sequence"] | None = None
    rollout_is_threshold: Annotated[float, Field(gt=0, allow_inf_nan=False)] | str | None = None
    rollout_is_batch_normalize: bool | None = None
    rollout_rs: Name | None = None
    rollout_rs_threshold: Annotated[float, Field(gt=0, allow_inf_nan=False)] | str | None = None


ESCALATION_KEYS: tuple[str, ...] = tuple(EscalationOptions.model_fields)


class RuleOptions(_Strict):
    """One entry of ``stable.guard.rules``: fields of :class:`verl_stable.monitor.guard.Rule` to set.

    Only the keys given are applied (to a default rule of that name, or a new rule). ``metric`` and ``metrics`` are
    synonyms; ``enabled: false`` drops the rule. The guard checks what depends on several fields (a condition's
    threshold, ``below_and_falling``'s window >= 2).
    """

    condition: Literal["above", "below", "below_and_falling", "non_finite"] | None = None
    metric: Name | None = None
    metrics: Annotated[tuple[Name, ...], BeforeValidator(_names), Field(min_length=1)] | None = None
    threshold: Annotated[Annotated[float, Field(allow_inf_nan=False)] | None, BeforeValidator(_numeric_string)] = None
    window: Window | None = None
    action: Literal["warn", "stop", "stop_checkpoint", "skip_update", "rollback", "escalate"] | None = None
    enabled: bool = True
    slope_tolerance: FiniteNonNegative | None = None
    optional: bool | None = None
    max_skips: Window | None = None
    max_rollbacks: Window | None = None
    rollback_data: Literal["replay", "skip"] | None = None
    escalate_to: EscalationOptions | None = None
    marks_checkpoints: bool | None = None


class GuardOptions(_Strict):
    """``stable.guard``: ``enable``, ``use_defaults`` and ``rules`` (name -> :class:`RuleOptions` or null to drop)."""

    switch_off: ClassVar[Mapping[str, Any]] = {"enable": False}

    enable: bool = True
    use_defaults: bool = True
    rules: Annotated[dict[Name, RuleOptions | None], BeforeValidator(lambda v: {} if v is None else v)] = {}


class StableOptions(_Strict):
    """The top-level ``stable`` key: ``monitor`` and ``guard``; ``false`` turns both off."""

    switch_off: ClassVar[Mapping[str, Any]] = {"monitor": {"enable": False}, "guard": {"enable": False}}

    monitor: Annotated[MonitorOptions, _section(MonitorOptions)] = MonitorOptions()
    guard: Annotated[GuardOptions, _section(GuardOptions)] = GuardOptions()


M = TypeVar("M", bound=BaseModel)


def to_plain(value: Any) -> Any:
    """An OmegaConf node (or anything holding them) as plain dicts and lists, interpolations resolved."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf comes with verl
        return value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_plain(v) for v in value)
    return value


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse(model: type[M], value: Any, key: str) -> M:
    """``value`` (a mapping, an OmegaConf node or None) validated by ``model``; ``key`` is the section's full name.

    Raises:
        ConfigError: naming each offending key below ``key``, what was expected and the value received.
    """
    value = _switch(model, to_plain(value))
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        expected = "a mapping of options" + ("" if model.switch_off is None else " (or true / false)")
        raise ConfigError(f"{key} must be {expected}, got {type(value).__name__} {_shown(value)}")
    bad_keys = [k for k in value if not isinstance(k, str)]
    if bad_keys:
        raise ConfigError(f"{key}: a key must be a name, got {_shown(bad_keys[0])}")
    try:
        return model.model_validate(dict(value))
    except ValidationError as exc:
        raise ConfigError("; ".join(_describe(model, key, error) for error in exc.errors())) from None


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (through Annotated, unions, dict values)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _known_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """The keys accepted where an unknown key at ``loc`` stands."""
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None:  # a free name (a guard rule's) below a dict: the dict's value model applies
            continue
        nested = _models_in(field.annotation)
        if not nested:
            break
        model = nested[0]
    return sorted(model.model_fields)


_PHRASES = {
    "bool_type": "must be a bool (true/false)",
    "int_type": "must be an int",
    "float_type": "must be a number",
    "string_type": "must be a string",
    "tuple_type": "must be a list",
    "dict_type": "must be a mapping",
    "model_type": "must be a mapping",
    "model_attributes_type": "must be a mapping",
    "finite_number": "must be a finite number",
}


def _phrase(error: Mapping[str, Any]) -> str:
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind in _PHRASES:
        return _PHRASES[kind]
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}"
    bounds = {"greater_than": "> {gt}", "greater_than_equal": ">= {ge}", "less_than": "< {lt}"}
    bounds["less_than_equal"] = "<= {le}"
    if kind in bounds:
        return "must be " + bounds[kind].format(**ctx)
    if kind in ("too_short", "string_too_short"):
        return "must not be empty"
    message = str(error["msg"])
    return message.removeprefix("Value error, ")


def _describe(model: type[BaseModel], key: str, error: Mapping[str, Any]) -> str:
    where = ".".join([key, *(str(part) for part in error["loc"])])
    if error["type"] == "extra_forbidden":
        return f"{where}: unknown key (known: {', '.join(_known_keys(model, tuple(error['loc'])))})"
    received = error.get("input")
    if error["loc"] and error["loc"][-1] == "[key]":
        return f"{key}.{'.'.join(str(p) for p in error['loc'][:-2])}: a key must be a name, got {_shown(received)}"
    return f"{where} {_phrase(error)}, got {type(received).__name__} {_shown(received)}"
