"""The escalate action's edge in verl: settings judged by verl's own rollout-correction code before a run starts,
applied to a trainer config as verl's trainer reads it, and effective: the same batch gets the stricter mask."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from verl_stable.integration import escalation
from verl_stable.recipes.validate import preflight

STRICTER = (("rollout_rs", "token_k3"), ("rollout_rs_threshold", 0.01))


def _config(**section):
    return OmegaConf.create({"algorithm": {"rollout_correction": section or None}})


def test_verls_refusals_are_raised_before_the_run_with_verls_message():
    escalation.check(_config(rollout_is="token"), STRICTER, "rule")
    with pytest.raises(ValueError, match=r"rule: verl's rollout correction refuses .*'rollout_rs': 'token_k9'"):
        escalation.check(_config(), {"rollout_rs": "token_k9", "rollout_rs_threshold": 0.01}, "rule")
    with pytest.raises(ValueError, match="bypass mode"):
        escalation.check(_config(bypass_mode=True), STRICTER, "rule")
    with pytest.raises(ValueError, match=r"keys \['clip_ratio'\] are not among"):
        escalation.check(_config(), {"clip_ratio": 0.1}, "rule")


def test_apply_changes_what_verls_trainer_reads_and_says_what_changed():
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    config = _config(rollout_is="token", rollout_is_threshold=2.0)
    old = torch.zeros(1, 4)
    rollout = torch.tensor([[0.0, -0.01, -0.5, 0.3]])  # per-token k3 of r = exp(old - rollout): 0, ~5e-5, 0.149, 0.041
    mask = torch.ones(1, 4)

    def masked_fraction():
        settings = escalation.effective(config)
        _, kept, metrics = compute_rollout_correction_and_rejection_mask(old, rollout, mask, **settings)
        return 1 - kept.mean().item(), metrics

    assert masked_fraction()[0] == 0.0
    changes = escalation.apply(config, STRICTER)
    assert changes == ["rollout_rs: None -> 'token_k3'", "rollout_rs_threshold: None -> 0.01"]
    assert config.algorithm.rollout_correction.rollout_is == "token"  # keys not named stay
    fraction, metrics = masked_fraction()
    assert fraction == pytest.approx(0.5)  # the two tokens with k3 above 0.01
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(0.5)  # as verl logs it
    assert escalation.apply(config, STRICTER) == []  # already in force
    fresh = _config()
    assert escalation.apply(fresh, {"rollout_is": "token"}) == ["rollout_is: None -> 'token'"]


def test_preflight_refuses_an_escalation_verl_would_refuse():
    from verl_stable.toy import launch

    rule = "+stable.guard.rules.kl_high"
    base = [*launch.cpu_overrides(launch.asset_paths("/tmp/unused")), "trainer.v1.trainer_mode=stable_sync"]
    base += [f"{rule}.condition=above", f"{rule}.metric=stable/train_inf/kl_k3", f"{rule}.threshold=0.01"]
    ok = [*base, f"{rule}.action=escalate", f"+{rule[1:]}.escalate_to.rollout_rs=token_k3"]
    ok += [f"+{rule[1:]}.escalate_to.rollout_rs_threshold=0.01"]
    preflight(ok)
    bad = [*base, f"{rule}.action=escalate", f"+{rule[1:]}.escalate_to.rollout_rs=token_k9"]
    with pytest.raises(ValueError, match="stable.guard.rules.kl_high: verl's rollout correction refuses"):
        preflight(bad)
