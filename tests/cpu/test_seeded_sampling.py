"""Seeded sampling in the ``hf`` backend (issue #17): a request's seed alone decides what it samples.

A request that carries ``seed`` is sampled from a ``torch.Generator`` of its own, also as one row of a cross-request
batch, so the tokens do not depend on which requests were batched with it or in which order they arrived. A request
without a seed keeps drawing from torch's global random stream.
"""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest
import torch

from verl_stable.backends.hf.generation import KVCachedSampler, SamplingSpec

PROMPTS = [[5, 6, 7], [9, 2, 4], [5, 6, 7], [1, 1, 3], [3, 3, 3], [7, 8, 9]]  # one length: one batch key
LOGPROB_TOL = 1e-6  # batched matrix products may sum in another order than a batch of one


def _specs(seeds, **kw) -> list[SamplingSpec]:
    return [SamplingSpec(max_tokens=8, seed=s, ignore_eos=True, **kw) for s in seeds]


def _assert_same_samples(got, want) -> None:
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    assert got.log_probs == pytest.approx(want.log_probs, abs=LOGPROB_TOL)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_seeded_request_samples_the_same_alone_or_in_any_batch_in_any_order(tiny_moe, temperature):
    sampler = KVCachedSampler(tiny_moe, max_model_len=32, eos_token_ids=[0])
    specs = _specs(range(100, 106), temperature=temperature)
    alone = [sampler.generate(p, s) for p, s in zip(PROMPTS, specs, strict=True)]
    assert len({tuple(g.token_ids) for g in alone}) > 3  # really sampled: the rows differ
    rng = random.Random(0)
    orders = [list(range(6)), list(range(5, -1, -1))] + [rng.sample(range(6), 6) for _ in range(3)]
    for order in orders:
        batch = sampler.generate_batch([PROMPTS[i] for i in order], [specs[i] for i in order])
        for i, got in zip(order, batch, strict=True):
            _assert_same_samples(got, alone[i])
    for size in (2, 3):  # other batch compositions: the request with different company
        for group in itertools.islice(itertools.combinations(range(6), size), 6):
            batch = sampler.generate_batch([PROMPTS[i] for i in group], [specs[i] for i in group])
            for i, got in zip(group, batch, strict=True):
                _assert_same_samples(got, alone[i])


def test_different_seeds_sample_differently_and_the_same_seed_repeats(tiny_moe):
    sampler = KVCachedSampler(tiny_moe, max_model_len=32, eos_token_ids=[0])
    prompt = [5, 6, 7]
    samples = [tuple(sampler.generate(prompt, s).token_ids) for s in _specs(range(8))]
    assert len(set(samples)) >= 6  # 8 tokens over 48 ids: distinct seeds give distinct samples
    assert [tuple(sampler.generate(prompt, s).token_ids) for s in _specs(range(8))] == samples
    # one prompt eight times in one batch, eight seeds: eight samples, each its seed's
    batch = sampler.generate_batch([prompt] * 8, _specs(range(8)))
    assert [tuple(g.token_ids) for g in batch] == samples


def test_seeded_requests_leave_the_global_stream_alone_unseeded_ones_use_it(tiny_moe):
    sampler = KVCachedSampler(tiny_moe, max_model_len=32, eos_token_ids=[0])
    torch.manual_seed(123)
    state = torch.get_rng_state()
    sampler.generate_batch(PROMPTS[:3], _specs((1, 2, 3)))
    assert torch.equal(torch.get_rng_state(), state)
    unseeded = SamplingSpec(max_tokens=8, ignore_eos=True)
    first = sampler.generate(PROMPTS[0], unseeded).token_ids
    assert not torch.equal(torch.get_rng_state(), state)  # today's behaviour: the global stream, in call order
    torch.set_rng_state(state)
    assert sampler.generate(PROMPTS[0], unseeded).token_ids == first


def _server(cpu_assets, max_batch_size: int):
    from verl.workers.config import HFModelConfig, RolloutConfig

    from verl_stable.backends.hf import rollout as hf_rollout

    cfg = RolloutConfig(
        name="hf",
        prompt_length=16,
        response_length=6,
        tensor_model_parallel_size=1,
        dtype="float32",
        engine_kwargs={"hf": {"max_batch_size": max_batch_size}},
    )
    return hf_rollout.HFRolloutServer(cfg, HFModelConfig(path=str(cpu_assets.model_dir)))


def test_server_samples_concurrent_seeded_requests_as_it_samples_them_one_at_a_time(cpu_assets):
    """Through the server's cross-request batching: arrival order and batch company change nothing."""
    prompts = [[3, 7, 5, 9, 20, 4], [3, 7, 5, 9, 20, 4], [4, 4, 6, 8, 2, 1], [9, 5, 3, 7, 2, 2], [8, 8, 3, 1, 6, 5]]
    params = dict(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True, ignore_eos=True)
    seeds = [11, 12, 13, 14, 15]

    async def concurrently(server, order):
        calls = [
            server.generate(prompt_ids=prompts[i], sampling_params={**params, "seed": seeds[i]}, request_id=f"r{i}")
            for i in order
        ]
        outs = await asyncio.gather(*calls)
        return {i: out for i, out in zip(order, outs, strict=True)}

    one_at_a_time = _server(cpu_assets, max_batch_size=1)
    reference = asyncio.run(concurrently(one_at_a_time, range(5)))
    assert one_at_a_time.batcher.stats.largest == 1
    assert reference[0].token_ids != reference[1].token_ids  # one prompt, two seeds: two samples
    batched = _server(cpu_assets, max_batch_size=64)
    for order in ([0, 1, 2, 3, 4], [4, 2, 0, 3, 1], [1, 3, 4, 0, 2]):
        got = asyncio.run(concurrently(batched, order))
        for i in range(5):
            assert got[i].token_ids == reference[i].token_ids
            assert got[i].log_probs == pytest.approx(reference[i].log_probs, abs=LOGPROB_TOL)
    assert batched.batcher.stats.largest > 1  # they really were sampled as one batch


def test_server_reads_the_seed_as_an_integer(cpu_assets):
    import numpy as np

    server = _server(cpu_assets, max_batch_size=1)
    assert server._spec(4, {"seed": np.int64(7)}).seed == 7
    assert type(server._spec(4, {"seed": np.int64(7)}).seed) is int
    assert server._spec(4, {}).seed is None and server._spec(4, {"seed": None}).seed is None
