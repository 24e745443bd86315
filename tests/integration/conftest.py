"""Fixtures of the integration tests: a one-rank gloo WORLD on CPU, alone or with verl's CPU platform.

Both are module-scoped: a test file asks for one with ``pytestmark = pytest.mark.usefixtures(...)`` and has it for all
its tests. Each leaves a process group it finds (does not create or destroy one) and restores what it changed.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest


@contextmanager
def _one_rank_gloo(tmp_path_factory):
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A one-rank gloo WORLD (verl's checkpoint manager reads the rank and world size of the default group)."""
    with _one_rank_gloo(tmp_path_factory):
        yield


@pytest.fixture(scope="module")
def cpu_runtime(tmp_path_factory):
    """verl's device helpers on the CPU platform and a one-rank gloo WORLD, restored afterwards."""
    from verl.plugin.platform import platform_manager

    from verl_stable.cpu.platform import platform_class

    previous = platform_manager._current_platform
    platform_manager._current_platform = platform_class()()
    try:
        with _one_rank_gloo(tmp_path_factory):
            yield
    finally:
        platform_manager._current_platform = previous
