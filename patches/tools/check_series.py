"""The maintainer's check of the upstream series: does each diff in ``patches/series.toml`` merge cleanly into verl?

For each base (``0.9.1``: verl's source distribution; ``main``: verl's main at the series' ``main_commit``) the check

1. builds a pristine verl tree (the sdist, downloaded with pip into a cache when ``--sdist`` is not given; for main a
   ``git archive`` of ``main_commit`` from ``--main-git``, and main is skipped with a note when that is not given);
2. applies the series in order (``git apply --check`` then ``git apply``, per diff) and each diff alone on a fresh copy;
3. finds verl's own CPU tests that touch a patched module (``tests/**/*_on_cpu.py`` importing it, or naming it in a
   string such as a ``monkeypatch`` target), runs them on the pristine tree ("before") and on each patched tree
   ("after": the whole series; one pytest subprocess per file with a timeout, outcomes from its junit XML) and
   reports new failures: passed, skipped or absent before and failed or errored after. Failures already there
   before are listed as pre-existing, not blamed. A file with new failures is rerun on the tree of each diff alone
   that touches a module it references, which attributes them (``--full``: every file, for every diff);
4. runs verl's pre-commit checks on every file a diff touches, on the tree with that diff alone (the PR as
   submitted): ruff 0.12.2 ``check`` and ``format --check`` with the tree's own configuration (installed into a
   cache venv when missing), the license headers of ``tests/special_sanity/check_license.py`` and the docstring
   coverage of ``tests/special_sanity/check_docstrings.py`` where the tree has them, and -- when the diff touches
   ``verl/trainer/config/`` -- the trainer-config generator (each ``_generated_*.yaml`` recomposed with
   ``scripts/print_cfg.py``, as ``scripts/generate_trainer_config.sh`` does, and compared). Findings the pristine
   file already had are pre-existing;
5. runs each diff's ``own_tests`` (the tests it adds inside verl's ``tests/``) on the tree with it alone and on
   the whole series.

Usage (from the repository root, with the interpreter whose packages verl's tests need)::

    .venv/bin/python patches/tools/check_series.py --base 0.9.1 [--sdist verl-0.9.1.tar.gz] --out report.md
    .venv/bin/python patches/tools/check_series.py --base main --main-git /path/to/verl.git --out report.json

``--baseline FILE`` reads the "before" outcomes from a file written by ``--record-baseline FILE`` (keyed by the
pristine source's sha256 and the test file list, so a stale one is refused). The exit code is 0 only when every
checked base passes: every diff applies alone and in series, no new failures, ruff / format / license / docstring /
config generator clean, every diff declares own tests and they pass.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def _load_sibling(name: str) -> ModuleType:
    """``patches/tools/<name>.py``, loaded by path.

    ``patches/tools`` is not a package, and this file runs as a script as well as being loaded by path from the tests;
    a module already loaded under ``name`` (by a test, say) is reused, so ``Applied`` stays one class.
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


# Copying a verl tree and applying one diff to it (check, then apply, git kept out of enclosing repositories) are
# shared with the tests and benchmarks; re-exported here, where the check and its tests have always found them.
_patched_tree = _load_sibling("patched_tree")
Applied = _patched_tree.Applied
apply_diff = _patched_tree.apply_diff
copy_tree = _patched_tree.copy_tree

REPO = Path(__file__).resolve().parents[2]
SERIES = REPO / "patches" / "series.toml"
BASES = ("0.9.1", "main")
RUFF_VERSION = "0.12.2"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "verl-stable-check"
TOP_KEYS = {"main_commit", "patch"}
PATCH_KEYS = {"file": str, "base": str, "feature": str, "switch": str, "description": str, "own_tests": list}
REQUIRED_KEYS = ("file", "base", "feature")
BAD = ("failed", "error")
GENERIC_LICENSE = "Licensed under the Apache License, Version 2.0"


# ------------------------------------------------------------------------------------------------ the series
class SeriesError(ValueError):
    """``series.toml`` is malformed; the message lists every problem found."""


@dataclass(frozen=True)
class Patch:
    """One ``[[patch]]`` entry of ``series.toml``."""

    file: str
    base: str
    feature: str
    switch: str
    description: str
    own_tests: tuple[str, ...]
    path: Path

    def touched(self) -> list[str]:
        """The verl-relative paths the diff writes."""
        return touched_files(self.path.read_text())


@dataclass(frozen=True)
class Series:
    """The parsed series: the pinned main commit and the patches in application order."""

    main_commit: str | None
    patches: tuple[Patch, ...]

    def for_base(self, base: str) -> list[Patch]:
        """The patches for ``base``, in order."""
        return [p for p in self.patches if p.base == base]


def touched_files(diff_text: str) -> list[str]:
    """Paths a git diff writes, from its ``diff --git a/X b/Y`` headers (``Y``), in order."""
    paths = []
    for line in diff_text.splitlines():
        match = re.match(r"diff --git a/(\S+) b/(\S+)$", line)
        if match:
            paths.append(match.group(2))
    return paths


