"""The docs site builds in strict mode: ``mkdocs build --strict`` with the repository's ``mkdocs.yml``.

This is how CI builds it: ``.ci/run`` calls ``scripts/test.sh``, which runs this file. ``mkdocs.yml`` turns every
link, anchor and nav check of mkdocs into a warning and ``--strict`` turns a warning into a failed build, so a link to
a page or heading that does not exist, or a page left out of ``nav``, fails here. The second test shows that on a
copy of the docs with one of each.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def build(root: Path, site: Path) -> tuple[int, str]:
    """``mkdocs build --strict`` of ``root/mkdocs.yml`` into ``site``; (exit code, output)."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.fail(
            "mkdocs and mkdocs-material are not installed: bash scripts/install_cpu.sh installs requirements/docs.txt"
        )
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(root / "mkdocs.yml")]
        + ["--site-dir", str(site)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's notice about its successor, not a build warning
    )
    return proc.returncode, proc.stdout + proc.stderr


def test_the_site_builds_in_strict_mode(tmp_path):
    code, output = build(REPO, tmp_path / "site")
    assert code == 0 and "WARNING" not in output, output
    pages = {p.relative_to(REPO / "docs").with_suffix("") for p in (REPO / "docs").rglob("*.md")}
    built = {p.relative_to(tmp_path / "site").parent for p in (tmp_path / "site").rglob("index.html")}
    assert {Path("." if p.name == "index" else p) for p in pages} <= built, sorted(map(str, pages))


def test_a_broken_link_or_a_page_outside_nav_fails_the_build(tmp_path):
    copy = tmp_path / "repo"
    shutil.copytree(REPO / "docs", copy / "docs")
    shutil.copy(REPO / "mkdocs.yml", copy / "mkdocs.yml")
    (copy / "docs" / "orphan.md").write_text("# A page nav does not list\n")
    start = copy / "docs" / "getting-started.md"
    start.write_text(
        start.read_text()
        + "\n[a page that is not there](how-to/nope.md), [a heading that is not there](reference/cli.md#nope)\n"
    )
    code, output = build(copy, tmp_path / "site")
    assert code != 0, output
    assert "orphan.md" in output and "how-to/nope.md" in output and "#nope" in output, output
