"""The verl contracts the CPU runtime relies on: all hold on verl 0.9.1, and a broken one is named."""

from __future__ import annotations

import pytest

from verl_stable.cpu import contracts


def test_all_contracts_hold_on_installed_verl():
    results = contracts.check_contracts()
    assert {r.name for r in results} == {c.name for c in contracts.CONTRACTS}
    failed = [f"{r.name}: {r.detail}" for r in results if not r.ok]
    assert not failed, failed


def test_broken_contract_is_named(monkeypatch):
    from verl.workers.rollout import base

    monkeypatch.delattr(base, "_ROLLOUT_REGISTRY")
    with pytest.raises(contracts.ContractError, match=r"\[rollout_registry\].*_ROLLOUT_REGISTRY"):
        contracts.require("rollout_registry")
    assert [r.ok for r in contracts.check_contracts(["rollout_registry"])] == [False]


def test_version_pin_is_checked(monkeypatch):
    import verl

    monkeypatch.setattr(verl, "__version__", "0.9.2")
    (result,) = contracts.check_contracts(["verl_version"])
    assert not result.ok and "pinned to verl==0.9.1" in result.detail


def test_server_method_drift_is_detected(monkeypatch):
    from verl_stable.cpu.hf_rollout import HFRolloutServer

    monkeypatch.delattr(HFRolloutServer, "release_kv_cache")
    (result,) = contracts.check_contracts(["server_methods"])
    assert not result.ok and "release_kv_cache" in result.detail


def test_unknown_contract_name():
    with pytest.raises(ValueError, match="unknown contracts"):
        contracts.require("no_such_contract")


def test_registration_is_idempotent_and_reaches_verls_tables():
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from verl_stable.cpu import hf_rollout, runtime

    assert runtime.register() == runtime.register()
    assert base._ROLLOUT_REGISTRY[("hf", "async")] == hf_rollout.ADAPTER_FQN
    assert base.get_rollout_class("hf", "async") is hf_rollout.HFServerAdapter
    assert RolloutReplicaRegistry.get("hf") is hf_rollout.replica_class()


def test_doctor_reports_registration():
    from verl_stable.cpu import runtime

    runtime.register()
    results = {r.name: r for r in runtime.doctor()}
    assert results["cpu_runtime_registered"].ok, results["cpu_runtime_registered"].detail
    assert all(r.ok for r in results.values()), [r for r in results.values() if not r.ok]


def test_offload_policy_contract_detects_a_renamed_import(monkeypatch):
    from verl.workers.engine.fsdp import transformer_impl

    monkeypatch.delattr(transformer_impl, "CPUOffloadPolicy")
    (result,) = contracts.check_contracts(["fsdp2_offload_policy"])
    assert not result.ok and "CPUOffloadPolicy" in result.detail
