"""``verl-stable doctor --model`` on a config.json that is deep or declares absurd sizes: a one-line verdict, fast.

A config.json is input from anywhere. Nested deeper than ``MAX_CONFIG_DEPTH`` (up to deeper than Python's JSON parser
recurses), it must be reported as malformed, not as a ``RecursionError``; declaring ``num_hidden_layers=10**9``, it must be refused before
transformers or the routing layout build one entry per layer (gigabytes). The size checks run in a subprocess with
a 4 GiB address-space limit, so that a regression fails with ``MemoryError`` instead of exhausting the machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from verl_stable import cli
from verl_stable.routing import describe, families

_DEPTH = 100_000


def _problems(tmp_path) -> tuple[list[str], list[str]]:
    lines: list[str] = []
    problems = cli._check_model(str(tmp_path), lines.append)
    return problems, lines


def _nested(depth: int, opening: str, closing: str) -> str:
    """A qwen3_moe config.json whose arrays / objects nest ``depth`` levels deep (the top-level object is one)."""
    inner = depth - 1
    return (
        '{"model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 2, "num_experts": 8, '
        f'"num_experts_per_tok": 2, "x": {opening * inner}0{closing * inner}}}'
    )


# 100000 levels: deeper than json's parser recurses; 500: parsed by json, but too deep for transformers' recursive
# copies and comparisons of a config (RecursionError there before the bound).
@pytest.mark.parametrize("depth", [_DEPTH, 500])
@pytest.mark.parametrize("nest", [("[", "]"), ('{"a": ', "}")], ids=["lists", "dicts"])
def test_doctor_model_reports_a_deeply_nested_config_as_malformed(tmp_path, nest, depth):
    (tmp_path / "config.json").write_text(_nested(depth, *nest))
    problems, lines = _problems(tmp_path)
    expected = (
        f"malformed config.json: {tmp_path / 'config.json'} nests JSON arrays / objects more than "
        f"{families.MAX_CONFIG_DEPTH} levels deep (a model config nests fewer than ten)"
    )
    assert problems == [f"routing of {tmp_path} cannot be checked: {expected}"]
    assert lines[-1] == f"    routing replay: cannot be checked ({expected})"
    # the library API gives the same verdict instead of raising
    report = describe.describe_model_routing(tmp_path)
    assert not report["replayable"] and report["reason"] == expected


def test_doctor_model_accepts_a_config_nested_to_the_bound(tmp_path):
    (tmp_path / "config.json").write_text(_nested(families.MAX_CONFIG_DEPTH, '{"a": ', "}"))
    problems, lines = _problems(tmp_path)
    assert problems == [], lines
    assert "    routing replay: supported (family qwen3_moe, model_type qwen3_moe)" in lines
    (tmp_path / "config.json").write_text(_nested(families.MAX_CONFIG_DEPTH + 1, '{"a": ', "}"))
    assert "malformed config.json" in _problems(tmp_path)[0][0]


def test_doctor_end_to_end_on_a_deeply_nested_config_exits_1_without_a_traceback(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_check_cpu_runtime", lambda out: [])  # its own tests live in tests/cpu
    (tmp_path / "config.json").write_text("[" * _DEPTH + "]" * _DEPTH)
    assert cli.main(["doctor", "--model", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert f"routing of {tmp_path} cannot be checked: malformed config.json" in captured.out
    assert "Traceback" not in captured.out + captured.err and "RecursionError" not in captured.out


_SIZES = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
from transformers import Qwen3MoeConfig
from verl_stable import cli
from verl_stable.routing import describe, families

root = sys.argv[1]
started = time.monotonic()
lines = []
out = {"doctor": cli._check_model(root, lines.append), "line": lines[-1]}
out["dict"] = describe.describe_model_routing(json.load(open(root + "/config.json")))["reason"]
config = Qwen3MoeConfig(hidden_size=32, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
config.num_hidden_layers = 10**9  # a config object edited after transformers built it
try:
    families.layout_from_config(config)
    out["layout"] = "accepted"
except families.UnsupportedModelError as exc:
    out["layout"] = str(exc)
out["seconds"] = time.monotonic() - started
print(json.dumps(out))
"""


def test_doctor_model_refuses_an_absurd_layer_count_before_building_per_layer_lists(tmp_path):
    layers = 10**9
    config = {"model_type": "qwen3_moe", "hidden_size": 32, "num_experts": 8, "num_experts_per_tok": 2}
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SIZES), str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    bound = f"must be <= {families.MAX_DECODER_LAYERS} (the most decoder layers verl-stable accepts), got {layers}"
    expected = f"{tmp_path / 'config.json'}: num_hidden_layers {bound}"
    assert out["doctor"] == [f"routing of {tmp_path} cannot be checked: {expected}"]
    assert out["line"] == f"    routing replay: cannot be checked ({expected})"
    assert out["dict"] == f"config num_hidden_layers {bound}"
    assert out["layout"] == f"config num_hidden_layers {bound}"
    assert out["seconds"] < 60  # refused, not built and then thrown away


def test_doctor_model_refuses_an_absurd_layer_count_in_text_config(tmp_path):
    text = {"model_type": "qwen3_5_moe_text", "num_hidden_layers": families.MAX_DECODER_LAYERS + 1}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": text}))
    problems, _ = _problems(tmp_path)
    assert problems == [
        f"routing of {tmp_path} cannot be checked: {tmp_path / 'config.json'}: text_config.num_hidden_layers must be "
        f"<= {families.MAX_DECODER_LAYERS} (the most decoder layers verl-stable accepts), "
        f"got {families.MAX_DECODER_LAYERS + 1}"
    ]


def test_doctor_model_accepts_the_largest_layer_count(tmp_path):
    from transformers import Qwen3MoeConfig

    layers = families.MAX_DECODER_LAYERS
    Qwen3MoeConfig(hidden_size=32, num_hidden_layers=layers, num_experts=8, num_experts_per_tok=2).save_pretrained(
        tmp_path
    )
    problems, lines = _problems(tmp_path)
    assert problems == []
    assert "    routing replay: supported (family qwen3_moe, model_type qwen3_moe)" in lines
    assert f"      MoE layers: {layers} of {layers} decoder layers (dense: none)" in lines
