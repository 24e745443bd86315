"""End to end on CPU: verl's ``main_ppo`` with the **Megatron** actor runs the shipped recipes
``recipes/megatron/minirl_n4_r3.yaml`` (MiniRL at N = 4, R3 through verl's own Megatron router replay) with **vLLM's
CPU build** as the rollout, and ``recipes/megatron/minirl_n2_r2.yaml`` (N = 2, R2: verl records pi_old's routing in the
log-prob pass and replays it in both update mini-steps) with the project's ``hf`` rollout, exactly as
``verl-stable recipe run-cpu megatron/<recipe> [--engine vllm]`` does. One run per recipe (R3: 2 steps; R2: 3 steps
with ``stable.monitor.replay_metrics_interval=2``, so the actor measures steps 1 and 3 and step 2 is verl's replay
alone), shared by the assertions on it.

R3 run, at pipeline parallel 2 (two actor ranks, two layers each; the layout MoE models train at): the run completes;
verl's Megatron engine replays on every stage's MoE layers; vLLM's routed experts reach the
actor through the compact transport and are replayed exactly (the replay metrics summed over both stages, each layer
once) (the project's replay metrics: every trained response
token's routing replayed, used experts equal the rollout's); the router's own choice is measured against them (the
mismatch the replay hides) and a guard rule on it is evaluated; the weights the actor trains reach vLLM each step (the
train-inference KL stays at the precision floor on step 2 as on step 1: with a stale rollout it would grow); and the
monitor reports on Megatron what it reports on FSDP.
"""

import json

import pytest

from verl_stable.toy import launch

pytestmark = pytest.mark.e2e

STEPS = 2
STALENESS = 4
# The R3 run's actor: two pipeline stages on two ranks (fake Ray GPUs), one vLLM replica each
PIPELINE = (
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
    "trainer.n_gpus_per_node=2",
    "ray_kwargs.ray_init.num_gpus=2",
)
# KL(mu || pi_old) k3 of the same recipe at world size 1, measured 6e-7 / 5e-7 on steps 1 / 2 (docs/how-to/megatron.md):
# bf16 vLLM against the bf16 Megatron actor on the weights it was sent. A layer of one stage exported under another's
# name, or a stage's weights not sent, moves it by orders of magnitude (the routers alone then pick other experts).
# Measured at pipeline parallel 2: 4.1e-7 / 3.9e-7.
KL_FLOOR = 5e-6


# a user's guard rule on the router's own disagreement (a warning; the threshold is out of reach of a fraction)
ROUTER_RULE = "+stable.guard.rules.router_drift"


def _run(tmp_path_factory, recipe: str, engine: str = "hf", overrides: tuple[str, ...] = (), steps: int = STEPS):
    """``verl-stable recipe run-cpu megatron/<recipe> --engine <engine>``: exit code, log, per-step metrics."""
    workdir = tmp_path_factory.mktemp(recipe)
    rc = launch.run_recipe(recipe, workdir, overrides, steps=steps, backend="megatron", engine=engine)
    run = workdir / "run"
    log = (run / "main_ppo.log").read_text()
    rows = launch.read_metrics(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []
    return rc, log, rows


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory):
    pytest.importorskip("vllm", reason="vLLM's CPU build is not installed (VERL_STABLE_NO_VLLM=1)")
    rule = (
        *PIPELINE,
        "+verl_stable.routing.share_prompt_rows_min_bytes=0",  # every group shares its prompt rows: the side reads
        f"{ROUTER_RULE}.condition=above",
        f"{ROUTER_RULE}.metric=stable/routing/router_disagreement",
        f"{ROUTER_RULE}.threshold=2.0",
        f"{ROUTER_RULE}.action=warn",
    )
    return _run(tmp_path_factory, "minirl_n4_r3", engine="vllm", overrides=rule)


def test_the_megatron_recipe_runs_through_verls_trainer(megatron_run):
    rc, log, rows = megatron_run
    assert rc == 0, log[-4000:]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # verl's Megatron engine patched every MoE layer's router: two on each of the two stages
    assert "routing replay layers: 2" in log and "routing replay layers: 4" not in log
    for row in rows:  # N = 4: four update mini-steps per step, each logged by the monitor
        assert {f"stable/staleness/update_{i}/kl_k3" for i in range(STALENESS)} <= set(row), sorted(row)
        # the FSDP actor's scale (1-3); with a zero <pad> embedding row, which Megatron trains (no padding_idx), a
        # sampled <pad> made it 90-360 (toy.assets.AssetSpec.random_pad_row)
        assert 0 < row["actor/grad_norm"] < 10


def test_the_actors_weights_reach_the_rollout_every_step(megatron_run):
    _, log, rows = megatron_run
    # bf16 Megatron actor vs bf16 vLLM serving the weights both stages exported: the world-size-1 run's precision
    # floor, on both steps
    for row in rows:
        assert 0.0 <= row["stable/train_inf/kl_k3"] < KL_FLOOR, json.dumps(row)[:2000]


