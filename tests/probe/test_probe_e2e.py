"""The probe against verl's real run: on the toy MoE with an int4 ``hf`` rollout and an fp32 FSDP actor, what the probe
measures agrees with what verl's trainer logs at step 1 within sampling error.

One verl start (``main_ppo``, V1 ``stable_sync``, one step, the rollout's routing exported and observed, no replay)
and one probe of the same checkpoint, precision, actor dtype, response length and prompts (``data.shuffle=False``:
verl's first batch is the file's first 8 prompts, 4 samples each, which the probe takes with ``--per-prompt 4``).
verl samples its own tokens, so the two are compared as two samples of the same quantity: within ``Z`` standard
errors of their difference, the run's error taken as the probe's (the same number of samples).

Compared: ``stable/train_inf/kl_k3`` and ``stable/routing/disagreement`` (with its worst layer and its share of
tokens) without replay. With R3 the run logs 0 disagreement by construction, which the R3 runs of
``tests/integration/test_replay_coverage_e2e.py`` and ``test_data_parallel_e2e.py`` check on verl's trainer and
``test_probe_toy.py`` on the probe; one verl start per file, so it is not run again here.
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


def test_probe_agrees_with_verls_step_1(tmp_path):
    assets = ensure_assets(tmp_path / "assets", launch.asset_spec("hf"))
    workdir = tmp_path / "run"
    overrides = launch.cpu_overrides(
        assets, steps=1, batch_size=PROMPTS, group_size=GROUP, max_prompt_length=16, max_response_length=RESPONSE,
        precision=PRECISION, routing_capture=True,
    )  # fmt: skip
    overrides += [
        f"trainer.default_local_dir={workdir / 'checkpoints'}",
        "trainer.v1.trainer_mode=stable_sync",
        "data.shuffle=False",
        f"{TRAIN_PRECISION}={FP32_TRAINING}",
    ]
    proc = launch.run_main_ppo(overrides, workdir, timeout_s=1500)
    log = (workdir / "main_ppo.log").read_text()
    assert proc.returncode == 0, log[-3000:]
    (step1,) = launch.read_metrics(workdir / "metrics.jsonl")

    probe = run_probe(
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
