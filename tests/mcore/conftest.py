"""Fixtures for tests of megatron-core on CPU: the runtime, and a world of one gloo rank in the test process."""

from __future__ import annotations

import warnings

import pytest

from verl_stable.cpu.megatron.runtime import megatron_cpu_runtime


@pytest.fixture
def megatron_runtime():
    """The Megatron CPU runtime for the test (restored afterwards); yields what it installed."""
    with warnings.catch_warnings():
        # megatron-core announces at import that it falls back from Transformer Engine / apex to torch
        warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
        with megatron_cpu_runtime() as installed:
            yield installed


@pytest.fixture
def world_of_one(tmp_path, megatron_runtime):
    """torch.distributed (gloo) and megatron's parallel state with one rank, inside the runtime; torn down after."""
    from testkit.megatron import parallel_state

    with parallel_state(0, 1, str(tmp_path / "store")):
        yield