def _patch_problems(index: int, entry: Any, root: Path) -> list[str]:
    """Every problem of one ``[[patch]]`` table (unknown / missing / mistyped keys, missing files)."""
    if not isinstance(entry, dict):
        return [f"patch #{index}: expected a table, got {type(entry).__name__}"]
    where = f"patch #{index} ({entry.get('file', '?')})"
    problems = [
        f"{where}: unknown key {key!r} (allowed: {', '.join(sorted(PATCH_KEYS))})"
        for key in entry
        if key not in PATCH_KEYS
    ]
    problems += [f"{where}: missing required key {key!r}" for key in REQUIRED_KEYS if key not in entry]
    problems += [
        f"{where}: {key!r} must be a {kind.__name__}, got {type(entry[key]).__name__}"
        for key, kind in PATCH_KEYS.items()
        if key in entry and not isinstance(entry[key], kind)
    ]
    if problems:
        return problems
    if entry["base"] not in BASES:
        problems.append(f"{where}: base {entry['base']!r} is not one of {', '.join(BASES)}")
    diff = root / entry["file"]
    if not diff.is_file():
        return [*problems, f"{where}: diff file {diff} does not exist"]
    touched = touched_files(diff.read_text())
    if not touched:
        problems.append(f"{where}: {entry['file']} has no `diff --git a/... b/...` headers")
    if entry.get("description") and not (root / entry["description"]).is_file():
        problems.append(f"{where}: description {root / entry['description']} does not exist")
    for test in entry.get("own_tests", []):
        if not isinstance(test, str) or not re.fullmatch(r"tests/.+_on_cpu\.py", test):
            problems.append(f"{where}: own test {test!r} is not a verl-relative tests/..._on_cpu.py path")
        elif test not in touched:
            problems.append(f"{where}: own test {test} is not in the diff")
    return problems


def load_series(path: Path = SERIES) -> Series:
    """Parse and validate ``series.toml``; raises :class:`SeriesError` listing every problem."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise SeriesError(f"{path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SeriesError(f"{path} is not valid TOML: {exc}") from exc
    problems = [
        f"unknown top-level key {key!r} (allowed: main_commit, [[patch]])" for key in data if key not in TOP_KEYS
    ]
    entries = data.get("patch", [])
    if not isinstance(entries, list) or not entries:
        problems.append("no [[patch]] entries")
        entries = []
    for index, entry in enumerate(entries, start=1):
        problems += _patch_problems(index, entry, path.parent)
    files = [e.get("file") for e in entries if isinstance(e, dict)]
    problems += [f"{f} is listed {n} times" for f, n in Counter(files).items() if n > 1]
    main_commit = data.get("main_commit")
    uses_main = any(isinstance(e, dict) and e.get("base") == "main" for e in entries)
    if main_commit is not None and not (isinstance(main_commit, str) and re.fullmatch(r"[0-9a-f]{40}", main_commit)):
        problems.append(f"main_commit {main_commit!r} is not a 40-hex commit id")
    elif uses_main and main_commit is None:
        problems.append("a patch has base 'main' but main_commit is not set")
    if problems:
        raise SeriesError(f"{path}:\n  " + "\n  ".join(problems))
    patches = tuple(
        Patch(
            file=e["file"],
            base=e["base"],
            feature=e["feature"],
            switch=e.get("switch", ""),
            description=e.get("description", ""),
            own_tests=tuple(e.get("own_tests", [])),
            path=path.parent / e["file"],
        )
        for e in entries
    )
    return Series(main_commit=main_commit, patches=patches)


# ------------------------------------------------------------------------------------------------ pristine trees
def _run(cmd: list[str], cwd: Path | None = None, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run`` capturing text output, never raising on a non-zero exit."""
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False, **kwargs)


def sha256(path: Path) -> str:
    """Hex sha256 of a file."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_sdist(version: str, cache: Path, python: str) -> Path:
    """verl's sdist for ``version`` from ``cache``, downloaded there with pip when absent."""
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(f"verl-{version}.tar.gz"))
    if found:
        return found[0]
    cmd = [python, "-m", "pip", "download", f"verl=={version}", "--no-binary", ":all:", "--no-deps", "-d", str(cache)]
    proc = _run(cmd)
    found = sorted(cache.glob(f"verl-{version}.tar.gz"))
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{proc.stderr[-2000:]}")
    return found[0]


def extract_tar(archive: Path, dest: Path, strip_top: bool) -> None:
    """Extract ``archive`` into ``dest`` (dropping the single top-level folder when ``strip_top``)."""
    dest.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        if strip_top:
            for member in members:
                member.name = member.name.split("/", 1)[1] if "/" in member.name else ""
            members = [m for m in members if m.name]
        tar.extractall(dest, members=members, filter="data")


def pristine_0_9_1(work: Path, sdist: Path | None, cache: Path, python: str) -> tuple[Path, str, str]:
    """The extracted 0.9.1 sdist, a description of its source and its key (``sha256:<hex>``)."""
    archive = sdist or fetch_sdist("0.9.1", cache / "sdist", python)
    tree = work / "pristine"
    extract_tar(archive, tree, strip_top=True)
    digest = sha256(archive)
    return tree, f"{archive} (sha256 {digest})", f"sha256:{digest}"


def pristine_main(work: Path, git_dir: Path, commit: str) -> tuple[Path, str, str]:
    """``git archive`` of ``commit`` from the repository ``git_dir``, its description and key (``git:<commit>``)."""
    archive = work / "main.tar"
    with archive.open("wb") as out:
        proc = subprocess.run(
            ["git", f"--git-dir={git_dir}", "archive", "--format=tar", commit], stdout=out, stderr=subprocess.PIPE
        )
    if proc.returncode != 0:
        raise RuntimeError(f"git archive {commit} from {git_dir} failed: {proc.stderr.decode()[-2000:]}")
    tree = work / "pristine"
    extract_tar(archive, tree, strip_top=False)
    archive.unlink()
    return tree, f"{git_dir} @ {commit}", f"git:{commit}"


