"""``verl-stable doctor``: a ``--log`` it cannot append to is refused with one error line (exit code 2, no
traceback), and a ``--model`` whose config transformers itself cannot build gets that as its verdict, not
"supported"."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from verl_stable import cli
from verl_stable.routing import describe, families

# a tiny config of each family that divides by decoder_sparse_step when it builds a decoder layer
MOE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "vocab_size": 64,
}


def _doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "verl_stable.cli", "doctor", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ("dir", "is a directory; expected a file to append to (created if missing)"),
        ("file/doctor.log", "lies below the file {tmp}/file; expected a file to append to (created if missing)"),
        ("file/a/b.log", "lies below the file {tmp}/file; expected a file to append to (created if missing)"),
    ],
)
def test_a_log_that_cannot_be_a_file_is_one_error_line(tmp_path, where, expected):
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("the user's file\n")
    done = _doctor("--log", str(tmp_path / where))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    error = [line for line in done.stderr.splitlines() if line.startswith("verl-stable doctor: error:")]
    assert error == [
        f"verl-stable doctor: error: argument --log: {str(tmp_path / where)!r} " + expected.format(tmp=tmp_path)
    ]
    assert (tmp_path / "file").read_text() == "the user's file\n" and not any((tmp_path / "dir").iterdir())


def test_a_log_that_is_a_directory_is_refused_by_the_parser_in_process(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["doctor", "--log", str(tmp_path)])
    assert info.value.code == 2
    assert f"argument --log: {str(tmp_path)!r} is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe"])
def test_a_zero_decoder_sparse_step_gets_a_verdict_not_supported(tmp_path, model_type):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **MOE, "decoder_sparse_step": 0}))
    lines: list[str] = []
    problems = cli._check_model(str(tmp_path), lines.append)
    reason = (
        "config decoder_sparse_step is 0: transformers builds layer 0 with (layer + 1) % decoder_sparse_step and "
        "cannot build this model (ZeroDivisionError); expected an integer >= 1 (1: every layer is MoE)"
    )
    assert problems == [f"routing of {tmp_path} cannot be replayed: {reason}"]
    assert lines[-1] == f"    routing replay: NOT supported ({reason})"
    with pytest.raises(families.UnsupportedModelError, match="decoder_sparse_step is 0"):
        families.qwen_sparse_layers(describe._load_config(tmp_path))


def test_a_zero_decoder_sparse_step_is_harmless_where_transformers_never_divides_by_it(tmp_path):
    config = {"model_type": "qwen3_moe", **MOE, "decoder_sparse_step": 0, "mlp_only_layers": [0, 1]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert families.qwen_sparse_layers(describe._load_config(tmp_path)) == ()  # every layer dense, as transformers


def test_a_config_whose_model_transformers_cannot_build_gets_that_verdict(tmp_path):
    """Every field passes the routing check, but the model's constructor fails (an activation it does not know)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", **MOE, "hidden_act": "nope"}))
    lines: list[str] = []
    problems = cli._check_model(str(tmp_path), lines.append)
    expected = "transformers cannot build the model from its config.json: KeyError: 'nope'"
    assert problems == [f"routing of {tmp_path} cannot be checked: {expected}"]
    assert "supported" not in "\n".join(lines)


def test_a_sound_config_is_still_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", **MOE}))
    lines: list[str] = []
    assert cli._check_model(str(tmp_path), lines.append) == []
    assert lines[1].startswith("    routing replay: supported (family qwen3_moe")
