"""Docs that cannot rot: what README.md, recipes/README.md and docs/ quote is checked against the repository.

* every repository path they quote exists (a backticked path such as ``verl_stable/lab/cli.py``, ``recipes/fsdp/``,
  ``monitor/guard.py`` -- module paths may be given relative to ``verl_stable/`` -- a path inside a quoted command, a
  bare ``name.py`` quoted alone, and every Markdown link to a file, anchors included);
* every ``verl-stable ...`` command they quote, in a code block or in inline code, parses with the CLI's own argument
  parser;
* every ``verl-stable recipe check NAME key=value ...`` they quote composes: ``recipe check`` exits 0, or the exit
  code the line's comment states (``# exit 1: ...``);
* ``docs/reference/cli.md`` has a section for every command and names every option of its parser;
* ``mkdocs build --strict`` passes (in ``test_mkdocs.py``).

How a command is parsed without running it. The parsers are built inside each command's ``main`` (``verl_stable.cli``,
``verl_stable.toy.launch``, ``verl_stable.recipe_cli``, ``verl_stable.lab.cli``), so the test calls that ``main``
with the quoted arguments and stops it where the work would begin: ``ArgumentParser.parse_args`` and
``parse_intermixed_args`` are wrapped to raise once they have returned (argparse's own errors exit 2 before that),
and ``recipe`` -- which parses with ``parse_known_args`` and then checks the recipe name and the overrides' syntax
itself -- has its actions (``list``, ``show``'s composition, ``check``, ``run-cpu``) replaced by the same stop. So a
quoted command passes exactly the checks its parser makes before any work, and nothing is built, composed or run.
``--help`` was not used: argparse acts on it as soon as it sees it, so the other arguments would go unchecked.

Placeholders. ``<...>`` in a quoted command stands for something of the reader's: it is replaced by ``PLACEHOLDER``
(so it parses only where any string would); a path ``/path/to/...`` is replaced by a checkpoint directory the test
makes (``doctor --model`` checks that one exists). A path right after the word ``verl's`` is verl's, not ours, and is
not looked for here.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PACKAGE = REPO / "verl_stable"


def doc_files() -> list[Path]:
    return [REPO / "README.md", REPO / "recipes" / "README.md", *sorted(DOCS.rglob("*.md"))]


# ---------------------------------------------------------------------------------------------------------------------
# Reading Markdown: fenced code blocks, inline code spans, links, headings


@dataclass(frozen=True)
class Code:
    """One piece of code a page quotes: a fenced block's logical line or an inline span."""

    page: Path
    line: int
    text: str
    block: bool  # from a fenced code block
    before: str = ""  # inline spans: the text just before the opening backtick

    def where(self) -> str:
        return f"{_show(self.page, REPO)}:{self.line}"


_FENCE = re.compile(r"^\s*(```|~~~)")
_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
_LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_COMMENT = re.compile(r"<!--.*?-->", re.S)


def _prose_lines(text: str) -> Iterator[tuple[int, str, bool]]:
    """(line number, line, inside a fenced block) for every line, HTML comments blanked."""
    text = _COMMENT.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if match:
            if fence is None:
                fence = match.group(1)
                yield number, line, True
                continue
            if match.group(1) == fence:
                fence = None
                yield number, line, True
                continue
        yield number, line, fence is not None


def _paragraphs(page: Path) -> Iterator[tuple[int, str]]:
    """(first line number, text) of every run of non-blank lines outside fenced blocks: a code span or a link may
    continue on the next line of its paragraph."""
    lines: list[tuple[int, str]] = []
    for number, line, fenced in [*_prose_lines(page.read_text()), (0, "", False)]:
        if fenced or not line.strip():
            if lines:
                yield lines[0][0], "\n".join(text for _, text in lines)
            lines = []
            continue
        lines.append((number, line))


