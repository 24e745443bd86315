"""The probe with vLLM's CPU build as the rollout engine (one vLLM start, ~30-60 s on 2 cores): its routed experts
come back through the project's codec, an fp32 vLLM matches the fp32 actor, and R3 replays its routing exactly."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (VERL_STABLE_NO_VLLM=1)")

from verl_stable.probe import cli  # noqa: E402
from verl_stable.toy.assets import ensure_assets  # noqa: E402
from verl_stable.toy.launch import asset_spec  # noqa: E402


def test_vllm_fp32_rollout_matches_the_fp32_actor_and_r3_replays_it_exactly(tmp_path, capsys):
    import json

    assets = ensure_assets(tmp_path / "assets", asset_spec("vllm"))  # head size 32: vLLM's CPU attention needs it
    out = tmp_path / "report"
    argv = ["--model", str(assets.model_dir), "--data", str(assets.train_file), "--engine", "vllm",
            "--rollout-precision", "fp32", "--train-dtype", "fp32", "--samples", "8", "--per-prompt", "2",
            "--max-tokens", "8", "--out", str(out), "--no-progress"]  # fmt: skip
    code = cli.main(argv)
    assert code == 0, capsys.readouterr().err[-3000:]
    report = json.loads((out / "probe.json").read_text())
    none, r3 = report["metrics"]["none"], report["metrics"]["r3"]
    assert report["options"]["engine"] == "vllm" and report["samples"]["samples"] == 8
    assert none["probe/disagreement_rows"] > 0  # vLLM's routed experts arrived and were compared
    # vLLM's fp32 CPU kernels against the fp32 transformers forward: the doctor's probe finds every row equal
    assert none["stable/routing/disagreement"] <= 0.01
    assert none["stable/train_inf/kl_k3"] < 1e-6
    assert r3["stable/routing/disagreement"] == 0.0
    assert r3["stable/train_inf/kl_k3"] < 1e-6