# ------------------------------------------------------------------------------------------------ test discovery
def module_of(rel: str) -> str | None:
    """The dotted module of a verl-relative ``verl/...py`` path (packages for ``__init__.py``), else ``None``."""
    if not (rel.startswith("verl/") and rel.endswith(".py")):
        return None
    parts = rel[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def referenced_modules(source: str) -> set[str]:
    """Modules a test file names: ``import a.b``, ``from a import b`` (``a`` and ``a.b``), dotted ``verl.`` strings.

    A string such as ``"verl.x.y.func"`` (a ``monkeypatch`` target) counts for each of its dotted prefixes.
    """
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"verl(\.\w+)+", node.value):
                parts = node.value.split(".")
                names.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
    return names


def discover_tests(tree: Path, touched: list[str]) -> dict[str, list[str]]:
    """verl's ``tests/**/*_on_cpu.py`` in ``tree`` that reference a module in ``touched``, with the modules."""
    modules = {m for m in map(module_of, touched) if m}
    found: dict[str, list[str]] = {}
    for test in sorted((tree / "tests").rglob("*_on_cpu.py")):
        try:
            hits = sorted(referenced_modules(test.read_text(encoding="utf-8")) & modules)
        except SyntaxError:
            continue
        if hits:
            found[test.relative_to(tree).as_posix()] = hits
    return found


# ------------------------------------------------------------------------------------------------ running tests
def tree_env(tree: Path) -> dict[str, str]:
    """Environment for anything run against ``tree``: its verl first on the path, external verl plugins off."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VERL_USE_EXTERNAL_MODULES")}
    env.update(
        PYTHONPATH=str(tree),
        VERL_USE_EXTERNAL_PLUGINS="none",
        PYTHONDONTWRITEBYTECODE="1",
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def assert_tree_is_imported(python: str, tree: Path) -> None:
    """Fail loudly unless ``import verl`` under :func:`tree_env` resolves to ``tree``."""
    proc = _run([python, "-c", "import verl; print(verl.__file__)"], cwd=tree, env=tree_env(tree))
    where = proc.stdout.strip()
    if proc.returncode != 0 or not where.startswith(str(tree)):
        raise RuntimeError(f"`import verl` in {tree} resolved to {where or proc.stderr[-1000:]}")


def parse_junit(xml_path: Path, test_file: str) -> dict[str, str]:
    """``{test id: passed|failed|error|skipped}`` from a pytest junit XML file (worst outcome per test)."""
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    module = test_file[: -len(".py")].replace("/", ".")
    outcomes: dict[str, str] = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        # pytest derives classname from the node id: the file's dotted path, then any test class.
        cls = case.get("classname") or ""
        tail = cls[len(module) :].lstrip(".") if cls.startswith(module) else cls
        test_id = "::".join(part for part in (test_file, tail, case.get("name", "?")) if part)
        tags = {child.tag for child in case}
        outcome = next(
            (o for t, o in (("error", "error"), ("failure", "failed"), ("skipped", "skipped")) if t in tags), None
        )
        outcome = outcome or "passed"
        if rank[outcome] >= rank[outcomes.get(test_id, "passed")]:
            outcomes[test_id] = outcome
    return outcomes


@dataclass
class FileRun:
    """One test file run in its own pytest subprocess."""

    test_file: str
    outcomes: dict[str, str]
    seconds: float
    note: str = ""


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the process group this check started for one pytest run."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _gist(output: str) -> str:
    """The lines of a pytest output that say what went wrong (``E`` / ``ERROR`` lines, else the last line)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(("E ", "ERROR "))]
    return " | ".join(errors[-3:] or lines[-1:])[:500]


