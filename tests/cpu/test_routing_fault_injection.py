"""Fault injection of the ``hf`` backend: every k-th request's routing is malformed, and the boundary sees it so."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl_stable.backends.hf import options as hf_options
from verl_stable.backends.hf import routing as hf_routing
from verl_stable.routing.codecs import BoundaryStats, ExpertIdRangeError
from verl_stable.routing.families import bind_model
from verl_stable.transport.boundary import compact_token_routing
from verl_stable.transport.options import RolloutRoutingOptions


def test_option_defaults_off_and_is_checked():
    assert hf_options.resolve_options({}).corrupt_routing_every == 0
    opts = hf_options.resolve_options({"engine_kwargs": {"hf": {"corrupt_routing_every": 3}}})
    assert opts.corrupt_routing_every == 3
    for bad in (-1, "2", 1.5, True):
        with pytest.raises(ValueError, match=r"engine_kwargs\.hf\.corrupt_routing_every must be (>= 0|an int), got"):
            hf_options.resolve_options({"engine_kwargs": {"hf": {"corrupt_routing_every": bad}}})


def _recording(model: torch.nn.Module, exporter: hf_routing.RoutingExporter, prompt: list[int]):
    with torch.no_grad(), exporter.capture(model) as recorder:
        model(input_ids=torch.tensor([prompt]))
    return recorder


def test_every_kth_request_is_corrupted_and_the_others_are_faithful(tiny_moe):
    faithful = hf_routing.routing_exporter(tiny_moe)
    faulty = hf_routing.routing_exporter(tiny_moe, corrupt_every=2)
    layout = bind_model(tiny_moe).layout
    prompt = [3, 7, 5, 9, 20]
    recorder = _recording(tiny_moe, faithful, prompt)
    want = faithful.to_array(recorder)
    got = [faulty.to_array(recorder) for _ in range(4)]
    for request, array in enumerate(got, start=1):
        assert array.shape == want.shape
        if request % 2:
            assert array.dtype == np.uint8 and (array == want).all()
        else:
            moe = array[:, list(layout.moe_layers)]
            assert array.dtype == np.uint16 and (moe == layout.num_experts).all()
    # the faithful exporter never counts: its payloads stay exact
    assert all((faithful.to_array(recorder) == want).all() for _ in range(3))
    with pytest.raises(ValueError, match="corrupt_every must be an int >= 0"):
        hf_routing.routing_exporter(tiny_moe, corrupt_every=-2)


def test_the_boundary_refuses_the_corrupted_payload_or_skips_the_sample(tiny_moe):
    exporter = hf_routing.routing_exporter(tiny_moe)
    layout = bind_model(tiny_moe).layout
    prompt = [3, 7, 5, 9, 20]
    good = exporter.to_array(_recording(tiny_moe, exporter, prompt))  # prompt_len 3 + 3 generated - 1 rows
    bad = hf_routing.corrupt_routing_payload(good, list(layout.moe_layers), layout.num_experts)
    assert (good == exporter.to_array(_recording(tiny_moe, exporter, prompt))).all()  # the input is not modified
    kwargs = dict(prompt_len=3, response_mask=[1, 1, 1], layout=layout)
    rows = compact_token_routing(good, **kwargs)
    assert rows is not None and rows.ids.shape[0] == 5
    with pytest.raises(ExpertIdRangeError):
        compact_token_routing(bad, **kwargs)
    stats = BoundaryStats()
    skip = RolloutRoutingOptions(on_invalid="skip_sample")
    assert compact_token_routing(bad, options=skip, stats=stats, **kwargs) is None
    assert stats.skipped_samples == 1 and stats.errors == {"ExpertIdRangeError": 1}


def test_the_server_corrupts_every_kth_request_from_its_engine_kwargs(cpu_assets):
    import asyncio

    from verl.workers.config import HFModelConfig, RolloutConfig

    from verl_stable.backends.hf import server as hf_server

    cfg = RolloutConfig(
        name="hf",
        prompt_length=16,
        response_length=3,
        tensor_model_parallel_size=1,
        enable_rollout_routing_replay=True,
        engine_kwargs={"hf": {"precision": "fp32", "corrupt_routing_every": 2}},
    )
    server = hf_server.HFRolloutServer(cfg, HFModelConfig(path=str(cpu_assets.model_dir)))
    layout = bind_model(server.model).layout
    params = dict(temperature=1.0, top_p=1.0, top_k=-1, ignore_eos=True, seed=0)
    outs = [
        asyncio.run(server.generate(prompt_ids=[3, 7, 5, 9], sampling_params=params, request_id=f"r{i}"))
        for i in range(4)
    ]
    moe = [out.routed_experts[:, list(layout.moe_layers)] for out in outs]
    assert [bool((m == layout.num_experts).all()) for m in moe] == [False, True, False, True]
    assert all(int(m.max()) < layout.num_experts for m in moe[::2])