def code_of(page: Path) -> list[Code]:
    found: list[Code] = []
    pending: list[str] = []
    start = 0
    for number, line, fenced in _prose_lines(page.read_text()):
        if not fenced or _FENCE.match(line):
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):  # a continued command: one logical line
            pending.append(line.rstrip()[:-1])
            continue
        found.append(Code(page, start, " ".join([*pending, line]), block=True))
        pending = []
    for first, text in _paragraphs(page):
        for match in _SPAN.finditer(text):
            span = " ".join(match.group(2).split()).replace("\\|", "|")  # a `|` inside a table cell is escaped
            before = text[: match.start()].rsplit("\n", 1)[-1]
            found.append(Code(page, first + text[: match.start()].count("\n"), span, block=False, before=before))
    return sorted(found, key=lambda c: c.line)


def links_of(page: Path) -> list[tuple[int, str]]:
    links = []
    for first, text in _paragraphs(page):
        text = _SPAN.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        links.extend((first + text[: m.start()].count("\n"), m.group(1)) for m in _LINK.finditer(text))
    return links


@functools.cache
def _headings(page: Path) -> list[tuple[str, str]]:
    """(the id mkdocs gives it, its text) of every heading: Python-Markdown's ``toc``, as mkdocs runs it."""
    import html

    import markdown

    md = markdown.Markdown(extensions=["toc", "tables", "fenced_code"])
    md.convert(page.read_text())

    def walk(tokens):
        for token in tokens:
            yield token["id"], html.unescape(token["name"])
            yield from walk(token["children"])

    return list(walk(md.toc_tokens))


def slug_github(text: str) -> str:
    """GitHub's anchor for a heading's text (what a reader of README.md on GitHub follows)."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors_of(page: Path, site: bool) -> set[str]:
    """The anchors of ``page``'s headings: mkdocs' ids (``site``) or GitHub's (numbered as GitHub numbers repeats)."""
    if site:
        return {anchor for anchor, _ in _headings(page)}
    seen: dict[str, int] = {}
    anchors = set()
    for _, text in _headings(page):
        base = slug_github(text)
        anchors.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return anchors


# ---------------------------------------------------------------------------------------------------------------------
# (a) paths

