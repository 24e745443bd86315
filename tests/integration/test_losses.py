"""The ``minirl`` / ``vespo`` policy losses inside real verl: registry, ``ppo_loss``, configs, micro-batching."""

import math
import os
import subprocess
import sys
from functools import partial

import numpy as np
import pytest
import torch
import verl  # noqa: F401  (loads the verl.plugins entry point, which registers the losses)
from testkit import losses as testkit_losses
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.utils import tensordict_utils as tu
from verl.utils.metric import Metric
from verl.workers.config import ActorConfig, PolicyLossConfig
from verl.workers.utils.losses import ppo_loss

from verl_stable.integration import losses
from verl_stable.integration.losses import MiniRLLossConfig, StablePolicyLossConfig, VespoLossConfig

EPS_LOW, EPS_HIGH = 0.2, 0.27


def actor_config(loss_mode: str, loss_agg_mode: str = "seq-mean-token-sum", **policy_loss) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp",
        rollout_n=4,
        ppo_micro_batch_size_per_gpu=2,
        clip_ratio_low=EPS_LOW,
        clip_ratio_high=EPS_HIGH,
        loss_agg_mode=loss_agg_mode,
        policy_loss=StablePolicyLossConfig(loss_mode=loss_mode, **policy_loss),
    )


ragged_batch = partial(testkit_losses.ragged_batch, batch=8, length=7, spread=0.3, holes=0.1)


def minirl_objective_grad(log_prob, old, adv, mask, weights):
    r = torch.exp(log_prob - old)
    masked = ((adv > 0) & (r > 1 + EPS_HIGH)) | ((adv < 0) & (r < 1 - EPS_LOW))
    return torch.where(mask & ~masked, weights * r * adv, 0.0)


def ppo_data(log_prob, old, adv, mask, weights, *, global_tokens, global_batch, prompt_seed=0):
    """A verl TensorDict for ``ppo_loss`` in padded mode, plus model-output log-probs laid out as verl's engine
    returns them (one flat, unpadded tensor over prompt + response tokens), differentiable w.r.t. ``log_prob``."""
    batch, length = log_prob.shape
    g = torch.Generator().manual_seed(prompt_seed)
    prompt_width = 3
    prompt_lens = torch.randint(1, prompt_width + 1, (batch,), generator=g)
    resp_lens = torch.stack([row.nonzero().max() + 1 for row in mask])
    attention = torch.zeros(batch, prompt_width + length, dtype=torch.long)
    pieces = []
    for i in range(batch):
        p, n = int(prompt_lens[i]), int(resp_lens[i])
        attention[i, prompt_width - p : prompt_width + n] = 1
        # Engine output is shifted by one: position k holds the log-prob of token k + 1.
        pieces += [log_prob.new_zeros(p - 1), log_prob[i, :n], log_prob.new_zeros(1)]
    tensors = {
        "prompts": torch.zeros(batch, prompt_width, dtype=torch.long),
        "responses": torch.zeros(batch, length, dtype=torch.long),
        "attention_mask": attention,
        "response_mask": mask.long(),
        "old_log_probs": old,
        "advantages": adv,
    }
    if weights is not None:
        tensors["rollout_is_weights"] = weights
    data = tu.get_tensordict(
        tensors, non_tensor_dict={"dp_size": 1, "batch_num_tokens": global_tokens, "global_batch_size": global_batch}
    )
    return data, {"log_probs": torch.cat(pieces)}


