"""mbridge on Megatron's local layer spec: verl's ``vanilla_mbridge=True`` path without Transformer Engine.

verl's Megatron engine with ``vanilla_mbridge=True`` builds its model through mbridge 0.15.1:
``mbridge.AutoBridge.from_config(hf_config)`` picks the bridge class registered for the model type, ``set_extra_args``
applies verl's ``override_transformer_config``, ``get_model`` builds the ``GPTModel`` and ``load_weights`` /
``export_weights`` move Hugging Face weights in and out. Two things tie that path to Transformer Engine:

* ``LLMBridge._get_transformer_layer_spec`` calls ``get_gpt_decoder_block_spec(config, use_transformer_engine=True)``;
* the weight-name maps know only the TE spec's parameter names: the input norm fused into
  ``self_attention.linear_qkv.layer_norm_weight`` (dense layers also the pre-MLP norm, into
  ``mlp.linear_fc1.layer_norm_weight``) and grouped experts as ``mlp.experts.linear_fcX.weight{expert}``. The local
  spec names them ``input_layernorm.weight``, ``pre_mlp_layernorm.weight`` and (``SequentialMLP``)
  ``mlp.experts.local_experts.{i}.linear_fcX.weight``.

:class:`LocalSpecBridgeMixin` overrides three of mbridge's per-model hooks: the layer spec becomes the local one (with
:class:`~verl_stable.cpu.megatron.attention.PackedDotProductAttention` as core attention, since verl packs its
micro-batches), the local-to-global name map additionally renames each local-spec parameter to its TE-spec name (so
every mbridge map, split and merge downstream applies unchanged, in both directions, expert parallelism included), and
the config defaults to what the local spec can build. :func:`local_spec_bridges` (or :func:`install` /
:func:`uninstall`, for the CPU runtime's process scope) puts subclasses of the registered bridges, with the mixin
first, into mbridge's model registry for :data:`LOCAL_SPEC_MODEL_TYPES`, so ``AutoBridge.from_config`` -- verl's own
call -- returns them; nothing of mbridge's classes is modified.

The config defaults also correct one mbridge convention that is not about TE: its Qwen3-MoE bridge always routes
with renormalized top-k probabilities, Hugging Face's ``norm_topk_prob=True``; a checkpoint with
``norm_topk_prob=False`` gets megatron's pre-softmax routing instead (:func:`local_config_defaults`).

Only model types checked end to end are listed (every tensor of a Hugging Face checkpoint back bit for bit after
load and export, also in bf16, and fp32 logits equal to the Hugging Face model's through verl's padded and packed
forwards: world size one, expert parallel 2, tensor parallel 2 with sequence parallelism); the others keep mbridge's
TE classes. Not checked: pipeline parallelism, and expert-tensor parallelism other than mbridge's default (equal to
tensor parallelism).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import inspect
import re
import threading
from collections.abc import Iterator
from typing import Any

from verl_stable.compat import contracts
from verl_stable.compat.contracts import Contract, ContractError, ContractResult

__all__ = [
    "CONTRACTS",
    "LOCAL_SPEC_MODEL_TYPES",
    "LocalSpecBridgeMixin",
    "check_contracts",
    "install",
    "local_block_spec",
    "local_config_defaults",
    "local_spec_bridges",
    "te_parameter_name",
    "uninstall",
    "with_core_attention",
]

LOCAL_SPEC_MODEL_TYPES: tuple[str, ...] = ("qwen3", "qwen3_moe")
"""Hugging Face ``model_type`` values whose mbridge bridge is replaced by its local-spec subclass."""

# A SequentialMLP expert parameter: ``<prefix>.mlp.experts.local_experts.<i>.linear_fc<1|2>.weight``.
_LOCAL_EXPERT = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\.local_experts\.(?P<index>\d+)\.(?P<fc>linear_fc[12])\.weight$"
)
# The layer index of a decoder-layer parameter (local to this pipeline stage / virtual chunk).
_LAYER = re.compile(r"(?:^|\.)decoder\.layers\.(?P<index>\d+)\.")


def te_parameter_name(name: str, *, dense_layer: bool, expert_offset: int = 0) -> str:
    """The TE-spec name of a local-spec parameter name (other names unchanged).

    Args:
        name: a ``GPTModel`` parameter name built with the local spec (layer index already global, as mbridge's
            local-to-global map produces it).
        dense_layer: whether the parameter's decoder layer has a dense MLP: TE fuses that layer's pre-MLP norm into
            ``mlp.linear_fc1``, while an MoE layer keeps a separate ``pre_mlp_layernorm``.
        expert_offset: added to a local expert index (``ep_rank * experts_per_rank``; 0 for the rank-local name).

    Returns:
        ``input_layernorm.weight`` -> ``self_attention.linear_qkv.layer_norm_weight``; on a dense layer
        ``pre_mlp_layernorm.weight`` -> ``mlp.linear_fc1.layer_norm_weight``; ``mlp.experts.local_experts.{i}.
        linear_fcX.weight`` -> ``mlp.experts.linear_fcX.weight{i + expert_offset}``.
    """
    expert = _LOCAL_EXPERT.match(name)
    if expert is not None:
        return f"{expert['prefix']}.{expert['fc']}.weight{int(expert['index']) + expert_offset}"
    if name.endswith(".input_layernorm.weight"):
        return name.removesuffix("input_layernorm.weight") + "self_attention.linear_qkv.layer_norm_weight"
    if dense_layer and name.endswith(".pre_mlp_layernorm.weight"):
        return name.removesuffix("pre_mlp_layernorm.weight") + "mlp.linear_fc1.layer_norm_weight"
    return name


def with_core_attention(block_spec: Any, core_attention: type) -> Any:
    """A copy of a decoder block spec whose layers' local ``DotProductAttention`` is ``core_attention``.

    Copies rather than edits: a layer spec object is shared by every layer of its kind.

    Args:
        block_spec: a ``TransformerBlockSubmodules`` of ``ModuleSpec`` layers with ``SelfAttention``.
        core_attention: a ``DotProductAttention`` drop-in (same constructor and forward signature).
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    def swap(layer_spec: Any) -> Any:
        attention = layer_spec.submodules.self_attention
        if attention.submodules.core_attention is not DotProductAttention:
            return layer_spec
        attention = dataclasses.replace(
            attention, submodules=dataclasses.replace(attention.submodules, core_attention=core_attention)
        )
        return dataclasses.replace(
            layer_spec, submodules=dataclasses.replace(layer_spec.submodules, self_attention=attention)
        )

    return dataclasses.replace(block_spec, layer_specs=[swap(spec) for spec in block_spec.layer_specs])


