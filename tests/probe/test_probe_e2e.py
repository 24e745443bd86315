"""The probe against verl's real runs: on the toy MoE with an int4 ``hf`` rollout and an fp32 FSDP actor, what the
probe measures agrees with what verl's trainer logs at step 1 within sampling error, without replay and with R3.

One probe of the checkpoint (both passes: no replay, R3) and two verl starts (``main_ppo``, V1 ``stable_sync``, one
step, the rollout's routing exported and observed): one without replay, one with R3 -- a verl start per
configuration, every assertion on a configuration sharing it. Same checkpoint, precision, actor dtype, response
length and prompts (``data.shuffle=False``: verl's first batch is the file's first 8 prompts, 4 samples each, which
the probe takes with ``--per-prompt 4``). verl samples its own tokens, so the two are compared as two samples of the
same quantity: within ``Z`` standard errors of their difference, the run's error taken as the probe's (the same
number of samples).

Compared without replay: ``stable/train_inf/kl_k3`` and ``stable/routing/disagreement`` (with its worst layer and
its share of tokens). With R3: the KL that replay leaves (numerics outside routing), the router's own disagreement
with the replayed routes (what replay hides), and the experts used against the replayed ones -- 0 in both.
"""

from __future__ import annotations

import math

import pytest

from verl_stable.lab.variants import FP32_TRAINING, TRAIN_PRECISION
from verl_stable.probe.runner import ProbeOptions, run_probe
from verl_stable.toy import launch
from verl_stable.toy.assets import ensure_assets

pytestmark = pytest.mark.e2e

PROMPTS, GROUP, RESPONSE, PRECISION = 8, 4, 16, "int4"
Z = 4.0


def _within(name: str, run: float, probe: float, se: float) -> None:
    bound = Z * math.sqrt(2) * se
    assert abs(run - probe) <= bound, f"{name}: run {run:.4g} vs probe {probe:.4g}, |diff| > {Z} x {se * 1.414:.3g}"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return ensure_assets(tmp_path_factory.mktemp("probe_e2e") / "assets", launch.asset_spec("hf"))


@pytest.fixture(scope="module")
def probe(assets):
    return run_probe(
        ProbeOptions(
            model=assets.model_dir,
            data=assets.train_file,
            rollout_precision=PRECISION,
            train_dtype="fp32",
            samples=PROMPTS * GROUP,
            per_prompt=GROUP,
            max_tokens=RESPONSE,
        )  # fmt: skip
    )


def _step_1(assets, workdir, extra=()):
    """verl's step 1 on the probe's settings (one verl start)."""
    overrides = launch.cpu_overrides(
        assets, steps=1, batch_size=PROMPTS, group_size=GROUP, max_prompt_length=16, max_response_length=RESPONSE,
        precision=PRECISION, routing_capture=True,
    )  # fmt: skip
    overrides += [
        f"trainer.default_local_dir={workdir / 'checkpoints'}",
        "trainer.v1.trainer_mode=stable_sync",
        "data.shuffle=False",
        f"{TRAIN_PRECISION}={FP32_TRAINING}",
        *extra,
    ]
    proc = launch.run_main_ppo(overrides, workdir, timeout_s=1500)
    log = (workdir / "main_ppo.log").read_text()
    assert proc.returncode == 0, log[-3000:]
    (step1,) = launch.read_metrics(workdir / "metrics.jsonl")
    return step1


def test_probe_agrees_with_verls_step_1(assets, probe, tmp_path):
    step1 = _step_1(assets, tmp_path / "run")
    none = probe.metrics["none"]
    print({k: (step1.get(k), none.get(k)) for k in none if k.startswith("stable/")})
    kl, flips = "stable/train_inf/kl_k3", "stable/routing/disagreement"
    _within(kl, step1[kl], none[kl], none["probe/kl_k3_se"])
    _within(flips, step1[flips], none[flips], none["probe/disagreement_se"])
    assert none[flips] > 0.05 and step1[flips] > 0.05  # the int4 rollout flips routing in both
    # the worst layer and the share of tokens: no error of their own, a looser band
    for key in (f"{flips}/layer_max", f"{flips}/token_any_layer"):
        assert step1[key] == pytest.approx(none[key], abs=0.1), key
    assert probe.metrics["r3"][flips] == 0.0


def test_probe_with_r3_agrees_with_verls_r3_step_1(assets, probe, tmp_path):
    step1 = _step_1(assets, tmp_path / "run_r3", ("+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3",))
    r3 = probe.metrics["r3"]
    print({k: (step1.get(k), r3.get(k)) for k in r3 if k.startswith("stable/")})
    kl, used, own = "stable/train_inf/kl_k3", "stable/routing/disagreement", "stable/routing/router_disagreement"
    # the experts used are the replayed ones, in verl's run and in the probe: 0, not "small"
    assert step1[used] == 0.0 and r3[used] == 0.0
    assert step1[f"{used}/layer_max"] == 0.0
    # what replay hides, the router's own choice against the rollout's routes, agrees as the flips do without replay
    _within(own, step1[own], r3[own], r3["probe/router_disagreement_se"])
    assert step1[own] > 0.05 and r3[own] > 0.05
    # the mismatch R3 leaves (numerics outside routing on this random toy) agrees
    _within(kl, step1[kl], r3[kl], r3["probe/kl_k3_se"])
