"""The ``hf`` rollout backend: options, weight re-packing from verl's names, the server's verl contract."""

from __future__ import annotations

import asyncio

import pytest
import torch

from verl_stable.backends.hf import rollout as hf_rollout
from verl_stable.backends.hf.precision import dequantize_fp8_rows, quantize_fp8_rows


def test_options_from_verl_knobs():
    assert hf_rollout.resolve_options({"dtype": "bfloat16"}).precision == "bf16"
    assert hf_rollout.resolve_options({"dtype": "float32"}).precision == "fp32"
    assert hf_rollout.resolve_options({"dtype": "bfloat16", "quantization": "fp8"}).precision == "fp8"
    opts = hf_rollout.resolve_options({"engine_kwargs": {"hf": {"precision": "fp16", "sync_weights": False}}})
    assert opts.precision == "fp16" and opts.sync_weights is False and opts.max_batch_size == 64
    assert hf_rollout.resolve_options({"engine_kwargs": {"hf": {"max_batch_size": 1}}}).max_batch_size == 1


def test_the_command_line_precisions_are_the_backends():
    from verl_stable.backends.hf import options as hf_options
    from verl_stable.backends.hf import precision

    assert set(hf_options.PRECISIONS) == set(precision.PRECISIONS) and len(hf_options.PRECISIONS) == 6


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({"engine_kwargs": {"hf": {"precision": "int3"}}}, "unknown rollout precision"),
        ({"engine_kwargs": {"hf": {"router_noise": -0.1}}}, r"hf\.router_noise must be >= 0"),
        ({"engine_kwargs": {"hf": {"router_noise": float("nan")}}}, r"hf\.router_noise must be a finite number"),
        ({"engine_kwargs": {"hf": {"router_noise": "0.1"}}}, r"hf\.router_noise must be a number, got str"),
        (
            {"engine_kwargs": {"hf": {"bogus": 1}}},
            r"engine_kwargs\.hf\.bogus: unknown key \(known: corrupt_routing_every, ",
        ),
        ({"dtype": "float64"}, "not supported by the hf backend"),
        ({"engine_kwargs": {"hf": {"max_batch_size": 0}}}, "max_batch_size must be >= 1"),
    ],
)
def test_bad_options_are_clear_errors(cfg, match):
    with pytest.raises(ValueError, match=match):
        hf_rollout.resolve_options(cfg)


def _verl_sync_stream(model):
    """What verl's FSDP engine sends: the state dict with MoE experts unfused to vLLM names."""
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    return list(unfuse_moe_params(model.state_dict().items(), model.config.model_type))


def test_weight_loader_repacks_verls_unfused_experts(tiny_moe, moe_config_factory):
    from transformers import Qwen3MoeForCausalLM

    stream = _verl_sync_stream(tiny_moe)
    assert any(".mlp.experts.3.up_proj.weight" in n for n, _ in stream)
    torch.manual_seed(123)
    target = Qwen3MoeForCausalLM(moe_config_factory()).float()
    loader = hf_rollout.WeightLoader(target, "fp32")
    for name, t in stream:
        loader.load(name, t)
    for k, v in tiny_moe.state_dict().items():
        assert torch.equal(target.state_dict()[k], v), k
    assert "model.layers.1.mlp.experts.gate_up_proj" in loader.loaded


def test_weight_loader_fp8_and_bad_names(tiny_moe, moe_config_factory):
    from transformers import Qwen3MoeForCausalLM

    target = Qwen3MoeForCausalLM(moe_config_factory()).to(torch.bfloat16)
    loader = hf_rollout.WeightLoader(target, "fp8")
    for name, t in _verl_sync_stream(tiny_moe):
        loader.load(name, t)
    fused = tiny_moe.model.layers[0].mlp.experts.gate_up_proj.detach()
    expected = dequantize_fp8_rows(*quantize_fp8_rows(fused), dtype=torch.bfloat16)
    assert torch.equal(target.model.layers[0].mlp.experts.gate_up_proj, expected)
    with pytest.raises(KeyError, match="weight-name contract"):
        loader.load("model.layers.0.mlp.shared_expert.up_proj.weight", torch.zeros(2, 2))
    with pytest.raises(ValueError, match="shape"):
        loader.load("model.layers.0.mlp.experts.0.down_proj.weight", torch.zeros(3, 3))


def test_routed_experts_layout_matches_vllm():
    trace = torch.tensor([[[1, 2]], [[3, 0]], [[2, 1]]])  # 3 rows, 1 MoE layer, top-2
    arr = hf_rollout.routed_experts_array(trace, [2], num_hidden_layers=3, num_experts=8)
    assert arr.shape == (3, 3, 2) and arr.dtype.name == "uint8"
    assert (arr[:, 0] == 0).all() and (arr[:, 1] == 0).all() and arr[1, 2].tolist() == [3, 0]
    assert hf_rollout.routed_experts_array(trace, [2], 3, 300).dtype.name == "uint16"
    with pytest.raises(ValueError, match="MoE layers"):
        hf_rollout.routed_experts_array(trace, [0, 2], 3, 8)
    with pytest.raises(ValueError, match="outside"):
        hf_rollout.routed_experts_array(trace, [2], 3, 3)


