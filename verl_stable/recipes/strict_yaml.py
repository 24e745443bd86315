"""Read a recipe file strictly: every command that reads one refuses a malformed file the same way, naming it.

A recipe reaches verl through hydra, which reads the file with PyYAML; what PyYAML lets through or reports badly is
refused here first, with the file, the line and what is expected:

* a byte that is not UTF-8 (hydra opens the file as UTF-8: its error names neither the file nor the line);
* YAML that does not parse (a tab where YAML wants indenting spaces, a bad indent ...), as PyYAML's problem at its line;
* a key given twice in one mapping (YAML says keys are unique; a second ``use_kl_in_reward:`` would silently win in
  some readers and be refused by others);
* aliases that expand beyond :data:`MAX_EXPANDED_NODES` values, or that refer to themselves: PyYAML shares an aliased
  node, but OmegaConf copies it per use, so nine levels of ten aliases each (a "billion laughs") take minutes and
  gigabytes of memory there. The count below is over the composed node graph with each node's size computed once,
  so it takes time and memory linear in the file, which :data:`MAX_FILE_BYTES` bounds.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

MAX_FILE_BYTES = 1 << 20
"""A recipe is a few KiB of YAML; a file above 1 MiB is not one."""
MAX_EXPANDED_NODES = 100_000
"""Values (mappings, lists, scalars and keys) a recipe may hold once its aliases are expanded; the shipped recipes hold
a few hundred, verl's whole trainer config about 2000."""


class RecipeFileError(ValueError):
    """A recipe file that cannot be read as one; the message starts with the file."""


def _at(path: Path, mark: Any) -> str:
    return f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else str(path)


def _expanded_size(path: Path, root: Any) -> int:
    """The number of values under ``root`` with every alias expanded; each node is counted once (memo), so this is
    linear in the node graph however often an alias is used.

    Raises:
        RecipeFileError: an alias refers to a node that contains it (expansion would never end), or the count passes
            :data:`MAX_EXPANDED_NODES`.
    """
    import yaml

    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: Any) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise RecipeFileError(
                f"{_at(path, node.start_mark)}: an alias refers to a node that contains it; expected a tree "
                "(an alias may only repeat a node defined before and outside it)"
            )
        open_nodes.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(size(child) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(size(k) + size(v) for k, v in node.value)
        open_nodes.discard(key)
        if total > MAX_EXPANDED_NODES:
            raise RecipeFileError(
                f"{_at(path, node.start_mark)}: its aliases expand to more than {MAX_EXPANDED_NODES} values (a YAML "
                f"alias bomb?); expected a recipe of at most {MAX_EXPANDED_NODES} values once aliases are expanded"
            )
        sizes[key] = total
        return total

    return size(root)


def _check_keys(path: Path, root: Any) -> None:
    """Refuse a mapping that gives one scalar key twice, naming both lines."""
    import yaml

    seen_nodes: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen_nodes:  # an aliased node is checked once
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[str, Any] = {}
            for key, value in node.value:
                # merge keys (<<) and non-scalar keys are YAML's to resolve; a repeated plain key is the user's slip
                if isinstance(key, yaml.ScalarNode) and key.tag == yaml.resolver.BaseResolver.DEFAULT_SCALAR_TAG:
                    if key.value in first:
                        raise RecipeFileError(
                            f"{_at(path, key.start_mark)}: duplicate key {key.value!r} (first at line "
                            f"{first[key.value].start_mark.line + 1}); expected each key once per mapping"
                        )
                    first[key.value] = key
                stack += [key, value]
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value


def read_recipe_file(path: str | os.PathLike) -> Any:
    """The YAML document of the recipe file ``path`` as plain Python data (None for an empty file).

    Raises:
        RecipeFileError: the file cannot be read, is larger than :data:`MAX_FILE_BYTES`, holds a byte that is not
            UTF-8, does not parse as one YAML document, repeats a key in a mapping, or has aliases that expand beyond
            :data:`MAX_EXPANDED_NODES` values or into themselves. The message starts with the file (and the line).
    """
    import yaml

    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise RecipeFileError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > MAX_FILE_BYTES:
        raise RecipeFileError(f"{path}: larger than {MAX_FILE_BYTES} bytes; expected a recipe of a few KiB of YAML")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise RecipeFileError(
            f"{path}, line {line}, column {column}: byte 0x{data[exc.start]:02x} is not UTF-8; expected UTF-8 text"
        ) from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_keys(path, node)
        _expanded_size(path, node)
        return loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "not YAML"
        if "'\\t'" in problem:
            problem += " (a tab: YAML indents with spaces)"
        raise RecipeFileError(f"{_at(path, mark)}: {problem}; expected one YAML mapping") from None
    except yaml.YAMLError as exc:
        raise RecipeFileError(f"{path}: {exc}; expected one YAML mapping") from None
    except RecursionError:
        raise RecipeFileError(f"{path}: nested too deeply to read; expected a recipe mapping") from None
    finally:
        loader.dispose()