def run_test_file(python: str, tree: Path, test_file: str, timeout: float, junit_dir: Path) -> FileRun:
    """Run one test file of ``tree`` with pytest (junit XML to ``junit_dir``), in its own process group."""
    junit_dir.mkdir(parents=True, exist_ok=True)
    xml = junit_dir / (test_file.replace("/", "__") + ".xml")
    xml.unlink(missing_ok=True)
    cmd = [python, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=tree, env=tree_env(tree), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        note = "" if proc.returncode in (0, 1, 5) else f"pytest exit {proc.returncode}: {_gist(output.decode())}"
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.communicate()
        note = f"timed out after {timeout:.0f}s"
    except BaseException:  # interrupted (Ctrl-C, SIGTERM): leave no pytest behind
        _kill_group(proc)
        raise
    seconds = time.monotonic() - start
    outcomes = parse_junit(xml, test_file) if xml.is_file() and not note.startswith("timed out") else {}
    if note and not outcomes:
        outcomes = {f"{test_file}::<file>": "error"}
    return FileRun(test_file, outcomes, seconds, note)


def run_tests(python: str, tree: Path, files: list[str], timeout: float, junit_dir: Path) -> list[FileRun]:
    """Run each test file in turn (one subprocess each)."""
    if files:
        assert_tree_is_imported(python, tree)
    return [run_test_file(python, tree, f, timeout, junit_dir) for f in files]


def merged(runs: list[FileRun]) -> dict[str, str]:
    """All outcomes of several file runs."""
    return {test: outcome for run in runs for test, outcome in run.outcomes.items()}


@dataclass
class Comparison:
    """After-vs-before outcomes of verl's tests."""

    new_failures: list[str] = field(default_factory=list)
    pre_existing: list[str] = field(default_factory=list)
    fixed: list[str] = field(default_factory=list)
    passed_after: int = 0
    total_after: int = 0


def compare(before: dict[str, str], after: dict[str, str]) -> Comparison:
    """New failures: failed / errored after but not before (or passed before and missing after)."""
    new = [t for t, o in after.items() if o in BAD and before.get(t) not in BAD]
    new += [f"{t} (missing after)" for t, o in before.items() if o == "passed" and t not in after]
    return Comparison(
        new_failures=sorted(new),
        pre_existing=sorted(t for t, o in after.items() if o in BAD and before.get(t) in BAD),
        fixed=sorted(t for t, o in after.items() if o == "passed" and before.get(t) in BAD),
        passed_after=sum(o == "passed" for o in after.values()),
        total_after=len(after),
    )


# ------------------------------------------------------------------------------------------------ pre-commit
@dataclass
class Verdict:
    """One pre-commit check on one diff's touched files."""

    verdict: str  # pass | fail | n/a
    new: list[str] = field(default_factory=list)
    pre_existing: list[str] = field(default_factory=list)
    note: str = ""


def verdict(new: list[str], pre_existing: list[str], note: str = "") -> Verdict:
    """``fail`` exactly when there are new findings."""
    return Verdict("fail" if new else "pass", sorted(new), sorted(pre_existing), note)


def ensure_ruff(tools: Path) -> Path:
    """A ruff ``RUFF_VERSION`` executable: on PATH, in ``tools``, or installed into a venv there."""
    on_path = shutil.which("ruff")
    if on_path and _run([on_path, "--version"]).stdout.split()[-1:] == [RUFF_VERSION]:
        return Path(on_path)
    venv = tools / f"ruff-{RUFF_VERSION}"
    ruff = venv / "bin" / "ruff"
    if not ruff.is_file():
        for cmd in ([sys.executable, "-m", "venv", str(venv)], [str(venv / "bin/python"), "-m", "pip", "install"]):
            proc = _run(cmd + ([f"ruff=={RUFF_VERSION}", "-q"] if "pip" in cmd else []))
            if proc.returncode != 0:
                raise RuntimeError(f"`{' '.join(cmd)}` failed: {proc.stderr[-2000:]}")
    return ruff


def _python_files(tree: Path, files: list[str]) -> list[str]:
    """The ``.py`` files of ``files`` that exist in ``tree``."""
    return [f for f in files if f.endswith(".py") and (tree / f).is_file()]


def ruff_findings(ruff: Path, tree: Path, files: list[str]) -> list[tuple[str, str, str]]:
    """``(file, code, message)`` per ``ruff check`` finding (tree's own config, as pre-commit passes files)."""
    files = _python_files(tree, files)
    if not files:
        return []
    proc = _run([str(ruff), "check", "--no-fix", "--force-exclude", "--output-format=json", *files], cwd=tree)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"ruff check failed in {tree}: {proc.stderr[-2000:]}")
    found = []
    for item in json.loads(proc.stdout or "[]"):
        rel = Path(item["filename"]).resolve().relative_to(tree.resolve()).as_posix()
        found.append((rel, item.get("code") or "?", f"{item['message']} (line {item['location']['row']})"))
    return found


def ruff_check(ruff: Path, pristine: Path, tree: Path, files: list[str]) -> Verdict:
    """New ``ruff check`` findings in ``files`` of ``tree`` (pristine ones, matched without line numbers, are old)."""
    old = Counter((f, c, re.sub(r" \(line \d+\)$", "", m)) for f, c, m in ruff_findings(ruff, pristine, files))
    new, pre = [], []
    for f, c, m in ruff_findings(ruff, tree, files):
        key = (f, c, re.sub(r" \(line \d+\)$", "", m))
        (pre if old[key] > 0 else new).append(f"{f}: {c} {m}")
        old[key] -= 1
    return verdict(new, pre)


def unformatted(ruff: Path, tree: Path, files: list[str]) -> set[str]:
    """Files ``ruff format --check`` would reformat."""
    files = _python_files(tree, files)
    if not files:
        return set()
    proc = _run([str(ruff), "format", "--check", "--force-exclude", *files], cwd=tree)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"ruff format failed in {tree}: {proc.stderr[-2000:]}")
    return {line.split(":", 1)[1].strip() for line in proc.stdout.splitlines() if line.startswith("Would reformat:")}


def ruff_format(ruff: Path, pristine: Path, tree: Path, files: list[str]) -> Verdict:
    """Touched files ``ruff format`` would change (those unformatted in the pristine tree too are pre-existing)."""
    old = unformatted(ruff, pristine, files)
    after = unformatted(ruff, tree, files)
    return verdict([f for f in after if f not in old], [f for f in after if f in old])


def _string_assignments(script: Path, prefix: str) -> list[str]:
    """String constants assigned to names starting with ``prefix`` in ``script`` (read, never executed)."""
    values = []
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            if any(isinstance(t, ast.Name) and t.id.startswith(prefix) for t in node.targets):
                values.append(node.value.value)
    return values


def license_check(pristine: Path, tree: Path, files: list[str]) -> Verdict:
    """Touched ``.py`` files carry one of the headers of the tree's ``check_license.py`` (or, without it, Apache-2.0)."""
    script = tree / "tests/special_sanity/check_license.py"
    headers = _string_assignments(script, "license_head") if script.is_file() else [GENERIC_LICENSE]
    note = (
        ""
        if script.is_file()
        else "tree has no tests/special_sanity/check_license.py: checked for the Apache-2.0 notice"
    )

    def lacks(root: Path, rel: str) -> bool:
        path = root / rel
        return path.is_file() and not any(h in path.read_text(encoding="utf-8") for h in headers)

    missing = [f for f in _python_files(tree, files) if lacks(tree, f)]
    return verdict(
        [f for f in missing if not lacks(pristine, f) or not (pristine / f).is_file()],
        [f for f in missing if (pristine / f).is_file() and lacks(pristine, f)],
        note,
    )


