"""The CPU runtime's test-only learning-rate spike: parsed strictly, exactly the k-th optimizer step, restored."""

from __future__ import annotations

import pytest
import torch
from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

from verl_stable.cpu import faults


@pytest.mark.parametrize("bad", ["3", "0:10", "a:10", "3:0", "3:nan", "3:-1", "1:2:3"])
def test_malformed_spikes_are_refused(bad):
    with pytest.raises(ValueError, match=faults.LR_SPIKE_ENV):
        faults.parse_lr_spike(bad)


def test_nothing_is_installed_unless_the_cpu_platform_is_selected():
    assert faults.register({faults.LR_SPIKE_ENV: "2:100"}) == []  # no VERL_PLATFORM=cpu
    assert faults.register({"VERL_PLATFORM": "cpu"}) == []  # no fault asked for


def _engine(lr: float) -> FSDPEngine:
    engine = FSDPEngine.__new__(FSDPEngine)
    torch.manual_seed(0)
    engine.module = torch.nn.Linear(3, 1, bias=False)
    engine.optimizer = torch.optim.SGD(engine.module.parameters(), lr=lr)
    engine.optimizer_config = type("Optim", (), {"clip_grad": 1e9})()
    engine.scaler = None
    engine._qat_enabled = False
    return engine


def _step(engine: FSDPEngine) -> torch.Tensor:
    before = engine.module.weight.detach().clone()
    engine.optimizer.zero_grad()
    engine.module(torch.ones(1, 3)).sum().backward()  # gradient of sum(w . 1) is 1 for every weight
    engine.optimizer_step()
    return engine.module.weight.detach() - before


def test_only_the_kth_optimizer_step_runs_at_the_spiked_learning_rate(monkeypatch):
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    assert faults.register({"VERL_PLATFORM": "cpu", faults.LR_SPIKE_ENV: "2:100"}) == ["fault:lr_spike@2x100"]
    try:
        engine = _engine(lr=0.01)
        moves = [_step(engine) for _ in range(3)]
        # SGD moves each weight by -lr * grad = -lr: 0.01, then 100 x 0.01, then 0.01 again
        torch.testing.assert_close(torch.stack(moves), torch.tensor([-0.01, -1.0, -0.01]).view(3, 1, 1).expand(3, 1, 3))
        assert engine.optimizer.param_groups[0]["lr"] == 0.01
    finally:
        faults.uninstall()
    assert "optimizer_step" not in faults._INSTALLED
    assert FSDPEngine.optimizer_step.__qualname__ == "FSDPEngine.optimizer_step"
