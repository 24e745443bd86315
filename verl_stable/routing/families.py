"""Per-family facts about Hugging Face MoE routing: where the top-k choice is made and how gate weights are formed.

Each supported ``model_type`` has one declarative :class:`FamilySpec`. Two kinds of routing *site* exist in
transformers 5.10:

* ``router_output``: a router module returns ``(router_logits, top_k_weights, top_k_index)`` (Qwen, Mixtral,
  OLMoE, GPT-OSS). The site is the router module; the live differentiable tensor is ``router_logits``.
* ``route_method``: the MoE block's ``route_tokens_to_experts(router_logits) -> (top_k_index, top_k_weights)``
  makes the choice (DeepSeek-V3, GLM-4.5 MoE: sigmoid scores, a selection-only bias, group-limited top-k).
  The site is the block; the live tensor is the fp32 ``router_logits`` argument.

``gate_weights(site, live, ids)`` recomputes the family's gate weights at given expert ids from the live tensor,
with the family's own normalisation and scaling, so that replaying the model's own ids reproduces its output
bit for bit and gradients reach the router; the formulas live in :mod:`verl_stable.routing.gates`.

Adding a family is one ``FamilySpec`` entry in ``_SPECS``. Routing is indexed by absolute decoder layer at engine
boundaries and by MoE-layer ordinal inside a RoutingTrace; ``RoutingLayout.moe_layers`` is the mapping.

This module owns the family table, the MoE-layer rules, :func:`layout_from_config`, :func:`bind_model` (a model
instance to its routing sites) and the ``verl-stable doctor --model`` report. Config integers are read with
:func:`verl_stable.routing.checks.config_int`; ``UnsupportedModelError`` is defined there and importable here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from verl_stable.routing.checks import config_int, config_int_value
from verl_stable.routing.errors import UnsupportedModelError
from verl_stable.routing.gates import (
    GateWeights,
    gpt_oss_gate_weights,
    mixtral_gate_weights,
    sigmoid_gate_weights,
    softmax_gate_weights,
)
from verl_stable.routing.trace import RoutingLayout

ROUTER_OUTPUT = "router_output"
ROUTE_METHOD = "route_method"

MoeLayers = Callable[[Any], tuple[int, ...]]


# ------------------------------------------------------------------------------------- MoE layer rules
def every_layer(config: Any) -> tuple[int, ...]:
    """Every decoder layer is MoE."""
    return tuple(range(config_int(config, "num_hidden_layers")))


def qwen_sparse_layers(config: Any) -> tuple[int, ...]:
    """Qwen2/3-MoE: MoE unless in ``mlp_only_layers``, every ``decoder_sparse_step``-th layer, if experts > 0.

    The rule of transformers' ``Qwen2MoeDecoderLayer`` / ``Qwen3MoeDecoderLayer``, in its order: a layer in
    ``mlp_only_layers`` or a config without experts is dense before the step is read.

    Raises:
        UnsupportedModelError: ``decoder_sparse_step`` is 0 while a layer reaches the step rule: transformers
            computes ``(layer + 1) % decoder_sparse_step`` there and cannot build the model (ZeroDivisionError).
    """
    only = getattr(config, "mlp_only_layers", None) or ()
    if isinstance(only, (str, bytes)) or not isinstance(only, (list, tuple, set, frozenset)):
        raise UnsupportedModelError(f"config mlp_only_layers must be a list of layer indices, got {only!r:.80}")
    only_dense = {config_int_value(i, "mlp_only_layers entry") for i in only}
    step = config_int(config, "decoder_sparse_step", 1)
    if config_int(config, "num_experts", 0) <= 0:
        return ()
    ruled = [i for i in range(config_int(config, "num_hidden_layers")) if i not in only_dense]
    if ruled and step == 0:
        raise UnsupportedModelError(
            f"config decoder_sparse_step is 0: transformers builds layer {ruled[0]} with (layer + 1) % "
            "decoder_sparse_step and cannot build this model (ZeroDivisionError); expected an integer >= 1 (1: every "
            "layer is MoE)"
        )
    return tuple(i for i in ruled if (i + 1) % step == 0)


def after_first_k_dense(config: Any) -> tuple[int, ...]:
    """DeepSeek-V3 / GLM-4.5: dense below ``first_k_dense_replace``, MoE from there on."""
    return tuple(range(config_int(config, "first_k_dense_replace", 0), config_int(config, "num_hidden_layers")))


# -------------------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class FamilySpec:
    """Declarative description of one MoE family's routing.

    Attributes:
        name: family name (the canonical model_type).
        model_types: every ``config.model_type`` served by this entry.
        site_kind: ``ROUTER_OUTPUT`` or ``ROUTE_METHOD`` (see module docstring).
        site_class: class name of the patched module (router, or MoE block for ROUTE_METHOD).
        num_experts_attr: text-config attribute holding the routed expert count.
        moe_layers: config -> absolute decoder indices of the MoE layers.
        gate_weights: ``(site, live, ids[T, K]) -> weights[T, K]`` from the live differentiable tensor.
        top_k_attr: text-config attribute holding top-k.
        kernel_block_class: MoE block class that a hub kernel may replace whole (bypassing the router).
        notes: caveats shown by ``describe_model_routing``.
    """

    name: str
    model_types: tuple[str, ...]
    site_kind: str
    site_class: str
    num_experts_attr: str
    moe_layers: MoeLayers
    gate_weights: GateWeights
    top_k_attr: str = "num_experts_per_tok"
    kernel_block_class: str | None = None
    notes: tuple[str, ...] = ()


_SPECS: tuple[FamilySpec, ...] = (
    FamilySpec(
        name="qwen3_moe",
        model_types=("qwen3_moe",),
        site_kind=ROUTER_OUTPUT,
        site_class="Qwen3MoeTopKRouter",
        num_experts_attr="num_experts",
        moe_layers=qwen_sparse_layers,
        gate_weights=softmax_gate_weights,
    ),
    FamilySpec(
        name="qwen3_5_moe",
        model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
        site_kind=ROUTER_OUTPUT,
        site_class="Qwen3_5MoeTopKRouter",
        num_experts_attr="num_experts",
        moe_layers=every_layer,
        gate_weights=softmax_gate_weights,
        notes=("hybrid attention (Gated DeltaNet + full attention); every decoder layer is MoE",),
    ),
    FamilySpec(
        name="qwen2_moe",
        model_types=("qwen2_moe",),
        site_kind=ROUTER_OUTPUT,
        site_class="Qwen2MoeTopKRouter",
        num_experts_attr="num_experts",
        moe_layers=qwen_sparse_layers,
        gate_weights=softmax_gate_weights,
        notes=("the shared expert and its sigmoid gate are not routed and are left untouched",),
    ),
    FamilySpec(
        name="mixtral",
        model_types=("mixtral",),
        site_kind=ROUTER_OUTPUT,
        site_class="MixtralTopKRouter",
        num_experts_attr="num_local_experts",
        moe_layers=every_layer,
        gate_weights=mixtral_gate_weights,
        notes=(
            "router_jitter_noise > 0 makes training-mode routing random: replay still forces the ids, "
            "gate weights come from the jittered router logits",
        ),
    ),
    FamilySpec(
        name="olmoe",
        model_types=("olmoe",),
        site_kind=ROUTER_OUTPUT,
        site_class="OlmoeTopKRouter",
        num_experts_attr="num_experts",
        moe_layers=every_layer,
        gate_weights=softmax_gate_weights,
    ),
    FamilySpec(
        name="deepseek_v3",
        model_types=("deepseek_v3",),
        site_kind=ROUTE_METHOD,
        site_class="DeepseekV3MoE",
        num_experts_attr="n_routed_experts",
        moe_layers=after_first_k_dense,
        gate_weights=sigmoid_gate_weights,
        notes=("sigmoid scores; e_score_correction_bias and group-limited top-k only affect selection",),
    ),
    FamilySpec(
        name="glm4_moe",
        model_types=("glm4_moe",),
        site_kind=ROUTE_METHOD,
        site_class="Glm4MoeMoE",
        num_experts_attr="n_routed_experts",
        moe_layers=after_first_k_dense,
        gate_weights=sigmoid_gate_weights,
        notes=("sigmoid scores; e_score_correction_bias and group-limited top-k only affect selection",),
    ),
    FamilySpec(
        name="gpt_oss",
        model_types=("gpt_oss",),
        site_kind=ROUTER_OUTPUT,
        site_class="GptOssTopKRouter",
        num_experts_attr="num_local_experts",
        moe_layers=every_layer,
        gate_weights=gpt_oss_gate_weights,
        kernel_block_class="GptOssMLP",
        notes=("load without hub kernels (use_kernels=False): the MegaBlocksMoeMLP kernel bypasses the router",),
    ),
)

FAMILIES: dict[str, FamilySpec] = {mt: spec for spec in _SPECS for mt in spec.model_types}
SUPPORTED_FAMILIES: tuple[str, ...] = tuple(spec.name for spec in _SPECS)


def _supported_text() -> str:
    return ", ".join(sorted(FAMILIES))


def text_config(config: Any) -> Any:
    """The decoder (text) sub-config of a possibly multimodal config."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def family_for(config: Any) -> FamilySpec:
    """The FamilySpec for a config; raises UnsupportedModelError listing the supported model types."""
    candidates = [getattr(config, "model_type", None), getattr(text_config(config), "model_type", None)]
    for model_type in candidates:
        if model_type in FAMILIES:
            return FAMILIES[model_type]
    raise UnsupportedModelError(
        f"routing capture/replay does not support model_type {candidates[0]!r}; supported model types: "
        f"{_supported_text()}"
    )