def test_registered_by_import_verl_alone():
    code = (
        "import sys, verl\n"
        "from verl.trainer.ppo.core_algos import get_policy_loss_fn\n"
        "fns = [get_policy_loss_fn(n) for n in ('minirl', 'vespo')]\n"
        "print([f.__module__ for f in fns])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "['verl_stable.integration.losses', 'verl_stable.integration.losses']"


def test_register_is_idempotent_and_refuses_foreign_functions(monkeypatch):
    assert losses.register() == ["minirl", "vespo"]
    assert losses.register() == ["minirl", "vespo"]
    assert get_policy_loss_fn("minirl") is losses.compute_policy_loss_minirl
    assert get_policy_loss_fn("vespo") is losses.compute_policy_loss_vespo

    def foreign(**kwargs):
        raise AssertionError

    monkeypatch.setitem(core_algos.POLICY_LOSS_REGISTRY, "vespo", foreign)
    with pytest.raises(RuntimeError, match="already registered"):
        losses.register()


@pytest.mark.parametrize("loss_agg_mode", ["seq-mean-token-sum", "token-mean"])
def test_minirl_gradient_through_registry(loss_agg_mode):
    log_prob, old, adv, mask, weights = ragged_batch(0)
    leaf = log_prob.clone().requires_grad_(True)
    loss, metrics = get_policy_loss_fn("minirl")(
        old_log_prob=old,
        log_prob=leaf,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=loss_agg_mode,
        config=actor_config("minirl", loss_agg_mode),
        rollout_is_weights=weights,
    )
    loss.backward()
    divisor = mask.any(-1).sum() if loss_agg_mode == "seq-mean-token-sum" else mask.sum()
    torch.testing.assert_close(leaf.grad, -minirl_objective_grad(log_prob, old, adv, mask, weights) / divisor)
    assert 0 < metrics["actor/pg_clipfrac"] < 1
    assert {"actor/ppo_kl", "actor/MiniRL/masked_frac_high", "actor/MiniRL/is_weight_max"} <= set(metrics)
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())


def test_vespo_gradient_through_registry_with_configured_constants():
    log_prob, old, adv, mask, weights = ragged_batch(1)
    old = log_prob + 0.05 * (old - log_prob)  # keep W moderate
    kernel = VespoLossConfig(c1_pos=1.0, c2_pos=0.5, c1_neg=4.0, c2_neg=1.0)
    leaf = log_prob.clone().requires_grad_(True)
    loss, metrics = get_policy_loss_fn("vespo")(
        old_log_prob=old,
        log_prob=leaf,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode="seq-mean-token-sum",
        config=actor_config("vespo", vespo=kernel),
        rollout_is_weights=weights,
    )
    loss.backward()
    log_w = torch.where(mask, log_prob - old + torch.log(weights), 0.0).sum(-1, keepdim=True).clamp(-20, 20)
    big_w = torch.exp(log_w)
    c1 = torch.where(adv > 0, 1.0, 4.0)
    c2 = torch.where(adv > 0, 0.5, 1.0)
    phi = big_w**c1 * torch.exp(c2 * (1 - big_w))
    expected = torch.where(mask, -phi * adv, 0.0) / mask.any(-1).sum()
    torch.testing.assert_close(leaf.grad, expected)
    assert {"actor/vespo/w_mean", "actor/vespo/phi_max", "actor/vespo/seq_log_is_mean"} <= set(metrics)
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("loss_mode", ["minirl", "vespo"])
def test_through_verl_ppo_loss_matches_direct_call(loss_mode):
    log_prob, old, adv, mask, weights = ragged_batch(2)
    config = actor_config(loss_mode)
    leaf = log_prob.clone().requires_grad_(True)
    data, model_output = ppo_data(leaf, old, adv, mask, weights, global_tokens=None, global_batch=None)
    loss, metrics = ppo_loss(config, model_output, data)
    loss.backward()

    direct_leaf = log_prob.clone().requires_grad_(True)
    direct_loss, direct_metrics = get_policy_loss_fn(loss_mode)(
        old_log_prob=old,
        log_prob=direct_leaf,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode="seq-mean-token-sum",
        config=actor_config(loss_mode),
        rollout_is_weights=weights,
    )
    direct_loss.backward()
    torch.testing.assert_close(loss, direct_loss)
    torch.testing.assert_close(leaf.grad, direct_leaf.grad)
    assert isinstance(metrics["actor/pg_loss"], Metric)
    for key, value in direct_metrics.items():
        assert metrics[key].aggregate() == pytest.approx(value)


