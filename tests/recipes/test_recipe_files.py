"""Every command that reads a recipe file refuses a malformed one the same way, naming the file and the line: a key
given twice, a tab where YAML indents with spaces, a byte that is not UTF-8, aliases that expand without bound.

``recipe check`` reports it as its one problem; ``show``, ``run-cpu`` and the lab refuse it with exit code 2 before
anything is composed, built or run (the work is replaced by functions that fail the test). An alias bomb is refused
in well under a second: before this, hydra's read of it ran for minutes and gigabytes.
"""

from __future__ import annotations

import shutil
import time

import pytest

from verl_stable import recipe_cli
from verl_stable import recipes as R
from verl_stable.lab import cli as lab_cli
from verl_stable.lab import sweep
from verl_stable.recipes import strict_yaml
from verl_stable.recipes.strict_yaml import MAX_EXPANDED_NODES, RecipeFileError, read_recipe_file
from verl_stable.toy import launch

# nine levels of ten aliases each: 10**9 values once expanded, 100 nodes in the file
BOMB = "lol:\n  a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"  {n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n" for p, n in zip("abcdefgh", "bcdefghi", strict=True)
)


def _malformed(kind: str, text: str) -> bytes:
    """The shipped ``vespo.yaml`` made malformed in one way, and the line the refusal must name."""
    if kind == "duplicate key":  # a second use_kl_in_reward under algorithm:
        return text.replace("algorithm:\n", "algorithm:\n  use_kl_in_reward: true\n", 1).encode()
    if kind == "tab":
        return text.replace("  train_batch_size: 512", "\ttrain_batch_size: 512", 1).encode()
    if kind == "not utf-8":
        return text.replace("data:\n", "data:  # \udcff\n", 1).encode("utf-8", "surrogateescape")
    if kind == "alias bomb":
        return (text + BOMB).encode()
    raise AssertionError(kind)


def _line_of(text: str, needle: str) -> int:
    return text[: text.index(needle)].count("\n") + 1


def _expected(kind: str, text: str, path) -> str:
    """What the refusal says: the file, the line, the problem."""
    if kind == "duplicate key":  # the added key is the first; the recipe's own, one line further down, the second
        first, second = _line_of(text, "algorithm:\n") + 1, _line_of(text, "  use_kl_in_reward: false") + 1
        return f"{path}, line {second}, column 3: duplicate key 'use_kl_in_reward' (first at line {first}); expected"
    if kind == "tab":
        return f"{path}, line {_line_of(text, '  train_batch_size')}, column 1: found character '\\t' that cannot"
    if kind == "not utf-8":
        return f"{path}, line {_line_of(text, 'data:')}, column 10: byte 0xff is not UTF-8; expected UTF-8 text"
    # the first node past the bound: e, 111111 values, on the bomb's sixth line, at its anchor
    return f"{path}, line {text.count(chr(10)) + 6}, column 6: its aliases expand to more than {MAX_EXPANDED_NODES}"


KINDS = ["duplicate key", "tab", "not utf-8", "alias bomb"]


@pytest.fixture
def bad_recipe(tmp_path, monkeypatch, request):
    """A recipes directory whose ``fsdp/vespo.yaml`` is malformed in the way ``request.param`` names."""
    shutil.copytree(R.recipes_dir() / "fsdp", tmp_path / "fsdp")
    path = tmp_path / "fsdp" / "vespo.yaml"
    text = path.read_text()
    path.write_bytes(_malformed(request.param, text))
    monkeypatch.setenv(R.RECIPES_ENV, str(tmp_path))
    return path, _expected(request.param, text, path)


def _fail(*args, **kwargs):
    raise AssertionError("work started although the recipe should have been refused")


@pytest.fixture
def no_work(monkeypatch):
    monkeypatch.setattr(launch, "ensure_assets", _fail)
    monkeypatch.setattr(launch, "run_main_ppo", _fail)
    for work in ("prepare", "ensure_assets", "cold_start", "run_one"):
        monkeypatch.setattr(sweep, work, _fail)


def _refused(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv, out=lambda _: None)
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("bad_recipe", KINDS, indirect=True)
def test_recipe_check_reports_the_malformed_file_as_its_one_problem(bad_recipe):
    path, expected = bad_recipe
    lines: list[str] = []
    t0 = time.monotonic()
    assert recipe_cli.main(["check", "fsdp/vespo"], out=lines.append) == 1
    assert time.monotonic() - t0 < 30  # the alias bomb ran past minutes in hydra's read
    assert lines[0].startswith(f"  - cannot read the recipe {expected}") and lines[1:] == ["fsdp/vespo: 1 problem(s)"]


@pytest.mark.parametrize("bad_recipe", KINDS, indirect=True)
@pytest.mark.parametrize("action", ["show", "run-cpu"])
def test_show_and_run_cpu_refuse_the_malformed_file_before_anything_is_built(
    bad_recipe, tmp_path, no_work, capsys, action
):
    path, expected = bad_recipe
    extra = ["--workdir", str(tmp_path / "w")] if action == "run-cpu" else []
    err = _refused(recipe_cli.main, [action, "fsdp/vespo", *extra], capsys)
    assert expected in err and "Traceback" not in err
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("bad_recipe", KINDS, indirect=True)
def test_the_lab_refuses_the_malformed_recipe_of_a_variant_before_any_work(bad_recipe, tmp_path, no_work, capsys):
    path, expected = bad_recipe
    err = _refused(lab_cli.main, ["--out", str(tmp_path / "lab"), "--variants", "vespo", "minirl"], capsys)
    assert expected in err
    assert not (tmp_path / "lab").exists()


@pytest.mark.parametrize("bad_recipe", KINDS, indirect=True)
def test_every_library_reader_of_a_recipe_refuses_it(bad_recipe):
    path, expected = bad_recipe
    for read in (R.recipe_keys, R.recipe_base, R.compose_file, read_recipe_file):
        with pytest.raises(RecipeFileError) as info:
            read(path)
        assert str(info.value).startswith(expected)


# ------------------------------------------------------------------------------------------------ the loader
def test_shipped_recipes_read_as_before():
    from omegaconf import OmegaConf

    for _, _, path in R.list_recipes():
        assert read_recipe_file(path) == OmegaConf.to_container(OmegaConf.load(path), resolve=False)


def test_an_alias_bomb_is_refused_fast_and_a_small_alias_is_kept(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(BOMB)
    t0 = time.monotonic()
    with pytest.raises(RecipeFileError, match="its aliases expand to more than 100000 values"):
        read_recipe_file(path)
    assert time.monotonic() - t0 < 1.0
    path.write_text("base: &b {lr: 0.1, n: 2}\nactor: *b\nref: {<<: *b, n: 3}\n")
    assert read_recipe_file(path) == {
        "base": {"lr": 0.1, "n": 2},
        "actor": {"lr": 0.1, "n": 2},
        "ref": {"lr": 0.1, "n": 3},
    }


def test_a_self_referring_alias_and_an_oversized_file_are_refused(tmp_path, monkeypatch):
    path = tmp_path / "r.yaml"
    path.write_text("a: &a\n  b: *a\n")
    with pytest.raises(RecipeFileError, match=f"{path}, line 1, column 4: an alias refers to a node that contains it"):
        read_recipe_file(path)
    monkeypatch.setattr(strict_yaml, "MAX_FILE_BYTES", 8)
    path.write_text("a: 123456789\n")
    with pytest.raises(RecipeFileError, match=f"{path}: larger than 8 bytes"):
        read_recipe_file(path)
