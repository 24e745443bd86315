"""Every input the probe cannot measure gets a clear answer: one line and exit code 2 before anything is loaded, or
(a dense model) a report that measures KL only and says that replay does not apply. Never a traceback."""

from __future__ import annotations

import importlib.util
import json

import pandas as pd
import pytest

from verl_stable.probe import checks, cli, inference
from verl_stable.probe.runner import ProbeOptions, run_probe


def _no_sampling(*args, **kwargs):
    raise AssertionError("a model was loaded although the input should have been refused")


@pytest.fixture
def no_work(monkeypatch):
    monkeypatch.setattr(inference, "sample_hf", _no_sampling)


def _refused(capsys, argv, *expected):
    code = cli.main([*argv, "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("verl-stable probe: "), err
    for text in expected:
        assert text in lines[0], lines[0]
    assert "Traceback" not in err
    return lines[0]


def test_a_folder_without_a_checkpoint(tmp_path, capsys, no_work):
    _refused(capsys, ["--model", str(tmp_path), "--out", str(tmp_path / "o")], "no config.json")
    _refused(capsys, ["--model", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")], "no such directory")
    (tmp_path / "config.json").write_text("[1, 2")
    _refused(capsys, ["--model", str(tmp_path), "--out", str(tmp_path / "o")], "cannot read config.json")


def test_a_moe_family_the_project_cannot_replay(tmp_path, capsys, no_work):
    config = {"model_type": "phimoe", "num_local_experts": 16, "num_experts_per_tok": 2, "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    _refused(capsys, ["--model", str(tmp_path), "--out", str(tmp_path / "o")],
             "'phimoe' declares 16 routed experts", "cannot capture or replay", "qwen3_moe")  # fmt: skip


def test_an_engine_without_routed_experts_export(toy, tmp_path, capsys, monkeypatch, no_work):
    monkeypatch.setattr(checks, "engine_exports_routing", lambda engine: False)
    _refused(capsys, ["--model", str(toy.model_dir), "--out", str(tmp_path / "o")],
             "does not export the routed experts", "--engine hf")  # fmt: skip


def test_a_checkpoint_without_weights(toy, tmp_path, capsys):
    import shutil

    for f in toy.model_dir.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, tmp_path / f.name)
    _refused(capsys, ["--model", str(tmp_path), "--data", str(toy.train_file), "--out", str(tmp_path / "o")],
             "transformers cannot load it")  # fmt: skip


def test_a_data_file_without_the_prompt_key(toy, tmp_path, capsys, no_work):
    data = tmp_path / "d.parquet"
    pd.DataFrame({"question": ["copy 3"], "answer": ["3"]}).to_parquet(data)
    argv = ["--model", str(toy.model_dir), "--data", str(data), "--out", str(tmp_path / "o")]
    _refused(capsys, argv, "has no column 'prompt'", "question, answer", "--prompt-key")
    _refused(capsys, [*argv, "--prompt-key", "question"], "row 0", "holds a str", "a chat")
    (tmp_path / "x.parquet").write_text("not parquet")
    _refused(capsys, ["--model", str(toy.model_dir), "--data", str(tmp_path / "x.parquet"), "--out", str(tmp_path)],
             "not a parquet file")  # fmt: skip
    _refused(capsys, ["--model", str(toy.model_dir), "--data", str(tmp_path / "none.parquet")], "no such file")


def test_a_precision_the_engine_does_not_offer(toy, tmp_path, capsys, no_work):
    argv = ["--model", str(toy.model_dir), "--engine", "vllm", "--rollout-precision", "int4", "--out", str(tmp_path)]
    if importlib.util.find_spec("vllm") is None:
        _refused(capsys, argv, "vLLM is not installed")
    else:
        offered = "fp32, bf16" if checks.vllm_cpu_build() else "fp32, bf16, fp16, fp8"
        _refused(capsys, argv, "--rollout-precision int4", f"offers {offered}", "hf engine offers")


def test_bad_counts_and_an_out_that_is_a_file(toy, tmp_path, capsys, no_work):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--model", str(toy.model_dir), "--samples", "0"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        cli.main(["--model", str(toy.model_dir), "--toy"])  # one or the other
    assert "not allowed with argument --model" in capsys.readouterr().err
    (tmp_path / "f").write_text("")
    _refused(capsys, ["--model", str(toy.model_dir), "--out", str(tmp_path / "f")], "is a file")


def test_a_dense_model_is_probed_for_kl_only(dense_model, toy, tmp_path, capsys):
    result = run_probe(ProbeOptions(model=dense_model, data=toy.train_file, samples=4, max_tokens=4,
                                    rollout_precision="int4", train_dtype="fp32"))  # fmt: skip
    assert result.model_kind == "dense" and list(result.metrics) == ["none"]
    assert result.metrics["none"]["stable/train_inf/kl_k3"] > 0
    assert not any(k.startswith("stable/routing") for k in result.metrics["none"])
    assert "Dense model: no routing to flip, so R2 / R3 do not apply" in result.advice["summary"]
    out = tmp_path / "r"
    assert cli.main(["--model", str(dense_model), "--data", str(toy.train_file), "--samples", "2", "--max-tokens",
                     "2", "--out", str(out), "--no-progress"]) == 0  # fmt: skip
    md = (out / "probe.md").read_text()
    assert "dense (no routed experts): KL only, replay does not apply" in md and "| does not apply |" in md
