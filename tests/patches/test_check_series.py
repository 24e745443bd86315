"""patches/tools/check_series.py: its pieces on hand-made inputs, and the whole check on verl 0.9.1's sdist.

The unit tests build their inputs by hand (a diff text, test files, junit XML, series.toml files) so each expected
answer is known independently of the checker. The end-to-end test downloads verl's 0.9.1 sdist with pip (or uses
``VERL_STABLE_SDIST``), runs the checker for base 0.9.1 on the series as it is on disk and asserts, per diff, what a
verl maintainer needs: it applies alone and in series, zero new failures in verl's own CPU tests, ruff 0.12.2
check and format clean, license and docstring checks clean, its own tests pass.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "patches" / "tools" / "check_series.py"
BASELINE = REPO / "patches" / "baselines" / "verl-0.9.1-cpu-tests.json"


def _load_tool():
    spec = importlib.util.spec_from_file_location("check_series", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


cs = _load_tool()

DIFF = """Some description: git apply ignores text before the first header.

diff --git a/verl/utils/foo.py b/verl/utils/foo.py
index 1111111..2222222 100644
--- a/verl/utils/foo.py
+++ b/verl/utils/foo.py
@@ -1,2 +1,2 @@
 def f():
-    return 1
+    return 2
diff --git a/verl/pkg/__init__.py b/verl/pkg/__init__.py
new file mode 100644
index 0000000..3333333
--- /dev/null
+++ b/verl/pkg/__init__.py
@@ -0,0 +1 @@
+X = 1
diff --git a/tests/pkg/test_pkg_on_cpu.py b/tests/pkg/test_pkg_on_cpu.py
new file mode 100644
index 0000000..4444444
--- /dev/null
+++ b/tests/pkg/test_pkg_on_cpu.py
@@ -0,0 +1,4 @@
+from verl.pkg import X
+
+def test_x():
+    assert X == 1
"""


# ------------------------------------------------------------------------------------------------ discovery
def test_touched_files_are_read_from_the_git_headers_in_order():
    assert cs.touched_files(DIFF) == ["verl/utils/foo.py", "verl/pkg/__init__.py", "tests/pkg/test_pkg_on_cpu.py"]
    assert cs.touched_files("--- a/verl/x.py\n+++ b/verl/x.py\n@@ -1 +1 @@\n-a\n+b\n") == []


@pytest.mark.parametrize(
    ("rel", "module"),
    [
        ("verl/utils/foo.py", "verl.utils.foo"),
        ("verl/pkg/__init__.py", "verl.pkg"),
        ("verl/trainer/config/fsdp.yaml", None),
        ("tests/test_x_on_cpu.py", None),
    ],
)
def test_module_of(rel, module):
    assert cs.module_of(rel) == module


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text))
    return tmp_path


def test_discovery_finds_cpu_tests_that_import_or_name_a_touched_module(tmp_path):
    tree = _tree(
        tmp_path,
        {
            "tests/a/test_direct_on_cpu.py": "import verl.utils.foo\n",
            "tests/a/test_from_module_on_cpu.py": "from verl.utils.foo import f\n",
            "tests/a/test_from_package_on_cpu.py": "from verl.utils import foo\n",
            "tests/a/test_monkeypatch_on_cpu.py": "def test(m):\n    m.setattr('verl.utils.foo.f', None)\n",
            "tests/a/test_package_on_cpu.py": "from verl.pkg import X\n",
            "tests/a/test_other_on_cpu.py": "from verl.utils.bar import g\nimport verl.utils\n",
            "tests/a/test_relative_on_cpu.py": "from .foo import f\n",
            "tests/a/test_gpu_only.py": "import verl.utils.foo\n",
            "tests/a/test_broken_on_cpu.py": "def (:\n",
        },
    )
    found = cs.discover_tests(tree, cs.touched_files(DIFF))
    assert found == {
        "tests/a/test_direct_on_cpu.py": ["verl.utils.foo"],
        "tests/a/test_from_module_on_cpu.py": ["verl.utils.foo"],
        "tests/a/test_from_package_on_cpu.py": ["verl.utils.foo"],
        "tests/a/test_monkeypatch_on_cpu.py": ["verl.utils.foo"],
        "tests/a/test_package_on_cpu.py": ["verl.pkg"],
    }


# ------------------------------------------------------------------------------------------------ junit / comparison
JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="5">
  <testcase classname="tests.a.test_m_on_cpu" name="test_ok" time="0.1"/>
  <testcase classname="tests.a.test_m_on_cpu.TestK" name="test_param[2-x]" time="0.1"><failure message="boom"/></testcase>
  <testcase classname="tests.a.test_m_on_cpu" name="test_skip" time="0"><skipped message="no gpu"/></testcase>
  <testcase classname="tests.a.test_m_on_cpu" name="test_teardown" time="0.1"><failure message="f"/></testcase>
  <testcase classname="tests.a.test_m_on_cpu" name="test_teardown" time="0.1"><error message="teardown"/></testcase>
</testsuite></testsuites>
"""