_TOP = (
    "verl_stable",
    "recipes",
    "scripts",
    "tests",
    "benchmarks",
    "requirements",
    "patches",
    "examples",
    "docs",
    ".ci",
)
_ROOT_FILES = ("README.md", "CHANGELOG.md", "Makefile", "mkdocs.yml", "setup.py", "pyproject.toml")
_SUBPACKAGES = tuple(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
_BARE = re.compile(r"^[\w.-]+\.(py|sh|yaml)$")
_SEARCHED = ("verl_stable", "tests", "benchmarks", "scripts", "examples", "recipes")


def _path_token(token: str) -> str | None:
    """The repository path a token names, or None when it names none of ours."""
    token = token.strip("\"'(),;:.").split("=")[-1]
    token = token.removeprefix("$PWD/").removeprefix("./")
    if not token or any(c in token for c in "<>$") or "..." in token:
        return None
    head = token.split("/", 1)[0]
    if head in _TOP or token in _ROOT_FILES:
        return token
    # relative to verl_stable/: a file (`monitor/guard.py`), a folder (`cpu/megatron/`) or a module's attribute
    # (`toy/trainer_process.run_main_ppo`); not a metric name such as `transport/samples`
    if head in _SUBPACKAGES and "/" in token and (token.endswith("/") or re.search(r"\.\w+$", token)):
        return token
    return None


def _expand(path: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    return [p for alt in match.group(1).split(",") for p in _expand(path[: match.start()] + alt + path[match.end() :])]


def path_problem(path: str) -> str | None:
    """Why ``path`` (as quoted) names nothing in the repository, or None."""
    path, _, node = path.partition("::")
    for candidate in _expand(path):
        hits = []
        for base in (REPO, PACKAGE):
            if any(c in candidate for c in "*?["):
                hits += [p for p in base.glob(candidate.rstrip("/"))]
            elif (base / candidate).exists():
                hits.append(base / candidate)
        module, _, attr = candidate.rpartition(".")
        if not hits and attr.isidentifier() and attr not in ("py", "sh", "md", "yaml", "txt", "json", "toml"):
            source = next((b / f"{module}.py" for b in (REPO, PACKAGE) if (b / f"{module}.py").is_file()), None)
            if source is not None:  # a module's attribute
                if not re.search(
                    rf"^\s*(?:async\s+)?(?:def|class)\s+{attr}\b|^{attr}\s*[:=]", source.read_text(), re.M
                ):
                    return f"{candidate}: {module}.py defines no {attr}"
                continue
        if not hits:
            return f"{candidate}: no such file or directory (from the repository root or verl_stable/)"
        if node and not any(re.search(rf"\bdef {re.escape(node.split('::')[-1])}\b", p.read_text()) for p in hits):
            return f"{candidate}::{node}: no such test in the file"
    return None


@functools.cache
def _file_names() -> frozenset[str]:
    return frozenset(p.name for d in _SEARCHED for p in (REPO / d).rglob("*") if "__pycache__" not in p.parts)


def _bare_file_exists(name: str) -> bool:
    return (REPO / name).exists() or name in _file_names()


def quoted_paths(code: Code) -> list[str]:
    if code.before.rstrip().endswith("verl's"):
        return []
    if not code.block and " " not in code.text and _BARE.match(code.text) and "/" not in code.text:
        return [] if _bare_file_exists(code.text) else [code.text + " (bare name)"]
    tokens = code.text.split() if (code.block or " " in code.text) else [code.text]
    return [p for p in map(_path_token, tokens) if p]


def _show(page: Path, root: Path) -> str:
    return str(page.relative_to(root)) if page.is_relative_to(root) else str(page)


def path_problems(pages: list[Path], root: Path = REPO) -> list[str]:
    """Every quoted path that names nothing, and every link whose file or heading is missing."""
    problems = []
    for page in pages:
        for code in code_of(page):
            for path in quoted_paths(code):
                if path.endswith(" (bare name)"):
                    problems.append(f"{_show(page, root)}:{code.line}: `{path[:-12]}` is no file of the repository")
                elif why := path_problem(path):
                    problems.append(f"{_show(page, root)}:{code.line}: {why}")
        for number, target in links_of(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.is_relative_to(root) or not dest.exists():
                problems.append(f"{_show(page, root)}:{number}: link to {target}: no such file")
                continue
            if anchor and dest.suffix == ".md":
                # a built page's links resolve to mkdocs' slugs; a file read on GitHub (README) to GitHub's, and
                # the page it links to is built too: both must have the heading
                in_site = page.is_relative_to(root / "docs")
                for site in (True,) if in_site else (False, True):
                    if anchor not in anchors_of(dest, site):
                        problems.append(f"{_show(page, root)}:{number}: link to {target}: no such heading")
                        break
    return problems


# ---------------------------------------------------------------------------------------------------------------------
# (b) commands


@dataclass(frozen=True)
class Command:
    code: Code
    argv: tuple[str, ...]
    expected_exit: int  # from a `# exit N` comment on the line; 0 without one


def _segments(text: str) -> list[str]:
    return [s for s in re.split(r"\s(?:&&|\|\||;|\|)\s", text) if s.strip()]


def commands_of(pages: list[Path], model_dir: Path) -> list[Command]:
    commands = []
    for page in pages:
        for code in code_of(page):
            comment = code.text.split(" #", 1)[1] if " #" in code.text else ""
            exit_match = re.search(r"\bexit (\d+)", comment)
            for segment in _segments(code.text):
                segment = re.sub(r"<[^<>]*>", "PLACEHOLDER", segment)
                try:
                    tokens = shlex.split(segment, comments=True)
                except ValueError:
                    continue  # not shell (prose in backticks)
                while tokens and (re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]) or tokens[0] in ("time", "exec")):
                    tokens.pop(0)
                if not tokens or Path(tokens[0]).name != "verl-stable":
                    continue
                argv = tuple(str(model_dir) if t.startswith("/path/to/") else t for t in tokens[1:])
                if not code.block and all(re.fullmatch(r"[a-z][a-z-]*", t) for t in argv):
                    argv = (*argv, "--help")  # a command named in prose (`verl-stable recipe check`): it must exist
                commands.append(Command(code, argv, int(exit_match.group(1)) if exit_match else 0))
    return commands


class _Stop(BaseException):
    """Raised where a command would start its work: its arguments parsed (a BaseException: no `except Exception`
    of the command catches it)."""


def _stop(*_args, **_kwargs):
    raise _Stop


def run_parser(
    argv: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> tuple[str | None, argparse.ArgumentParser | None]:
    """Parse ``verl-stable ARGV`` with the CLI's own parser, run nothing; (the error or None, the outermost parser)."""
    from verl_stable import cli, recipe_cli
    from verl_stable.toy import launch

    parsers: list[argparse.ArgumentParser] = []
    depth = [0]
    known = argparse.ArgumentParser.parse_known_args

    def parse_known_args(self, args=None, namespace=None):
        if depth[0] == 0:
            parsers.append(self)
        depth[0] += 1
        try:
            return known(self, args, namespace)
        finally:
            depth[0] -= 1

    def stop_after(method):
        def wrapper(self, *args, **kwargs):
            method(self, *args, **kwargs)
            raise _Stop

        return wrapper

    err = io.StringIO()
    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_args)
        m.setattr(argparse.ArgumentParser, "parse_args", stop_after(argparse.ArgumentParser.parse_args))
        m.setattr(
            argparse.ArgumentParser, "parse_intermixed_args", stop_after(argparse.ArgumentParser.parse_intermixed_args)
        )
        for name in ("_cmd_list", "_cmd_check", "compose_recipe"):
            m.setattr(recipe_cli, name, _stop)
        m.setattr(launch, "run_recipe", _stop)
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                rc = cli.main(list(argv))
        except _Stop:
            rc = 0
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
        except Exception as exc:  # noqa: BLE001 - reported as the command's problem
            return f"{type(exc).__name__}: {exc}", parsers[0] if parsers else None
    error = None if rc == 0 else (err.getvalue().strip().splitlines() or [f"exit {rc}"])[-1]
    return error, parsers[0] if parsers else None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("checkpoint")
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    return path


@pytest.fixture(scope="module")
def commands(model_dir) -> list[Command]:
    return commands_of(doc_files(), model_dir)


# ---------------------------------------------------------------------------------------------------------------------
# the tests


def test_every_quoted_repository_path_exists():
    problems = path_problems(doc_files())
    assert not problems, "\n".join(problems)


def test_every_quoted_verl_stable_command_parses(commands, monkeypatch):
    assert len(commands) > 30  # the docs quote many; none found means the extraction broke
    problems = []
    for argv in sorted({c.argv for c in commands}):
        error, _ = run_parser(argv, monkeypatch)
        if error:
            where = ", ".join(c.code.where() for c in commands if c.argv == argv)
            problems.append(f"{where}: verl-stable {shlex.join(argv)}\n    {error}")
    assert not problems, "\n".join(problems)


@pytest.mark.filterwarnings("ignore:set sequence parallel:UserWarning")  # verl's note on composing a Megatron recipe
def test_every_quoted_recipe_check_composes(commands, capsys):
    from verl_stable import recipe_cli

    checks = {
        (c.argv, c.expected_exit): c for c in commands if c.argv[:2] == ("recipe", "check") and c.argv[-1] != "--help"
    }
    assert checks, "the docs quote no `verl-stable recipe check` line"
    problems = []
    for (argv, expected), code in sorted(checks.items(), key=lambda kv: kv[0]):
        lines: list[str] = []
        rc = recipe_cli.main(list(argv[1:]), out=lines.append)
        if rc != expected:
            problems.append(f"{code.code.where()}: verl-stable {shlex.join(argv)} exited {rc}, the docs say {expected}")
            problems.extend(f"    {line}" for line in lines)
    capsys.readouterr()
    assert not problems, "\n".join(problems)


def _leaf_commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], list]]:
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    yield prefix, options
    for action in subparsers:
        for name, sub in action.choices.items():
            yield from _leaf_commands(sub, (*prefix, name))


