"""The monitored verl trainers, driven with real verl objects (config, registry, TensorDict layout) on small tensors."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import verl
from hydra import compose, initialize_config_dir
from verl.trainer.ppo.v1 import get_trainer_cls
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils import tensordict_utils as tu
from verl.utils.tensordict_utils import list_of_dict_to_tensordict
from verl.workers.utils.padding import response_to_nested

from verl_stable.integration import trainer as T
from verl_stable.integration.guard_actions import GuardActionsMixin
from verl_stable.monitor import checkpoints as CK
from verl_stable.monitor import step as S
from verl_stable.monitor import update_metrics as U
from verl_stable.monitor.guard import GuardTripped

CONFIG_DIR = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")


def _config(*overrides):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


@pytest.fixture(scope="module")
def registered():
    return T.register()


@pytest.fixture
def sync_trainer(registered, tmp_path):
    cfg = _config(
        "trainer.v1.trainer_mode=stable_sync",
        f"trainer.default_local_dir={tmp_path}",
        "+stable.guard.rules.train_inference_kl.threshold=0.02",
    )
    trainer = get_trainer_cls(cfg.trainer.v1.trainer_mode)(cfg)
    trainer.global_steps = 7
    trainer.total_training_steps = 100
    return trainer


def test_register_is_idempotent_and_selects_monitored_trainers(registered):
    assert registered == ["trainer:stable_sync", "trainer:stable_colocate_async", "trainer:stable_separate_async"]
    assert T.register() == registered
    assert get_trainer_cls("stable_sync") is T.StablePPOTrainerSync
    assert issubclass(T.StablePPOTrainerSync, PPOTrainerSync)
    assert get_trainer_cls("sync") is PPOTrainerSync  # verl's own trainer is untouched


def test_monitored_trainer_behaves_as_its_base_mode(sync_trainer):
    # verl branches on trainer_mode == "sync" (replay buffer kind, TQ checkpointing, refill policy)
    assert sync_trainer.trainer_mode == "sync"
    assert sync_trainer._stable_registered_mode == "stable_sync"
    assert type(sync_trainer.replay_buffer) is ReplayBuffer and not isinstance(
        sync_trainer.replay_buffer, ReplayBufferAsync
    )


@pytest.mark.parametrize(("interval", "measured_steps"), [(1, [1, 2, 3, 4, 5]), (2, [1, 3, 5]), (3, [1, 4]), (0, [])])
def test_the_trainer_tells_the_actor_which_steps_measure_replay_metrics(registered, tmp_path, interval, measured_steps):
    """``stable.monitor.replay_metrics_interval``: step 1 and every N-th after it carry ``stable_replay_metrics=True``
    in the batch's ``extra_info`` (which verl hands the engine as non-tensor data), the other steps ``False``."""
    from transfer_queue import KVBatchMeta

    from verl_stable.integration.megatron_replay import REPLAY_METRICS_FLAG
    from verl_stable.recipes.compose import compose_recipe

    cfg = compose_recipe(
        "megatron",
        "minirl_n4_r3",
        [f"trainer.default_local_dir={tmp_path}", f"+stable.monitor.replay_metrics_interval={interval}"],
    )
    trainer = get_trainer_cls(cfg.trainer.v1.trainer_mode)(cfg)
    seen = []
    for step in range(1, 6):
        trainer.global_steps = step
        batch = KVBatchMeta(partition_id="train", keys=["a"], tags=[{}])
        trainer._stable_mark_replay_metrics(batch)
        if batch.extra_info[REPLAY_METRICS_FLAG]:
            seen.append(step)
    assert seen == measured_steps


def test_stable_config_from_yaml_shape_and_errors():
    cfg = _config("+stable.monitor.taus=[2,3]", "+stable.guard.enable=false")
    parsed = S.StableConfig.from_trainer_config(cfg)
    assert parsed.monitor.taus == (2.0, 3.0) and parsed.guard_enable is False
    assert S.StableConfig.from_trainer_config(_config()) == S.StableConfig()
    with pytest.raises(ValueError, match=r"stable\.gaurd: unknown key \(known: guard, monitor\)"):
        S.StableConfig.from_dict({"gaurd": {}})
    with pytest.raises(ValueError, match="stable.monitor"):
        S.StableConfig.from_dict({"monitor": {"tau": [2]}})
    with pytest.raises(ValueError, match="action must be one of"):  # a guard typo fails at startup
        S.StableConfig.from_dict({"guard": {"rules": {"non_finite": {"action": "explode"}}}})


