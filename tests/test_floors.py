"""The import picture of docs/explanation/architecture.md, checked on the source: which floor may import which."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import verl_stable

PACKAGE = Path(verl_stable.__file__).parent

# what each pure floor may import from verl_stable (itself always); nothing of them imports verl, vllm or sglang
PURE = {
    "metric_names": set(),
    "schema": set(),
    "algos": {"metric_names"},
    "routing": {"metric_names", "schema"},
    "monitor": {"routing", "metric_names", "schema"},  # the step monitor names routing disagreement
    "transport": {"routing", "metric_names", "schema"},
    "compat": set(),
}
THIRD_PARTY_ENGINES = ("verl", "vllm", "sglang")


def _imports(path: Path, top_level_only: bool) -> list[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
    return found


def _floor(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def _modules(floor: str) -> list[Path]:
    root = PACKAGE / floor
    return sorted(root.rglob("*.py")) if root.is_dir() else [PACKAGE / f"{floor}.py"]


@pytest.mark.parametrize("floor", sorted(PURE))
def test_pure_floors_import_only_what_lies_below(floor):
    allowed = PURE[floor] | {floor}
    for path in _modules(floor):
        for name in _imports(path, top_level_only=floor == "compat"):
            parts = name.split(".")
            assert parts[0] not in THIRD_PARTY_ENGINES, f"{path.relative_to(PACKAGE)} imports {name}"
            if parts[0] == "verl_stable" and len(parts) > 1:
                assert parts[1] in allowed, f"{path.relative_to(PACKAGE)} imports {name} (floor {floor})"


def test_every_integration_module_touches_verl():
    """integration/ holds the modules at verl's seams only: each imports verl (at its top or where it registers)."""
    for path in sorted((PACKAGE / "integration").rglob("*.py")):
        names = _imports(path, top_level_only=False)
        hooks = "when_imported(" in path.read_text()
        assert hooks or any(n.split(".")[0] == "verl" for n in names), f"{path.relative_to(PACKAGE)} touches no verl"


def test_the_cpu_runtime_imports_no_integration_module():
    for path in sorted((PACKAGE / "cpu").rglob("*.py")):
        for name in _imports(path, top_level_only=False):
            assert not name.startswith("verl_stable.integration"), f"{path.relative_to(PACKAGE)} imports {name}"
