"""Every upstreamable diff is listed in patches/series.toml, and each 0.9.1 one applies to the installed verl 0.9.1."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import verl

PATCHES_DIR = Path(__file__).parents[2] / "patches"
SITE_PACKAGES = Path(verl.__file__).parents[1]


def _series():
    spec = importlib.util.spec_from_file_location("check_series", PATCHES_DIR / "tools" / "check_series.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module.load_series()


SERIES = _series()
PATCHES_0_9_1 = [p.path for p in SERIES.for_base("0.9.1")]


@pytest.mark.skipif(shutil.which("git") is None, reason="git is needed for `git apply --check`")
@pytest.mark.parametrize("patch", PATCHES_0_9_1, ids=[p.name for p in PATCHES_0_9_1])
def test_patch_applies_to_installed_verl(patch):
    # Only verl/: site-packages holds no tests/ tree, and `--check` needs nothing more.
    proc = subprocess.run(
        ["git", "apply", "--check", "-p1", "--include=verl/*", str(patch)],
        cwd=SITE_PACKAGES,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr


def test_there_are_patches():
    assert PATCHES_0_9_1, "series.toml lists no diff for verl 0.9.1"


def test_every_diff_is_in_the_series():
    listed = {p.path.name for p in SERIES.patches}
    on_disk = {p.name for p in PATCHES_DIR.glob("*.diff")}
    assert on_disk <= listed, f"not in patches/series.toml: {sorted(on_disk - listed)}"
