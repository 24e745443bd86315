"""VESPO: kernel values, sequence weight, gradients against the analytic formula, bad input."""

import math
from functools import partial

import numpy as np
import pytest
import torch
from testkit import losses as testkit_losses

from verl_stable.algos.vespo import (
    LOG_W_BOUND,
    VespoKernel,
    vespo_kernel,
    vespo_policy_loss,
    vespo_sequence_log_weight,
)

ragged_batch = partial(
    testkit_losses.ragged_batch, batch=6, length=8, spread=0.15, holes=0.15, weight_low=0.5, weight_scale=1.0
)


def reference_grad(log_prob, old, adv, mask, weights, c=(2.0, 3.0, 3.0, 2.0)):
    """-phi(W_i) * A_it with W_i = prod_t (pi/pi_old * w) over valid tokens, phi = W^c1 e^{c2 (1 - W)}."""
    lp, o, a, m = (t.detach().numpy() for t in (log_prob, old, adv, mask))
    w = np.ones_like(lp) if weights is None else weights.numpy()
    out = np.zeros_like(lp)
    for i in range(lp.shape[0]):
        big_w = math.exp(min(max(sum(lp[i, t] - o[i, t] + math.log(w[i, t]) for t in np.flatnonzero(m[i])), -20), 20))
        for t in np.flatnonzero(m[i]):
            c1, c2 = (c[0], c[1]) if a[i, t] > 0 else (c[2], c[3])
            out[i, t] = -(big_w**c1) * math.exp(c2 * (1 - big_w)) * a[i, t]
    return out


def test_kernel_values():
    log_w = torch.log(torch.tensor([0.25, 0.5, 1.0, 2.0, 4.0], dtype=torch.float64))
    for c1, c2 in [(2.0, 3.0), (3.0, 2.0), (0.5, 0.0)]:
        expected = torch.exp(log_w) ** c1 * torch.exp(c2 * (1 - torch.exp(log_w)))
        torch.testing.assert_close(vespo_kernel(log_w, c1, c2), expected)
        assert vespo_kernel(torch.zeros((), dtype=torch.float64), c1, c2).item() == pytest.approx(1.0)
    # The maximum of W^c1 e^{-c2 W} is at W = c1 / c2.
    grid = torch.linspace(-3, 3, 6001, dtype=torch.float64)
    for c1, c2 in [(2.0, 3.0), (3.0, 2.0)]:
        assert torch.exp(grid[vespo_kernel(grid, c1, c2).argmax()]).item() == pytest.approx(c1 / c2, rel=2e-3)
    # Finite at both clamp ends.
    assert torch.isfinite(vespo_kernel(torch.tensor([-LOG_W_BOUND, LOG_W_BOUND]), 3.0, 2.0)).all()


def test_sequence_log_weight_sums_valid_tokens_and_folds_in_is_weights():
    log_prob, old, _, mask, weights = ragged_batch(0)
    raw, clamped = vespo_sequence_log_weight(log_prob, old, mask, weights)
    for i in range(log_prob.shape[0]):
        valid = mask[i]
        expected = (log_prob[i, valid] - old[i, valid] + torch.log(weights[i, valid])).sum()
        assert raw[i].item() == pytest.approx(expected.item())
    torch.testing.assert_close(clamped, raw)  # small spread: nothing reaches the clamp
    raw_no_is, _ = vespo_sequence_log_weight(log_prob, old, mask)
    torch.testing.assert_close(raw_no_is, torch.where(mask, log_prob - old, 0.0).sum(-1))


def test_sequence_log_weight_clamps_and_zero_weight_hits_lower_clamp():
    log_prob = torch.zeros(3, 4, dtype=torch.float64)
    old = torch.zeros_like(log_prob)
    old[0] = -10.0  # log W = +40 -> 20
    old[1] = 10.0  # log W = -40 -> -20
    weights = torch.ones_like(log_prob)
    weights[2, 1] = 0.0  # a rejected token
    raw, clamped = vespo_sequence_log_weight(log_prob, old, torch.ones_like(log_prob), weights)
    assert raw[0].item() == pytest.approx(40.0) and raw[1].item() == pytest.approx(-40.0)
    assert clamped.tolist() == [20.0, -20.0, -20.0]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("with_weights", [True, False])
