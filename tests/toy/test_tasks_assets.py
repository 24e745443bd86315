"""Toy tasks + reward and the locally built assets (tokenizer, tiny MoE, verl-format parquet)."""

from __future__ import annotations

import random

import pytest

from verl_stable.toy import tasks


@pytest.mark.parametrize("task", tasks.TASKS)
def test_examples_are_correct(task):
    for ex in tasks.make_examples(task, 50, seed=1):
        words = ex.question.split()
        digits = [int(w) for w in words if w.isdigit()]
        expected = {"copy": digits[0], "add": sum(digits) % 10, "max": max(digits)}[task]
        assert ex.answer == str(expected)


def test_score_exact_partial_format():
    assert tasks.score("7", "7") == 1.0
    assert tasks.score(" 7 \n", "7") == 1.0
    assert tasks.score("7 copy", "7") == 0.5
    assert tasks.score("3", "7") == 0.1
    assert tasks.score("copy", "7") == 0.0
    assert tasks.score("", "7") == 0.0
    assert tasks.compute_score("verl_stable/copy", "7", "7") == {"score": 1.0, "acc": 1.0}
    with pytest.raises(ValueError, match="single digit"):
        tasks.score("7", "17")
    with pytest.raises(ValueError, match="unknown task"):
        tasks.make_example("sort", random.Random(0))


def test_reward_loads_the_way_verl_loads_it():
    """The toy tasks' file works as ``reward.custom_reward_function.path`` (what ``verl-stable run`` passes)."""
    from verl.utils.import_utils import load_extern_object

    fn = load_extern_object(module_path=tasks.__file__, object_name="compute_score")
    assert fn(data_source="x", solution_str="4", ground_truth="4")["score"] == 1.0


def test_assets_round_trip(tmp_path):
    import pandas as pd
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_stable.toy.assets import AssetSpec, ensure_assets

    spec = AssetSpec(task="add", num_train=6, num_val=2, hidden_size=32, num_hidden_layers=2, num_experts=4)
    a = ensure_assets(tmp_path, spec)
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "add 3 plus 5"}], add_generation_prompt=True)[
        "input_ids"
    ]
    assert tok.unk_token_id not in ids
    assert tok.encode("\n", add_special_tokens=False) != [] and len(tok.encode("\n", add_special_tokens=False)) == 1
    assert tok.decode(ids[-1:]) == "\n" and tok.eos_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(a.model_dir)
    assert model.config.model_type == "qwen3_moe" and model.config.num_experts == 4
    assert model.config.vocab_size == len(tok)
    df = pd.read_parquet(a.train_file)
    assert len(df) == 6 and set(df.columns) >= {"data_source", "prompt", "reward_model", "extra_info"}
    row = df.iloc[0]
    assert row["prompt"][0]["role"] == "user" and row["reward_model"]["ground_truth"].isdigit()
    mtime = a.train_file.stat().st_mtime_ns
    ensure_assets(tmp_path, spec)  # identical spec: nothing rebuilt
    assert a.train_file.stat().st_mtime_ns == mtime


def test_the_megatron_assets_draw_the_pad_row_and_change_nothing_else(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from verl_stable.toy import launch
    from verl_stable.toy.assets import ensure_assets

    small = dict(num_train=4, num_val=2, hidden_size=32, num_hidden_layers=1, num_experts=4)
    spec = launch.asset_spec("hf", "copy")
    megatron_spec = launch.asset_spec("hf", "copy", actor="megatron")
    assert (spec.random_pad_row, megatron_spec.random_pad_row) == (False, True)
    models = {}
    for name, s in (("fsdp", spec), ("megatron", megatron_spec)):
        a = ensure_assets(tmp_path / name, type(s)(**{**s.__dict__, **small}))
        models[name] = AutoModelForCausalLM.from_pretrained(a.model_dir)
    pad = models["fsdp"].config.pad_token_id
    rows = {name: m.model.embed_tokens.weight.detach() for name, m in models.items()}
    # transformers zeroes the padding_idx row; the Megatron assets draw it like the others (std 0.02)
    assert torch.count_nonzero(rows["fsdp"][pad]) == 0
    assert 0.005 < float(rows["megatron"][pad].std()) < 0.05
    others = [i for i in range(rows["fsdp"].shape[0]) if i != pad]
    assert torch.equal(rows["fsdp"][others], rows["megatron"][others])
    fsdp_state, megatron_state = models["fsdp"].state_dict(), models["megatron"].state_dict()
    assert all(torch.equal(fsdp_state[k], megatron_state[k]) for k in fsdp_state if "embed_tokens" not in k)
    with pytest.raises(ValueError, match="actor must be one of"):
        launch.asset_spec("hf", "copy", actor="deepspeed")
