"""End to end on CPU: verl's ``main_ppo`` with the **Megatron** actor runs the shipped recipes
``recipes/megatron/minirl_n4_r3.yaml`` (MiniRL at N = 4, R3 through verl's own Megatron router replay) and
``recipes/megatron/minirl_n2_r2.yaml`` (N = 2, R2: verl records pi_old's routing in the log-prob pass and replays it
in both update mini-steps) with the project's ``hf`` rollout, exactly as ``verl-stable recipe run-cpu megatron/<recipe>``
does. The R2 run (2 steps) is asserted on by the last test.

One run (2 steps, 4 update mini-steps each) shared by every assertion: the run completes; verl's Megatron engine
replays on the model's MoE layers; the rollout's routing reaches the actor and is replayed exactly (the project's replay
metrics: every trained response token's routing replayed, used experts equal the rollout's); the weights the actor
trains reach the rollout each step (the train-inference KL stays at the precision floor on step 2 as on step 1:
with a stale rollout it would grow); and the monitor reports on Megatron what it reports on FSDP.
"""

import json

import pytest

from verl_stable.toy import launch

pytestmark = pytest.mark.e2e

STEPS = 2
STALENESS = 4


def _run(tmp_path_factory, recipe: str):
    """``verl-stable recipe run-cpu megatron/<recipe>``: exit code, log, per-step metrics."""
    workdir = tmp_path_factory.mktemp(recipe)
    rc = launch.run_recipe(recipe, workdir, steps=STEPS, backend="megatron")
    run = workdir / "run"
    log = (run / "main_ppo.log").read_text()
    rows = launch.read_metrics(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []
    return rc, log, rows


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory):
    return _run(tmp_path_factory, "minirl_n4_r3")


def test_the_megatron_recipe_runs_through_verls_trainer(megatron_run):
    rc, log, rows = megatron_run
    assert rc == 0, log[-4000:]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert "routing replay layers: 4" in log  # verl's Megatron engine patched every MoE layer's router
    for row in rows:  # N = 4: four update mini-steps per step, each logged by the monitor
        assert {f"stable/staleness/update_{i}/kl_k3" for i in range(STALENESS)} <= set(row), sorted(row)
        assert row["actor/grad_norm"] > 0


def test_the_actors_weights_reach_the_rollout_every_step(megatron_run):
    _, log, rows = megatron_run
    # bf16 Megatron actor vs fp32 hf rollout of the same weights: a precision floor, the same on both steps
    for row in rows:
        assert 0.0 <= row["stable/train_inf/kl_k3"] < 1e-3, json.dumps(row)[:2000]


def test_the_rollouts_experts_travel_compact_and_are_replayed_exactly(megatron_run):
    _, log, rows = megatron_run
    for row in rows:
        # the compact transport carried every sample's routing (verl_stable.integration.rollout's manager) ...
        assert row["stable/routing/transport/samples"] > 0 and row["stable/routing/transport/skipped_samples"] == 0
        # ... the Megatron actor expanded it for verl's replay, and every replayed decision used the rollout's experts
        assert row["stable/routing/disagreement"] == 0.0, json.dumps(row)[:3000]
        assert row["stable/routing/disagreement/layer_max"] == 0.0
        assert row["stable/routing/replayed_rows"] > 0
        # every trained response token's routing was replayed (verl leaves each sequence's last row native; it is
        # never trained), so the guard's replay_coverage rule is quiet
        assert row["stable/routing/coverage/response_replayed"] == 1.0
        assert row["stable/guard/replay_coverage"] == 0.0


@pytest.fixture(scope="module")
def megatron_r2_run(tmp_path_factory):
    return _run(tmp_path_factory, "minirl_n2_r2")


def test_the_r2_recipe_replays_pi_olds_recorded_routing_in_both_mini_steps(megatron_r2_run):
    rc, log, rows = megatron_r2_run
    assert rc == 0, log[-4000:]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        # N = 2: two update mini-steps, each replaying what verl's log-prob pass recorded (the targets verl set)
        assert {f"stable/staleness/update_{i}/kl_k3" for i in range(2)} <= set(row), sorted(row)
        assert "stable/staleness/update_2/kl_k3" not in row
        assert row["stable/routing/disagreement"] == 0.0, json.dumps(row)[:3000]
        assert row["stable/routing/replayed_rows"] > 0
        assert row["stable/routing/coverage/response_replayed"] == 1.0
        # pi_theta == pi_old at the first mini-step (same weights, same routing), then the policy moves
        assert row["stable/staleness/update_0/ratio_dev_max"] < 1e-3
        assert row["actor/grad_norm"] > 0