@pytest.mark.parametrize("value", ["false", "true", 0, 1, None])
def test_stable_guard_enable_must_be_a_bool(value):
    # bool("false") is True: a quoted YAML value or a string override must be refused, not read as "on"
    with pytest.raises(TypeError, match=r"stable\.guard\.enable must be a bool \(true/false\), got"):
        S.StableConfig.from_dict({"guard": {"enable": value}})


def test_stable_guard_enable_false_disables_the_guard_and_keeps_validating_the_rules():
    parsed = S.StableConfig.from_dict({"guard": {"enable": False, "rules": {"train_inference_kl": {"threshold": 1}}}})
    assert parsed.guard_enable is False and "enable" not in parsed.guard
    assert S.StepMonitor(parsed).guard is None
    assert S.StableConfig.from_dict({"guard": {"enable": True}}).guard_enable is True
    with pytest.raises(ValueError, match="action must be one of"):
        S.StableConfig.from_dict({"guard": {"enable": False, "rules": {"non_finite": {"action": "explode"}}}})


@pytest.mark.parametrize("key", ["enable", "per_update"])
def test_stable_monitor_switches_must_be_bools(key):
    with pytest.raises(TypeError, match=rf"stable\.monitor\.{key} must be a bool"):
        S.StableConfig.from_dict({"monitor": {key: "false"}})


def test_bad_stable_config_fails_when_the_trainer_is_built(registered):
    cfg = _config("trainer.v1.trainer_mode=stable_sync", "+stable.guard.rules.non_finite.action=explode")
    with pytest.raises(ValueError, match="action must be one of"):
        get_trainer_cls("stable_sync")(cfg)


def _tq_answer(rows, with_routing=True):
    """A TensorDict laid out as TransferQueue returns it in verl's V1 trainer (jagged per-sample fields)."""
    fields = []
    for r in rows:
        n = len(r["old"])
        f = {
            "response_mask": torch.tensor(r["mask"]),
            "loss_mask": torch.tensor(r.get("loss_mask", r["mask"])),
            "old_log_probs": torch.tensor(r["old"]),
            "rollout_log_probs": torch.tensor(r["mu"]),
            "entropy": torch.tensor(r["ent"]),
        }
        if with_routing:
            f["routed_experts"] = torch.tensor(r["routing"], dtype=torch.int16)
        assert all(len(v) == n for k, v in f.items() if k != "routed_experts")
        fields.append(f)
    td = list_of_dict_to_tensordict(fields)
    # the IS weights go through verl's own padded -> nested writer, as in PPOTrainer._compute_advantage
    padded = td.select("response_mask", "old_log_probs", "rollout_log_probs").to_padded_tensor()
    weights = torch.exp(padded["old_log_probs"] - padded["rollout_log_probs"]).clamp(max=2.0)
    td["rollout_is_weights"] = response_to_nested(weights, td["response_mask"])
    return td


ROWS = [
    {  # 3 tokens; routing: 2 prompt rows + 3 response rows, layer 0 dense (zeros), top-2 of 4 experts
        "mask": [1, 1, 1],
        "old": [-1.0, -0.5, -0.2],
        "mu": [-1.0, -1.5, -0.2],
        "ent": [0.5, 0.7, 0.9],
        "routing": [[[0, 0], [0, 1]], [[0, 0], [2, 3]], [[0, 0], [0, 1]], [[0, 0], [1, 2]], [[0, 0], [0, 0]]],
    },
    {  # 1 token
        "mask": [1],
        "old": [-2.0],
        "mu": [-2.0],
        "ent": [0.1],
        "routing": [[[0, 0], [0, 3]], [[0, 0], [1, 3]]],
    },
    {  # a padding sample verl added for divisibility: must be ignored
        "mask": [1, 1],
        "old": [-50.0, -50.0],
        "mu": [0.0, 0.0],
        "ent": [100.0, 100.0],
        "routing": [[[0, 0], [3, 2]]],
    },
]