def test_parse_junit_gives_one_worst_outcome_per_test(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(JUNIT)
    assert cs.parse_junit(xml, "tests/a/test_m_on_cpu.py") == {
        "tests/a/test_m_on_cpu.py::test_ok": "passed",
        "tests/a/test_m_on_cpu.py::TestK::test_param[2-x]": "failed",
        "tests/a/test_m_on_cpu.py::test_skip": "skipped",
        "tests/a/test_m_on_cpu.py::test_teardown": "error",
    }


def test_compare_blames_only_what_got_worse():
    before = {
        "t::stays_ok": "passed",
        "t::breaks": "passed",
        "t::errors_now": "passed",
        "t::was_skipped": "skipped",
        "t::old_failure": "failed",
        "t::old_error_now_failure": "error",
        "t::fixed": "failed",
        "t::vanishes": "passed",
    }
    after = {
        "t::stays_ok": "passed",
        "t::breaks": "failed",
        "t::errors_now": "error",
        "t::was_skipped": "failed",
        "t::old_failure": "failed",
        "t::old_error_now_failure": "failed",
        "t::fixed": "passed",
        "t::brand_new_failing": "failed",
        "t::brand_new_ok": "passed",
    }
    result = cs.compare(before, after)
    assert result.new_failures == [
        "t::brand_new_failing",
        "t::breaks",
        "t::errors_now",
        "t::vanishes (missing after)",
        "t::was_skipped",
    ]
    assert result.pre_existing == ["t::old_error_now_failure", "t::old_failure"]
    assert result.fixed == ["t::fixed"]
    assert (result.passed_after, result.total_after) == (3, 9)
    assert cs.compare(before, dict(before)).new_failures == []


# ------------------------------------------------------------------------------------------------ series.toml
def _series(tmp_path: Path, body: str, diff: str = DIFF) -> Path:
    (tmp_path / "x.diff").write_text(diff)
    (tmp_path / "x.md").write_text("PR text")
    path = tmp_path / "series.toml"
    path.write_text(textwrap.dedent(body))
    return path


GOOD = """
main_commit = "1dda039b9c6311889a9c9a26040677e1254814f9"

[[patch]]
file = "x.diff"
base = "0.9.1"
feature = "x"
switch = "a.b"
description = "x.md"
own_tests = ["tests/pkg/test_pkg_on_cpu.py"]
"""


def test_a_valid_series_loads(tmp_path):
    series = cs.load_series(_series(tmp_path, GOOD))
    (patch,) = series.patches
    assert (patch.file, patch.base, patch.feature, patch.own_tests) == (
        "x.diff",
        "0.9.1",
        "x",
        ("tests/pkg/test_pkg_on_cpu.py",),
    )
    assert patch.touched()[0] == "verl/utils/foo.py"
    assert series.for_base("main") == []


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.replace('switch = "a.b"', 'switch = "a.b"\nown_test = []'), "unknown key 'own_test'"),
        (lambda s: "extra = 1\n" + s, "unknown top-level key 'extra'"),
        (lambda s: s.replace('file = "x.diff"', 'file = "missing.diff"'), "diff file"),
        (lambda s: s.replace('description = "x.md"', 'description = "nope.md"'), "description"),
        (lambda s: s.replace('base = "0.9.1"', 'base = "0.9.2"'), "base '0.9.2' is not one of 0.9.1, main"),
        (lambda s: s.replace('feature = "x"\n', ""), "missing required key 'feature'"),
        (lambda s: s.replace("own_tests = [", 'own_tests = "tests/x_on_cpu.py" #['), "'own_tests' must be a list"),
        (lambda s: s.replace("tests/pkg/test_pkg_on_cpu.py", "tests/pkg/test_other_on_cpu.py"), "is not in the diff"),
        (lambda s: s.replace("tests/pkg/test_pkg_on_cpu.py", "tests/pkg/test_gpu.py"), "_on_cpu.py path"),
        (lambda s: s.replace('base = "0.9.1"', 'base = "main"').replace("main_commit", "#"), "main_commit is not set"),
        (lambda s: s.replace("1dda039b", "zz"), "is not a 40-hex commit id"),
        (lambda s: s + s[s.index("[[patch]]") :], "x.diff is listed 2 times"),
        (lambda s: s.replace("[[patch]]", "[[patches]]"), "no [[patch]] entries"),
        (lambda s: s.replace('"0.9.1"', "0.9.1"), "is not valid TOML"),
    ],
)
def test_a_malformed_series_is_refused_with_a_clear_message(tmp_path, edit, message):
    with pytest.raises(cs.SeriesError) as info:
        cs.load_series(_series(tmp_path, edit(GOOD)))
    assert message in str(info.value), str(info.value)


