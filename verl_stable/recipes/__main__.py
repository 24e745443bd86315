"""``python -m verl_stable.recipes``: the ``verl-stable recipe`` command (:mod:`verl_stable.recipe_cli`).

Kept because launch scripts and the docs run the recipes this way; the command itself lives with the command line.
"""

from __future__ import annotations

from verl_stable.recipe_cli import main

if __name__ == "__main__":
    raise SystemExit(main())