def missing_docstrings(path: Path) -> set[str]:
    """Public classes, module-level functions and methods (not nested in functions) without a docstring."""
    missing: set[str] = set()

    def visit(node: ast.AST, owner: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{owner}.{child.name}" if owner else child.name
                if not child.name.startswith("_") and ast.get_docstring(child) is None:
                    missing.add(name)
                if isinstance(child, ast.ClassDef):
                    visit(child, name)

    visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return missing


def _enforced_docstring_files(tree: Path) -> list[str] | None:
    """The files verl's ``check_docstrings.py`` covers (its ``files_to_check`` list), ``None`` without the script."""
    script = tree / "tests/special_sanity/check_docstrings.py"
    if not script.is_file():
        return None
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "files_to_check" for t in node.targets
        ):
            return [e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)]
    return []


def docstring_check(pristine: Path, tree: Path, files: list[str]) -> Verdict:
    """New public definitions without docstrings in touched files that verl's ``check_docstrings.py`` covers.

    New ones in other touched ``verl/`` files are listed in the note (advisory: verl's hook does not cover them).
    """
    enforced = _enforced_docstring_files(tree)
    new, pre, advisory = [], [], []
    for rel in _python_files(tree, [f for f in files if f.startswith("verl/")]):
        before = missing_docstrings(pristine / rel) if (pristine / rel).is_file() else set()
        after = missing_docstrings(tree / rel)
        if enforced is not None and rel in enforced:
            new += [f"{rel}: {n}" for n in sorted(after - before)]
            pre += [f"{rel}: {n}" for n in sorted(after & before)]
        else:
            advisory += [f"{rel}: {n}" for n in sorted(after - before)]
    note = "advisory, not in verl's hook: " + ", ".join(advisory) if advisory else ""
    if enforced is None:
        return Verdict(
            "n/a", [], [], "tree has no tests/special_sanity/check_docstrings.py" + ("; " + note if note else "")
        )
    return verdict(new, pre, note)


def regenerate_trainer_configs(python: str, tree: Path) -> dict[str, str]:
    """``{_generated yaml: "" if up to date else what differs}`` -- what ``generate_trainer_config.sh`` checks."""
    results: dict[str, str] = {}
    for target in sorted((tree / "verl/trainer/config").glob("_generated_*.yaml")):
        text = target.read_text()
        header = "".join(
            line for line in text.splitlines(keepends=True)[:6] if line.startswith("#") or not line.strip()
        )
        match = re.search(r"--cfg job ?(.*?)' to flatten", header)
        args = match.group(1).split() if match else []
        proc = _run([python, "scripts/print_cfg.py", "--cfg", "job", *args], cwd=tree, env=tree_env(tree))
        lines = proc.stdout.splitlines(keepends=True)
        start = next((i for i, line in enumerate(lines) if line.startswith("actor_rollout_ref")), None)
        rel = target.relative_to(tree).as_posix()
        if proc.returncode != 0 or start is None:
            results[rel] = f"print_cfg.py failed: {(proc.stderr or proc.stdout)[-300:].strip()}"
            continue
        expected = header + "".join(lines[start:])
        if expected != text:
            diff = [f"{a!r} != {b!r}" for a, b in zip(expected.splitlines(), text.splitlines(), strict=False) if a != b]
            results[rel] = f"out of date ({len(diff)} lines differ, first: {diff[0] if diff else 'length'})"
        else:
            results[rel] = ""
    return results


def trainer_config_check(python: str, pristine_results: dict[str, str], tree: Path, files: list[str]) -> Verdict:
    """The generator check when ``files`` touch ``verl/trainer/config/``; stale-before files are pre-existing."""
    if not any(f.startswith("verl/trainer/config/") for f in files):
        return Verdict("n/a", note="no trainer config touched")
    if not (tree / "scripts/print_cfg.py").is_file():
        return Verdict("n/a", note="tree has no scripts/print_cfg.py")
    after = regenerate_trainer_configs(python, tree)
    new = [f"{f}: {why}" for f, why in after.items() if why and not pristine_results.get(f)]
    pre = [f"{f}: {why}" for f, why in after.items() if why and pristine_results.get(f)]
    return verdict(new, pre)


# ------------------------------------------------------------------------------------------------ one base
@dataclass
class OwnTests:
    """A diff's own tests on one tree: every file must pass with no failure and at least one passed test."""

    verdict: str
    passed: int = 0
    failed: list[str] = field(default_factory=list)
    skipped: int = 0
    seconds: float = 0.0
    note: str = ""


def own_tests(python: str, tree: Path | None, patch: Patch, timeout: float, junit_dir: Path) -> OwnTests:
    """Run ``patch.own_tests`` on ``tree``."""
    if not patch.own_tests:
        return OwnTests("fail", note="no own tests declared in series.toml")
    if tree is None:
        return OwnTests("fail", note="the diff did not apply")
    runs = run_tests(python, tree, list(patch.own_tests), timeout, junit_dir)
    outcomes = merged(runs)
    failed = sorted(t for t, o in outcomes.items() if o in BAD)
    empty = [r.test_file for r in runs if not any(o == "passed" for o in r.outcomes.values())]
    return OwnTests(
        "fail" if failed or empty else "pass",
        passed=sum(o == "passed" for o in outcomes.values()),
        failed=failed + [f"{f} (no test passed)" for f in empty if not any(t.startswith(f) for t in failed)],
        skipped=sum(o == "skipped" for o in outcomes.values()),
        seconds=sum(r.seconds for r in runs),
        note="; ".join(f"{r.test_file}: {r.note}" for r in runs if r.note),
    )


