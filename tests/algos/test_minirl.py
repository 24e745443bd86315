"""MiniRL per-token loss: gradients against the analytic formula, the trust-region mask, bad input."""

import math
from functools import partial

import numpy as np
import pytest
import torch
from testkit import losses as testkit_losses

from verl_stable.algos.minirl import minirl_policy_loss

EPS_LOW, EPS_HIGH = 0.2, 0.27


# random token tensors with ragged right padding and a few holes inside responses
ragged_batch = partial(testkit_losses.ragged_batch, batch=6, length=9, spread=0.3, holes=0.15)


def reference_grad(log_prob, old, adv, mask, weights):
    """d(objective)/d(logp_theta) = M * w * r * A, written out independently in numpy."""
    lp, o, a, m, w = (t.detach().numpy() for t in (log_prob, old, adv, mask, weights))
    r = np.exp(lp - o)
    out = np.zeros_like(lp)
    for i, j in np.ndindex(lp.shape):
        if not m[i, j]:
            continue
        masked = (a[i, j] > 0 and r[i, j] > 1 + EPS_HIGH) or (a[i, j] < 0 and r[i, j] < 1 - EPS_LOW)
        out[i, j] = 0.0 if masked else w[i, j] * r[i, j] * a[i, j]
    return out


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_gradient_matches_analytic_formula(seed):
    log_prob, old, adv, mask, weights = ragged_batch(seed)
    leaf = log_prob.clone().requires_grad_(True)
    terms = minirl_policy_loss(leaf, old, adv, mask.float(), weights, clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH)
    terms.loss_mat.sum().backward()
    expected = -reference_grad(log_prob, old, adv, mask, weights)
    np.testing.assert_allclose(leaf.grad.numpy(), expected, rtol=1e-5, atol=1e-7)
    # Some tokens are masked on each side, so the mask is actually exercised.
    metrics = terms.scalars()
    assert 0 < metrics["actor/pg_clipfrac"] < 1
    assert all(math.isfinite(v) for v in metrics.values())
    assert (terms.loss_mat[~mask] == 0).all()


def test_trust_region_mask_each_side():
    # One token per row: (A, r) pairs on both sides of both bounds.
    cases = [
        (1.0, 1.30, False),  # A > 0, above 1 + eps_high -> masked
        (1.0, 1.25, True),
        (1.0, 0.30, True),  # A > 0 is never masked below
        (-1.0, 0.79, False),  # A < 0, below 1 - eps_low -> masked
        (-1.0, 0.81, True),
        (-1.0, 3.00, True),  # A < 0 is never masked above
    ]
    adv = torch.tensor([[a] for a, _, _ in cases], dtype=torch.float64)
    ratio = torch.tensor([[r] for _, r, _ in cases], dtype=torch.float64)
    old = torch.full_like(ratio, -1.0)
    leaf = (old + torch.log(ratio)).requires_grad_(True)
    weights = torch.full_like(ratio, 2.0)
    terms = minirl_policy_loss(
        leaf, old, adv, torch.ones_like(adv), weights, clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH
    )
    terms.loss_mat.sum().backward()
    kept = torch.tensor([[float(k)] for _, _, k in cases], dtype=torch.float64)
    torch.testing.assert_close(leaf.grad, -kept * weights * ratio * adv)
    metrics = terms.scalars()
    assert metrics["actor/MiniRL/masked_frac_high"] == pytest.approx(1 / 6)
    assert metrics["actor/MiniRL/masked_frac_low"] == pytest.approx(1 / 6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 6)
    assert metrics["actor/MiniRL/ratio_max"] == pytest.approx(3.0)
    assert metrics["actor/MiniRL/is_weight_mean"] == pytest.approx(2.0)


def test_on_policy_gradient_is_weight_times_advantage():
    log_prob, _, adv, mask, weights = ragged_batch(5)
    leaf = log_prob.clone().requires_grad_(True)
    terms = minirl_policy_loss(leaf, log_prob, adv, mask, weights)
    terms.loss_mat.sum().backward()
    torch.testing.assert_close(leaf.grad, torch.where(mask, -weights * adv, 0.0))
    assert terms.scalars()["actor/pg_clipfrac"] == 0.0


