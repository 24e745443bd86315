"""Routing export from the ``hf`` backend in vLLM 0.24's layout, and its replay reproducing the logits."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch

from verl_stable.backends.hf import routing as hf_routing
from verl_stable.backends.hf import server as hf_server
from verl_stable.routing import RoutingTrace, UnsupportedModelError, capture, replay

PROMPT = [3, 7, 5, 9, 20, 4, 5, 3, 8, 5]
PARAMS = dict(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True, seed=0)


def _server(path, precision="fp32", **hf):
    from verl.workers.config import HFModelConfig, RolloutConfig

    cfg = RolloutConfig(
        name="hf",
        prompt_length=16,
        response_length=6,
        tensor_model_parallel_size=1,
        enable_rollout_routing_replay=True,
        engine_kwargs={"hf": {"precision": precision, **hf}},
    )
    return hf_server.HFRolloutServer(cfg, HFModelConfig(path=str(path)))


@pytest.mark.parametrize("precision", ["fp32", "fp8"])
def test_routed_experts_layout_and_replay_reproduce_logits(cpu_assets, precision):
    server = _server(cpu_assets.model_dir, precision)
    model, cfg = server.model, server.model.config
    out = asyncio.run(server.generate(prompt_ids=PROMPT, sampling_params=dict(PARAMS, ignore_eos=True), request_id="r"))
    arr = out.routed_experts
    n = len(out.token_ids)
    # vLLM 0.24: [prompt_len + n_output - 1, num_hidden_layers, top_k], uint8 for <= 256 experts.
    assert arr.shape == (len(PROMPT) + n - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    assert arr.dtype.name == "uint8"
    seq = torch.tensor([PROMPT + out.token_ids[:-1]])
    with torch.no_grad(), capture(model) as rec:
        own_logits = model(input_ids=seq).logits
    # The exported rows are the routing a teacher-forced forward of the same model takes.
    assert torch.equal(torch.from_numpy(arr).long(), rec.trace.to_tensor().long())
    trace = RoutingTrace.from_tensor(torch.from_numpy(arr).long(), num_experts=cfg.num_experts)
    with torch.no_grad(), replay(model, trace) as rp:
        replayed_logits = model(input_ids=seq).logits
    assert rp.stats.replayed_rows == arr.shape[0] * cfg.num_hidden_layers and rp.stats.missing_rows == 0
    assert torch.equal(replayed_logits, own_logits)


def test_unroutable_model_family_is_a_clear_error(cpu_assets, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    for f in cpu_assets.model_dir.iterdir():
        if "token" in f.name or f.name == "chat_template.jinja":
            shutil.copy(f, tmp_path / f.name)
    dense = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    LlamaForCausalLM(dense).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="does not support model_type 'llama'"):
        _server(tmp_path)


def test_lean_generation_capture_equals_general_capture(tiny_moe):
    from verl_stable.backends.hf.generation import KVCachedSampler, SamplingSpec

    capture_factory, to_array, _ = hf_routing.routing_exporter(tiny_moe)
    sampler = KVCachedSampler(tiny_moe, max_model_len=32)
    spec = SamplingSpec(max_tokens=8, ignore_eos=True, seed=3)
    prompt = [3, 7, 5, 9, 20]
    lean = sampler.generate(prompt, spec, routing_capture=capture_factory)
    general = sampler.generate(prompt, spec, routing_capture=capture)
    assert isinstance(lean.routing, hf_routing.RouterIdsRecorder)
    assert lean.token_ids == general.token_ids
    expected = general.routing.trace.to_tensor()
    assert expected.shape[0] == len(prompt) + len(lean.token_ids) - 1
    assert torch.equal(lean.routing.ids(), expected.long())
    layout = general.routing.layout
    want = hf_routing.routed_experts_array(expected, list(layout.moe_layers), layout.num_hidden_layers, 8)
    assert (to_array(lean.routing) == want).all()
    # hooks are gone after the generation
    assert all(not site.module._forward_hooks for site in lean.routing.routing.sites)


def test_lean_capture_reports_a_bypassed_router(tiny_moe):
    capture_factory, _, _ = hf_routing.routing_exporter(tiny_moe)
    with torch.no_grad(), capture_factory(tiny_moe) as rec:
        tiny_moe(input_ids=torch.tensor([[3, 4, 5]]))
    rec.rows[1].pop()  # as if layer 1's router had not run in the last forward
    with pytest.raises(UnsupportedModelError, match=r"decoder layers \[1\] did not run"):
        rec.ids()


def test_concurrent_requests_are_batched_and_equal_one_at_a_time(cpu_assets):
    """The server's cross-request batching changes nothing a request gets back: tokens, log-probs, routing."""
    batched, serial = _server(cpu_assets.model_dir), _server(cpu_assets.model_dir, max_batch_size=1)
    prompts = [PROMPT, PROMPT, PROMPT[::-1], PROMPT[:7], PROMPT[:7], PROMPT]

    async def run(server):
        calls = [
            server.generate(prompt_ids=p, sampling_params=dict(PARAMS, seed=i), request_id=f"r{i}")
            for i, p in enumerate(prompts)
        ]
        return await asyncio.gather(*calls)

    got, want = asyncio.run(run(batched)), asyncio.run(run(serial))
    assert (batched.batcher.stats.requests, batched.batcher.stats.batches) == (6, 2)  # lengths 10 and 7
    assert serial.batcher.stats.batches == 6
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert g.log_probs == pytest.approx(w.log_probs, abs=1e-5)
        assert g.routed_experts.dtype == w.routed_experts.dtype and (g.routed_experts == w.routed_experts).all()
