"""``tests/gpu/check_probe.py`` without a GPU: which settings it probes, and that it skips (exit 0) where there is no
CUDA device. Its probes themselves run on a GPU node only."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "gpu" / "check_probe.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("check_probe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_settings_probe_fp32_only_on_the_toy_and_fp8_only_where_the_gpu_has_it(script):
    assert script.settings(toy=True, fp8=True) == [("fp32", "fp32"), ("bf16", "bf16"), ("fp8", "bf16")]
    assert script.settings(toy=False, fp8=False) == [("bf16", "bf16")]


def test_it_skips_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the script would run its probes")
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "SKIP: no CUDA device"