@pytest.mark.parametrize("loss_mode", ["minirl", "vespo"])
@pytest.mark.parametrize("loss_agg_mode", ["seq-mean-token-sum", "token-mean", "seq-mean-token-mean"])
def test_micro_batching_invariance_through_ppo_loss(loss_mode, loss_agg_mode):
    log_prob, old, adv, mask, weights = ragged_batch(3, batch=9)
    global_tokens, global_batch = int(mask.sum()), mask.shape[0]

    def grad_of(rows_list):
        config = actor_config(loss_mode, loss_agg_mode)
        leaf = log_prob.clone().requires_grad_(True)
        for rows in rows_list:
            sl = slice(*rows)
            data, out = ppo_data(
                leaf[sl],
                old[sl],
                adv[sl],
                mask[sl],
                weights[sl],
                global_tokens=global_tokens,
                global_batch=global_batch,
            )
            loss, _ = ppo_loss(config, out, data)
            loss.backward()
        return leaf.grad

    full = grad_of([(0, 9)])
    split = grad_of([(0, 2), (2, 7), (7, 9)])
    torch.testing.assert_close(split, full)
    assert full.abs().sum() > 0


def test_minirl_missing_weights_error_and_explicit_opt_out():
    log_prob, old, adv, mask, _ = ragged_batch(4)
    kwargs = dict(old_log_prob=old, advantages=adv, response_mask=mask, loss_agg_mode="seq-mean-token-sum")
    with pytest.raises(ValueError, match=r"rollout_is=token.*rollout_is_threshold=5\.0.*allow_missing_rollout_is"):
        get_policy_loss_fn("minirl")(log_prob=log_prob, config=actor_config("minirl"), **kwargs)
    # Plain verl PolicyLossConfig: paper defaults, so missing weights still raise.
    plain = ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, policy_loss=PolicyLossConfig(loss_mode="minirl")
    )
    with pytest.raises(ValueError, match="rollout_is_weights=None"):
        get_policy_loss_fn("minirl")(log_prob=log_prob, config=plain, **kwargs)

    opted_out = actor_config("minirl", minirl=MiniRLLossConfig(allow_missing_rollout_is_weights=True))
    a = log_prob.clone().requires_grad_(True)
    get_policy_loss_fn("minirl")(log_prob=a, config=opted_out, **kwargs)[0].backward()
    b = log_prob.clone().requires_grad_(True)
    get_policy_loss_fn("minirl")(
        log_prob=b, config=actor_config("minirl"), rollout_is_weights=torch.ones_like(old), **kwargs
    )[0].backward()
    torch.testing.assert_close(a.grad, b.grad)

    # Through ppo_loss, a batch without the rollout_is_weights field.
    data, out = ppo_data(log_prob, old, adv, mask, None, global_tokens=None, global_batch=None)
    with pytest.raises(ValueError, match="rollout_is=token"):
        ppo_loss(actor_config("minirl"), out, data)
    loss, _ = ppo_loss(opted_out, out, data)
    assert torch.isfinite(loss)


@pytest.mark.parametrize("loss_mode", ["minirl", "vespo"])
@pytest.mark.parametrize("loss_agg_mode", ["seq-mean-token-sum", "token-mean", "seq-mean-token-mean", "token-sum"])
def test_all_zero_mask_gives_zero_loss_and_zero_grads(loss_mode, loss_agg_mode):
    log_prob, old, adv, mask, weights = ragged_batch(5)
    leaf = log_prob.clone().requires_grad_(True)
    loss, metrics = get_policy_loss_fn(loss_mode)(
        old_log_prob=old,
        log_prob=leaf,
        advantages=adv,
        response_mask=torch.zeros_like(mask),
        loss_agg_mode=loss_agg_mode,
        config=actor_config(loss_mode, loss_agg_mode),
        rollout_is_weights=weights,
    )
    loss.backward()
    assert loss.item() == 0.0
    assert (leaf.grad == 0).all()
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("loss_mode", ["minirl", "vespo"])
def test_bad_input_through_registry(loss_mode):
    log_prob, old, adv, mask, weights = ragged_batch(6)
    fn = get_policy_loss_fn(loss_mode)
    config = actor_config(loss_mode)
    bad = log_prob.clone()
    bad[mask.nonzero()[:3].T.unbind()] = float("nan")
    with pytest.raises(ValueError, match="log_prob: 3 position"):
        fn(
            old_log_prob=old,
            log_prob=bad,
            advantages=adv,
            response_mask=mask,
            config=config,
            rollout_is_weights=weights,
        )
    with pytest.raises(ValueError, match="shape mismatch"):
        fn(
            old_log_prob=old[:-1],
            log_prob=log_prob,
            advantages=adv,
            response_mask=mask,
            config=config,
            rollout_is_weights=weights,
        )
    with pytest.raises(ValueError, match="needs the actor config"):
        fn(old_log_prob=old, log_prob=log_prob, advantages=adv, response_mask=mask, rollout_is_weights=weights)
    # NaN only at masked positions: a finite loss.
    dirty = log_prob.clone()
    dirty[~mask] = float("nan")
    loss, _ = fn(
        old_log_prob=old, log_prob=dirty, advantages=adv, response_mask=mask, config=config, rollout_is_weights=weights
    )
    assert torch.isfinite(loss)