@dataclass
class DiffReport:
    """Everything checked for one diff on one base."""

    file: str
    feature: str
    touched: list[str]
    applies_alone: Applied
    applies_in_series: Applied
    tests: dict[str, list[str]]
    alone: Comparison | None
    run_alone: list[str]
    ruff_check: Verdict
    ruff_format: Verdict
    license: Verdict
    docstrings: Verdict
    trainer_config: Verdict
    own_tests_alone: OwnTests
    own_tests_series: OwnTests
    seconds: float = 0.0
    passed: bool = False


@dataclass
class BaseReport:
    """The check of one base."""

    base: str
    status: str  # checked | skipped | error
    note: str = ""
    pristine: str = ""
    tests: dict[str, list[str]] = field(default_factory=dict)
    before: dict[str, str] = field(default_factory=dict)
    before_source: str = ""
    series: Comparison | None = None
    series_applies: bool = False
    diffs: list[DiffReport] = field(default_factory=list)
    seconds: float = 0.0
    passed: bool = False


@dataclass
class Options:
    """Command-line options shared by every base."""

    python: str
    work: Path
    cache: Path
    timeout: float
    sdist: Path | None = None
    main_git: Path | None = None
    baseline: Path | None = None
    record_baseline: Path | None = None
    full: bool = False


def _lint(ruff: Path, python: str, pristine: Path, tree: Path, files: list[str], configs: dict[str, str]) -> tuple:
    """The pre-commit verdicts of ``files`` in ``tree``."""
    return (
        ruff_check(ruff, pristine, tree, files),
        ruff_format(ruff, pristine, tree, files),
        license_check(pristine, tree, files),
        docstring_check(pristine, tree, files),
        trainer_config_check(python, configs, tree, files),
    )


def _before(opts: Options, pristine: Path, key: str, files: list[str], junit: Path) -> tuple[dict[str, str], str]:
    """The "before" outcomes of ``files``.

    Files recorded in ``--baseline`` (for the same pristine ``key``) are taken from it, the others are run on
    ``pristine``; ``--record-baseline`` runs every ``*_on_cpu.py`` file of ``pristine`` and writes them all (per test
    file, so a series that later touches other modules finds its files recorded).
    """
    wanted = files
    recorded: dict[str, dict[str, str]] = {}
    if opts.record_baseline:  # every CPU test file of the tree, so later series find theirs recorded
        files = sorted(
            {*files, *(t.relative_to(pristine).as_posix() for t in (pristine / "tests").rglob("*_on_cpu.py"))}
        )
    elif opts.baseline and opts.baseline.is_file():
        data = json.loads(opts.baseline.read_text())
        if data.get("pristine") != key:
            raise RuntimeError(
                f"{opts.baseline} was recorded for pristine {data.get('pristine')}, not {key}: "
                "regenerate it with --record-baseline"
            )
        recorded = data["files"]
    missing = [f for f in files if f not in recorded]
    fresh = {run.test_file: run.outcomes for run in run_tests(opts.python, pristine, missing, opts.timeout, junit)}
    if opts.record_baseline:
        python = _run([opts.python, "--version"]).stdout.strip()
        data = {"pristine": key, "python": python, "files": dict(sorted(fresh.items()))}
        opts.record_baseline.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    outcomes = {t: o for f in wanted for t, o in {**recorded, **fresh}[f].items()}
    if not recorded:
        return outcomes, "run on the pristine tree"
    ran = len([f for f in missing if f in wanted])
    return outcomes, f"{len(wanted) - ran} files from {opts.baseline}, {ran} run on the pristine tree"


@dataclass
class Shared:
    """What the checks of every diff of one base share."""

    opts: Options
    ruff: Path
    work: Path
    pristine: Path
    before: dict[str, str]
    series_tree: Path | None
    series_after: dict[str, str] | None
    configs: dict[str, str]


def _build_trees(patches: list[Patch], pristine: Path, work: Path) -> tuple[dict, dict, Path, dict]:
    """Each diff alone on a copy of ``pristine`` and the whole series on another: trees and apply outcomes."""
    alone_trees: dict[str, Path | None] = {}
    alone_applied: dict[str, Applied] = {}
    for patch in patches:
        tree = copy_tree(pristine, work / f"alone-{patch.feature}")
        alone_applied[patch.file] = apply_diff(tree, patch.path)
        alone_trees[patch.file] = tree if alone_applied[patch.file].ok else None
    series_tree = copy_tree(pristine, work / "series")
    series_applied = {patch.file: apply_diff(series_tree, patch.path) for patch in patches}
    return alone_trees, alone_applied, series_tree, series_applied


def check_base(base: str, series: Series, opts: Options, ruff: Path) -> BaseReport:
    """Run every check of ``base``; see the module docstring."""
    start = time.monotonic()
    patches = series.for_base(base)
    if not patches:
        return BaseReport(base, "skipped", note=f"series.toml has no patch for base {base}")
    if base == "main" and opts.main_git is None:
        return BaseReport(base, "skipped", note="main not checked: no --main-git DIR given (verl's git history)")
    report = BaseReport(base, "checked")
    work = opts.work / base
    work.mkdir(parents=True)
    if base == "main":
        pristine, report.pristine, key = pristine_main(work, opts.main_git, series.main_commit)
    else:
        pristine, report.pristine, key = pristine_0_9_1(work, opts.sdist, opts.cache, opts.python)
    touched = {p.file: p.touched() for p in patches}
    alone_trees, alone_applied, series_tree, series_applied = _build_trees(patches, pristine, work)
    report.series_applies = all(a.ok for a in series_applied.values())
    report.tests = discover_tests(pristine, sorted({f for files in touched.values() for f in files}))
    files = sorted(report.tests)
    report.before, report.before_source = _before(opts, pristine, key, files, work / "junit/before")
    series_after = None
    if report.series_applies:
        series_after = merged(run_tests(opts.python, series_tree, files, opts.timeout, work / "junit/series"))
        report.series = compare(report.before, series_after)
    touches_config = any(f.startswith("verl/trainer/config/") for fs in touched.values() for f in fs)
    shared = Shared(
        opts=opts,
        ruff=ruff,
        work=work,
        pristine=pristine,
        before=report.before,
        series_tree=series_tree if report.series_applies else None,
        series_after=series_after,
        configs=regenerate_trainer_configs(opts.python, pristine) if touches_config else {},
    )
    for patch in patches:
        tests = discover_tests(pristine, touched[patch.file])
        applied = (alone_applied[patch.file], series_applied[patch.file])
        report.diffs.append(_check_diff(patch, shared, alone_trees[patch.file], applied, touched[patch.file], tests))
    report.passed = (
        report.series_applies
        and report.series is not None
        and not report.series.new_failures
        and all(d.passed for d in report.diffs)
    )
    report.seconds = time.monotonic() - start
    return report