def test_monitor_batch_from_transfer_queue_layout():
    batch = S.MonitorBatch.from_tensordict(_tq_answer(ROWS), keep_rows=[True, True, False])
    assert batch.tokens["old_log_probs"].shape == (2, 3)
    assert batch.tokens["response_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert [tuple(r.shape) for r in batch.rollout_routing] == [(5, 2, 2), (2, 2, 2)]
    assert batch.train_routing is None
    with pytest.raises(ValueError, match="keep_rows"):
        S.MonitorBatch.from_tensordict(_tq_answer(ROWS), keep_rows=[True, False])
    with pytest.raises(ValueError, match="response_mask"):
        S.MonitorBatch.from_tensordict(_tq_answer(ROWS).exclude("response_mask"))


def test_step_monitor_logs_stable_metrics_by_hand():
    monitor = S.StepMonitor(S.StableConfig.from_dict({"monitor": {"num_experts": 4}}))
    batch = S.MonitorBatch.from_tensordict(_tq_answer(ROWS), keep_rows=np.array([True, True, False]))
    metrics = {"actor/pg_loss": 0.1, "actor/grad_norm": 1.0, "actor/stable/staleness/ratio_max": 1.3}
    verdicts = monitor.step(1, batch, metrics)
    assert [(v.rule, v.step) for v in verdicts] == [("train_inference_kl", 1)]  # k3 = 0.18 > 0.01
    d = [0.0, -1.0, 0.0, 0.0]  # logp_mu - logp_old over the 4 valid tokens
    assert metrics["stable/valid_tokens"] == 4
    assert metrics["stable/train_inf/kl_k1"] == pytest.approx(sum(d) / 4)
    assert metrics["stable/train_inf/kl_k3"] == pytest.approx(sum(math.exp(-x) - 1 + x for x in d) / 4)
    assert metrics["stable/train_inf/extreme_frac_tau2"] == pytest.approx(1 / 4)  # ratio e = 2.72 > 2
    assert metrics["stable/train_inf/frac_truncated"] == pytest.approx(1 / 4)  # capped at 2
    assert metrics["stable/entropy/mean"] == pytest.approx((0.5 + 0.7 + 0.9 + 0.1) / 4)
    assert metrics["stable/is/ess"] == pytest.approx(5.0**2 / (4 * 7.0))  # weights 1, 2, 1, 1
    # layer 1 loads over the 6 rows with data: e0=3, e1=3, e2=2, e3=4 -> max/mean = 4/3
    assert metrics["stable/routing/load/layer_1/max_over_mean"] == pytest.approx(4 / 3)
    assert "stable/routing/load/layer_0/max_over_mean" not in metrics
    assert metrics["stable/staleness/ratio_max"] == 1.3 and "actor/stable/staleness/ratio_max" not in metrics
    assert metrics["stable/guard/train_inference_kl"] == 1.0 and metrics["stable/guard/non_finite"] == 0.0


def test_step_monitor_entropy_slope_and_guard_verdicts():
    monitor = S.StepMonitor(S.StableConfig.from_dict({"guard": {"rules": {"entropy_collapse": {"window": 3}}}}))
    seen = []
    for step, ent in enumerate([0.4, 0.3, 0.2, 0.1], start=1):
        rows = [dict(r, ent=[ent] * len(r["ent"]), mu=r["old"]) for r in ROWS[:2]]  # on-policy: KL = 0
        metrics = {"actor/grad_norm": 1.0}
        verdicts = monitor.step(step, S.MonitorBatch.from_tensordict(_tq_answer(rows, with_routing=False)), metrics)
        seen.append((metrics.get("stable/entropy/slope"), [v.rule for v in verdicts]))
    assert seen[0] == (None, [])
    assert seen[1][0] == pytest.approx(-0.1)
    assert seen[2] == (pytest.approx(-0.1), ["entropy_collapse"])  # 0.2 < 0.25, falling over 3 steps
    metrics = {"actor/grad_norm": float("nan")}
    assert [v.rule for v in monitor.step(5, None, metrics)] == ["non_finite"]


def test_routing_disagreement_uses_the_routing_issue_function():
    td = _tq_answer(ROWS[:2])
    train = [r.clone() for r in td["routed_experts"].unbind(0)]
    train[0][1, 1] = torch.tensor([2, 1], dtype=torch.int16)  # one decision differs: {2,3} -> {1,2}
    train[0][3, 1] = torch.tensor([2, 1], dtype=torch.int16)  # same set {1,2} in another order: agrees
    fields = [
        {"response_mask": m, "trained_experts": t} for m, t in zip(td["response_mask"].unbind(0), train, strict=True)
    ]
    td["trained_experts"] = list_of_dict_to_tensordict(fields)["trained_experts"]
    monitor = S.StepMonitor(S.StableConfig.from_dict({"monitor": {"train_routing_field": "trained_experts"}}))
    metrics = {}
    monitor.step(1, S.MonitorBatch.from_tensordict(td, train_routing_field="trained_experts"), metrics)
    # 6 token rows with data, one MoE layer (the dense layer 0 is dropped): 1 of 6 decisions differs
    assert metrics["stable/routing/rollout_vs_train/layer_0"] == pytest.approx(1 / 6)
    assert metrics["stable/routing/rollout_vs_train/overall"] == pytest.approx(1 / 6)
    assert metrics["stable/routing/rollout_vs_train/token_any_layer"] == pytest.approx(1 / 6)
    assert metrics["stable/routing/rollout_vs_train/layer_max"] == pytest.approx(1 / 6)


def test_stopping_verdict_ends_the_loop_and_names_the_last_good_checkpoint(sync_trainer, tmp_path):
    # folders holding only data.pt, as verl's rotation leaves them: no weights, never named
    # (tests/integration/test_checkpoint_resumable.py names real checkpoints written by verl's checkpoint manager)
    for step in (2, 4, 6):
        (tmp_path / f"global_step_{step}").mkdir()
        (tmp_path / f"global_step_{step}" / "data.pt").write_bytes(b"")
    (tmp_path / "global_step_x").mkdir()
    monitor = sync_trainer._stable_state()
    metrics = {"actor/grad_norm": float("inf")}
    verdicts = monitor.step(7, None, metrics)
    sync_trainer._stable_handle(verdicts, 7)
    # the loop condition (global_steps <= total_training_steps after the increment) now ends the run
    assert sync_trainer.total_training_steps == 7
    (trip,) = sync_trainer._stable_trip
    assert trip.rule == "non_finite" and trip.last_good_checkpoint is None
    exc = GuardTripped(sync_trainer._stable_trip)
    assert "step 7" in str(exc) and "global_step_" not in str(exc) and "actor/grad_norm=inf" in str(exc)
    assert "last good checkpoint: none (no resumable checkpoint before the trip" in str(exc)  # saved, not resumable


def test_warn_verdict_does_not_stop(registered, tmp_path):
    cfg = _config(
        "trainer.v1.trainer_mode=stable_sync",
        "+stable.guard.rules.train_inference_kl.action=warn",
    )
    trainer = get_trainer_cls("stable_sync")(cfg)
    trainer.global_steps, trainer.total_training_steps = 3, 10
    verdicts = trainer._stable_state().step(3, None, {"stable/train_inf/kl_k3": 0.5})
    trainer._stable_handle(verdicts, 3)
    assert [v.action for v in verdicts] == ["warn"]
    assert trainer.total_training_steps == 10 and trainer._stable_trip == []


def test_saved_checkpoint_steps(tmp_path):
    assert CK.saved_checkpoint_steps(str(tmp_path / "missing")) == []
    for name in ("global_step_10", "global_step_2", "global_step_", "other"):
        (tmp_path / name).mkdir()
    (tmp_path / "global_step_3").write_text("not a folder")
    assert CK.saved_checkpoint_steps(str(tmp_path)) == [2, 10]


def test_registration_waits_for_verls_trainer_package_in_a_fresh_process():
    # The plugin runs in every process: it must not import verl's trainer stack (and engines) itself.
    code = (
        "import sys\n"
        "from verl_stable.integration import trainer as T\n"
        "print(T.register())\n"
        "assert 'verl.trainer.ppo.v1' not in sys.modules and 'verl.workers.engine' not in sys.modules\n"
        "from verl.trainer.ppo.v1 import get_trainer_cls\n"
        "cls = get_trainer_cls('stable_colocate_async')\n"
        "print(cls.__name__, cls.__mro__[3].__name__, T.register())\n"
        "from verl_stable.compat import import_hooks\n"
        "assert not import_hooks.pending_hooks() and not import_hooks.finder_installed()\n"
    )
    env = dict(os.environ, VERL_USE_EXTERNAL_PLUGINS="none")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    first, last = out.strip().splitlines()[-2:]
    assert "trainer:stable_sync (on import of verl.trainer.ppo.v1)" in first
    assert last.startswith("StablePPOTrainerColocateAsync PPOTrainerColocateAsync ['trainer:stable_sync'")


def test_per_update_metrics_split_verls_per_mini_step_lists():
    raw = {
        "actor/stable/staleness/ratio_dev_max": [0.0, 0.25, 0.5],
        "actor/stable/staleness/frac_outside_trust_region": [0.0, 0.1, 0.2],
        "stable/routing/r2_drift": [0.0, 0.05, 0.125],  # the engine's keys reach the driver without "actor/"
        "stable/routing/compared_rows": [10.0, 10.0, 10.0],  # not a per-update metric
        "actor/pg_loss": [1.0, 2.0, 3.0],
        "actor/stable/staleness/ratio_mean": 1.0,  # not a list: nothing to split
    }
    out, count = U.per_update_metrics(raw, first_update=2)
    assert count == 3
    assert out == {
        "stable/staleness/update_2/ratio_dev_max": 0.0,
        "stable/staleness/update_3/ratio_dev_max": 0.25,
        "stable/staleness/update_4/ratio_dev_max": 0.5,
        "stable/staleness/update_2/frac_outside_trust_region": 0.0,
        "stable/staleness/update_3/frac_outside_trust_region": 0.1,
        "stable/staleness/update_4/frac_outside_trust_region": 0.2,
        "stable/routing/update_2/r2_drift": 0.0,
        "stable/routing/update_3/r2_drift": 0.05,
        "stable/routing/update_4/r2_drift": 0.125,
    }
    assert U.per_update_metrics({"actor/pg_loss": [1.0]}) == ({}, 0)
    with pytest.raises(ValueError, match="disagree on the number of mini-steps"):
        U.per_update_metrics({"stable/routing/r2_drift": [0.0], "actor/stable/staleness/kl_k3": [0.0, 1.0]})
    with pytest.raises(ValueError, match="not a number"):
        U.per_update_metrics({"stable/routing/r2_drift": [[0.0, 1.0]]})


class _ActorWorkerGroup:
    """Stands in for verl's remote actor worker group: answers ``update_actor`` as verl's worker lays it out."""

    def __init__(self, metrics):
        self.metrics = metrics
        self.calls = 0

    def update_actor(self, batch):
        self.calls += 1
        return tu.get_tensordict(
            tensor_dict={}, non_tensor_dict={"metrics": {k: list(v) for k, v in self.metrics.items()}}
        )


def test_update_actor_logs_one_value_per_mini_step_next_to_verls_reduction(sync_trainer):
    from transfer_queue import KVBatchMeta

    group = _ActorWorkerGroup(
        {
            "actor/stable/staleness/ratio_dev_max": [1e-7, 0.5],
            "stable/routing/r2_drift": [0.0, 0.25],
            "actor/pg_loss": [1.0, 3.0],
            "mfu": [0.1, 0.1],
        }
    )
    sync_trainer.actor_rollout_wg = group
    sync_trainer._stable_updates_in_step = 0
    metrics = {}
    for _ in range(2):  # two local updates in one logged step (an async mode's parameter_sync_step = 2)
        sync_trainer._update_actor(KVBatchMeta(partition_id="train", keys=["a"], tags=[{}]), metrics)
    assert sync_trainer.actor_rollout_wg is group and group.calls == 2  # the tap is gone again
    assert metrics["stable/staleness/update_0/ratio_dev_max"] == 1e-7
    assert metrics["stable/staleness/update_1/ratio_dev_max"] == 0.5
    assert metrics["stable/routing/update_3/r2_drift"] == 0.25
    assert sync_trainer._stable_updates_in_step == 4
    # verl's own reduction of the same lists is still logged, by verl's rules (max for *max*, else mean)
    assert metrics["actor/stable/staleness/ratio_dev_max"] == 0.5
    assert metrics["actor/stable/routing/r2_drift"] == pytest.approx(0.125)
    assert metrics["actor/pg_loss"] == 2.0
    sync_trainer._stable_state().step(7, None, metrics)
    assert metrics["stable/routing/r2_drift"] == pytest.approx(0.125) and "actor/stable/routing/r2_drift" not in metrics


def test_per_update_metrics_can_be_switched_off(registered, tmp_path):
    from transfer_queue import KVBatchMeta

    cfg = _config("trainer.v1.trainer_mode=stable_sync", "+stable.monitor.per_update=false")
    trainer = get_trainer_cls("stable_sync")(cfg)
    trainer.global_steps = 1  # verl's fit sets it before the first step
    trainer.actor_rollout_wg = _ActorWorkerGroup({"stable/routing/r2_drift": [0.0, 0.25], "mfu": [0.1, 0.1]})
    metrics = {}
    trainer._update_actor(KVBatchMeta(partition_id="train", keys=["a"], tags=[{}]), metrics)
    assert not any("/update_" in k for k in metrics) and metrics["actor/stable/routing/r2_drift"] == 0.125


@pytest.mark.parametrize("mode", ["stable_sync", "stable_colocate_async", "stable_separate_async"])
def test_every_registered_trainer_has_the_hooks_over_verls_trainer_of_its_mode(registered, mode):
    cls = get_trainer_cls(mode)
    base_mode = mode.removeprefix("stable_")
    module_name, class_name = T.BASE_TRAINERS[base_mode]
    base = getattr(__import__(module_name, fromlist=[class_name]), class_name)
    assert cls.__mro__[1:4] == (T.StabilityMonitorMixin, GuardActionsMixin, base)
    for hook in ("_compute_metrics", "_update_actor", "_compute_old_log_prob", "_compute_ref_log_prob", "step", "fit"):
        assert getattr(cls, hook) is getattr(T.StabilityMonitorMixin, hook), hook
    for hook in ("_save_checkpoint", "_load_checkpoint"):  # the guard's run state beside verl's checkpoints
        assert getattr(cls, hook) is getattr(GuardActionsMixin, hook), hook
        assert hasattr(base, hook), f"verl's {class_name} has no {hook}: the hook would never run"
    assert cls._stable_base_mode == base_mode


def test_stable_sync_hands_the_trainer_each_sampled_batch_in_dispatch_order(registered, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from transfer_queue import KVBatchMeta

    from verl_stable.transport.seeding import DispatchLedger

    def as_finished(self, global_steps, partition_id, batch_size):  # verl's order: as the samples were put
        keys = ["b_0_0", "a_1_0", "c_0_0", "a_0_0"]
        return KVBatchMeta(keys=keys, tags=[{"k": k} for k in keys], partition_id=partition_id), {"gen": 1.0}

    monkeypatch.setattr(ReplayBuffer, "sample", as_finished)
    cfg = _config("trainer.v1.trainer_mode=stable_sync", f"trainer.default_local_dir={tmp_path}")
    trainer = get_trainer_cls("stable_sync")(cfg)
    ledger = DispatchLedger()
    ledger.record(["a", "b"])  # "c" came from elsewhere (e.g. restored): after the dispatched ones
    trainer.agent_loop_manager = SimpleNamespace(stable_dispatch=ledger)
    batch, metrics = trainer.replay_buffer.sample(global_steps=1, partition_id="train", batch_size=3)
    assert batch.keys == ["a_0_0", "a_1_0", "b_0_0", "c_0_0"] and metrics == {"gen": 1.0}
    assert [t["k"] for t in batch.tags] == batch.keys  # tags travel with their keys
    # verl's own agent-loop manager records nothing: the batch stays as verl sampled it
    trainer.agent_loop_manager = SimpleNamespace()
    batch, _ = trainer.replay_buffer.sample(global_steps=1, partition_id="train", batch_size=3)
    assert batch.keys == ["b_0_0", "a_1_0", "c_0_0", "a_0_0"]