def local_block_spec(config: Any, vp_stage: int | None = None) -> Any:
    """megatron's GPT decoder block spec without Transformer Engine, with packed-capable core attention.

    Args:
        config: the bridge's ``TransformerConfig`` (qk-norm, MoE and the norm kind come from it).
        vp_stage: the virtual pipeline stage, as mbridge passes it.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from verl_stable.cpu.megatron.attention import PackedDotProductAttention

    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization=config.normalization, vp_stage=vp_stage
    )
    return with_core_attention(spec, PackedDotProductAttention)


def local_config_defaults(hf_config: Any) -> dict[str, Any]:
    """Transformer-config values the local spec needs in place of mbridge's TE-oriented ones.

    ``set_extra_args`` (verl's ``override_transformer_config``) still wins over these.

    * ``moe_grouped_gemm=False``: mbridge asks for grouped GEMM; without TE that is the legacy ``GroupedMLP``, which
      needs the ``grouped_gemm`` CUDA package. ``SequentialMLP`` (one ``MLP`` per expert) is what runs on CPU.
    * ``moe_router_pre_softmax``: Hugging Face's ``norm_topk_prob=False`` means "softmax over all experts, keep the
      top-k probabilities as they are", which is megatron's pre-softmax routing; mbridge's Qwen3-MoE bridge always
      asks for the renormalized top-k (``norm_topk_prob=True``, what released Qwen3-MoE checkpoints use).
    """
    defaults: dict[str, Any] = {"moe_grouped_gemm": False}
    if getattr(hf_config, "model_type", None) == "qwen3_moe":
        defaults["moe_router_pre_softmax"] = not bool(getattr(hf_config, "norm_topk_prob", True))
    return defaults


class LocalSpecBridgeMixin:
    """Mixed in before an mbridge ``LLMBridge`` subclass: local layer spec, local-spec weight names.

    Overrides mbridge private hooks whose signatures :data:`CONTRACTS` pins.
    """

    hf_config: Any
    config: Any
    mpu: Any
    has_vp_stage: bool

    def _build_base_config(self, text_config_key: str | None = None, **kwargs: Any) -> Any:
        """mbridge's config with :func:`local_config_defaults` in place of the model bridge's TE-oriented values."""
        kwargs.update(local_config_defaults(self.hf_config))
        return super()._build_base_config(text_config_key, **kwargs)  # type: ignore[misc]

    def _get_transformer_layer_spec(self, vp_stage: int | None = None) -> Any:
        """The local decoder block spec (mbridge's reads ``use_transformer_engine=True``)."""
        if self.config.normalization != "RMSNorm":
            raise NotImplementedError(f"local-spec mbridge: only RMSNorm models, got {self.config.normalization}")
        # mbridge's model provider passes vp_stage to GPTModel only when the spec function takes it (a contract).
        self.has_vp_stage = True
        return local_block_spec(self.config, vp_stage)

    def _weight_name_mapping_mcore_local_to_global(self, model: Any, consider_ep: bool = True) -> dict[str, str]:
        """mbridge's map (pipeline layer offsets), then each local-spec name renamed to its TE-spec name.

        mbridge's expert-parallel renumbering only recognizes TE expert names, so the global expert index is set
        here: ``ep_rank * experts_per_rank + i`` (megatron's own expert offset), or the rank-local ``i`` when
        ``consider_ep`` is False (mbridge's export then gathers the EP ranks itself).
        """
        from mbridge.core.util import unwrap_model
        from megatron.core.transformer.moe.moe_layer import MoELayer

        names = super()._weight_name_mapping_mcore_local_to_global(model, consider_ep=consider_ep)  # type: ignore[misc]
        module = unwrap_model(model)
        layers = module.decoder.layers if hasattr(module, "decoder") else []
        dense = {index for index, layer in enumerate(layers) if not isinstance(layer.mlp, MoELayer)}
        offset = 0
        if consider_ep and self.mpu.ep_size > 1:
            offset = self.mpu.ep_rank * (self.config.num_moe_experts // self.mpu.ep_size)
        renamed = {}
        for local, global_name in names.items():
            layer = _LAYER.search(local)
            dense_layer = layer is not None and int(layer["index"]) in dense
            renamed[local] = te_parameter_name(global_name, dense_layer=dense_layer, expert_offset=offset)
        return renamed


@functools.cache
def _local_class(base: type) -> type:
    """The local-spec subclass of an mbridge bridge class.

    Cached so that every install gives a base the same subclass: a bridge built under one install stays an instance
    of the class the registry holds under the next.
    """
    return type(f"LocalSpec{base.__name__}", (LocalSpecBridgeMixin, base), {"__module__": __name__})


@dataclasses.dataclass
class _Holds:
    """Who holds which registry entry switched (guarded by ``lock``); the last holder restores mbridge's class."""

    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    count: dict[str, int] = dataclasses.field(default_factory=dict)
    originals: dict[str, type] = dataclasses.field(default_factory=dict)
    process: contextlib.ExitStack | None = None  # install()'s hold


_HOLDS = _Holds()


def _hold(registry: dict[str, type], model_type: str) -> None:
    if _HOLDS.count.get(model_type, 0) == 0:
        original = registry[model_type]
        _HOLDS.originals[model_type] = original
        # patch: mbridge_local_spec (verl_stable.compat.catalogue)
        registry[model_type] = original if issubclass(original, LocalSpecBridgeMixin) else _local_class(original)
    _HOLDS.count[model_type] = _HOLDS.count.get(model_type, 0) + 1


def _release(registry: dict[str, type], model_type: str) -> None:
    _HOLDS.count[model_type] -= 1
    if _HOLDS.count[model_type] == 0:
        del _HOLDS.count[model_type]
        registry[model_type] = _HOLDS.originals.pop(model_type)


@contextlib.contextmanager
def local_spec_bridges(model_types: tuple[str, ...] = LOCAL_SPEC_MODEL_TYPES) -> Iterator[dict[str, type]]:
    """Within the block, ``mbridge.AutoBridge.from_config`` builds local-spec bridges for ``model_types``.

    Holds nest and may overlap :func:`install` in any order: mbridge's class comes back when the last holder of an
    entry leaves. Bridges created inside keep their class after the block.

    Args:
        model_types: Hugging Face model types to switch; each must be registered with mbridge.

    Yields:
        The local-spec classes by model type.

    Raises:
        KeyError: a model type mbridge does not register.
    """
    from mbridge.core.bridge import _MODEL_REGISTRY

    missing = [t for t in model_types if t not in _MODEL_REGISTRY]
    if missing:
        raise KeyError(f"mbridge registers no bridge for {missing}")
    with _HOLDS.lock:
        for model_type in model_types:
            _hold(_MODEL_REGISTRY, model_type)
        installed = {t: _MODEL_REGISTRY[t] for t in model_types}
    try:
        yield installed
    finally:
        with _HOLDS.lock:
            for model_type in model_types:
                _release(_MODEL_REGISTRY, model_type)


def install() -> list[str]:
    """Switch mbridge to the local spec for the rest of the process (idempotent); the CPU runtime calls it.

    Only for processes that selected the CPU platform (the caller checks): a GPU process keeps TE.

    Returns:
        ``mbridge_local_spec:<model_type>`` for each entry switched (empty when :func:`install` already holds them).
    """
    with _HOLDS.lock:
        if _HOLDS.process is not None:
            return []
        stack = contextlib.ExitStack()
        stack.enter_context(local_spec_bridges())
        _HOLDS.process = stack
    # released before interpreter shutdown clears this module's globals (the hold's generator still needs them)
    atexit.register(uninstall)
    return [f"mbridge_local_spec:{t}" for t in LOCAL_SPEC_MODEL_TYPES]


def uninstall() -> None:
    """Drop :func:`install`'s hold (a no-op when it holds nothing); open :func:`local_spec_bridges` blocks keep
    theirs."""
    with _HOLDS.lock:
        stack, _HOLDS.process = _HOLDS.process, None
        if stack is not None:
            stack.close()


# ---------------------------------------------------------------------------------------------------------------------
# Contracts: the mbridge / megatron-core private interfaces the adapter relies on, checked by name.


def _params(func: Any) -> tuple[str, ...]:
    return tuple(inspect.signature(func).parameters)


def _registry() -> str:
    from mbridge import AutoBridge
    from mbridge.core.bridge import _MODEL_REGISTRY
    from mbridge.core.llm_bridge import LLMBridge

    for model_type in LOCAL_SPEC_MODEL_TYPES:
        cls = _MODEL_REGISTRY.get(model_type)
        if cls is None or not issubclass(cls, LLMBridge):
            raise ContractError(f"_MODEL_REGISTRY[{model_type!r}] is {cls!r}, not an LLMBridge")
    if "_MODEL_REGISTRY[" not in inspect.getsource(AutoBridge.from_config.__func__):
        raise ContractError("AutoBridge.from_config no longer looks the bridge class up in _MODEL_REGISTRY")
    return f"_MODEL_REGISTRY holds LLMBridge classes for {list(LOCAL_SPEC_MODEL_TYPES)}"


def _hooks() -> str:
    from mbridge.core.bridge import Bridge
    from mbridge.core.llm_bridge import LLMBridge

    expected = {
        LLMBridge._build_base_config: ("self", "text_config_key", "kwargs"),
        LLMBridge._get_transformer_layer_spec: ("self", "vp_stage"),
        Bridge._weight_name_mapping_mcore_local_to_global: ("self", "model", "consider_ep"),
    }
    for func, params in expected.items():
        if _params(func) != params:
            raise ContractError(f"{func.__qualname__} now takes {_params(func)}, overridden for {params}")
    provider = inspect.getsource(LLMBridge._model_provider)
    if "self._get_transformer_layer_spec(vp_stage)" not in provider or "self.has_vp_stage" not in provider:
        raise ContractError("LLMBridge._model_provider no longer builds its spec via the hook / reads has_vp_stage")
    for method in (Bridge.load_weights, Bridge.export_weights):
        if "_weight_name_mapping_mcore_local_to_global(" not in inspect.getsource(method):
            raise ContractError(f"{method.__qualname__} no longer names parameters via the local-to-global map")
    return "LLMBridge spec / config hooks and Bridge local-to-global map"


def _te_name_maps() -> str:
    from mbridge.core.bridge import _MODEL_REGISTRY

    layer = "model.layers.3"
    shared = {
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight": [f"{layer}.input_layernorm.weight"],
        "decoder.layers.3.self_attention.q_layernorm.weight": [f"{layer}.self_attn.q_norm.weight"],
        "decoder.layers.3.self_attention.k_layernorm.weight": [f"{layer}.self_attn.k_norm.weight"],
    }
    expected = {
        "qwen3_moe": {
            **shared,
            "decoder.layers.3.pre_mlp_layernorm.weight": [f"{layer}.post_attention_layernorm.weight"],
            "decoder.layers.3.mlp.router.weight": [f"{layer}.mlp.gate.weight"],
            "decoder.layers.3.mlp.experts.linear_fc1.weight5": [
                f"{layer}.mlp.experts.5.gate_proj.weight",
                f"{layer}.mlp.experts.5.up_proj.weight",
            ],
            "decoder.layers.3.mlp.experts.linear_fc2.weight5": [f"{layer}.mlp.experts.5.down_proj.weight"],
        },
        "qwen3": {
            **shared,
            "decoder.layers.3.mlp.linear_fc1.layer_norm_weight": [f"{layer}.post_attention_layernorm.weight"],
            "decoder.layers.3.mlp.linear_fc1.weight": [f"{layer}.mlp.gate_proj.weight", f"{layer}.mlp.up_proj.weight"],
        },
    }
    for model_type, names in expected.items():
        cls = _MODEL_REGISTRY[model_type]
        # the maps read only class attributes; no parallel state is needed to run them
        bridge = object.__new__(cls)
        for te_name, hf_names in names.items():
            got = cls._weight_name_mapping_mcore_to_hf(bridge, te_name)
            if got != hf_names:
                raise ContractError(f"{cls.__name__} maps {te_name} to {got}, expected {hf_names}")
    return "mbridge maps the TE-spec names the local-spec names are renamed to"


def _local_spec() -> str:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.attention import SelfAttentionSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    params = _params(get_gpt_decoder_block_spec)
    if params[:2] != ("config", "use_transformer_engine") or not {"normalization", "vp_stage"} <= set(params):
        raise ContractError(f"get_gpt_decoder_block_spec now takes {params}")
    if "core_attention" not in {f.name for f in dataclasses.fields(SelfAttentionSubmodules)}:
        raise ContractError("SelfAttentionSubmodules has no core_attention field")
    if "layer_specs" not in {f.name for f in dataclasses.fields(TransformerBlockSubmodules)}:
        raise ContractError("TransformerBlockSubmodules has no layer_specs field")
    if "self.local_experts" not in inspect.getsource(SequentialMLP.__init__):
        raise ContractError("SequentialMLP no longer holds its experts as local_experts")
    return "get_gpt_decoder_block_spec(use_transformer_engine=False), SelfAttention core_attention, local_experts"


CONTRACTS: tuple[Contract, ...] = (
    Contract("mbridge_registry", "mbridge's model registry, read by AutoBridge.from_config", _registry),
    Contract("mbridge_hooks", "mbridge's config / layer-spec / local-to-global name hooks", _hooks),
    Contract("mbridge_te_name_maps", "mbridge's TE-spec weight-name maps for Qwen3(-MoE)", _te_name_maps),
    Contract("megatron_local_spec", "megatron-core's local GPT layer spec", _local_spec),
)


def check_contracts(names: tuple[str, ...] | list[str] | None = None) -> list[ContractResult]:
    """Run the local-spec mbridge adapter's contracts (all by default); never raises."""
    return contracts.check(CONTRACTS, names)
