"""The scripts under examples/ run and show what they claim."""

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parents[1] / "examples"


def _run(name: str) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_minirl_loss_example_uses_verls_registries():
    out = _run("minirl_loss_in_verl.py")
    assert "advantages per response: [0.5, -0.5, 0.0, 0.0]" in out
    assert "minirl: loss=" in out and "vespo: loss=" in out


def test_routing_replay_example_removes_the_disagreement():
    out = _run("routing_replay_tiny_moe.py")
    assert "-> 0.000% with replay" in out
    assert "decisions that differ: 0.000%" not in out  # bf16 really routes differently before replay
