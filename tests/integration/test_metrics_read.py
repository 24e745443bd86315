"""The monitor's fields ride on verl's metrics read: one TransferQueue request per step instead of two.

Through verl's real ``get_metric_data_with_optional_routed_experts``, looked up in ``verl.trainer.ppo.v1.trainer_base``
as ``_compute_metrics`` looks it up, on an in-memory store with TransferQueue's ``kv_batch_get`` contract
(``testkit.kv_store``): verl gets exactly the fields it asked for, the monitor gets its own from the same request,
and every way the combined read can fail leaves verl's read as verl made it.
"""

from __future__ import annotations

import pytest
import torch
from testkit.kv_store import KVStore
from verl.trainer.ppo.metric_utils import RolloutMoELoadBalanceMetricsAccumulator
from verl.trainer.ppo.v1 import trainer_base

from verl_stable.integration.metrics_read import MonitorRead, joint_metrics_read

VERL_FIELDS = ["responses", "response_mask", "advantages"]
MONITOR_FIELDS = ["response_mask", "old_log_probs", "rollout_log_probs"]
KEYS = ["s0", "s1", "s2"]


@pytest.fixture
def store() -> KVStore:
    store = KVStore()
    for i, key in enumerate(KEYS):
        n = 2 + i
        fields = {name: torch.arange(n, dtype=torch.float32) + 10 * j + i for j, name in enumerate(VERL_FIELDS)}
        fields.update({"old_log_probs": -torch.rand(n), "rollout_log_probs": -torch.rand(n)})
        store.data.setdefault("train", {})[key] = (fields, {})
    return store


def verl_read(store: KVStore, keys=KEYS, interval: int = 0):
    """verl's metrics read, called as ``PPOTrainer._compute_metrics`` calls it (through trainer_base's name)."""
    return trainer_base.get_metric_data_with_optional_routed_experts(
        keys=keys,
        partition_id="train",
        fields=list(VERL_FIELDS),
        moe_lb_metrics_interval=interval,
        global_steps=1,
        accumulator=RolloutMoELoadBalanceMetricsAccumulator(),
        kv_batch_get=store.kv_batch_get,
    )


def assert_same(a, b, names):
    for name in names:
        assert [t.tolist() for t in a[name].unbind(0)] == [t.tolist() for t in b[name].unbind(0)], name


def test_one_request_brings_both_and_verl_sees_only_its_fields(store):
    alone = verl_read(store)
    store.gets.clear()
    original = trainer_base.get_metric_data_with_optional_routed_experts
    read = MonitorRead(keys=KEYS, partition_id="train", fields=MONITOR_FIELDS)
    with joint_metrics_read(read):
        joint = verl_read(store)
    assert trainer_base.get_metric_data_with_optional_routed_experts is original
    assert store.gets == [VERL_FIELDS + ["old_log_probs", "rollout_log_probs"]]  # response_mask asked once
    assert sorted(joint.keys()) == sorted(VERL_FIELDS)
    assert_same(joint, alone, VERL_FIELDS)
    assert sorted(read.data.keys()) == sorted(MONITOR_FIELDS)
    assert_same(
        read.data, store.kv_batch_get(keys=KEYS, partition_id="train", select_fields=MONITOR_FIELDS), MONITOR_FIELDS
    )


def test_a_field_no_sample_has_leaves_verls_read_alone(store):
    read = MonitorRead(keys=KEYS, partition_id="train", fields=[*MONITOR_FIELDS, "stable_routing_boundary"])
    with joint_metrics_read(read):
        joint = verl_read(store)
    assert read.data is None  # the monitor reads alone afterwards
    assert store.gets == [VERL_FIELDS + ["old_log_probs", "rollout_log_probs", "stable_routing_boundary"], VERL_FIELDS]
    assert sorted(joint.keys()) == sorted(VERL_FIELDS)


def test_another_batch_is_not_touched(store):
    read = MonitorRead(keys=KEYS[:2], partition_id="train", fields=MONITOR_FIELDS)
    with joint_metrics_read(read):
        verl_read(store)
    assert read.data is None and store.gets == [VERL_FIELDS]


def test_verls_routed_experts_retry_still_works(store):
    """With verl's MoE load-balance metrics on, a batch without routed_experts is read again without them."""
    read = MonitorRead(keys=KEYS, partition_id="train", fields=MONITOR_FIELDS)
    with joint_metrics_read(read):
        joint = verl_read(store, interval=1)
    extra = ["old_log_probs", "rollout_log_probs"]
    assert store.gets == [
        VERL_FIELDS + ["routed_experts"] + extra,
        VERL_FIELDS + ["routed_experts"],
        VERL_FIELDS + extra,
    ]
    assert sorted(joint.keys()) == sorted(VERL_FIELDS) and sorted(read.data.keys()) == sorted(MONITOR_FIELDS)


def test_nothing_to_read_and_errors_restore_verls_function(store):
    original = trainer_base.get_metric_data_with_optional_routed_experts
    with joint_metrics_read(None) as read:
        assert read is None and trainer_base.get_metric_data_with_optional_routed_experts is original
    with pytest.raises(RuntimeError), joint_metrics_read(MonitorRead(KEYS, "train", MONITOR_FIELDS)):
        assert trainer_base.get_metric_data_with_optional_routed_experts is not original
        raise RuntimeError("verl failed mid-step")
    assert trainer_base.get_metric_data_with_optional_routed_experts is original
