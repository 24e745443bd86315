"""``tests/gpu/device_check.sh`` on the CPU, so the device checks cannot rot between the rare runs on a lent GPU.

The whole entry point runs once (``--device cpu --quick``: the toy MoE and one Qwen3-30B-A3B-width layer at a few
tokens, the losses, the overhead rounds) with a wheel folder that holds one wheel the interpreter lacks (installed) and
one named after a distribution it has (skipped: it would break the run if installed). Two further tests run the
replay checks in process on the toy model with the replay broken, to show that they fail when replay is wrong.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "gpu" / "device_check.sh"
CHECKS = REPO / "tests" / "gpu" / "device_checks.py"
LINE = re.compile(r"^\[(PASS|FAIL|INFO)\] (.*?)(?: - (.*))?$")


def _wheel(folder: Path, name: str, body: str) -> Path:
    """A minimal pure-Python wheel of distribution ``name`` whose package ``name`` holds ``body``."""
    info = f"{name}-0.0.1.dist-info"
    files = {
        f"{name}/__init__.py": body,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.1\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    path = folder / f"{name}-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in files.items():
            archive.writestr(member, text)
    return path


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One run of ``device_check.sh --device cpu --quick``: (return code, parsed check lines, output, seconds)."""
    tmp = tmp_path_factory.mktemp("device_check")
    wheels = tmp / "wheels"
    wheels.mkdir()
    _wheel(wheels, "devcheck_probe", "VALUE = 7\n")
    _wheel(wheels, "numpy", "raise ImportError('the carried numpy wheel was installed over the real numpy')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script must find the project itself
    env.update(PYTHON=sys.executable, DEVICE_WHEELS=str(wheels), DEVICE_SITE=str(tmp / "site"))
    start = time.perf_counter()
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--device", "cpu", "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp,
    )
    seconds = time.perf_counter() - start
    lines = [m.groups() for m in map(LINE.match, proc.stdout.splitlines()) if m]
    return proc.returncode, lines, proc.stdout + proc.stderr, seconds, tmp / "site"


def test_every_check_passes_on_the_cpu(cpu_run):
    code, lines, output, seconds, _ = cpu_run
    assert code == 0, output[-4000:]
    failed = [name for status, name, _ in lines if status == "FAIL"]
    assert not failed, output[-4000:]
    names = [name for status, name, _ in lines if status == "PASS"]
    for label in ("toy", "30B-A3B layer"):
        for needle in (
            "R3 native routes: experts used == replayed",
            "R3 native routes: output bit-identical to no replay",
            "R3 random routes: experts used == replayed (independent hooks)",
            "R3 random routes change the output",
            "R3 random routes: every router gets a finite, non-zero gradient",
        ):
            assert any(n.startswith(f"{label}: {needle}") for n in names), (label, needle, names)
    for loss in ("minirl", "vespo"):
        assert sum(n.startswith(f"losses: {loss} on cpu") for n in names) == 2, names  # fp32 and bf16 log-probs
    assert any(n.startswith("losses: group-mean advantage") for n in names)
    assert "overhead: every R3 step replayed exactly (disagreement 0)" in names
    # the timing is printed, not judged, on the CPU
    info = {name: detail for status, name, detail in lines if status == "INFO"}
    ratio = re.search(r"median R3 / off ([0-9.]+)", info["overhead: R3 step vs no replay (timing judged on cuda only)"])
    assert ratio and float(ratio.group(1)) > 0
    assert re.search(r"(\d+)/\1 checks passed", output), output[-500:]
    print(f"device_check.sh --device cpu --quick: {len(names)} checks passed in {seconds:.1f} s")


def test_carried_wheels_install_only_what_is_missing(cpu_run):
    _, _, output, _, site = cpu_run
    assert "installing 1 carried wheel(s)" in output and "devcheck_probe-0.0.1-py3-none-any.whl" in output
    assert (site / "devcheck_probe" / "__init__.py").read_text() == "VALUE = 7\n"
    assert not (site / "numpy").exists()  # numpy is importable here: its wheel is skipped


def test_without_cuda_the_cuda_run_fails_rather_than_passing_silently():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    proc = subprocess.run([sys.executable, str(CHECKS)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "[FAIL] no CUDA device" in proc.stdout


@pytest.fixture()
def checks():
    spec = importlib.util.spec_from_file_location("device_checks", CHECKS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    threads = torch.get_num_threads()
    try:
        spec.loader.exec_module(module)
        torch.set_num_threads(1)  # as the script runs on the CPU
        yield module
    finally:
        torch.set_num_threads(threads)
        sys.modules.pop(spec.name, None)


def _toy_results(checks) -> dict[str, str]:
    model = checks.build(checks.toy_config(), "cpu", causal_lm=True)
    packed = checks.pack((7, 12, 5, 9), 3, "cpu", vocab=model.config.vocab_size, hidden=None)
    checks.replay_checks("toy", model, packed)
    return {name: status for status, name, _ in checks.RESULTS}


def test_a_replay_that_keeps_the_routers_choice_fails_the_checks(checks, monkeypatch):
    from verl_stable.routing.replay import RoutingReplayer

    monkeypatch.setattr(RoutingReplayer, "_route", lambda self, site, live, out, own, first_call: None)
    results = _toy_results(checks)
    assert results["toy: R3 random routes: experts used == replayed (independent hooks)"] == "FAIL"
    assert results["toy: R3 random routes: the project's used-experts count agrees (disagreement 0)"] == "FAIL"
    assert results["toy: R3 native routes: output bit-identical to no replay"] == "PASS"  # nothing was replaced


def test_gate_weights_off_by_the_renormalisation_fail_the_checks(checks, monkeypatch):
    from dataclasses import replace

    from verl_stable.routing import families

    def unnormalised(site, logits, ids):
        return torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, ids).to(logits.dtype)

    monkeypatch.setitem(
        families.FAMILIES, "qwen3_moe", replace(families.FAMILIES["qwen3_moe"], gate_weights=unnormalised)
    )
    results = _toy_results(checks)
    assert results["toy: R3 native routes: output bit-identical to no replay"] == "FAIL"
    assert (
        results["toy: R3 random routes: gate weights == softmax(router logits)[replayed ids], renormalised"] == "FAIL"
    )
    assert results["toy: R3 random routes: experts used == replayed (independent hooks)"] == "PASS"