def _sections(page: Path) -> dict[str, str]:
    """`verl-stable ...` heading -> the text up to the next heading."""
    sections: dict[str, str] = {}
    current = None
    for _, line, fenced in _prose_lines(page.read_text()):
        match = None if fenced else _HEADING.match(line)
        if match:
            span = re.fullmatch(r"`(verl-stable[^`]*)`", match.group(2).strip())
            current = span.group(1) if span else None
            if current:
                sections[current] = ""
            continue
        if current:
            sections[current] += line + "\n"
    return sections


def test_the_cli_reference_covers_every_command_and_option(monkeypatch):
    page = DOCS / "reference" / "cli.md"
    sections = _sections(page)
    _, top = run_parser(("--version",), monkeypatch)
    commands = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)][0].choices
    problems = []
    tree = list(_leaf_commands(top, ("verl-stable",)))
    for name in commands:
        _, parser = run_parser((name, "list") if name == "recipe" else (name,), monkeypatch)
        if parser.prog != top.prog:  # a delegated command (run, recipe, lab): its own parser
            tree = [t for t in tree if t[0] != ("verl-stable", name)] + list(
                _leaf_commands(parser, ("verl-stable", name))
            )
    for path, options in tree:
        title = " ".join(path)
        if title not in sections:
            problems.append(f"{page.relative_to(REPO)}: no section headed `{title}`")
            continue
        text = sections[title]  # and the pages the section links to (a command documented on a page of its own)
        for _, target in re.findall(r"(?<!!)\[([^\]]*)\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", text):
            linked = (page.parent / target).resolve()
            text += linked.read_text() if linked.is_file() else ""
        problems += [f"`{title}` does not name {o}" for o in options if f"`{o}" not in text]
    assert not problems, "\n".join(problems)