#: The most decoder layers a config may declare: 2**16. The deepest published decoder stacks have ~130 layers
#: (Llama-3.1-405B: 126, Qwen3-235B-A22B: 94, DeepSeek-V3: 61), and at 2**16 every per-layer structure (transformers'
#: ``layer_types``, the MoE-layer tuples below, the doctor report's lists) stays under a megabyte and a second to build.
#: A config declaring 10**9 layers would instead make them gigabytes before anything could report on it. Checked
#: before transformers builds a config from a file or dict, and before a MoE-layer rule runs.
MAX_DECODER_LAYERS = 65536


def layer_count_problem(attr: str, value: Any) -> str | None:
    """Why a declared ``num_hidden_layers`` is refused as absurd; None when it is within :data:`MAX_DECODER_LAYERS`.

    Only the bound is judged here (a non-integer is left to the type checks of the caller).

    Args:
        attr: the name to report, e.g. ``num_hidden_layers`` or ``text_config.num_hidden_layers``.
        value: the declared value.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_DECODER_LAYERS:
        return (
            f"{attr} must be <= {MAX_DECODER_LAYERS} (the most decoder layers verl-stable accepts), got {value!r:.40}"
        )
    return None


def _check_config_sizes(raw: Mapping) -> None:
    """Refuse a raw config (a parsed config.json) whose layer count is absurd, before transformers expands it."""
    sections = [("", raw)]
    if isinstance(raw.get("text_config"), Mapping):
        sections.append(("text_config.", raw["text_config"]))
    for prefix, section in sections:
        problem = layer_count_problem(f"{prefix}num_hidden_layers", section.get("num_hidden_layers"))
        if problem is not None:
            raise UnsupportedModelError(f"config {problem}")


#: The deepest nesting of JSON arrays / objects a config.json may have (the top-level object is level 1). Model configs
#: nest fewer than ten levels (``quantization_config.config_groups.group_0.weights``); transformers copies and
#: compares a config recursively, several stack frames per level, and hits Python's recursion limit at a few hundred.
MAX_CONFIG_DEPTH = 64


def _nesting_exceeds(value: Any, limit: int) -> bool:
    """Whether arrays / objects in a parsed JSON value nest deeper than ``limit``; iterative, so it cannot recurse."""
    stack = [(value, 1)]
    while stack:
        node, level = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if level > limit:
            return True
        stack.extend((child, level + 1) for child in children)
    return False


def read_config_json(path: Path) -> Any:
    """Parse a ``config.json``, refusing nesting deeper than :data:`MAX_CONFIG_DEPTH` as malformed (not a crash).

    Raises:
        UnsupportedModelError: If arrays / objects nest deeper than :data:`MAX_CONFIG_DEPTH`, including files too
            deep for the JSON parser itself (it recurses once per level and raises ``RecursionError``).
        OSError: If the file cannot be read.
        UnicodeDecodeError: If the file is not text.
        json.JSONDecodeError: If the file is not JSON.
    """
    text = path.read_text()
    try:
        raw = json.loads(text)
        too_deep = _nesting_exceeds(raw, MAX_CONFIG_DEPTH)
    except RecursionError:
        too_deep = True  # deeper than the parser recurses, so far deeper than the bound
    if too_deep:
        raise UnsupportedModelError(
            f"malformed config.json: {path} nests JSON arrays / objects more than {MAX_CONFIG_DEPTH} levels deep "
            "(a model config nests fewer than ten)"
        )
    return raw


def layout_from_config(config: Any) -> RoutingLayout:
    """The RoutingLayout a config implies (raises UnsupportedModelError for unknown or expert-less models)."""
    spec = family_for(config)
    text = text_config(config)
    num_experts = config_int(text, spec.num_experts_attr, 0)
    top_k = config_int(text, spec.top_k_attr, 0)
    num_hidden_layers = config_int(text, "num_hidden_layers", minimum=1)
    too_many = layer_count_problem("num_hidden_layers", num_hidden_layers)
    if too_many is not None:  # before the MoE-layer rule builds a tuple of that length
        raise UnsupportedModelError(f"config {too_many}")
    moe_layers = spec.moe_layers(text)
    if num_experts <= 0 or top_k <= 0 or not moe_layers:
        raise UnsupportedModelError(
            f"{config.model_type} config has no routed experts ({spec.num_experts_attr}={num_experts}, "
            f"{spec.top_k_attr}={top_k}, MoE layers={list(moe_layers)}); nothing to capture or replay"
        )
    if top_k > num_experts:
        raise UnsupportedModelError(f"{spec.top_k_attr}={top_k} exceeds {spec.num_experts_attr}={num_experts}")
    return RoutingLayout(
        family=spec.name,
        model_type=str(getattr(config, "model_type", spec.name)),
        num_hidden_layers=num_hidden_layers,
        moe_layers=tuple(moe_layers),
        top_k=top_k,
        num_experts=num_experts,
    )


# --------------------------------------------------------------------------------------- model binding
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class RoutingSite:
    """One MoE layer's patch point.

    Attributes:
        ordinal: MoE-layer ordinal (index into a trace's layer dimension).
        layer: absolute decoder-layer index.
        name: qualified module name of the site.
        module: the router (ROUTER_OUTPUT) or MoE block (ROUTE_METHOD).
    """

    ordinal: int
    layer: int
    name: str
    module: nn.Module


@dataclass(frozen=True)
class ModelRouting:
    """A model bound to its family: layout plus the per-layer routing sites in MoE-ordinal order."""

    spec: FamilySpec
    layout: RoutingLayout
    sites: tuple[RoutingSite, ...]


def _find_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is not None:
        return config
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "model_type"):
            return config
    raise UnsupportedModelError(
        f"{type(model).__name__} has no Hugging Face config; pass a transformers MoE model "
        f"(supported model types: {_supported_text()})"
    )


def _check_block_not_replaced(model: nn.Module, spec: FamilySpec, block_name: str, block: nn.Module) -> None:
    if "forward" in vars(block):
        raise UnsupportedModelError(
            f"the MoE block {block_name} ({type(block).__name__}) has an instance-level forward (a hub kernel or "
            "another patch replaced it); routing would bypass the patched router. Load the model without kernels."
        )
    if spec.kernel_block_class is None:
        return
    if type(block).__name__ != spec.kernel_block_class:
        raise UnsupportedModelError(
            f"{spec.name}: expected the MoE block {block_name} to be {spec.kernel_block_class}, found "
            f"{type(block).__name__} (replaced by a hub kernel?); routing cannot be captured or replayed"
        )
    if getattr(model, "use_kernels", False) and hasattr(type(block), "kernel_layer_name"):
        raise UnsupportedModelError(
            f"{spec.name}: the model was kernelized (use_kernels=True) and {spec.kernel_block_class} is replaced "
            f"by the hub kernel {type(block).kernel_layer_name!r}, which computes routing inside the kernel; "
            "reload with use_kernels=False to capture or replay routing"
        )


def bind_model(model: nn.Module, config: Any | None = None) -> ModelRouting:
    """Find every routing site of ``model`` and check it against the layout its config implies.

    Args:
        model: a transformers MoE model (any wrapper whose submodule names contain ``layers.<i>.``).
        config: override for the model's config.

    Raises:
        UnsupportedModelError: unknown family, sites not matching the config's MoE layers, replaced MoE blocks.
    """
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(
            f"bind_model needs a torch.nn.Module (a transformers model), got {type(model).__name__}"
        )
    config = _find_config(model) if config is None else config
    spec = family_for(config)
    layout = layout_from_config(config)
    modules = dict(model.named_modules())
    found: dict[int, tuple[str, nn.Module]] = {}
    for name, module in modules.items():
        if type(module).__name__ != spec.site_class:
            continue
        # the innermost "layers.<i>." names the decoder layer (outer ones may be wrappers or towers)
        matches = list(_LAYER_RE.finditer(name + "."))
        if not matches:
            raise UnsupportedModelError(f"cannot tell the decoder layer of routing module {name!r}")
        layer = int(matches[-1].group(1))
        if layer in found:
            raise UnsupportedModelError(
                f"two routing modules claim decoder layer {layer}: {found[layer][0]!r} and {name!r}"
            )
        found[layer] = (name, module)
    if tuple(sorted(found)) != layout.moe_layers:
        raise UnsupportedModelError(
            f"{spec.name}: the config implies MoE layers {list(layout.moe_layers)} but the model has "
            f"{spec.site_class} modules at layers {sorted(found)}"
        )
    sites = []
    for ordinal, layer in enumerate(layout.moe_layers):
        name, module = found[layer]
        block_name = name.rsplit(".", 1)[0] if spec.site_kind == ROUTER_OUTPUT else name
        _check_block_not_replaced(model, spec, block_name, modules.get(block_name, module))
        sites.append(RoutingSite(ordinal=ordinal, layer=layer, name=name, module=module))
    return ModelRouting(spec=spec, layout=layout, sites=tuple(sites))
