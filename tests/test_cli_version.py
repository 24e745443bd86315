"""``verl-stable --version``: the installed distribution's version, exit code 0, nothing started."""

from __future__ import annotations

import importlib.metadata as md
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from verl_stable import cli


def test_version_prints_the_installed_distributions_version_and_exits_0(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"verl-stable {md.version('verl-stable')}"


def test_the_console_script_answers_version_without_a_command():
    # the installed entry point, as a user types it; next to this interpreter when the venv is not activated
    script = shutil.which("verl-stable", path=str(Path(sys.executable).parent)) or shutil.which("verl-stable")
    if script is None:
        pytest.skip("the verl-stable console script is not installed")
    out = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"verl-stable {md.version('verl-stable')}"
