"""The ``minirl`` advantage estimator inside real verl: registry and verl's own ``compute_advantage``."""

import numpy as np
import pytest
import torch
import verl  # noqa: F401  (loads the verl.plugins entry point, which registers the estimator)
from verl import DataProto
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.core_algos import get_adv_estimator_fn, register_adv_est

from verl_stable.integration import advantages


def batch():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]])
    rewards = torch.zeros(5, 4)
    rewards[0, 2], rewards[1, 1], rewards[2, 3], rewards[3, 0], rewards[4, 2] = 1.0, 0.0, 2.0, 4.0, 3.0
    uids = np.array(["a", "a", "b", "b", "c"], dtype=object)
    # Group a: mean 0.5; group b: mean 3; group c: single response -> 0.
    expected = torch.tensor([0.5, -0.5, -1.0, 1.0, 0.0])[:, None] * mask
    return rewards, mask, uids, expected


def test_registered_and_idempotent():
    fn = get_adv_estimator_fn("minirl")
    assert fn is advantages.compute_minirl_outcome_advantage
    assert advantages.register() == ["minirl"]
    assert advantages.register() == ["minirl"]
    assert get_adv_estimator_fn("minirl") is fn
    # verl itself refuses a different function under the same name, so register() must reuse this one.
    with pytest.raises(ValueError, match="already been registered"):
        register_adv_est("minirl")(lambda **kw: None)
    assert core_algos.ADV_ESTIMATOR_REGISTRY["minirl"] is fn


def test_called_with_verls_keywords():
    rewards, mask, uids, expected = batch()
    with pytest.warns(UserWarning, match="single response"):
        adv, returns = get_adv_estimator_fn("minirl")(
            token_level_rewards=rewards,
            response_mask=mask,
            config=AlgoConfig(adv_estimator="minirl"),
            index=uids,
            reward_baselines=torch.zeros(5),
        )
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(returns, expected)


def test_through_verls_compute_advantage():
    from verl.trainer.ppo.ray_trainer import compute_advantage

    rewards, mask, uids, expected = batch()
    data = DataProto.from_dict(
        tensors={"token_level_rewards": rewards, "response_mask": mask}, non_tensors={"uid": uids}
    )
    with pytest.warns(UserWarning, match="single response"):
        out = compute_advantage(data, adv_estimator="minirl", config=AlgoConfig(adv_estimator="minirl"))
    torch.testing.assert_close(out.batch["advantages"], expected)
    torch.testing.assert_close(out.batch["returns"], expected)


def test_missing_uid_raises():
    rewards, mask, _, _ = batch()
    with pytest.raises(ValueError, match="uid"):
        get_adv_estimator_fn("minirl")(token_level_rewards=rewards, response_mask=mask, config=None)
