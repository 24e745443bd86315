"""End to end: R3 is neutral where it has nothing to correct -- at N = 1 with no numeric mismatch (fp32 rollout, fp32
training) R3 and no replay give the same run through verl's trainer.

The lab found R3 lowering the late reward at N = 4 on some seed sets, also without numeric mismatch. Two causes are
possible: a replay that changes something it should not, or the staleness bias the paper describes (in mini-batches
2..N the model's own routing has moved away from the rollout's, and R3 trains the policy on routes it no longer
chooses). This test rules out the first: with one update per step (N = 1) the policy that sampled is the policy that
trains, an fp32 rollout routes every token as the fp32 actor does, so the replayed routes are the router's own choice
(0 rows differ) and the replay must change nothing. Every value both runs log agrees to 1e-6 (the replay's gather of
gate weights at the given ids rounds like the router's own top-k). The lab's MiniRL variant and its R3 twin, one
seed, 2 steps of 2 prompts x 4 samples on the ``hf`` backend.
"""

from __future__ import annotations

import pytest

from verl_stable.lab import variants as V
from verl_stable.toy import tasks
from verl_stable.toy.launch import read_metrics, run_main_ppo

pytestmark = pytest.mark.e2e

STEPS = 2
TOL = 1e-6
# neither a value of the run nor a function of it: wall-clock and resource figures
VOLATILE = ("timing", "perf/", "time", "throughput", "memory")
# verl's standard deviation of the IS weights, in float32 as sqrt(E[w^2] - E[w]^2): for weights that all lie within
# 1 +- 5e-7 (rollout_is_min / _max, compared) the cancellation leaves 0 or sqrt(2^-24) = 2.4e-4 by rounding alone
# (measured: 0.0 without replay, 0.000244 with R3 at step 2, every weight within 1 +- 4.8e-7 in both)
ROUNDING_ONLY = ("rollout_corr/rollout_is_std",)


def _run(workdir, assets, variant: str) -> list[dict]:
    overrides = V.run_overrides(
        variant,
        assets,
        staleness=1,
        steps=STEPS,
        mini_batch_prompts=2,
        group_size=4,
        precision="fp32",
        seed=0,
        reward_path=tasks.__file__,
        workdir=workdir / variant,
    )
    proc = run_main_ppo(overrides, workdir / variant, timeout_s=900)
    assert proc.returncode == 0, (workdir / variant / "main_ppo.log").read_text()[-6000:]
    return read_metrics(workdir / variant / "metrics.jsonl")


@pytest.fixture(scope="module")
def runs(cpu_assets, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("neutrality")
    return _run(workdir, cpu_assets, "minirl"), _run(workdir, cpu_assets, "minirl_r3")


def _values(rows: list[dict]) -> dict[tuple[int, str], float]:
    return {
        (r["step"], k): v
        for r in rows
        for k, v in r.items()
        if k != "step" and not any(s in k for s in VOLATILE) and k not in ROUNDING_ONLY
    }


def test_r3_replays_the_routers_own_choice_at_n1_without_mismatch(runs):
    plain, r3 = runs
    assert [r["step"] for r in r3] == list(range(1, STEPS + 1))
    for row in r3:
        assert row["stable/routing/router_disagreement"] == 0.0  # the router would have chosen the replayed experts
        assert row["stable/routing/disagreement"] == 0.0
        assert row["stable/routing/coverage/response_replayed"] == 1.0
    for row in plain:
        assert row["stable/routing/disagreement"] == 0.0  # observed: the fp32 rollout routed as the actor does
        assert "stable/routing/coverage/response_replayed" not in row


def test_r3_and_no_replay_log_the_same_run(runs):
    plain, r3 = (_values(rows) for rows in runs)
    shared = plain.keys() & r3.keys()
    names = {k for _, k in shared}
    assert {"critic/score/mean", "actor/pg_loss", "actor/grad_norm", "stable/train_inf/kl_k3", "actor/entropy"} <= names
    differ = {k: (plain[k], r3[k]) for k in shared if r3[k] != pytest.approx(plain[k], rel=TOL, abs=TOL)}
    assert differ == {}
    for step in range(1, STEPS + 1):  # what the std stands for: every IS weight is 1 to float32 rounding, both runs
        for name in ("rollout_corr/rollout_is_max", "rollout_corr/rollout_is_min"):
            assert plain[(step, name)] == pytest.approx(1.0, abs=TOL) and r3[(step, name)] == pytest.approx(
                1.0, abs=TOL
            )
    # what only one side logs is the replay's own bookkeeping
    only = {k for _, k in r3.keys() - plain.keys()} | {k for _, k in plain.keys() - r3.keys()}
    assert all(k.startswith(("stable/routing/", "stable/guard/")) for k in only), sorted(only)
