"""Every upstreamable diff under patches/ applies cleanly to the installed verl 0.9.1 source."""

import shutil
import subprocess
from pathlib import Path

import pytest
import verl

PATCHES = sorted((Path(__file__).parents[2] / "patches").glob("*.diff"))
SITE_PACKAGES = Path(verl.__file__).parents[1]


@pytest.mark.skipif(shutil.which("git") is None, reason="git is needed for `git apply --check`")
@pytest.mark.parametrize("patch", PATCHES, ids=[p.name for p in PATCHES])
def test_patch_applies_to_installed_verl(patch):
    proc = subprocess.run(
        ["git", "apply", "--check", "-p1", str(patch)], cwd=SITE_PACKAGES, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_there_are_patches():
    assert PATCHES, "patches/ holds no .diff"