def test_hydra_config_from_verl_yaml_reaches_the_loss():
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    overrides = [
        "actor_rollout_ref.actor.policy_loss.loss_mode=vespo",
        "actor_rollout_ref.actor.policy_loss._target_=verl_stable.integration.losses.StablePolicyLossConfig",
        "+actor_rollout_ref.actor.policy_loss.vespo.c1_pos=1.5",
        "+actor_rollout_ref.actor.policy_loss.minirl.allow_missing_rollout_is_weights=true",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    ]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
        bad = compose(
            config_name="ppo_trainer", overrides=[*overrides, "+actor_rollout_ref.actor.policy_loss.vespo.c9=1"]
        )
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor.policy_loss, StablePolicyLossConfig)
    assert actor.policy_loss.vespo == VespoLossConfig(c1_pos=1.5)
    assert actor.policy_loss.minirl.allow_missing_rollout_is_weights is True
    with pytest.raises(
        Exception, match=r"policy_loss\.vespo\.c9: unknown key \(known: c1_neg, c1_pos, c2_neg, c2_pos\)"
    ):
        omega_conf_to_dataclass(bad.actor_rollout_ref.actor)

    log_prob, old, adv, mask, _ = ragged_batch(7)
    loss, metrics = get_policy_loss_fn("minirl")(
        old_log_prob=old,
        log_prob=log_prob,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=actor.loss_agg_mode,
        config=actor,
    )
    assert torch.isfinite(loss) and metrics["actor/MiniRL/is_weight_mean"] == 1.0
    assert np.isclose(actor.clip_ratio_high, 0.2)  # verl's own default is untouched


def _hand_staleness(log_prob, old, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH):
    r = torch.exp(log_prob - old)[mask].double()
    outside = (r > 1 + eps_high) | (r < 1 - eps_low)
    return {
        "ratio_mean": float(r.mean()),
        "ratio_min": float(r.min()),
        "ratio_max": float(r.max()),
        "ratio_dev_max": float((r - 1).abs().max()),
        "kl_k3": float((r - 1 - r.log()).mean()),
        "frac_outside_trust_region": float(outside.double().mean()),
    }


@pytest.mark.parametrize("loss_mode", ["minirl", "vespo"])
def test_staleness_metrics_through_verl_ppo_loss_by_hand(loss_mode):
    log_prob, old, adv, mask, weights = ragged_batch(4)
    data, model_output = ppo_data(log_prob, old, adv, mask, weights, global_tokens=None, global_batch=None)
    _, metrics = ppo_loss(actor_config(loss_mode), model_output, data)
    for name, value in _hand_staleness(log_prob, old, mask).items():
        metric = metrics[losses.STALENESS_METRIC_PREFIX + name]
        assert metric.values == [pytest.approx(value, rel=1e-9)], name
    assert 0 < metrics["actor/stable/staleness/frac_outside_trust_region"].values[0] < 1

    # pi_theta == pi_old (the first update mini-step of an on-policy step): no deviation at all
    data, model_output = ppo_data(log_prob, log_prob.clone(), adv, mask, weights, global_tokens=None, global_batch=None)
    _, metrics = ppo_loss(actor_config(loss_mode), model_output, data)
    assert metrics["actor/stable/staleness/ratio_dev_max"].values == [0.0]
    assert metrics["actor/stable/staleness/frac_outside_trust_region"].values == [0.0]