def test_the_rollouts_experts_travel_compact_and_are_replayed_exactly(megatron_run):
    _, log, rows = megatron_run
    for row in rows:
        # the compact transport carried every sample's routing (verl_stable.integration.rollout's manager) ...
        assert row["stable/routing/transport/samples"] > 0 and row["stable/routing/transport/skipped_samples"] == 0
        # every group's prompt rows travelled once, as a TransferQueue side entry the actor read once per step (its
        # log-prob pass) and reused in the four update mini-steps
        assert row["stable/routing/transport/prompt_groups_shared"] > 0
        assert (
            row["stable/routing/transport/side_reads"] == 1.0
            and row["stable/routing/transport/side_reads_per_rank"] == 1.0
        )
        assert row["stable/routing/transport/side_read_entries"] == row["stable/routing/transport/prompt_groups_shared"]
        assert row["stable/routing/transport/side_read_bytes"] > 0
        # ... the Megatron actor expanded it for verl's replay, and every replayed decision used the rollout's experts
        assert row["stable/routing/disagreement"] == 0.0, json.dumps(row)[:3000]
        assert row["stable/routing/disagreement/layer_max"] == 0.0
        assert row["stable/routing/replayed_rows"] > 0
        # every trained response token's routing was replayed (verl leaves each sequence's last row native; it is
        # never trained), so the guard's replay_coverage rule is quiet
        assert row["stable/routing/coverage/response_replayed"] == 1.0
        assert row["stable/guard/replay_coverage"] == 0.0


def test_the_routers_own_choice_is_measured_against_vllms_routing_and_guarded(megatron_run):
    _, log, rows = megatron_run
    for row in rows:
        first, last = (row[f"stable/routing/update_{i}/router_disagreement"] for i in (0, STALENESS - 1))
        # mini-step 0 trains pi_old's weights: what differs is vLLM's kernels against the bf16 Megatron actor, a few
        # rows (measured 0.019 and 0.010) ...
        assert 0.0 <= first < 0.1, json.dumps(row)[:3000]
        # ... then the update moves the routers while R3 keeps replaying the rollout's experts: their own choice
        # drifts away from what they replay (measured 0.93 and 0.70 by the fourth mini-step)
        assert last > first + 0.1
        assert "stable/routing/r2_drift" not in row  # R3: the targets are the rollout's, not pi_old's
        assert row["stable/guard/router_drift"] == 0.0  # the user's rule was evaluated on Megatron, and is quiet


# the R2 run measures its replay metrics at steps 1 and 3 only (stable.monitor.replay_metrics_interval=2)
R2_STEPS = 3
R2_MEASURED = (1, 3)


def _trainer_routing_metric(name: str) -> bool:
    """The routing metrics a step logs without the actor's measurement: the trainer's own (transport, load)."""
    return name.startswith(("stable/routing/transport/", "stable/routing/load/", "stable/routing/rollout_vs_train/"))


@pytest.fixture(scope="module")
def megatron_r2_run(tmp_path_factory):
    return _run(
        tmp_path_factory, "minirl_n2_r2", overrides=("+stable.monitor.replay_metrics_interval=2",), steps=R2_STEPS
    )


def test_the_r2_recipe_replays_pi_olds_recorded_routing_in_both_mini_steps(megatron_r2_run):
    rc, log, rows = megatron_r2_run
    assert rc == 0, log[-4000:]
    assert [r["step"] for r in rows] == list(range(1, R2_STEPS + 1))
    for row in rows:
        # N = 2: two update mini-steps, each replaying what verl's log-prob pass recorded (the targets verl set)
        assert {f"stable/staleness/update_{i}/kl_k3" for i in range(2)} <= set(row), sorted(row)
        assert "stable/staleness/update_2/kl_k3" not in row
        if row["step"] not in R2_MEASURED:
            # a step the trainer sampled out: verl replayed (the policy still trains: staleness and loss logged
            # above and below) and the actor measured nothing: no replay metric, and the optional replay_coverage rule
            # has nothing to judge (its flag stays 0)
            actors = [
                k
                for k in row
                if k.startswith(("stable/routing/", "actor/stable/routing/")) and not _trainer_routing_metric(k)
            ]
            assert not actors, actors
            assert "stable/routing/coverage/response_replayed" not in row and row["stable/guard/replay_coverage"] == 0.0
            assert 0 < row["actor/grad_norm"] < 10
            continue
        assert row["stable/routing/disagreement"] == 0.0, json.dumps(row)[:3000]
        assert row["stable/routing/replayed_rows"] > 0
        assert row["stable/routing/coverage/response_replayed"] == 1.0
        # the routers' own choice against pi_old's recording: 0 in the first mini-step (pi_old's weights), then drift
        assert row["stable/routing/update_0/r2_drift"] == 0.0
        assert 0.0 <= row["stable/routing/r2_drift"] < 0.5
        # pi_theta == pi_old at the first mini-step (same weights, same routing), then the policy moves
        assert row["stable/staleness/update_0/ratio_dev_max"] < 1e-3
        assert 0 < row["actor/grad_norm"] < 10