def test_missing_weights_mean_weight_one():
    log_prob, old, adv, mask, _ = ragged_batch(6)
    a = log_prob.clone().requires_grad_(True)
    b = log_prob.clone().requires_grad_(True)
    minirl_policy_loss(a, old, adv, mask, None).loss_mat.sum().backward()
    minirl_policy_loss(b, old, adv, mask, torch.ones_like(old)).loss_mat.sum().backward()
    torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize(
    "garbage",
    [
        (float("nan"), float("inf"), float("nan"), -float("inf")),  # non-finite: the torch.where path
        (50.0, -1e4, 3e3, -7.0),  # finite: the multiply-by-mask path
    ],
)
def test_garbage_at_masked_positions_does_not_leak(garbage):
    log_prob, old, adv, mask, weights = ragged_batch(7)
    clean = log_prob.clone().requires_grad_(True)
    ref = minirl_policy_loss(clean, old, adv, mask, weights)
    ref.loss_mat.sum().backward()

    dirty_inputs = [t.clone() for t in (log_prob, old, adv, weights)]
    for t, bad in zip(dirty_inputs, garbage, strict=True):
        t[~mask] = bad
    dirty = dirty_inputs[0].requires_grad_(True)
    terms = minirl_policy_loss(dirty, *dirty_inputs[1:3], mask, dirty_inputs[3])
    terms.loss_mat.sum().backward()
    assert torch.isfinite(terms.loss_mat).all()
    torch.testing.assert_close(dirty.grad, clean.grad)
    torch.testing.assert_close(terms.loss_mat, ref.loss_mat)
    assert terms.scalars() == pytest.approx(ref.scalars())


@pytest.mark.parametrize(
    ("name", "value", "count"),
    [("log_prob", float("nan"), 2), ("old_log_prob", float("inf"), 1), ("advantages", float("nan"), 3)],
)
def test_nonfinite_at_valid_positions_raises_naming_tensor_and_count(name, value, count):
    log_prob, old, adv, mask, weights = ragged_batch(8)
    tensors = {"log_prob": log_prob, "old_log_prob": old, "advantages": adv}
    valid = mask.nonzero()[:count]
    tensors[name] = tensors[name].clone()
    tensors[name][valid[:, 0], valid[:, 1]] = value
    terms = minirl_policy_loss(tensors["log_prob"], tensors["old_log_prob"], tensors["advantages"], mask, weights)
    with pytest.raises(ValueError, match=rf"{name}: {count} position"):
        terms.scalars()


def test_negative_or_nan_importance_weight_raises():
    log_prob, old, adv, mask, weights = ragged_batch(9)
    weights = weights.clone()
    weights[0, 0] = -1.0
    with pytest.raises(ValueError, match=r"rollout_is_weights: 1 position"):
        minirl_policy_loss(log_prob, old, adv, mask, weights).scalars()


def test_shape_mismatch_raises():
    log_prob, old, adv, mask, weights = ragged_batch(10)
    with pytest.raises(ValueError, match="old_log_prob has shape"):
        minirl_policy_loss(log_prob, old[:, :-1], adv, mask, weights)
    with pytest.raises(ValueError, match="rollout_is_weights has shape"):
        minirl_policy_loss(log_prob, old, adv, mask, weights[:-1])
    with pytest.raises(ValueError, match="must be 2-D"):
        minirl_policy_loss(log_prob[0], old[0], adv[0], mask[0], weights[0])
    with pytest.raises(ValueError, match="clip ratios"):
        minirl_policy_loss(log_prob, old, adv, mask, weights, clip_ratio_low=-0.1)


def test_all_zero_mask_gives_zero_loss_matrix_and_finite_metrics():
    log_prob, old, adv, mask, weights = ragged_batch(11)
    leaf = log_prob.clone().requires_grad_(True)
    terms = minirl_policy_loss(leaf, old, adv, torch.zeros_like(mask), weights)
    terms.loss_mat.sum().backward()
    assert (terms.loss_mat == 0).all() and (leaf.grad == 0).all()
    metrics = terms.scalars()
    assert all(v == 0.0 for v in metrics.values())


def test_extreme_ratio_stays_finite_and_bfloat16_works():
    log_prob, old, adv, mask, weights = ragged_batch(12)
    old = old.clone()
    old[0, 0] = log_prob[0, 0] - 500.0  # r = e^500 without the clamp
    terms = minirl_policy_loss(log_prob, old, adv, mask, weights)
    assert torch.isfinite(terms.loss_mat).all()
    assert all(math.isfinite(v) for v in terms.scalars().values())

    leaf = log_prob.to(torch.bfloat16).requires_grad_(True)
    terms = minirl_policy_loss(leaf, old.to(torch.bfloat16), adv, mask, weights)
    terms.loss_mat.sum().backward()
    assert leaf.grad.dtype == torch.bfloat16 and torch.isfinite(leaf.grad).all()
