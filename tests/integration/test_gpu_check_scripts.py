"""The logic of ``tests/gpu/check_data_parallel.py`` that runs without a GPU or a trainer: the comparison of two runs'
metric rows, the actor count read from a log, and the GPU arguments (composed on verl's config and checked by verl's
own ``validate_config`` at dp = 8, with no CPU-runtime setting left in them). The script's runs are not made here.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "gpu" / "check_data_parallel.py"


@pytest.fixture(scope="module")
def cdp():
    spec = importlib.util.spec_from_file_location("check_data_parallel", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _row(step, **changes):
    row = {
        "step": step,
        "stable/routing/disagreement": 0.0,
        "stable/routing/update_0/disagreement": 0.0,
        "stable/routing/coverage/response_replayed": 1.0,
        "critic/score/mean": 0.25,
        "response_length/mean": 3.5,
        "stable/routing/coverage/response_rows": 56.0,
        "stable/routing/coverage/response_replayed_rows": 56.0,
        "stable/routing/coverage/prompt_rows": 160.0,
        "stable/routing/coverage/prompt_replayed_rows": 160.0,
        "rollout_corr/training_log_ppl": 3.25,
        "actor/pg_loss": 0.004,
    }
    row.update(changes)
    return row


def _statuses(checks):
    return {c.name: c.status for c in checks}


def test_equal_runs_pass_every_cross_run_check(cdp):
    one = [_row(1), _row(2)]
    many = [_row(1, **{"critic/score/mean": 0.25 + 4e-9}), _row(2)]  # float32 summation order
    checks = cdp.across_runs(one, many, label="r3", regime="r3", tol=cdp.TOLERANCES["cpu"], strict_steps=None)
    assert checks and all(c.status == "PASS" for c in checks), [c.line() for c in checks]
    assert sum("pg_loss" in c.name for c in checks) == 1
    r2 = cdp.across_runs(one, many, label="r2", regime="r2", tol=cdp.TOLERANCES["cpu"], strict_steps=None)
    assert not any("pg_loss" in c.name for c in r2)  # mini-steps hold different samples at different dp


def test_a_row_lost_or_counted_twice_across_ranks_fails(cdp):
    for key in ("response_rows", "prompt_replayed_rows"):
        many = [_row(1, **{f"stable/routing/coverage/{key}": 2 * _row(1)[f"stable/routing/coverage/{key}"]})]
        checks = cdp.across_runs([_row(1)], many, label="r3", regime="r3", tol=cdp.TOLERANCES["cpu"], strict_steps=1)
        assert [c.status for c in checks if "coverage rows" in c.name] == ["FAIL"], key
    missing = [{k: v for k, v in _row(1).items() if k != "stable/routing/coverage/prompt_rows"}]
    checks = cdp.across_runs([_row(1)], missing, label="r3", regime="r3", tol=cdp.TOLERANCES["cpu"], strict_steps=1)
    assert [c.status for c in checks if "coverage rows" in c.name] == ["FAIL"]


def test_tolerances_tell_bf16_noise_from_a_different_computation(cdp):
    cpu, gpu = cdp.TOLERANCES["cpu"], cdp.TOLERANCES["cuda"]
    assert gpu.close(3.25, 3.25 + 8e-3) and not cpu.close(3.25, 3.25 + 8e-3)
    assert not gpu.close(3.25, 3.35)  # 3 %: not rounding
    assert gpu.close(0.004, -0.004) and not gpu.close(0.004, 0.03)  # absolute near a loss of ~0
    one, many = [_row(1)], [_row(1, **{"rollout_corr/training_log_ppl": 3.25 + 8e-3})]
    checks = _statuses(cdp.across_runs(one, many, label="x", regime="r3", tol=gpu, strict_steps=1))
    assert "PASS" == checks[f"x step 1: rollout_corr/training_log_ppl equal ({gpu})"]
    checks = _statuses(cdp.across_runs(one, many, label="x", regime="r3", tol=cpu, strict_steps=1))
    assert "FAIL" == checks[f"x step 1: rollout_corr/training_log_ppl equal ({cpu})"]


def test_later_steps_may_part_on_gpu_but_never_on_the_strict_steps(cdp):
    one = [_row(1), _row(2)]
    many = [_row(1), _row(2, **{"response_length/mean": 3.75, "stable/routing/coverage/response_rows": 60.0})]
    gpu = cdp.across_runs(one, many, label="x", regime="r3", tol=cdp.TOLERANCES["cuda"], strict_steps=1)
    assert [c.status for c in gpu if c.name.startswith("x step 2")] == ["INFO"]  # no coverage comparison either
    assert not any(c.status == "FAIL" for c in gpu)
    cpu = cdp.across_runs(one, many, label="x", regime="r3", tol=cdp.TOLERANCES["cpu"], strict_steps=None)
    assert [c.status for c in cpu if c.name.startswith("x step 2")] == ["FAIL", "FAIL"]
    short = cdp.across_runs(one, many[:1], label="x", regime="r3", tol=cdp.TOLERANCES["cpu"], strict_steps=None)
    assert any(c.status == "FAIL" and "same steps" in c.name for c in short)


def test_within_run_needs_zero_disagreement_in_every_update_and_full_coverage(cdp):
    good = [_row(1), _row(2, **{"stable/routing/update_1/disagreement": 0.0})]
    assert all(c.status == "PASS" for c in cdp.within_run(good, label="x", steps=2, regime="r3"))
    bad = [_row(1), _row(2, **{"stable/routing/update_1/disagreement": 0.01})]
    assert (
        _statuses(cdp.within_run(bad, label="x", steps=2, regime="r3"))[
            "x: stable/routing/disagreement == 0 (and update_<i>) at every step"
        ]
        == "FAIL"
    )
    partial = [_row(1, **{"stable/routing/coverage/response_replayed": 0.9375})]
    assert "FAIL" in _statuses(cdp.within_run(partial, label="x", steps=1, regime="r3")).values()
    assert "FAIL" in _statuses(cdp.within_run([_row(1)], label="x", steps=2, regime="r3")).values()  # step 2 missing
    assert "FAIL" in _statuses(cdp.within_run([], label="x", steps=1, regime="r3")).values()
    # r2: exactly two update mini-steps
    r2 = [_row(1, **{"stable/routing/update_1/disagreement": 0.0})]
    assert all(c.status == "PASS" for c in cdp.within_run(r2, label="x", steps=1, regime="r2"))
    assert "FAIL" in _statuses(cdp.within_run([_row(1)], label="x", steps=1, regime="r2")).values()


def test_actor_pids_counts_distinct_actors_of_one_class(cdp):
    log = (
        "(WorkerDict pid=11) a\n(WorkerDict pid=12) b\n(WorkerDict pid=11) c\n"
        "(vLLMHttpServer pid=21, ip=10.0.0.2) d\n(HFRolloutServer pid=31) e\n(TaskRunner pid=9) f\n"
    )
    assert cdp.actor_pids(log, "WorkerDict") == {"11", "12"}
    assert cdp.actor_pids(log, "vLLMHttpServer") == {"21"}
    checks = cdp.placement({1: "(HFRolloutServer pid=5) x", 2: log}, label="x", device="cpu", dp=2)
    assert [c.status for c in checks] == ["FAIL"]  # one hf replica at dp = 2


@pytest.mark.parametrize("regime", ["r3", "r2"])
def test_gpu_arguments_compose_and_verl_accepts_them_at_dp_8(cdp, regime, tmp_path, monkeypatch):
    from verl_stable.toy.assets import asset_paths

    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)

    for dp in (1, 8):
        args = cdp.run_overrides(
            regime, device="cuda", dp=dp, geometry_dp=8, assets=asset_paths(tmp_path), steps=2, run_dir=tmp_path
        )
        cfg = cdp.compose(args)
        assert cfg.trainer.device == "cuda" and cfg.trainer.n_gpus_per_node == dp and cfg.trainer.nnodes == 1
        rollout = cfg.actor_rollout_ref.rollout
        assert rollout.name == "vllm" and "hf" not in rollout.get("engine_kwargs", {})
        assert cfg.actor_rollout_ref.actor.fsdp_config.router_replay.mode == regime.upper()
        assert cfg.actor_rollout_ref.actor.use_dynamic_bsz and cfg.trainer.balance_batch
        assert cfg.trainer.v1.trainer_mode == "stable_sync"
        env = cfg.ray_kwargs.ray_init.runtime_env.env_vars
        assert "VERL_PLATFORM" not in env and env["VLLM_BATCH_INVARIANT"] == "1"
        assert cfg.ray_kwargs.ray_init.get("num_gpus") is None  # Ray counts the node's GPUs
        assert "CompactRouting" in rollout.agent.agent_loop_manager_class