# The checks above can fail: each is shown failing on a page made to break it.


def test_the_checks_find_what_is_broken(tmp_path, monkeypatch, model_dir):
    page = tmp_path / "broken.md"
    page.write_text(
        "See `verl_stable/lab/nope.py`, `monitor/guardian.py`, `hf_rollout.py`, verl's `docs/algo/grpo.md`,\n"
        "`tests/lab/test_lab_sweep.py::test_no_such_test`, [a page](nope.md).\n\n"
        "```bash\nverl-stable lab --preset nope   # a preset that does not exist\n"
        "verl-stable recipe check fsdp/minirl_n2_r2 data.train_batch_size=256   # exit 1: N = 4 is not R2\n```\n"
    )
    problems = [p.split(": ", 1)[1] for p in path_problems([page], root=tmp_path)]
    assert problems == [
        "verl_stable/lab/nope.py: no such file or directory (from the repository root or verl_stable/)",
        "monitor/guardian.py: no such file or directory (from the repository root or verl_stable/)",
        "`hf_rollout.py` is no file of the repository",
        "tests/lab/test_lab_sweep.py::test_no_such_test: no such test in the file",
        "link to nope.md: no such file",
    ], problems  # verl's path is verl's, not looked for
    found = commands_of([page], model_dir)
    assert [(c.argv, c.expected_exit) for c in found] == [
        (("lab", "--preset", "nope"), 0),
        (("recipe", "check", "fsdp/minirl_n2_r2", "data.train_batch_size=256"), 1),
    ]
    assert "invalid choice: 'nope'" in run_parser(found[0].argv, monkeypatch)[0]
    assert run_parser(found[1].argv, monkeypatch)[0] is None  # it parses; composing it exits 1
    assert "unknown regime 'no_such_recipe'" in run_parser(("recipe", "check", "fsdp/no_such_recipe"), monkeypatch)[0]
    assert "unrecognized arguments" in run_parser(("run", "--steps", "2", "--no-such-option"), monkeypatch)[0]
    assert run_parser(("doctor", "--model", str(model_dir)), monkeypatch)[0] is None
    assert "no such file" in run_parser(("doctor", "--model", str(tmp_path / "nope")), monkeypatch)[0]


def test_a_missing_heading_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# Page\n\n## What the lab found\n\n## `verl-stable lab --out` (b)\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "[ok](docs/page.md#what-the-lab-found) [broken](docs/page.md#what-the-lab-finds)\n"
        "[slugs differ](docs/page.md#verl-stable-lab-out-b)\n"
    )
    problems = path_problems([readme], root=tmp_path)
    assert problems == [
        "README.md:1: link to docs/page.md#what-the-lab-finds: no such heading",
        "README.md:2: link to docs/page.md#verl-stable-lab-out-b: no such heading",  # GitHub: verl-stable-lab---out-b
    ], problems
