"""Every upstreamable diff is listed in patches/series.toml, and each 0.9.1 one applies to the installed verl 0.9.1."""

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
import verl

PATCHES_DIR = Path(__file__).parents[2] / "patches"
SITE_PACKAGES = Path(verl.__file__).parents[1]


def _load_tool(name: str):
    """``patches/tools/<name>.py``, loaded by path (``patches/tools`` is no package); one module per name."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, PATCHES_DIR / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


SERIES = _load_tool("check_series").load_series()
pt = _load_tool("patched_tree")
PATCHES_0_9_1 = [p.path for p in SERIES.for_base("0.9.1")]


@pytest.mark.skipif(shutil.which("git") is None, reason="git is needed for `git apply --check`")
@pytest.mark.parametrize("patch", PATCHES_0_9_1, ids=[p.name for p in PATCHES_0_9_1])
def test_patch_applies_to_installed_verl(patch):
    # Only verl/: site-packages holds no tests/ tree, and `--check` needs nothing more. check_diff keeps git out of an
    # enclosing work tree (a .venv inside a checkout), where the check would skip every path and pass vacuously.
    checked = pt.check_diff(SITE_PACKAGES, patch, include="verl/*")
    assert checked.ok, checked.message


def test_there_are_patches():
    assert PATCHES_0_9_1, "series.toml lists no diff for verl 0.9.1"


def test_every_diff_is_in_the_series():
    listed = {p.path.name for p in SERIES.patches}
    on_disk = {p.name for p in PATCHES_DIR.glob("*.diff")}
    assert on_disk <= listed, f"not in patches/series.toml: {sorted(on_disk - listed)}"