def test_a_diff_without_git_headers_is_refused(tmp_path):
    headerless = "--- a/verl/utils/foo.py\n+++ b/verl/utils/foo.py\n@@ -1 +1 @@\n-a\n+b\n"
    with pytest.raises(cs.SeriesError, match=r"has no `diff --git"):
        cs.load_series(_series(tmp_path, GOOD.replace("own_tests = [", "own_tests = [] #"), diff=headerless))


def test_the_projects_series_is_valid():
    series = cs.load_series()
    assert series.for_base("0.9.1"), "no diff for verl 0.9.1"


# ------------------------------------------------------------------------------------------------ applying
@pytest.mark.skipif(shutil.which("git") is None, reason="git apply")
def test_apply_reports_which_stage_failed(tmp_path):
    tree = _tree(tmp_path / "tree", {"verl/utils/foo.py": "def f():\n    return 1\n"})
    diff = tmp_path / "x.diff"
    diff.write_text(DIFF)
    assert cs.apply_diff(tree, diff).ok
    assert (tree / "verl/utils/foo.py").read_text() == "def f():\n    return 2\n"
    assert (tree / "tests/pkg/test_pkg_on_cpu.py").is_file()
    again = cs.apply_diff(tree, diff)  # already applied: the check refuses, nothing changes
    assert not again.ok
    assert again.message.startswith("git apply --check:") and "verl/utils/foo.py" in again.message


# ------------------------------------------------------------------------------------------------ end to end
def _sdist() -> Path | None:
    given = os.environ.get("VERL_STABLE_SDIST")
    return Path(given) if given else None


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("git") is None, reason="git apply")
def test_the_series_passes_the_maintainers_check_on_verl_0_9_1(tmp_path_factory):
    """The whole check for base 0.9.1 (sdist from pip's cache dir unless VERL_STABLE_SDIST names one)."""
    out = tmp_path_factory.mktemp("check") / "report.json"
    cmd = [sys.executable, str(TOOL), "--base", "0.9.1", "--out", str(out)]
    sdist = _sdist()
    if sdist:
        cmd += ["--sdist", str(sdist)]
    if BASELINE.is_file():  # verl's own outcomes on the pristine sdist: only files it lacks run "before"
        cmd += ["--baseline", str(BASELINE)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=REPO)
    assert out.is_file(), proc.stderr[-3000:]
    (base,) = json.loads(out.read_text())["bases"]
    assert base["status"] == "checked", base["note"]
    failures = []
    for diff in base["diffs"]:
        problems = [
            name
            for name, ok in (
                ("applies alone", diff["applies_alone"]["ok"]),
                ("applies in series", diff["applies_in_series"]["ok"]),
                ("zero new failures", diff["alone"] is not None and not diff["alone"]["new_failures"]),
                ("ruff check", diff["ruff_check"]["verdict"] != "fail"),
                ("ruff format", diff["ruff_format"]["verdict"] != "fail"),
                ("license", diff["license"]["verdict"] != "fail"),
                ("docstrings", diff["docstrings"]["verdict"] != "fail"),
                ("trainer config", diff["trainer_config"]["verdict"] != "fail"),
                ("own tests", diff["own_tests_alone"]["verdict"] == "pass"),
                ("own tests in series", diff["own_tests_series"]["verdict"] == "pass"),
            )
            if not ok
        ]
        if problems:
            failures.append(f"{diff['file']}: {', '.join(problems)}")
    assert base["series"] is not None and not base["series"]["new_failures"], base["series"]
    assert not failures, "\n".join(failures) + "\n\n" + proc.stdout[-6000:]
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_the_baseline_supplies_before_outcomes_only_for_its_own_pristine_tree(tmp_path):
    baseline = tmp_path / "baseline.json"
    recorded = {"tests/a/test_a_on_cpu.py": {"tests/a/test_a_on_cpu.py::test_x": "failed"}}
    baseline.write_text(json.dumps({"pristine": "sha256:aaa", "python": "Python 3", "files": recorded}))
    opts = cs.Options(python=sys.executable, work=tmp_path, cache=tmp_path, timeout=60, baseline=baseline)
    outcomes, source = cs._before(opts, tmp_path, "sha256:aaa", ["tests/a/test_a_on_cpu.py"], tmp_path / "junit")
    assert outcomes == {"tests/a/test_a_on_cpu.py::test_x": "failed"}
    assert source == f"1 files from {baseline}, 0 run on the pristine tree"
    with pytest.raises(RuntimeError, match="recorded for pristine sha256:aaa, not sha256:bbb"):
        cs._before(opts, tmp_path, "sha256:bbb", ["tests/a/test_a_on_cpu.py"], tmp_path / "junit")


def test_the_gist_of_a_pytest_failure_is_its_error_lines():
    output = "collecting ...\nE   ImportError: cannot import name 'X'\nnoise\nERROR tests/a_on_cpu.py\n1 error in 2s\n"
    assert cs._gist(output) == "E   ImportError: cannot import name 'X' | ERROR tests/a_on_cpu.py"
    assert cs._gist("just one line\n\n") == "just one line"
