"""The verl contracts the CPU runtime relies on: all hold on verl 0.9.1, and a broken one is named.

Each module of the runtime declares its own contracts (``CONTRACTS``, ``check_contracts()``); the doctor collects them
in one way (:func:`verl_stable.cpu.runtime.contract_modules`). The mechanism itself (:mod:`verl_stable.compat.contracts`)
knows no module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from verl_stable.backends.hf import rollout as hf_rollout
from verl_stable.backends.vllm_cpu import rollout as vllm_rollout
from verl_stable.compat import contracts
from verl_stable.cpu import engines, platform, polling, runtime

# The names ``verl-stable doctor`` printed before the contracts moved into their modules, in that set.
CPU_CONTRACTS = {
    "verl_version",
    "platform_registry",
    "device_id_string",
    "device_module_calls",
    "backend_string",
    "engine_registry",
    "replica_registry",
    "rollout_registry",
    "server_methods",
    "token_output",
    "weight_sync",
    "replay_buffer_poll",
    "fsdp2_offload_policy",
}


def test_all_contracts_hold_on_installed_verl():
    modules = (platform, engines, hf_rollout, polling)
    results = [r for m in modules for r in m.check_contracts()]
    assert [r.name for r in results] == [c.name for m in modules for c in m.CONTRACTS]
    assert {r.name for r in results} == CPU_CONTRACTS
    failed = [f"{r.name}: {r.detail}" for r in results if not r.ok]
    assert not failed, failed


def test_doctor_collects_every_module_in_one_way():
    modules = runtime.contract_modules()
    assert modules[:4] == (platform, engines, hf_rollout, polling)
    assert (vllm_rollout in modules) == (vllm_rollout.installed_version() is not None)
    names = [c.name for m in modules for c in m.CONTRACTS]
    assert len(names) == len(set(names)), "contract names must be unique across modules"
    assert CPU_CONTRACTS <= set(names)


def test_the_mechanism_knows_no_module():
    tree = ast.parse(Path(contracts.__file__).read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m and m.startswith("verl")], imported


def test_broken_contract_is_named(monkeypatch):
    from verl.workers.rollout import base

    monkeypatch.delattr(base, "_ROLLOUT_REGISTRY")
    with pytest.raises(contracts.ContractError, match=r"\[rollout_registry\].*_ROLLOUT_REGISTRY"):
        contracts.require(hf_rollout.CONTRACTS, "rollout_registry")
    assert [r.ok for r in hf_rollout.check_contracts(["rollout_registry"])] == [False]


def test_version_pin_is_checked(monkeypatch):
    import verl

    monkeypatch.setattr(verl, "__version__", "0.9.2")
    (result,) = platform.check_contracts(["verl_version"])
    assert not result.ok and "pinned to verl==0.9.1" in result.detail


def test_server_method_drift_is_detected(monkeypatch):
    from verl_stable.backends.hf.rollout import HFRolloutServer

    monkeypatch.delattr(HFRolloutServer, "release_kv_cache")
    (result,) = hf_rollout.check_contracts(["server_methods"])
    assert not result.ok and "release_kv_cache" in result.detail


def test_unknown_contract_name():
    with pytest.raises(ValueError, match="unknown contracts"):
        contracts.require(hf_rollout.CONTRACTS, "no_such_contract")


def test_a_check_that_raises_becomes_a_failed_result():
    def broken() -> str:
        raise KeyError("gone")

    ok = contracts.Contract("fine", "holds", lambda: "found")
    bad = contracts.Contract("broken", "the thing", broken)
    results = contracts.check((ok, bad))
    assert results == [
        contracts.ContractResult("fine", True, "found"),
        contracts.ContractResult("broken", False, "the thing: KeyError: 'gone'"),
    ]
    assert contracts.check((ok, bad), ["fine"]) == results[:1]
    contracts.require((ok, bad), "fine")
    with pytest.raises(contracts.ContractError, match=r"verl contract broken: \[broken\] the thing: KeyError"):
        contracts.require((ok, bad), "fine", "broken")


def test_registration_is_idempotent_and_reaches_verls_tables():
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    assert runtime.register() == runtime.register()
    assert base._ROLLOUT_REGISTRY[("hf", "async")] == hf_rollout.ADAPTER_FQN
    assert base.get_rollout_class("hf", "async") is hf_rollout.HFServerAdapter
    assert RolloutReplicaRegistry.get("hf") is hf_rollout.replica_class()


def test_doctor_reports_registration():
    runtime.register()
    results = {r.name: r for r in runtime.doctor()}
    assert results["cpu_runtime_registered"].ok, results["cpu_runtime_registered"].detail
    assert CPU_CONTRACTS <= set(results)
    assert all(r.ok for r in results.values()), [r for r in results.values() if not r.ok]


def test_offload_policy_contract_detects_a_renamed_import(monkeypatch):
    from verl.workers.engine.fsdp import transformer_impl

    monkeypatch.delattr(transformer_impl, "CPUOffloadPolicy")
    (result,) = engines.check_contracts(["fsdp2_offload_policy"])
    assert not result.ok and "CPUOffloadPolicy" in result.detail
