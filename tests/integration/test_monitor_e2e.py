"""End to end on CPU through verl's real trainer (``main_ppo``, V1 ``stable_sync``): the ``stable/`` metrics reach
verl's logged metrics; a deliberately destabilised run is stopped by the guard with its reason, a healthy one is not.

Slow (two short runs of a few minutes on two cores): marked ``e2e``.
"""

import pytest

from verl_stable.toy import launch
from verl_stable.toy.assets import AssetSpec, ensure_assets

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return ensure_assets(tmp_path_factory.mktemp("assets"), AssetSpec(task="copy"))


def _run(assets, workdir, *extra, steps, **kwargs):
    overrides = launch.cpu_overrides(assets, steps=steps, **kwargs)
    overrides += [f"trainer.default_local_dir={workdir / 'checkpoints'}", "trainer.v1.trainer_mode=stable_sync"]
    proc = launch.run_main_ppo([*overrides, *extra], workdir, timeout_s=1500)
    log = (workdir / "main_ppo.log").read_text()
    rows = launch.read_metrics(workdir / "metrics.jsonl") if (workdir / "metrics.jsonl").exists() else []
    return proc.returncode, log, rows


def test_healthy_run_logs_stable_metrics_and_is_not_stopped(assets, tmp_path):
    experts = AssetSpec().num_experts
    rc, log, rows = _run(
        assets, tmp_path / "healthy", f"+stable.monitor.num_experts={experts}", steps=3, routing_capture=True
    )
    assert rc == 0, log[-3000:]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        # ours next to verl's own, in the same logged step dict
        for key in ("stable/train_inf/kl_k3", "stable/train_inf/extreme_frac_tau2", "stable/entropy/mean"):
            assert key in row, sorted(k for k in row if k.startswith("stable/"))
        assert "actor/entropy" in row and "rollout_corr/k3_kl" in row
        assert row["stable/train_inf/kl_k3"] == pytest.approx(row["rollout_corr/k3_kl"], rel=0.05, abs=1e-6)
        assert 0.9 < row["stable/is/ess"] <= 1.0
        assert row["stable/guard/train_inference_kl"] == 0.0 and row["stable/guard/non_finite"] == 0.0
        # expert load balance from the rollout's routed_experts (the tiny model has 4 MoE layers)
        assert 1.0 <= row["stable/routing/load/max_over_mean"] <= experts
        assert {f"stable/routing/load/layer_{i}/cv" for i in range(4)} <= set(row)
    assert "stable/entropy/slope" in rows[-1]
    assert "GuardTripped" not in log


def test_destabilised_run_is_stopped_by_the_guard_with_its_reason(assets, tmp_path):
    rc, log, rows = _run(
        assets,
        tmp_path / "destabilised",
        "actor_rollout_ref.actor.optim.lr=10.0",  # absurd learning rate
        "+stable.guard.rules.entropy_collapse.window=2",
        "trainer.save_freq=1",
        steps=6,
        rollout_is=None,  # no IS weight
    )
    assert rc != 0
    assert "GuardTripped" in log and "verl-stable guard stopped the run at step" in log, log[-3000:]
    tripped = [r for r in rows if any(v == 1.0 for k, v in r.items() if k.startswith("stable/guard/"))]
    assert tripped, "the tripping step's metrics were not logged"
    trip_step = tripped[0]["step"]
    assert rows[-1]["step"] == trip_step < 6  # the loop ended right after logging the tripping step
    rule = next(k.split("/")[-1] for k, v in tripped[0].items() if k.startswith("stable/guard/") and v == 1.0)
    assert f"[{rule}]" in log
