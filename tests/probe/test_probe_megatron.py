"""The probe's training side on verl's Megatron path (``--train-engine megatron``) scores the toy MoE as the FSDP side
does, at fp32.

References, independent of the Megatron side: the FSDP side (the Hugging Face model, routing read by
:mod:`verl_stable.routing`'s hooks on the Hugging Face MoE blocks) on the very same sampled rollouts, and the rollout's
own routes. On one set of int4 rollouts of the toy MoE (qwen3_moe: 4 layers, all sparse, top-4 of 16 experts,
``norm_topk_prob=True``):

* log-probs of the sampled tokens agree within :data:`LOGP_ATOL`, without replay and with R3;
* the router's own choice is identical row for row, (token, MoE layer) by (token, MoE layer), in both passes;
* under R3 the experts used are exactly the rollout's on every row that has a route (the last token keeps its own);
* the whole probe with ``--train-engine megatron`` gives the metrics of ``--train-engine fsdp``: routing metrics
  identical, KL k3 / k1 within fp32 rounding;
* a model type without a local-spec Megatron bridge is refused in one line before anything is loaded.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

from verl_stable.probe import cli, inference, runner  # noqa: E402
from verl_stable.probe.runner import ProbeOptions, run_probe  # noqa: E402

SAMPLES, MAX_TOKENS = 8, 8
ENGINES = ("fsdp", "megatron")

# |log pi_megatron - log pi_fsdp| per sampled token, both fp32. Measured max 4.8e-7 over 32 int4 rollouts of up to 32
# tokens (751 tokens, |log pi| up to 3.7; an fp32 ulp there is 2.4e-7), 2.4e-7 on this test's 8 x 8: the two sum the
# same products in different orders (megatron's fused QKV / SwiGLU matmuls and torch RMSNorm, expert outputs combined
# by scatter-add, verl's vocab-parallel cross entropy vs log_softmax). 5e-6 leaves ~10x margin; one replayed route
# wrong, or a routing convention off, moves log-probs by 1e-3 .. 1e-1 (the int4 rollout's flips do).
LOGP_ATOL = 5e-6


def _options(toy, engine: str) -> ProbeOptions:
    return ProbeOptions(
        model=toy.model_dir, rollout_precision="int4", train_dtype="fp32", train_engine=engine, data=toy.train_file,
        samples=SAMPLES, max_tokens=MAX_TOKENS,
    )  # fmt: skip


class _Recorder:
    """A training forward that keeps what it scored: ``(rollout, replay, Scored)`` per call, in call order."""

    def __init__(self, forward, calls: list) -> None:
        self._forward, self._calls = forward, calls

    def score(self, rollout, replay: bool = False):
        scored = self._forward.score(rollout, replay=replay)
        self._calls.append((rollout, replay, scored))
        return scored


@pytest.fixture(scope="module")
def probes(toy) -> dict:
    """One whole probe per training engine, same options (so the same sampled rollouts); each engine's real forward
    records what it scored, for the row-by-row comparisons."""
    real = runner.training_forward
    out = {}
    with pytest.MonkeyPatch.context() as patch:
        for engine in ENGINES:
            calls: list = []

            @contextlib.contextmanager
            def recording(options, model_type, layout, calls=calls):
                with real(options, model_type, layout) as (forward, what):
                    yield _Recorder(forward, calls), what

            patch.setattr(runner, "training_forward", recording)
            out[engine] = (run_probe(_options(toy, engine)), calls)
    return out


@pytest.fixture(scope="module")
def scored(probes) -> dict:
    """Per engine, ``[(without replay, with R3)]`` per rollout; ``rollouts`` the sampled rollouts (one list: both
    probes sampled the same tokens)."""
    out = {}
    for engine, (_, calls) in probes.items():
        plain = [(r, s) for r, replay, s in calls if not replay]
        r3 = [s for _, replay, s in calls if replay]
        assert len(plain) == len(r3) == SAMPLES
        out[engine] = list(zip([s for _, s in plain], r3, strict=True))
        rollouts = [r for r, _ in plain]
        if "rollouts" in out:
            assert [(r.prompt_ids, r.response_ids) for r in rollouts] == [
                (r.prompt_ids, r.response_ids) for r in out["rollouts"]
            ]
        out["rollouts"] = rollouts
    return out


def _sets(ids: torch.Tensor) -> torch.Tensor:
    """Expert ids as sets: sorted along top-k (the two sides list a row's experts in different orders)."""
    return ids.sort(dim=-1).values


def test_the_toy_is_qwen3_moe_shaped(toy):
    config = json.loads((toy.model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["mlp_only_layers"] == []
    assert config["decoder_sparse_step"] == 1 and config["norm_topk_prob"] is True


def test_log_probs_equal_the_fsdp_side_at_fp32(scored):
    worst = 0.0
    for (f_none, f_r3), (m_none, m_r3) in zip(scored["fsdp"], scored["megatron"], strict=True):
        for f, m in ((f_none, m_none), (f_r3, m_r3)):
            assert m.logp.dtype == torch.float32 and m.logp.shape == f.logp.shape
            torch.testing.assert_close(m.logp, f.logp, atol=LOGP_ATOL, rtol=0)
            worst = max(worst, float((m.logp - f.logp).abs().max()))
    # the two forwards are distinct computations: equal to the bit would mean one side scored both
    assert worst > 0.0
    # and R3 changed the scores (replay took effect on both sides alike)
    assert any(not torch.equal(m_none.logp, m_r3.logp) for m_none, m_r3 in scored["megatron"])


def test_the_routers_own_choice_is_identical_row_for_row(scored):
    rows = 0
    for r, (f_none, f_r3), (m_none, m_r3) in zip(scored["rollouts"], scored["fsdp"], scored["megatron"], strict=True):
        tokens = len(r.prompt_ids) + len(r.response_ids)
        for f, m in ((f_none, m_none), (f_r3, m_r3)):
            assert m.natural.shape == f.natural.shape == (tokens, 4, 4)
            assert torch.equal(_sets(m.natural), _sets(f.natural))
        assert torch.equal(_sets(m_none.used), _sets(f_none.used))  # without replay: used = own choice
        rows += tokens * 4
    assert rows > 0


def test_r3_uses_exactly_the_rollouts_experts(scored):
    replayed = differ_own = 0
    for r, (_, m_r3) in zip(scored["rollouts"], scored["megatron"], strict=True):
        routes = torch.from_numpy(r.routing).long()  # [P + R - 1, moe_layers, top_k]
        n = routes.shape[0]
        assert torch.equal(_sets(m_r3.used[:n]), _sets(routes))  # 0 disagreement, every row and layer
        # the last token keeps its own routing (verl's R3 mask): it feeds no log-prob
        assert torch.equal(_sets(m_r3.used[n:]), _sets(m_r3.natural[n:]))
        replayed += routes.shape[0] * routes.shape[1]
        differ_own += int((_sets(m_r3.natural[:n]) != _sets(routes)).any(-1).sum())
    # replay had something to do: the router's own choice differs from the int4 rollout's on many rows
    assert differ_own > 0.05 * replayed


def test_a_whole_probe_on_megatron_agrees_with_fsdp(probes):
    (fsdp, _), (megatron, _) = probes["fsdp"], probes["megatron"]
    assert megatron.options["train_engine"] == "megatron" and fsdp.options["train_engine"] == "fsdp"
    assert "Megatron" in megatron.training and "FSDP" in fsdp.training
    for name in ("none", "r3"):
        f, m = fsdp.metrics[name], megatron.metrics[name]
        assert f.keys() == m.keys()
        routing = [k for k in f if k.startswith("stable/routing/") or k.startswith("probe/disagreement")]
        assert routing and {k: m[k] for k in routing} == {k: f[k] for k in routing}
        assert m["probe/tokens"] == f["probe/tokens"] > 0
        # k1 = mean(log mu - log pi) moves by at most max |delta log pi| <= LOGP_ATOL; k3 = mean(pi/mu - 1 - log(pi/mu))
        # by ~mean(|pi/mu - 1| |delta|): ~1e-5 of its value here (|log mu - log pi| ~ 0.04), 1e-3 allowed
        assert m["stable/train_inf/kl_k1"] == pytest.approx(f["stable/train_inf/kl_k1"], rel=0, abs=LOGP_ATOL)
        assert m["stable/train_inf/kl_k3"] == pytest.approx(f["stable/train_inf/kl_k3"], rel=1e-3)
        assert m["stable/train_inf/kl_k3"] != f["stable/train_inf/kl_k3"]  # two computations, not one reused
    assert megatron.metrics["r3"]["stable/routing/disagreement"] == 0.0
    assert megatron.metrics["none"]["stable/routing/disagreement"] > 0.05  # the int4 rollout flips ~30 %


def test_the_report_names_the_training_engine(probes, tmp_path):
    from verl_stable.probe.report import write_report

    md, js, _ = write_report(probes["megatron"][0], tmp_path)
    assert "`--train-engine megatron`" in md.read_text() and "actor.megatron.dtype=float32" in md.read_text()
    data = json.loads(js.read_text())
    assert data["options"]["train_engine"] == "megatron" and "Megatron" in data["training"]


def test_a_model_type_without_a_megatron_bridge_is_refused(tmp_path, capsys, monkeypatch):
    def no_sampling(*args, **kwargs):
        raise AssertionError("a model was loaded although the input should have been refused")

    monkeypatch.setattr(inference, "sample_hf", no_sampling)
    config = {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["--model", str(tmp_path), "--train-engine", "megatron", "--out", str(tmp_path / "o"), "--no-progress"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("verl-stable probe: --train-engine megatron: model_type 'mixtral'"), err
    assert "no local-spec Megatron bridge" in err and "qwen3_moe" in err and "--train-engine fsdp" in err
    # the same checkpoint on the default engine gets past this check (to the missing weights, not this answer)
    assert cli.build_parser().parse_args(["--model", str(tmp_path)]).train_engine == "fsdp"


def test_without_megatron_core_the_megatron_engine_is_refused(toy, tmp_path):
    """A process where megatron-core cannot be imported (the skip-imports finder refuses it, as an uninstalled package
    is refused): one line, exit 2, before the checkpoint is loaded."""
    import subprocess
    import sys

    argv = ["--model", str(toy.model_dir), "--train-engine", "megatron", "--out", str(tmp_path / "o"), "--no-progress"]
    code = (
        "import sys; from verl_stable.compat.skip_imports import install; install(['megatron']); "
        f"from verl_stable.probe import cli; sys.exit(cli.main({argv!r}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert lines[0].startswith("verl-stable probe: --train-engine megatron: megatron.core is not importable"), lines
    assert "--train-engine fsdp" in lines[0]
    assert not (tmp_path / "o").exists()  # nothing was written: refused before any work
