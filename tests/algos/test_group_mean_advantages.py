"""Group-mean-baseline advantage: hand-computed values, the singleton rule, bad input."""

import numpy as np
import pytest
import torch

from verl_stable.algos.advantages import group_ids_to_index, group_mean_baseline_advantages


def outcome_batch(rewards, lengths, width=4):
    """Rewards placed on the last valid token of each response, as verl's reward managers do."""
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    token_rewards = torch.zeros(len(rewards), width)
    for i, (r, n) in enumerate(zip(rewards, lengths, strict=True)):
        token_rewards[i, n - 1] = r
    return token_rewards, mask


def test_hand_computed_groups():
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 5.0]
    uids = np.array(["p", "p", "q", "q", "q", "r"], dtype=object)
    token_rewards, mask = outcome_batch(rewards, [4, 2, 3, 1, 4, 2])
    with pytest.warns(UserWarning, match="single response"):
        adv, scores = group_mean_baseline_advantages(token_rewards, mask, uids)
    expected_seq = [0.5, -0.5, 1 / 3, 1 / 3, -2 / 3, 0.0]  # group r has one response: A = 0
    expected = torch.tensor(expected_seq)[:, None] * mask
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(scores, torch.tensor(rewards))
    assert (adv[~mask] == 0).all()


def test_no_std_normalisation_and_zero_mean_per_group():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(12, 5, generator=g)
    mask = torch.rand(12, 5, generator=g) < 0.8
    uids = [i // 4 for i in range(12)]
    adv, scores = group_mean_baseline_advantages(rewards, mask, uids)
    adv10, _ = group_mean_baseline_advantages(rewards * 10, mask, uids)
    torch.testing.assert_close(adv10, adv * 10)  # a std-normalised advantage would be scale-free
    seq_adv = torch.stack([adv[i][mask[i]][0] if mask[i].any() else torch.tensor(0.0) for i in range(12)])
    for group in range(3):
        rows = slice(4 * group, 4 * group + 4)
        torch.testing.assert_close(seq_adv[rows].sum(), torch.tensor(0.0), atol=1e-5, rtol=0)
        torch.testing.assert_close(seq_adv[rows], scores[rows] - scores[rows].mean())


def test_masked_rewards_are_ignored_even_if_nan():
    token_rewards, mask = outcome_batch([1.0, 3.0], [2, 3])
    token_rewards[~mask] = float("nan")
    adv, _ = group_mean_baseline_advantages(token_rewards, mask, ["a", "a"])
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0])[:, None] * mask)


def test_bad_input_raises():
    token_rewards, mask = outcome_batch([1.0, 3.0], [2, 3])
    with pytest.raises(ValueError, match="2 responses"):
        group_mean_baseline_advantages(token_rewards, mask, ["a"])
    with pytest.raises(ValueError, match="response_mask has shape"):
        group_mean_baseline_advantages(token_rewards, mask[:, :2], ["a", "a"])
    bad = token_rewards.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        group_mean_baseline_advantages(bad, mask, ["a", "a"])


def test_group_ids_accept_strings_ints_and_tensors():
    assert group_ids_to_index(np.array(["x", "y", "x"], dtype=object), 3).tolist() == [0, 1, 0]
    assert group_ids_to_index(torch.tensor([7, 7, 3]), 3).tolist() == [0, 0, 1]
    assert group_ids_to_index([None, None], 2).tolist() == [0, 0]