def _alone_comparison(
    patch: Patch, shared: Shared, alone: Path, tests: dict[str, list[str]]
) -> tuple[Comparison, list[str]]:
    """verl's tests on the tree with ``patch`` alone, compared with before; also the files actually run alone.

    With the series applied, a file is run again alone only when it has new failures in the series (to attribute
    them); the outcomes of the others are the series run's (``--full`` runs every file alone).
    """
    files = sorted(tests)
    before = {t: o for t, o in shared.before.items() if t.split("::")[0] in tests}
    if shared.series_after is None or shared.opts.full:
        run = files
    else:
        failing = {t.split("::")[0] for t in compare(shared.before, shared.series_after).new_failures}
        run = [f for f in files if f in failing]
    after = {
        t: o
        for t, o in (shared.series_after or {}).items()
        if t.split("::")[0] in tests and t.split("::")[0] not in run
    }
    after.update(
        merged(run_tests(shared.opts.python, alone, run, shared.opts.timeout, shared.work / "junit" / patch.feature))
    )
    return compare(before, after), run


def _check_diff(
    patch: Patch,
    shared: Shared,
    alone: Path | None,
    applied: tuple[Applied, Applied],
    touched: list[str],
    tests: dict[str, list[str]],
) -> DiffReport:
    """verl's tests, pre-commit and own tests of one diff (alone on pristine, and in the series)."""
    start = time.monotonic()
    junit = shared.work / "junit" / patch.feature
    comparison, run_alone = _alone_comparison(patch, shared, alone, tests) if alone is not None else (None, [])
    lint_tree = alone or shared.series_tree
    if lint_tree is None:
        lints = (Verdict("fail", note="the diff did not apply"),) * 5
    else:
        lints = _lint(shared.ruff, shared.opts.python, shared.pristine, lint_tree, touched, shared.configs)
    python, timeout = shared.opts.python, shared.opts.timeout
    report = DiffReport(
        file=patch.file,
        feature=patch.feature,
        touched=touched,
        applies_alone=applied[0],
        applies_in_series=applied[1],
        tests=tests,
        alone=comparison,
        run_alone=run_alone,
        ruff_check=lints[0],
        ruff_format=lints[1],
        license=lints[2],
        docstrings=lints[3],
        trainer_config=lints[4],
        own_tests_alone=own_tests(python, alone, patch, timeout, junit / "own-alone"),
        own_tests_series=own_tests(python, shared.series_tree, patch, timeout, junit / "own-series"),
    )
    report.passed = (
        applied[0].ok
        and applied[1].ok
        and comparison is not None
        and not comparison.new_failures
        and all(v.verdict != "fail" for v in lints)
        and report.own_tests_alone.verdict == "pass"
        and report.own_tests_series.verdict == "pass"
    )
    report.seconds = time.monotonic() - start
    return report