def test_relabelled_extremes_are_exact_over_micro_batches_with_verls_aggregation():
    from verl.utils.py_functional import append_to_dict

    log_prob, old, adv, mask, weights = ragged_batch(5, batch=9)
    collected: dict = {}
    for rows in (slice(0, 2), slice(2, 7), slice(7, 9)):  # three micro-batches of one mini-step
        data, out = ppo_data(
            log_prob[rows], old[rows], adv[rows], mask[rows], weights[rows], global_tokens=None, global_batch=None
        )
        _, metrics = ppo_loss(actor_config("minirl"), out, data)
        append_to_dict(collected, losses.relabel_stable_metrics(metrics))  # what the replay engine's forward_step does
    whole = _hand_staleness(log_prob, old, mask)
    per_micro = [_hand_staleness(log_prob[r], old[r], mask[r]) for r in (slice(0, 2), slice(2, 7), slice(7, 9))]
    step = {key: Metric.aggregate_dp([value]) for key, value in collected.items()}  # verl's per-mini-step value
    p = losses.STALENESS_METRIC_PREFIX
    assert step[p + "ratio_max"] == pytest.approx(whole["ratio_max"])
    assert step[p + "ratio_min"] == pytest.approx(whole["ratio_min"])
    assert step[p + "ratio_dev_max"] == pytest.approx(whole["ratio_dev_max"])
    # means stay verl's unweighted mean over micro-batches, like actor/pg_clipfrac
    assert step[p + "ratio_mean"] == pytest.approx(np.mean([m["ratio_mean"] for m in per_micro]))
    assert step["actor/pg_clipfrac"] == pytest.approx(
        np.mean(collected["actor/pg_clipfrac"].values)
    )  # verl's own metrics are untouched
    assert collected["actor/pg_clipfrac"].aggregation.value == "mean"


def test_stable_metric_aggregation_and_relabel_errors():
    agg = losses.stable_metric_aggregation
    assert agg("actor/stable/staleness/ratio_max").value == "max"
    assert agg("stable/routing/r2_drift").value == "mean"
    assert agg("stable/x/ratio_min").value == "min"
    assert agg("actor/pg_clipfrac") is None and agg("actor/MiniRL/ratio_max") is None
    metrics = {"stable/routing/r2_drift": 0.25, "actor/ppo_kl": 1.0}
    losses.relabel_stable_metrics(metrics)
    drift = metrics["stable/routing/r2_drift"]
    assert isinstance(drift, Metric) and drift.values == [0.25]
    assert metrics["actor/ppo_kl"] == 1.0
    two = Metric("mean")
    two.extend([1.0, 2.0])
    with pytest.raises(ValueError, match="holds 2 values"):
        losses.relabel_stable_metrics({"actor/stable/staleness/ratio_max": two})


def test_metric_names_reduce_as_their_suffix_says_in_verls_trainer():
    """verl reduces per-mini-step values by substring ('max' -> max, 'min' -> min, else mean): names must fit."""
    from verl.utils.metric import reduce_metrics

    log_prob, old, adv, mask, weights = ragged_batch(0)
    keys: set[str] = set()
    for mode in ("minirl", "vespo"):
        _, metrics = get_policy_loss_fn(mode)(
            old_log_prob=old,
            log_prob=log_prob,
            advantages=adv,
            response_mask=mask,
            loss_agg_mode="seq-mean-token-sum",
            config=actor_config(mode, "seq-mean-token-sum"),
            rollout_is_weights=weights,
        )
        keys |= set(metrics)
    assert "actor/MiniRL/ratio_mean" in keys and "actor/vespo/w_mean" in keys
    for key in sorted(keys):
        reduced = reduce_metrics({key: [1.0, 3.0, 2.0]})[key]
        tail = key.rsplit("/", 1)[-1]
        expected = 3.0 if tail.endswith("max") else 1.0 if tail.endswith("min") else 2.0
        assert reduced == expected, f"{key}: verl reduces it to {reduced}, its name says {expected}"
