"""The CPU platform: registration, explicit-only selection, device module, backend-string fix, engines."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from verl_stable.cpu import engines, platform


def test_cpu_requested_only_when_asked():
    assert platform.cpu_requested({"VERL_PLATFORM": "cpu"}, ["main_ppo"])
    assert platform.cpu_requested({}, ["main_ppo", "data.x=1", "trainer.device=cpu"])
    assert not platform.cpu_requested({}, ["main_ppo", "trainer.device=cuda"])
    assert not platform.cpu_requested({}, ["trainer.device=cpu"])  # argv[0] is the program, not an override
    # An explicit VERL_PLATFORM wins over the override.
    assert not platform.cpu_requested({"VERL_PLATFORM": "nvidia"}, ["main_ppo", "trainer.device=cpu"])


def test_registered_platform_is_never_auto_detected(monkeypatch):
    from verl.plugin.platform import PlatformRegistry

    platform.register()
    cls = PlatformRegistry.get("cpu")
    assert cls is platform.platform_class()
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    assert cls().is_platform_available(use_smi_check=True) is False
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    assert cls().is_platform_available(use_smi_check=True) is True


def test_platform_answers_what_verl_asks():
    p = platform.platform_class()()
    assert p.device_name == "cpu" and p.current_device() == "cpu"
    assert p.communication_backend_name() == "gloo"
    assert p.ray_resource_name() == "GPU"
    # verl moves modules with .to(get_device_id()): the id must be a device torch accepts on CPU.
    assert torch.nn.Linear(2, 2).to(p.current_device()).weight.device.type == "cpu"
    mod = p.device_module
    free, total = mod.mem_get_info()
    assert 0 < free <= total
    state = mod.get_rng_state()
    a = torch.rand(3)
    mod.set_rng_state(state)
    assert torch.equal(a, torch.rand(3))
    mod.empty_cache(), mod.reset_peak_memory_stats(), mod.synchronize()
    assert mod.memory_allocated() >= 0 and mod.current_stream() is not None


def test_device_module_unknown_call_names_itself():
    with pytest.raises(AttributeError, match="get_torch_device\\(\\).no_such_call"):
        platform.CPU_DEVICE_MODULE.no_such_call  # noqa: B018


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("cpu:gloo,cpu:gloo", "gloo"),
        ("gloo", "gloo"),
        ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"),
        (None, None),
    ],
)
def test_normalize_backend(spec, expected):
    assert platform.normalize_backend(spec) == expected


def test_normalize_backend_conflict_raises():
    with pytest.raises(ValueError, match="two backends"):
        platform.normalize_backend("cpu:gloo,cpu:mpi")


def test_gloo_fix_lets_verls_backend_string_initialise(tmp_path):
    # Run in a subprocess: a process group is process-global state.
    code = """
import os, socket, torch
with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
from verl_stable.cpu.platform import gloo_backend_fix
try:
    torch.distributed.init_process_group(backend="cpu:gloo,cpu:gloo", rank=0, world_size=1)
    raise SystemExit("torch accepted a duplicate backend string; the fix may be obsolete")
except ValueError:
    pass
with gloo_backend_fix():
    torch.distributed.init_process_group(backend="cpu:gloo,cpu:gloo", rank=0, world_size=1)
assert torch.distributed.get_backend() == "gloo"
assert not hasattr(torch.distributed.init_process_group, "__verl_stable_wrapped__")
print("OK")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "OK" in out.stdout, out.stderr[-2000:]


def test_engines_register_for_cpu_idempotently():
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    try:
        first = engines.register(force=True)
        second = engines.register(force=True)
    finally:
        engines.uninstall()
    assert first == second
    assert EngineRegistry._engines["language_model"]["fsdp2"]["cpu"] is FSDPEngineWithLMHead


def test_engines_register_installs_unpinned_offload_and_uninstalls():
    from torch.distributed.fsdp import CPUOffloadPolicy
    from verl.workers.engine.fsdp import transformer_impl

    engines.uninstall()
    assert transformer_impl.CPUOffloadPolicy is CPUOffloadPolicy
    try:
        assert "fsdp2_offload:unpinned" in engines.register(force=True)
        engines.register(force=True)  # idempotent: one installation
        policy = transformer_impl.CPUOffloadPolicy(pin_memory=True)  # what verl builds for the reference engine
        assert isinstance(policy, CPUOffloadPolicy) and policy.pin_memory is False
    finally:
        engines.uninstall()
    assert transformer_impl.CPUOffloadPolicy is CPUOffloadPolicy


def test_reference_engine_offload_policy_works_on_cpu_only_unpinned():
    # verl's forward-only (reference) FSDP2 engine shards with CPUOffloadPolicy(pin_memory=True): on a host without
    # CUDA that fails in fully_shard; the CPU runtime's policy shards and runs. Subprocess: a process group is global.
    code = """
import os, socket, torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.device_mesh import init_device_mesh
from verl_stable.cpu.engines import HostOffloadPolicy
with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)
torch.manual_seed(0)
x = torch.randn(3, 4)
def build():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
expected = build().to(torch.bfloat16)(x.to(torch.bfloat16))
try:
    fully_shard(build(), mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=True), mp_policy=mp)
    print("PINNED_OK")
except RuntimeError as exc:
    print("PINNED_FAILS", exc)
model = build()
fully_shard(model[0], mesh=mesh, offload_policy=HostOffloadPolicy(pin_memory=True), mp_policy=mp)
fully_shard(model, mesh=mesh, offload_policy=HostOffloadPolicy(pin_memory=True), mp_policy=mp)
with torch.no_grad():
    out = model(x)
assert torch.equal(out, expected), (out, expected)
print("UNPINNED_OK")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "UNPINNED_OK" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    if not torch.cuda.is_available():
        assert "PINNED_FAILS" in out.stdout, "pinning worked without CUDA: the fix may be obsolete"
