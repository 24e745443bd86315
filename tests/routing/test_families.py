"""Family table: MoE layer maps, unsupported models, replaced MoE blocks and the doctor report."""

from __future__ import annotations

import types

import pytest
import torch
from routing_testkit import FAMILY_MODEL_TYPES, tiny_config, tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

from verl_stable.routing import (
    SUPPORTED_FAMILIES,
    UnsupportedModelError,
    bind_model,
    capture,
    describe_model_routing,
    format_routing_report,
    layout_from_config,
    replay,
)

EXPECTED_MOE_LAYERS = {
    "qwen3_moe": (0, 2),  # mlp_only_layers=[1]
    "qwen3_5_moe_text": (0, 1),
    "qwen2_moe": (1, 3),  # decoder_sparse_step=2
    "mixtral": (0, 1),
    "olmoe": (0, 1),
    "deepseek_v3": (1, 2),  # first_k_dense_replace=1
    "glm4_moe": (1, 2),
    "gpt_oss": (0, 1),
}


def test_every_required_family_is_supported():
    required = {"qwen3_moe", "qwen3_5_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "glm4_moe", "gpt_oss"}
    assert required <= set(SUPPORTED_FAMILIES)


@pytest.mark.parametrize("model_type", FAMILY_MODEL_TYPES)
def test_layout_from_config_and_model_sites_agree(model_type):
    layout = layout_from_config(tiny_config(model_type))
    assert layout.moe_layers == EXPECTED_MOE_LAYERS[model_type]
    assert (layout.top_k, layout.num_experts) == (2, 8)
    routing = bind_model(tiny_model(model_type))
    assert [s.layer for s in routing.sites] == list(layout.moe_layers)
    assert [s.ordinal for s in routing.sites] == list(range(layout.num_moe_layers))


def test_qwen3_5_multimodal_config_uses_its_text_config():
    cfg = AutoConfig.for_model(
        "qwen3_5_moe", text_config={"num_hidden_layers": 3, "num_experts": 16, "num_experts_per_tok": 4}
    )
    layout = layout_from_config(cfg)
    assert (layout.family, layout.model_type, layout.moe_layers, layout.top_k, layout.num_experts) == (
        "qwen3_5_moe",
        "qwen3_5_moe",
        (0, 1, 2),
        4,
        16,
    )


def test_unsupported_models_list_the_supported_families():
    dense = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(
            "llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
        )
    )
    with pytest.raises(UnsupportedModelError, match=r"model_type 'llama'.*supported model types: .*qwen3_moe"):
        capture(dense).__enter__()
    with pytest.raises(UnsupportedModelError, match="has no Hugging Face config"):
        bind_model(torch.nn.Linear(2, 2))
    with pytest.raises(UnsupportedModelError, match="no routed experts"):
        layout_from_config(tiny_config("qwen3_moe", num_experts=0))


def test_gpt_oss_refuses_a_hub_kernel_moe_block(monkeypatch):
    model = tiny_model("gpt_oss")
    block_cls = type(model.model.layers[0].mlp)
    monkeypatch.setattr(block_cls, "kernel_layer_name", "MegaBlocksMoeMLP", raising=False)
    model._use_kernels = True
    with pytest.raises(UnsupportedModelError, match="hub kernel 'MegaBlocksMoeMLP'.*use_kernels=False"):
        bind_model(model)
    report = describe_model_routing(model)
    assert report["replayable"] is False and "MegaBlocksMoeMLP" in report["reason"]
    model._use_kernels = False
    bind_model(model)
    model.model.layers[1].mlp.forward = types.MethodType(lambda self, h: (h, None), model.model.layers[1].mlp)
    with pytest.raises(UnsupportedModelError, match=r"model.layers.1.mlp \(GptOssMLP\) has an instance-level forward"):
        bind_model(model)


def test_model_whose_modules_disagree_with_its_config_is_refused():
    model = tiny_model("deepseek_v3")
    model.config.first_k_dense_replace = 0
    with pytest.raises(UnsupportedModelError, match=r"config implies MoE layers \[0, 1, 2\] but the model has"):
        bind_model(model)


def test_describe_model_routing_for_config_dict_path_and_model(tmp_path):
    cfg = tiny_config("deepseek_v3")
    report = describe_model_routing(cfg)
    assert report["replayable"] and report["family"] == "deepseek_v3"
    assert report["moe_layers"] == [1, 2] and report["dense_layers"] == [0]
    assert (report["top_k"], report["num_experts"], report["trace_dtype"]) == (2, 8, "uint8")
    assert report["bytes_per_token"] == 2 * 2
    cfg.save_pretrained(tmp_path)
    assert describe_model_routing(tmp_path)["moe_layers"] == [1, 2]
    assert describe_model_routing(str(tmp_path / "config.json"))["replayable"]
    assert describe_model_routing(tiny_model("mixtral"))["notes"][0].startswith("router_jitter_noise")
    as_dict = describe_model_routing({"model_type": "qwen3_moe", "num_hidden_layers": 48, "num_experts": 128})
    assert as_dict["bytes_per_token"] == 48 * 8  # the Qwen3-30B-A3B figure: uint8, 48 layers, top-8
    text = format_routing_report(report)
    assert "routing replay: supported (family deepseek_v3" in text and "dense: [0]" in text
    missing = describe_model_routing(tmp_path / "nowhere")
    assert not missing["replayable"] and "no config.json" in missing["reason"]
    llama = describe_model_routing({"model_type": "llama"})
    assert not llama["replayable"] and "supported model types" in llama["reason"]
    assert format_routing_report(llama).startswith("routing replay: NOT supported")


def test_qwen3_5_multimodal_model_binds_its_language_model_layers():
    from transformers import Qwen3_5MoeForConditionalGeneration

    text = tiny_config("qwen3_5_moe_text").to_dict()
    text = {k: text[k] for k in text if k not in ("model_type", "transformers_version", "architectures")}
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32)
    torch.manual_seed(0)
    model = Qwen3_5MoeForConditionalGeneration(
        AutoConfig.for_model("qwen3_5_moe", text_config=text, vision_config=vision)
    ).eval()
    routing = bind_model(model)
    assert [s.name for s in routing.sites] == [f"model.language_model.layers.{i}.mlp.gate" for i in (0, 1)]
    ids = torch.randint(3, 90, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with capture(model) as rec:
            model(input_ids=ids)
        with replay(model, rec.trace):
            assert torch.equal(model(input_ids=ids).logits, plain)