# ------------------------------------------------------------------------------------------------ the report
def _names(items: list[str], limit: int = 12) -> str:
    """A short comma-separated list."""
    shown = ", ".join(f"`{i}`" for i in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _verdict_cell(v: Verdict) -> str:
    """One pre-commit verdict as a table cell."""
    if v.verdict == "pass":
        return "pass" + (f" ({len(v.pre_existing)} pre-existing)" if v.pre_existing else "")
    if v.verdict == "n/a":
        return "n/a"
    return f"**FAIL** ({len(v.new)})"


def render_markdown(reports: list[BaseReport]) -> str:
    """The report a maintainer reads."""
    out = ["# verl-stable upstream series: maintainer's check", ""]
    for r in reports:
        out += [
            f"## Base {r.base}: " + ("PASS" if r.passed else "skipped" if r.status == "skipped" else "**FAIL**"),
            "",
        ]
        if r.status != "checked":
            out += [r.note, ""]
            continue
        out += [f"- pristine: {r.pristine}", f"- checked in {r.seconds / 60:.1f} min"]
        out.append("- series applies in order: " + ("yes" if r.series_applies else "**no**"))
        out.append(
            f"- verl CPU test files that reference a touched module ({len(r.tests)}): " + _names(sorted(r.tests))
        )
        out.append(
            f"- before: {sum(o == 'passed' for o in r.before.values())}/{len(r.before)} passed ({r.before_source})"
        )
        if r.series:
            s = r.series
            out.append(
                f"- after the whole series: {s.passed_after}/{s.total_after} passed, **{len(s.new_failures)} new failures**"
                + (f": {_names(s.new_failures)}" if s.new_failures else "")
            )
            if s.pre_existing:
                out.append(
                    f"- pre-existing failures (fail before too, not blamed): {len(s.pre_existing)}: {_names(s.pre_existing)}"
                )
        out += [
            "",
            "| diff | alone | in series | new failures (alone) | ruff check | ruff format | license | docstrings | trainer config | own tests (alone / series) | time |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for d in r.diffs:
            nf = "n/a" if d.alone is None else str(len(d.alone.new_failures)) + f" of {d.alone.total_after}"
            own = f"{d.own_tests_alone.verdict} {d.own_tests_alone.passed} / {d.own_tests_series.verdict} {d.own_tests_series.passed}"
            out.append(
                f"| `{d.file}` | {'yes' if d.applies_alone.ok else '**no**'} | {'yes' if d.applies_in_series.ok else '**no**'} | "
                f"{nf} | {_verdict_cell(d.ruff_check)} | {_verdict_cell(d.ruff_format)} | {_verdict_cell(d.license)} | "
                f"{_verdict_cell(d.docstrings)} | {_verdict_cell(d.trainer_config)} | {own} | {d.seconds:.0f}s |"
            )
        out.append("")
        for d in r.diffs:
            out += _diff_details(d)
    return "\n".join(out).rstrip() + "\n"


def _diff_details(d: DiffReport) -> list[str]:
    """The findings behind one diff's table row."""
    lines = []
    for label, applied in (("alone", d.applies_alone), ("in series", d.applies_in_series)):
        if not applied.ok:
            lines.append(f"- does not apply {label}: {applied.message[:600]}")
    if d.alone and d.alone.new_failures:
        lines.append(f"- new failures: {_names(d.alone.new_failures, 30)}")
    if d.alone and d.alone.pre_existing:
        lines.append(f"- pre-existing failures: {_names(d.alone.pre_existing)}")
    for label, v in (
        ("ruff check", d.ruff_check),
        ("ruff format", d.ruff_format),
        ("license", d.license),
        ("docstrings", d.docstrings),
        ("trainer config", d.trainer_config),
    ):
        if v.new:
            lines.append(f"- {label}: " + "; ".join(v.new[:20]) + (f" (+{len(v.new) - 20})" if len(v.new) > 20 else ""))
        if v.note and (v.verdict != "n/a" or label == "docstrings"):
            lines.append(f"- {label} note: {v.note[:600]}")
    for label, o in (("own tests alone", d.own_tests_alone), ("own tests in series", d.own_tests_series)):
        if o.verdict != "pass":
            lines.append(f"- {label}: {o.note or ''} {_names(o.failed)}".rstrip())
    if not d.tests:
        lines.append("- no verl CPU test in this tree references a module it touches")
    elif d.alone is not None and len(d.run_alone) < len(d.tests):
        lines.append(
            f"- verl tests referencing its modules: {len(d.tests)} file(s), {len(d.run_alone)} rerun with this diff alone "
            "(the others had no new failure in the series run, whose outcomes they keep)"
        )
    return [f"### `{d.file}`: " + ("pass" if d.passed else "**FAIL**"), *lines, ""] if lines or not d.passed else []


def to_json(reports: list[BaseReport]) -> str:
    """The whole report as JSON."""
    return json.dumps(
        {"passed": all(r.passed or r.status == "skipped" for r in reports), "bases": [asdict(r) for r in reports]},
        indent=1,
        default=str,
    )


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments."""
    default_python = REPO / ".venv/bin/python"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", action="append", choices=BASES, help="repeat for several (default: 0.9.1)")
    parser.add_argument("--series", type=Path, default=SERIES)
    parser.add_argument("--sdist", type=Path, help="verl-0.9.1.tar.gz (else pip downloads it into the cache)")
    parser.add_argument("--main-git", type=Path, help="a git dir with verl's history (for --base main)")
    parser.add_argument("--out", type=Path, help="write the report here (.md or .json)")
    parser.add_argument("--keep", type=Path, help="build the trees in this (new) folder and keep them")
    parser.add_argument("--tools", type=Path, default=CACHE, help="where ruff is installed when missing")
    parser.add_argument("--cache", type=Path, default=CACHE, help="where the sdist is downloaded")
    parser.add_argument("--python", default=str(default_python if default_python.exists() else sys.executable))
    parser.add_argument("--timeout", type=float, default=900, help="seconds per test file")
    parser.add_argument("--baseline", type=Path, help="read the 0.9.1 'before' outcomes from this file")
    parser.add_argument("--record-baseline", type=Path, help="write the 0.9.1 'before' outcomes to this file")
    parser.add_argument("--full", action="store_true", help="run every test file on each diff alone too")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Check every requested base; print (and write) the report; 0 only when all checked bases pass."""
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the running pytest's process group is killed and --keep-less trees removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    series = load_series(args.series)
    work = args.keep or Path(tempfile.mkdtemp(prefix="check-series-"))
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=False)
    ruff = ensure_ruff(args.tools)
    reports = []
    try:
        for base in args.base or ["0.9.1"]:
            opts = Options(
                python=args.python,
                work=work,
                cache=args.cache,
                timeout=args.timeout,
                sdist=args.sdist,
                main_git=args.main_git,
                baseline=args.baseline if base == "0.9.1" else None,
                record_baseline=args.record_baseline if base == "0.9.1" else None,
                full=args.full,
            )
            try:
                reports.append(check_base(base, series, opts, ruff))
            except RuntimeError as exc:
                reports.append(BaseReport(base, "error", note=f"could not check {base}: {exc}"))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    markdown = render_markdown(reports)
    print(markdown)
    if args.out:
        args.out.write_text(to_json(reports) if args.out.suffix == ".json" else markdown)
    return 0 if all(r.passed or r.status == "skipped" for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
