"""The `minirl` and `vespo` losses as verl sees them: plain `import verl` registers them (no verl_stable import).

Run: .venv/bin/python examples/minirl_loss_in_verl.py
"""

import torch
from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn
from verl.workers.config import ActorConfig

torch.manual_seed(0)
batch, length = 4, 6
mask = torch.ones(batch, length)
mask[0, 4:] = 0  # a shorter response
scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
rewards = torch.zeros(batch, length)
rewards[torch.arange(batch), mask.sum(-1).long() - 1] = scores  # outcome reward on the last valid token

# A = R - mean(R) over the responses of the same prompt (uid), no division by std.
adv, _ = get_adv_estimator_fn("minirl")(
    token_level_rewards=rewards, response_mask=mask, index=["p0", "p0", "p1", "p1"], config=None
)
print("advantages per response:", adv[:, 0].tolist())

old_log_prob = -torch.rand(batch, length)
log_prob = (old_log_prob + 0.1 * torch.randn(batch, length)).requires_grad_()
rollout_is_weights = torch.exp(old_log_prob - (old_log_prob - 0.05)).clamp(
    max=5.0
)  # verl's token TIS, w=min(pi_old/mu, 5)
config = ActorConfig(
    strategy="fsdp", clip_ratio_low=0.2, clip_ratio_high=0.27, ppo_micro_batch_size_per_gpu=1, rollout_n=2
)
for name in ("minirl", "vespo"):
    loss, metrics = get_policy_loss_fn(name)(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode="seq-mean-token-sum",
        config=config,
        rollout_is_weights=rollout_is_weights,
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    shown = {k: round(float(v), 4) for k, v in sorted(metrics.items())[:4]}
    print(f"{name}: loss={loss.item():.4f} |grad|={grad.norm():.4f} {shown}")
