"""The lab's toy tasks: every name of :mod:`verl_stable.cpu.tasks`, where the CPU launcher keeps them.

Kept so that ``verl_stable.lab.tasks`` and this file's path keep working: verl loads a reward file by path
(``reward.custom_reward_function.path=.../verl_stable/lab/tasks.py`` with ``name=compute_score``), and this file only
imports installed modules.
"""

from __future__ import annotations

from verl_stable.cpu.tasks import (
    DATA_SOURCE_PREFIX,
    DIGITS,
    TASK_WORDS,
    TASKS,
    Example,
    compute_score,
    make_example,
    make_examples,
    score,
    to_verl_row,
)

__all__ = [
    "DATA_SOURCE_PREFIX",
    "DIGITS",
    "TASKS",
    "TASK_WORDS",
    "Example",
    "compute_score",
    "make_example",
    "make_examples",
    "score",
    "to_verl_row",
]
