"""End to end on CPU through verl's real trainer (``main_ppo``): the monitor under verl's ``colocate_async`` V1
trainer. (The monitor under the ``minirl_n2_r2`` recipe, per update mini-step staleness and R2 drift, is asserted on
that recipe's runs in ``test_data_parallel_r2_e2e.py``.)

Kept apart from ``test_monitor_e2e.py`` so that pytest-xdist's ``--dist loadfile`` can run the two files' verl runs on
different workers. Slow (a short run of a few minutes on two cores): marked ``e2e``.
"""

import pytest
from testkit.logged import catalogue_mismatches, compose_run_config

from verl_stable.toy import launch
from verl_stable.toy.assets import AssetSpec, ensure_assets

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return ensure_assets(tmp_path_factory.mktemp("assets"), AssetSpec(task="copy"))


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
    # what the guard's preflight assumes this configuration logs is what it logged
    assert catalogue_mismatches(compose_run_config(overrides), rows) == []
    for row in rows:
        for key in ("stable/train_inf/kl_k3", "stable/entropy/mean", "stable/guard/non_finite"):
            assert key in row, sorted(k for k in row if k.startswith("stable/"))
        # one update per step; pi_old is recomputed with the weights being updated, whatever produced the samples
        assert row["stable/staleness/update_0/ratio_dev_max"] < 1e-4
        assert "stable/staleness/update_1/ratio_dev_max" not in row
