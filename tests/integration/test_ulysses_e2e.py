"""Ulysses sequence parallelism on the CPU runtime: verl's main_ppo at sp=2 against sp=1, R3 through the compact
transport, both packed (``use_remove_padding=True``) with the pure-torch varlen kernel (``verl_stable.cpu.attention``).

Two verl runs shared by the assertions: sp=1 (one actor rank) and dp x sp = 2 x 2 (four actor ranks, two Ulysses
groups, four rollout replicas; ``balance_batch`` and dynamic batch sizes on, as data-parallel runs use them). (A run at
sp=2 alone, one Ulysses group at dp = 1, was dropped for CI time: the 2 x 2 run holds two such groups, and the
in-process tests of ``test_fsdp_engine_ulysses_train.py`` run sp=2 at dp = 1.) Every worker process registers the kernel in
verl's plugin step; at sp=2 verl's Ulysses patch all-to-alls each layer's query/key/value to the whole sequence with
half the heads and calls the kernel underneath. Rollouts are seeded per sample (``transport/seeding.py``), so
both runs sample the same tokens whichever of their replicas serves a sample; the sp=2 run must then replay exactly
and compute, on step 1 (before the runs may part by float rounding after the first Adam step), the same log-probs,
loss and gradient norm as the sp=1 run. Without the kernel (sdpa under sp=2) each rank would attend only within its
own half of the sequence; that the log-probs then differ is shown in-process in ``test_fsdp_engine_ulysses.py`` (and
the preflight refuses such a run).
"""

from __future__ import annotations

import re

import pytest

RUNS = {1: (1, 1), 4: (4, 2)}
"""Run name (its actor ranks) -> (ranks, Ulysses degree)."""
KERNEL_LINE = re.compile(r"\(WorkerDict pid=(\d+)\).*verl_stable_varlen attention kernel ran \(([^)]*)\)")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from verl_stable import recipes
    from verl_stable.toy import launch
    from verl_stable.toy.assets import AssetSpec, ensure_assets
    from verl_stable.transport.options import MANAGER_FQN

    tmp = tmp_path_factory.mktemp("sp")
    assets = ensure_assets(tmp / "assets", AssetSpec(task="copy"))  # 4 heads, 2 kv heads: 2 and 1 per sp rank
    out = {}
    for name, (ranks, sp) in RUNS.items():
        overrides = launch.cpu_overrides(
            assets, steps=2, routing_capture=True, metrics_logger=("file",), attention="varlen"
        )
        overrides += [
            f"trainer.default_local_dir={tmp / f'ckpt{name}'}",
            f"trainer.n_gpus_per_node={ranks}",
            f"ray_kwargs.ray_init.num_gpus={ranks}",  # one fake GPU per actor rank and rollout replica
            f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}",  # the reference follows (no ref here)
            "+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3",
            f"+actor_rollout_ref.rollout.agent.agent_loop_manager_class={MANAGER_FQN}",
            "trainer.v1.trainer_mode=stable_sync",
        ]
        if ranks > sp:  # data parallel too: verl's fixed micro-batches do not divide the balanced halves
            overrides += [
                "trainer.balance_batch=True",
                "actor_rollout_ref.actor.use_dynamic_bsz=True",
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=256",
            ]
        recipes.preflight(overrides)  # the CPU preflight lets sp=2 through with the kernel
        proc = launch.run_main_ppo(overrides, tmp / f"run{name}", timeout_s=1200)
        log = (tmp / f"run{name}" / "main_ppo.log").read_text(errors="ignore")
        assert proc.returncode == 0, log[-4000:]
        out[name] = (launch.read_metrics(tmp / f"run{name}" / "metrics.jsonl"), log)
    return out


@pytest.mark.e2e
def test_the_kernel_ran_under_verls_ulysses_attention_on_both_sp_ranks(runs):
    for name, (ranks, sp) in RUNS.items():
        log = runs[name][1]
        workers = set(re.findall(r"\(WorkerDict pid=(\d+)\)", log))
        ran = {pid: how for pid, how in KERNEL_LINE.findall(log)}
        assert len(workers) == ranks, workers
        # every actor rank ran it, inside verl's Ulysses wrapper (at sp=1 verl's packed path installs it too)
        assert ran == dict.fromkeys(workers, f"under verl's Ulysses attention, sp={sp}"), ran


@pytest.mark.e2e
def test_sp2_replays_every_response_row_exactly(runs):
    for name in RUNS:
        for row in runs[name][0]:
            assert row["stable/routing/disagreement"] == 0.0  # every rank, every micro-batch used the rollout's experts
            assert row["stable/routing/coverage/response_replayed"] == 1.0
    for row1, row2 in zip(runs[1][0], runs[4][0], strict=True):
        # counted once per data-parallel rank: the rows the single rank sees, none lost, none counted twice
        for key in ("response_rows", "response_replayed_rows"):
            assert row2[f"stable/routing/coverage/{key}"] == row1[f"stable/routing/coverage/{key}"] > 0, key


@pytest.mark.e2e
def test_sp2_samples_and_computes_what_sp1_does(runs):
    one, two = runs[1][0], runs[4][0]
    assert len(one) == len(two) == 2
    for row1, row2 in zip(one, two, strict=True):  # the same tokens, whichever replica sampled them
        for key in ("critic/score/mean", "response_length/mean"):
            assert row2[key] == pytest.approx(row1[key], abs=1e-7), key
    first1, first2 = one[0], two[0]
    print({k: (first1[k], first2[k]) for k in ("rollout_corr/training_log_ppl", "actor/pg_loss", "actor/grad_norm")})
    assert first2["rollout_corr/training_log_ppl"] == pytest.approx(first1["rollout_corr/training_log_ppl"], abs=1e-6)
    assert first2["actor/pg_loss"] == pytest.approx(first1["actor/pg_loss"], abs=1e-6)
    assert first2["actor/grad_norm"] == pytest.approx(first1["actor/grad_norm"], rel=1e-3)
    assert first1["actor/grad_norm"] > 0
