"""End to end on CPU through verl's real trainer (``main_ppo``, V1 ``stable_sync``): the ``stable/`` metrics reach
verl's logged metrics; a deliberately destabilised run is stopped by the guard with its reason, a healthy one is not.

Slow (two short runs of a few minutes on two cores): marked ``e2e``.
"""

import pytest
from testkit.logged import catalogue_mismatches, compose_run_config

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
    return proc.returncode, log, rows, [*overrides, *extra]


def test_healthy_run_logs_stable_metrics_and_is_not_stopped(assets, tmp_path):
    experts = AssetSpec().num_experts
    rc, log, rows, overrides = _run(
        assets,
        tmp_path / "healthy",
        f"+stable.monitor.num_experts={experts}",
        steps=3,
        routing_capture=True,
        precision="bf16",
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
    # replay off, routing exported: what the guard's preflight assumes this configuration logs is what it logged
    assert catalogue_mismatches(compose_run_config(overrides), rows) == []
    assert "GuardTripped" not in log
    # replay off (the default): the plugin's FSDP engine still measures the actor's routing against the exported one,
    # and the bf16 rollout routed some tokens to other experts than the fp32 actor does -- over the run: a step's ~800
    # (token, layer) rows flip 0.1-1.2 % of the time (measured), so one step with no flip at all is a matter of chance
    # (the samples are not seeded here; one suite run saw it)
    for row in rows:
        assert 0.0 <= row["stable/routing/disagreement"] < 0.1
        assert "stable/routing/replayed_rows" not in row
    assert sum(row["stable/routing/disagreement"] for row in rows) > 0.0
