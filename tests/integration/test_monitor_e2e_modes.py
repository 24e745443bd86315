"""End to end on CPU through verl's real trainer (``main_ppo``): the monitor under the ``minirl_n2_r2`` recipe (per
update mini-step staleness and R2 drift) and under verl's ``colocate_async`` V1 trainer.

Kept apart from ``test_monitor_e2e.py`` so that pytest-xdist's ``--dist loadfile`` can run the two files' verl runs on
different workers. Slow (two short runs of a few minutes on two cores): marked ``e2e``.
"""

import math

import pytest

from verl_stable.toy import launch
from verl_stable.toy.assets import AssetSpec, ensure_assets

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return ensure_assets(tmp_path_factory.mktemp("assets"), AssetSpec(task="copy"))


def test_n2_r2_recipe_logs_staleness_and_r2_drift_per_update_mini_step(tmp_path):
    # The minirl_n2_r2 recipe (stable_sync, minirl, R2, N = 2 update mini-steps per step) on the tiny MoE, through
    # verl's real main_ppo: the one e2e run of the R2 recipe (the recipe and FSDP-engine tests rely on it).
    from verl_stable import recipes as R

    assets = ensure_assets(tmp_path / "assets", AssetSpec(task="copy"))
    path = R.recipe_path("fsdp", "minirl_n2_r2")
    overrides = [
        *launch.regime_overrides("minirl_n2_r2", assets, steps=2),
        f"trainer.default_local_dir={tmp_path / 'ckpt'}",
    ]
    workdir = tmp_path / "run"
    proc = launch.run_main_ppo([f"--config-path={path.parent}", f"--config-name={path.stem}", *overrides], workdir)
    log = (workdir / "main_ppo.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    rows = launch.read_metrics(workdir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        per_update = sorted(k for k in row if "/update_" in k)
        print(f"step {row['step']}:", {k: row[k] for k in per_update if k.endswith(("ratio_dev_max", "r2_drift"))})
        assert "stable/staleness/update_1/ratio_dev_max" in row and "stable/staleness/update_2/kl_k3" not in row, (
            per_update
        )
        # update 0 runs on the weights that computed pi_old: pi_theta == pi_old up to float noise, same routing
        assert row["stable/staleness/update_0/ratio_dev_max"] < 1e-4
        assert row["stable/staleness/update_0/frac_outside_trust_region"] == 0.0
        assert row["stable/routing/update_0/r2_drift"] == 0.0
        # update 1 runs after one optimizer step
        assert row["stable/staleness/update_1/ratio_dev_max"] > 10 * row["stable/staleness/update_0/ratio_dev_max"]
        assert 0.0 <= row["stable/routing/update_1/r2_drift"] <= 1.0
        # verl's reduction over the two updates, moved from actor/stable/... to stable/...
        assert row["stable/staleness/ratio_dev_max"] == pytest.approx(row["stable/staleness/update_1/ratio_dev_max"])
        drift = (row["stable/routing/update_0/r2_drift"] + row["stable/routing/update_1/r2_drift"]) / 2
        assert row["stable/routing/r2_drift"] == pytest.approx(drift)
        assert row["stable/routing/disagreement"] == 0.0  # both updates used pi_old's experts
        assert not any(k.startswith("actor/stable/") for k in row)
        # the recipe itself: minirl loss with token IS weights, R2 replay through the plugin's FSDP engine
        assert math.isfinite(row["actor/pg_loss"]) and row["actor/grad_norm"] > 0
        assert "rollout_corr/k3_kl" in row  # token IS weights were computed and reached the loss
        assert "actor/MiniRL/ratio_mean" in row and "stable/entropy/mean" in row
        assert row["stable/routing/replayed_rows"] > 0
        assert row["stable/routing/missing_rows"] == 0.0  # pi_old's log-prob pass recorded every token
    # N = 2: the second mini-step of a step sees pi_theta != pi_old (on-policy the ratio would be exactly 1)
    assert rows[0]["actor/MiniRL/ratio_min"] < 1.0 < rows[0]["actor/MiniRL/ratio_max"]


def test_colocate_async_mode_logs_stable_metrics(assets, tmp_path):
    # verl's colocate_async V1 trainer (partial rollout, one warm-up batch prefetched) with the monitor on top.
    workdir = tmp_path / "colocate_async"
    overrides = launch.cpu_overrides(assets, steps=2)
    overrides += [
        f"trainer.default_local_dir={workdir / 'checkpoints'}",
        "trainer.v1.trainer_mode=stable_colocate_async",
        "actor_rollout_ref.actor.policy_loss.loss_mode=minirl",
        # step 2 trains on the prefetched batch sampled by the step-1 weights: KL(mu || pi_old) includes that lag
        # (k3 ~ 0.011 here) and would trip the default 0.01 stop rule
        "+stable.guard.rules.train_inference_kl.action=warn",
    ]
    proc = launch.run_main_ppo(overrides, workdir, timeout_s=1500)
    log = (workdir / "main_ppo.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    rows = launch.read_metrics(workdir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in ("stable/train_inf/kl_k3", "stable/entropy/mean", "stable/guard/non_finite"):
            assert key in row, sorted(k for k in row if k.startswith("stable/"))
        # one update per step; pi_old is recomputed with the weights being updated, whatever produced the samples
        assert row["stable/staleness/update_0/ratio_dev_max"] < 1e-4
        assert "stable/staleness/update_1/ratio_dev_max" not in row
