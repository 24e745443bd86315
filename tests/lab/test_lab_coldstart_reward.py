"""Cold start (supervised fine-tune, cached) and the lab's binary exact-match reward."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import pytest
import torch

from verl_stable.lab import reward
from verl_stable.lab.coldstart import ColdStartConfig, cache_key, cold_start, encode_examples, expected_reward
from verl_stable.lab.progress import ProgressBar
from verl_stable.toy import tasks
from verl_stable.toy.assets import AssetSpec, ensure_assets

TINY = AssetSpec(
    task="copy", num_train=8, num_val=4, hidden_size=32, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2
)


def test_reward_is_binary_exact_match():
    assert reward.exact_match("7", "7") == 1.0
    assert reward.exact_match(" 7 \n", "7") == 1.0
    assert reward.exact_match("7 copy", "7") == 0.0  # tasks.score gives 0.5 here
    assert reward.exact_match("3", "7") == 0.0  # tasks.score gives 0.1 (format credit)
    assert reward.exact_match("", "7") == 0.0
    assert reward.compute_score("verl_stable/copy", "4", "4") == {"score": 1.0, "acc": 1.0}
    with pytest.raises(ValueError, match="single digit"):
        reward.exact_match("7", "77")


def test_reward_loads_the_way_verl_loads_it():
    from verl.utils.import_utils import load_extern_object

    fn = load_extern_object(module_path=reward.__file__, object_name="compute_score")
    assert fn(data_source="x", solution_str="4 4", ground_truth="4")["score"] == 0.0
    assert fn(data_source="x", solution_str="4", ground_truth="4")["score"] == 1.0


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory):
    return ensure_assets(tmp_path_factory.mktemp("assets"), TINY)


def test_encoding_marks_answer_and_end_of_turn(tiny_assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_assets.model_dir))
    examples = tasks.make_examples("max", 3, seed=0)
    ids, attn, tmask = encode_examples(tok, examples)
    assert ids.shape == attn.shape == tmask.shape
    for b, ex in enumerate(examples):
        targets = ids[b][tmask[b]].tolist()
        assert tok.convert_ids_to_tokens(targets) == [ex.answer, "<|im_end|>"]
        assert tmask[b, -2:].all() and attn[b, -1] == 1  # left padding: targets end each row
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": ex.question}], add_generation_prompt=True, tokenize=False
        )
        n = int(attn[b].sum()) - 2
        assert tok.decode(ids[b][attn[b].bool()][:n], skip_special_tokens=False).replace(" ", "") == prompt.replace(
            " ", ""
        )


def test_expected_reward_is_the_probability_of_the_exact_answer(tiny_assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_assets.model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_assets.model_dir), dtype=torch.float32).eval()
    (ex,) = tasks.make_examples("copy", 1, seed=3)
    ids, attn, tmask = encode_examples(tok, [ex])
    prompt_len = int(attn.sum()) - 2
    with torch.no_grad():  # independent reference: two explicit next-token distributions
        p1 = torch.softmax(model(input_ids=ids[:, :prompt_len]).logits[0, -1], -1)[ids[0, prompt_len]]
        p2 = torch.softmax(model(input_ids=ids[:, : prompt_len + 1]).logits[0, -1], -1)[ids[0, prompt_len + 1]]
    assert expected_reward(model, ids, attn, tmask) == pytest.approx(float(p1 * p2), rel=1e-4)


def test_cold_start_raises_reward_and_is_cached(tiny_assets, tmp_path):
    torch.set_num_threads(1)
    cfg = ColdStartConfig(target_reward=0.05, max_steps=60, batch_size=16, lr=1e-2, eval_every=5, num_eval=16)
    first = cold_start(tiny_assets, TINY, tmp_path, cfg)
    assert not first.cached and first.steps <= cfg.max_steps
    assert first.expected_reward > first.initial_expected_reward
    assert first.expected_reward >= cfg.target_reward or first.steps == cfg.max_steps
    assert (first.model_dir / "tokenizer.json").exists() and (first.model_dir / "config.json").exists()
    again = cold_start(tiny_assets, TINY, tmp_path, cfg)
    assert again.cached and again.model_dir == first.model_dir and again.expected_reward == first.expected_reward
    assert json.loads((first.model_dir / "coldstart.json").read_text())["steps"] == first.steps
    # routers frozen (default): bit-identical to the initial model's, everything else trained
    from transformers import AutoModelForCausalLM

    from verl_stable.lab.coldstart import router_parameters

    before = AutoModelForCausalLM.from_pretrained(str(tiny_assets.model_dir), dtype=torch.float32)
    after = AutoModelForCausalLM.from_pretrained(str(first.model_dir), dtype=torch.float32)
    routers = {id(p) for p in router_parameters(after)}
    assert len(routers) == TINY.num_hidden_layers
    changed = []
    for (name, p0), p1 in zip(before.named_parameters(), after.parameters(), strict=True):
        if id(p1) in routers:
            assert torch.equal(p0, p1), name
        elif not torch.equal(p0, p1):
            changed.append(name)
    assert any("experts" in n for n in changed) and any("self_attn" in n for n in changed)
    assert all(p.requires_grad for p in after.parameters())


def test_cache_key_covers_inputs_and_config_is_checked():
    cfg = ColdStartConfig()
    assert cache_key(TINY, cfg) == cache_key(TINY, ColdStartConfig())
    assert cache_key(TINY, cfg) != cache_key(replace(TINY, task="add"), cfg)
    assert cache_key(TINY, cfg) != cache_key(TINY, replace(cfg, lr=1e-4))
    with pytest.raises(ValueError, match="target_reward"):
        ColdStartConfig(target_reward=1.0)
    with pytest.raises(ValueError, match=">= 1"):
        ColdStartConfig(max_steps=0)


def test_progress_bar_renders_and_logs_only_changes():
    stream = io.StringIO()
    bar = ProgressBar(10, stream=stream, width=10)
    bar.update(0, "run 1")
    bar.update(0, "run 1")
    bar.update(5, "run 1")
    bar.update(12, "run 2")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[1].startswith("[#####.....] 5/10 steps | run 1")
    assert lines[2].startswith("[##########] 10/10 steps | run 2")
    with pytest.raises(ValueError):
        ProgressBar(-1)
