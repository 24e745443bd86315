"""KV-cached sampling: processed log-probs, equivalence to a teacher-forced forward, stop/length, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from verl_stable.backends.hf.generation import (
    KVCachedSampler,
    SamplingSpec,
    process_logits,
    teacher_forced_logprobs,
)
from verl_stable.backends.hf.precision import precision_copy


def test_process_logits_by_hand():
    z = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    # top-k 2: only the two largest survive, renormalised.
    p = torch.softmax(process_logits(z, SamplingSpec(max_tokens=1, top_k=2)), -1)
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    # top-p 0.7: 0.5 < 0.7, 0.5 + 0.3 reaches it -> keep two.
    p = torch.softmax(process_logits(z, SamplingSpec(max_tokens=1, top_p=0.7)), -1)
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    # top-p 0.5 keeps exactly the first (its mass reaches p); a tiny p still keeps one token.
    assert torch.isfinite(process_logits(z, SamplingSpec(max_tokens=1, top_p=0.5))).sum() == 1
    assert torch.isfinite(process_logits(z, SamplingSpec(max_tokens=1, top_p=1e-6))).sum() == 1
    # temperature 2 halves the logits.
    assert torch.allclose(process_logits(z, SamplingSpec(max_tokens=1, temperature=2.0)), z / 2)
    # repetition penalty: positive logits divided, negative multiplied, only for seen ids.
    z2 = torch.tensor([2.0, -1.0, 3.0])
    out = process_logits(z2, SamplingSpec(max_tokens=1, repetition_penalty=2.0), torch.tensor([0, 1]))
    assert torch.allclose(out, torch.tensor([1.0, -2.0, 3.0]))


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(max_tokens=1, top_p=0.0), dict(max_tokens=1, temperature=-1)])
def test_sampling_spec_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        SamplingSpec(**bad)


@pytest.mark.parametrize("prec", ["fp32", "bf16", "fp8"])
def test_logprobs_equal_teacher_forced_forward_of_same_precision(tiny_moe, prec):
    model = precision_copy(tiny_moe, prec)
    sampler = KVCachedSampler(model, max_model_len=40)
    prompt = [3, 7, 11, 2, 9]
    gen = sampler.generate(prompt, SamplingSpec(max_tokens=12, seed=1))
    assert len(gen.token_ids) == 12 and gen.finish_reason == "length"
    tf = teacher_forced_logprobs(model, prompt, gen.token_ids)
    tol = 1e-4 if prec == "fp32" else 0.1  # bf16 KV-cached vs full attention differ by rounding only
    assert torch.allclose(torch.tensor(gen.log_probs), tf, atol=tol), (gen.log_probs, tf.tolist())
    if prec == "fp32":
        assert (torch.tensor(gen.log_probs) - tf).abs().max() < 1e-4


def test_processed_logprobs_with_top_k_are_renormalised(tiny_moe):
    sampler = KVCachedSampler(tiny_moe, max_model_len=40)
    spec = SamplingSpec(max_tokens=6, top_k=3, temperature=0.7, seed=0)
    prompt = [1, 2, 3]
    gen = sampler.generate(prompt, spec)
    ids = torch.tensor([prompt + gen.token_ids])
    logits = tiny_moe(input_ids=ids).logits[0, len(prompt) - 1 : -1].float().detach()
    for t, (tok, lp) in enumerate(zip(gen.token_ids, gen.log_probs, strict=True)):
        z = logits[t] / 0.7
        top = torch.topk(z, 3)
        assert tok in top.indices.tolist()  # never samples outside the top-k
        assert math.isclose(lp, float(torch.log_softmax(top.values, -1)[top.indices.tolist().index(tok)]), abs_tol=1e-4)


def test_seeded_sampling_is_reproducible_and_greedy_is_argmax(tiny_moe):
    sampler = KVCachedSampler(tiny_moe, max_model_len=40)
    a = sampler.generate([5, 6], SamplingSpec(max_tokens=8, seed=3))
    b = sampler.generate([5, 6], SamplingSpec(max_tokens=8, seed=3))
    assert a.token_ids == b.token_ids
    g = sampler.generate([5, 6], SamplingSpec(max_tokens=5, temperature=0.0))
    ids = [5, 6]
    for tok in g.token_ids:
        assert tok == int(tiny_moe(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(tok)


def test_stop_tokens_eos_and_max_model_len(tiny_moe):
    sampler = KVCachedSampler(tiny_moe, max_model_len=10, eos_token_ids=[])
    g = sampler.generate([5, 6], SamplingSpec(max_tokens=8, temperature=0.0))
    first = g.token_ids[0]
    stopped = sampler.generate([5, 6], SamplingSpec(max_tokens=8, temperature=0.0, stop_token_ids=(first,)))
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    eos_sampler = KVCachedSampler(tiny_moe, max_model_len=10, eos_token_ids=[first])
    assert eos_sampler.generate([5, 6], SamplingSpec(max_tokens=8, temperature=0.0)).token_ids == [first]
    ignored = eos_sampler.generate([5, 6], SamplingSpec(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert len(ignored.token_ids) == 8  # clamped by max_model_len - prompt = 8
    long = sampler.generate([1] * 7, SamplingSpec(max_tokens=50, temperature=0.0))
    assert len(long.token_ids) == 3


def test_bad_prompts_are_clear_errors(tiny_moe):
    sampler = KVCachedSampler(tiny_moe, max_model_len=8)
    with pytest.raises(ValueError, match="prompt length 8 leaves no room"):
        sampler.generate(list(range(8)), SamplingSpec(max_tokens=1))
    with pytest.raises(ValueError, match="empty prompt"):
        sampler.generate([], SamplingSpec(max_tokens=1))
    with pytest.raises(ValueError, match="out of range"):
        sampler.generate([1, 999], SamplingSpec(max_tokens=1))


def test_batch_equals_one_request_at_a_time(tiny_moe):
    """Rows of a batch sample what each request alone samples: same tokens, log-probs, finish, per-row specs."""
    sampler = KVCachedSampler(tiny_moe, max_model_len=32, eos_token_ids=[0])
    prompts = [[5, 6, 7], [9, 2, 4], [5, 6, 7], [1, 1, 3]]
    specs = [
        SamplingSpec(max_tokens=6, seed=1),
        SamplingSpec(max_tokens=2, seed=2, top_k=5),
        SamplingSpec(max_tokens=6, seed=3, ignore_eos=True, temperature=0.7),
        SamplingSpec(max_tokens=6, temperature=0.0, repetition_penalty=1.3),
    ]
    batch = sampler.generate_batch(prompts, specs)
    for prompt, spec, got in zip(prompts, specs, batch, strict=True):
        alone = sampler.generate(prompt, spec)
        assert got.token_ids == alone.token_ids and got.finish_reason == alone.finish_reason
        assert got.log_probs == pytest.approx(alone.log_probs, abs=1e-5)
        tf = teacher_forced_logprobs(tiny_moe, prompt, got.token_ids)
        if spec.temperature == 1.0 and spec.top_k <= 0:
            assert torch.allclose(torch.tensor(got.log_probs), tf, atol=1e-4)
    assert len(batch[1].token_ids) <= 2
    assert len({len(g.token_ids) for g in batch}) > 1  # rows ended at different steps


def test_batch_routing_rows_select_each_requests_own_rows(tiny_moe):
    from verl_stable.backends.hf.routing import routing_exporter
    from verl_stable.routing import capture

    exporter = routing_exporter(tiny_moe)
    assert exporter.batched
    sampler = KVCachedSampler(tiny_moe, max_model_len=32)
    prompts = [[5, 6, 7, 8], [9, 2, 4, 4], [3, 3, 3, 3]]
    specs = [SamplingSpec(max_tokens=n, seed=n, ignore_eos=True) for n in (5, 1, 3)]
    batch = sampler.generate_batch(prompts, specs, routing_capture=exporter.capture)
    assert all(g.routing is batch[0].routing for g in batch)
    # a forward of [B, T] routes B*T rows in (b, t) order: prefill 12 rows, then 3 rows per decode step
    for b, g in enumerate(batch):
        rows = g.extra["routing_rows"]
        assert rows[:4] == list(range(4 * b, 4 * b + 4))
        assert rows[4:] == [12 + 3 * s + b for s in range(len(g.token_ids) - 1)]  # the last token is never fed
    # each request's rows are the routing of a teacher-forced forward of that request alone
    for prompt, g in zip(prompts, batch, strict=True):
        with torch.no_grad(), capture(tiny_moe) as rec:
            tiny_moe(input_ids=torch.tensor([prompt + g.token_ids[:-1]]))
        alone = rec.trace.to_tensor().long()
        assert torch.equal(g.routing.ids()[torch.tensor(g.extra["routing_rows"])], alone)
        assert (exporter.to_array(g.routing, g.extra["routing_rows"]) == exporter.to_array(rec)).all()


def test_batch_bad_input(tiny_moe):
    sampler = KVCachedSampler(tiny_moe, max_model_len=8)
    with pytest.raises(ValueError, match="prompts of one length"):
        sampler.generate_batch([[1, 2], [1, 2, 3]], [SamplingSpec(max_tokens=1)] * 2)
    with pytest.raises(ValueError, match="one spec per prompt"):
        sampler.generate_batch([[1, 2]], [SamplingSpec(max_tokens=1)] * 2)
    with pytest.raises(ValueError, match="one spec per prompt"):
        sampler.generate_batch([], [])
    with pytest.raises(ValueError, match="out of range"):
        sampler.generate_batch([[1, 2], [1, 999]], [SamplingSpec(max_tokens=1)] * 2)