def _server(cpu_assets, **rollout):
    from verl.workers.config import HFModelConfig, RolloutConfig

    cfg = dict(name="hf", prompt_length=16, response_length=6, tensor_model_parallel_size=1, dtype="float32")
    cfg.update(rollout)
    return hf_rollout.HFRolloutServer(RolloutConfig(**cfg), HFModelConfig(path=str(cpu_assets.model_dir)))


def test_server_generate_honours_verls_contract(cpu_assets):
    from verl.workers.rollout.replica import TokenOutput

    from verl_stable.backends.hf.generation import teacher_forced_logprobs

    server = _server(cpu_assets)
    prompt = [3, 7, 5, 9, 20, 4, 5, 3, 8, 5]
    params = dict(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True, seed=0)
    out = asyncio.run(server.generate(prompt_ids=prompt, sampling_params=dict(params), request_id="r0"))
    assert isinstance(out, TokenOutput) and 1 <= len(out.token_ids) <= 6
    assert isinstance(out.extra_fields["global_steps"], int) and out.stop_reason == "completed"
    tf = teacher_forced_logprobs(server.model, prompt, out.token_ids)
    assert torch.allclose(torch.tensor(out.log_probs), tf, atol=1e-4)
    no_lp = asyncio.run(
        server.generate(prompt_ids=prompt, sampling_params={**params, "logprobs": False}, request_id="r1")
    )
    assert no_lp.log_probs is None
    asyncio.run(server.set_global_steps(7))
    again = asyncio.run(server.generate(prompt_ids=prompt, sampling_params=dict(params, max_tokens=2), request_id="r2"))
    assert again.extra_fields["global_steps"] == 7 and len(again.token_ids) <= 2
    for method in hf_rollout_server_methods():
        assert callable(getattr(server, method))


def hf_rollout_server_methods():
    from verl_stable.backends.hf.rollout import server_methods_called

    return sorted(server_methods_called())


def test_the_nan_logprob_fault_hits_only_the_listed_weight_versions(cpu_assets):
    server = _server(cpu_assets, engine_kwargs={"hf": {"nan_logprobs_at_versions": [1, 3]}})
    prompt = [3, 7, 5, 9, 20, 4, 5, 3, 8, 5]
    params = dict(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True, seed=0)
    served = {}
    for version in range(4):
        asyncio.run(server.set_global_steps(version))
        served[version] = asyncio.run(server.generate(prompt_ids=prompt, sampling_params=dict(params), request_id="r"))
    for version, out in served.items():
        nan = torch.tensor(out.log_probs).isnan()
        assert bool(nan.all()) if version in (1, 3) else not bool(nan.any()), (version, out.log_probs)
    # the tokens are sampled as usual: the same seed gives the same tokens at every version
    assert len({tuple(out.token_ids) for out in served.values()}) == 1


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([-1], r"nan_logprobs_at_versions\.0 must be >= 0"),
        ("1", r"nan_logprobs_at_versions must be a list, got str"),
        ([1.5], r"nan_logprobs_at_versions\.0 must be an int, got float"),
    ],
)
def test_the_nan_logprob_fault_refuses_what_is_not_a_list_of_versions(value, match):
    with pytest.raises(ValueError, match=match):
        hf_rollout.resolve_options({"engine_kwargs": {"hf": {"nan_logprobs_at_versions": value}}})


def test_server_bad_input(cpu_assets):
    server = _server(cpu_assets)
    with pytest.raises(ValueError, match="leaves no room"):
        asyncio.run(server.generate(prompt_ids=[3] * 22, sampling_params={}, request_id="x"))
    with pytest.raises(ValueError, match="unsupported sampling parameters \\['min_p'\\]"):
        asyncio.run(server.generate(prompt_ids=[3, 4], sampling_params={"min_p": 0.1}, request_id="y"))
    with pytest.raises(NotImplementedError, match="multimodal"):
        asyncio.run(server.generate(prompt_ids=[3, 4], sampling_params={}, request_id="z", image_data=[1]))
    with pytest.raises(ValueError, match="unknown rollout precision"):
        _server(cpu_assets, engine_kwargs={"hf": {"precision": "fp4"}})


def test_server_weight_update_round_trip(cpu_assets):
    server = _server(cpu_assets)
    new = {k: v + 0.01 for k, v in server.model.state_dict().items()}

    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    stream = list(unfuse_moe_params(new.items(), "qwen3_moe"))
    asyncio.run(server.load_weight_bucket(stream[:5]))
    asyncio.run(server.load_weight_bucket(stream[5:]))
    report = asyncio.run(server.finish_weight_update(global_steps=3))
    assert report["tensors"] == len(new) and server.global_steps == 3
    got = asyncio.run(server.get_weights())
    for k, v in new.items():
        assert torch.equal(got[k], v), k