def test_gradient_matches_analytic_formula(seed, with_weights):
    log_prob, old, adv, mask, weights = ragged_batch(seed, token_adv=seed == 2)
    weights = weights if with_weights else None
    leaf = log_prob.clone().requires_grad_(True)
    terms = vespo_policy_loss(leaf, old, adv, mask.float(), weights)
    terms.loss_mat.sum().backward()
    np.testing.assert_allclose(leaf.grad.numpy(), reference_grad(log_prob, old, adv, mask, weights), rtol=1e-6)
    assert all(math.isfinite(v) for v in terms.scalars().values())


def test_sign_dependent_default_and_custom_constants():
    # One sequence per row, log W = log 2 exactly.
    old = torch.zeros(2, 1, dtype=torch.float64)
    log_prob = torch.full_like(old, math.log(2.0)).requires_grad_(True)
    adv = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
    vespo_policy_loss(log_prob, old, adv, torch.ones_like(adv)).loss_mat.sum().backward()
    phi_pos, phi_neg = 4 * math.exp(-3), 8 * math.exp(-2)  # 2^2 e^{3(1-2)}, 2^3 e^{2(1-2)}
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-phi_pos], [phi_neg]], dtype=torch.float64))

    log_prob.grad = None
    kernel = VespoKernel(c1_pos=1.0, c2_pos=0.0, c1_neg=0.0, c2_neg=1.0)
    terms = vespo_policy_loss(log_prob, old, adv, torch.ones_like(adv), kernel=kernel)
    terms.loss_mat.sum().backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-2.0], [math.exp(-1)]], dtype=torch.float64))
    metrics = terms.scalars()
    assert metrics["actor/vespo/w_mean"] == pytest.approx(2.0)
    assert metrics["actor/vespo/phi_min"] == pytest.approx(math.exp(-1))
    assert metrics["actor/vespo/phi_max"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="c2_neg"):
        VespoKernel(c2_neg=-1.0)


@pytest.mark.parametrize("garbage", [float("nan"), -40.0])
def test_garbage_at_masked_positions_does_not_leak(garbage):
    log_prob, old, adv, mask, weights = ragged_batch(3)
    clean = log_prob.clone().requires_grad_(True)
    ref = vespo_policy_loss(clean, old, adv, mask, weights)
    ref.loss_mat.sum().backward()
    dirty_inputs = [t.clone() for t in (log_prob, old, adv, weights)]
    for t in dirty_inputs:
        t[~mask] = garbage
    dirty = dirty_inputs[0].requires_grad_(True)
    terms = vespo_policy_loss(dirty, dirty_inputs[1], dirty_inputs[2], mask, dirty_inputs[3])
    terms.loss_mat.sum().backward()
    torch.testing.assert_close(terms.loss_mat, ref.loss_mat)
    torch.testing.assert_close(dirty.grad, clean.grad)
    assert terms.scalars() == pytest.approx(ref.scalars())


def test_nonfinite_at_valid_positions_and_shape_mismatch_raise():
    log_prob, old, adv, mask, weights = ragged_batch(4)
    bad = log_prob.clone()
    bad[0, 0] = float("-inf")
    with pytest.raises(ValueError, match=r"log_prob: 1 position"):
        vespo_policy_loss(bad, old, adv, mask, weights).scalars()
    bad_w = weights.clone()
    bad_w[1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"rollout_is_weights: 1 position"):
        vespo_policy_loss(log_prob, old, adv, mask, bad_w).scalars()
    with pytest.raises(ValueError, match="advantages has shape"):
        vespo_policy_loss(log_prob, old, adv[:, :1], mask, weights)


def test_all_zero_mask_and_extreme_ratios_stay_finite():
    log_prob, old, adv, mask, weights = ragged_batch(5)
    leaf = log_prob.clone().requires_grad_(True)
    terms = vespo_policy_loss(leaf, old, adv, torch.zeros_like(mask), weights)
    terms.loss_mat.sum().backward()
    assert (terms.loss_mat == 0).all() and (leaf.grad == 0).all()
    assert all(v == 0.0 for v in terms.scalars().values())

    old = old.clone()
    old[0] = log_prob[0] - 50.0  # log W far above the clamp
    old[1] = log_prob[1] + 50.0  # far below
    terms = vespo_policy_loss(log_prob, old, adv, mask, weights)
    metrics = terms.scalars()
    assert torch.isfinite(terms.loss_mat).all()
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["actor/vespo/clamped_frac"] == pytest.approx(2 / 6)
    assert metrics["actor/vespo/log_w_max"] == pytest.approx(LOG_W_BOUND)
