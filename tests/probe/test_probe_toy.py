"""The probe on the toy MoE with the ``hf`` engine: an int4 rollout flips routing that R3 removes exactly, an fp32
rollout against an fp32 actor leaves no mismatch, the numbers equal an independent computation on the same samples,
and the command writes its report."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from verl_stable.probe import cli, inference, prompts
from verl_stable.probe.runner import ProbeOptions, run_probe

SAMPLES, MAX_TOKENS = 8, 8


def _options(toy, precision, train_dtype="fp32", **kw):
    return ProbeOptions(
        model=toy.model_dir, rollout_precision=precision, train_dtype=train_dtype, data=toy.train_file,
        samples=SAMPLES, max_tokens=MAX_TOKENS, **kw,
    )  # fmt: skip


@pytest.fixture(scope="module")
def int4(toy):
    return run_probe(_options(toy, "int4"))


def test_int4_rollout_flips_routing_and_r3_removes_every_flip(int4):
    none, r3 = int4.metrics["none"], int4.metrics["r3"]
    assert int4.model_kind == "moe"
    assert none["stable/routing/disagreement"] > 0.05  # ~30 % on this random toy
    assert none["stable/routing/disagreement/token_any_layer"] > none["stable/routing/disagreement"]
    assert none["stable/train_inf/kl_k3"] > 1e-6
    # R3: every (token, layer) row used the rollout's experts, in every MoE layer
    flips = {k: v for k, v in r3.items() if k.startswith("stable/routing/disagreement")}
    assert flips and all(v == 0.0 for v in flips.values()), flips
    assert r3["probe/disagreement_response"] == 0.0
    assert r3["probe/disagreement_rows"] == none["probe/disagreement_rows"] > 0
    # what replay hides: the router's own choice still disagrees with the rollout
    assert r3["stable/routing/router_disagreement"] > 0.05
    assert math.isfinite(r3["stable/train_inf/kl_k3"])


def test_fp32_rollout_against_an_fp32_actor_leaves_no_mismatch(toy):
    result = run_probe(_options(toy, "fp32"))
    for name in ("none", "r3"):
        m = result.metrics[name]
        assert m["stable/train_inf/kl_k3"] < 1e-10, (name, m["stable/train_inf/kl_k3"])
        assert m["stable/routing/disagreement"] == 0.0
        assert m["stable/train_inf/extreme_frac_tau2"] == 0.0
    assert "no measurable train-inference mismatch" in result.advice["summary"]


def _independent(toy, result):
    """Resample the same completions (same seeds) and score them with plain transformers: top-k of the router logits,
    log-softmax, numpy -- nothing of the probe's metrics or of verl_stable.routing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(toy.model_dir)
    chats = prompts.read_chats(toy.train_file)
    of_sample = prompts.sample_prompts(len(chats), SAMPLES, 1)
    rendered = {i: tokenizer.apply_chat_template(chats[i], add_generation_prompt=True, tokenize=True)["input_ids"]
                for i in set(of_sample)}  # fmt: skip
    layout_moe = result.routing
    from verl_stable.routing import layout_from_config

    layout = layout_from_config(AutoModelForCausalLM.from_pretrained(toy.model_dir).config)
    rollouts = inference.sample_hf(
        toy.model_dir, rendered, of_sample, precision="int4", max_tokens=MAX_TOKENS, seed=0,
        eos_ids=inference.eos_token_ids(toy.model_dir, tokenizer), layout=layout,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(toy.model_dir, dtype=torch.float32).eval()
    d, differ, rows, layer_differ = [], 0, 0, np.zeros(len(layout_moe["moe_layers"]))
    for r in rollouts:
        ids = torch.tensor([r.prompt_ids + r.response_ids])
        with torch.no_grad():
            out = model(ids, output_router_logits=True)
        logp = torch.log_softmax(out.logits[0].double(), -1)
        p = len(r.prompt_ids)
        pi = logp[p - 1 : -1].gather(-1, ids[0, p:, None]).squeeze(-1).numpy()
        d.extend(np.asarray(r.logp) - pi)
        top = [lg.topk(layout.top_k, dim=-1).indices.numpy() for lg in out.router_logits]
        for t in range(r.routing.shape[0]):
            for layer, chosen in enumerate(top):
                flip = set(chosen[t].tolist()) != set(r.routing[t, layer].tolist())
                differ, rows = differ + flip, rows + 1
                layer_differ[layer] += flip
    d = np.asarray(d)
    return {
        "kl_k3": float(np.mean(np.exp(-d) - 1 + d)),
        "kl_k1": float(np.mean(d)),
        "f2": float(np.mean(np.abs(d) > np.log(2))),
        "ratio_max": float(np.exp(-d).max()),
        "flips": differ / rows,
        "per_layer": layer_differ / (rows / len(top)),
        "tokens": len(d),
    }


def test_metrics_equal_an_independent_computation_on_the_same_samples(toy, int4):
    ref = _independent(toy, int4)
    none = int4.metrics["none"]
    assert none["probe/tokens"] == ref["tokens"]
    assert none["stable/train_inf/kl_k3"] == pytest.approx(ref["kl_k3"], rel=1e-3, abs=1e-9)
    assert none["stable/train_inf/kl_k1"] == pytest.approx(ref["kl_k1"], rel=1e-3, abs=1e-9)
    assert none["stable/train_inf/extreme_frac_tau2"] == pytest.approx(ref["f2"])
    assert none["stable/train_inf/ratio_max"] == pytest.approx(ref["ratio_max"], rel=1e-4)
    assert none["stable/routing/disagreement"] == pytest.approx(ref["flips"])
    for i, value in enumerate(ref["per_layer"]):
        assert none[f"stable/routing/disagreement/layer_{i}"] == pytest.approx(value)


def test_the_command_writes_markdown_json_and_one_figure(toy, tmp_path, capsys):
    out = tmp_path / "report"
    argv = ["--model", str(toy.model_dir), "--data", str(toy.train_file), "--rollout-precision", "int4",
            "--train-dtype", "fp32", "--samples", "4", "--max-tokens", "4", "--out", str(out), "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "of (token, MoE layer) routing decisions flip" in printed and "N >= 4" in printed
    assert sorted(p.name for p in out.iterdir()) == ["probe.json", "probe.md", "probe.png"]
    data = json.loads((out / "probe.json").read_text())
    assert data["options"]["rollout_precision"] == "int4" and data["samples"]["samples"] == 4
    assert data["metrics"]["r3"]["stable/routing/disagreement"] == 0.0
    md = (out / "probe.md").read_text()
    for text in ("minirl_n4_r3", "Where the evidence stops", "stable/train_inf/kl_k3", "nearest lab finding"):
        assert text in md
    assert (out / "probe.png").read_bytes()[:4] == b"\x89PNG"
