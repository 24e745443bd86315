"""Verifiable toy tasks for CPU runs of verl: generated prompts with single-digit answers and an exact-match reward.

Tasks (answers are one digit token, so a random model sometimes succeeds and a short SFT cold start learns them):

* ``copy``: ``copy 7`` -> ``7``;
* ``add``: ``add 3 plus 5`` -> ``(3 + 5) mod 10`` = ``8``;
* ``max``: ``max 3 8 1`` -> ``8``.

Reward (:func:`compute_score`, usable as verl's ``reward.custom_reward_function.path`` with ``name=compute_score``):
``1.0`` when the whole response is exactly the answer; ``0.5`` when its first word is the answer but more follows;
``0.1`` when the first word is some other digit (format credit); ``0`` otherwise. The partial credit makes rewards
vary within a GRPO group even for a random model, so advantages and gradients are non-zero from the first step.

The CPU launcher (:mod:`verl_stable.toy.launch`) builds its data from these tasks and points verl at this file for the
reward; the lab uses them too (and :mod:`verl_stable.toy.tasks` still offers every name).
"""

from __future__ import annotations

import random
from typing import Any, NamedTuple

TASKS = ("copy", "add", "max")
DIGITS = tuple(str(d) for d in range(10))
TASK_WORDS = ("copy", "add", "plus", "max")
DATA_SOURCE_PREFIX = "verl_stable/"


# A NamedTuple, not a dataclass: verl loads reward files with importlib outside sys.modules, where
# dataclass creation fails.
class Example(NamedTuple):
    """One prompt with its ground-truth answer."""

    task: str
    question: str
    answer: str


def make_example(task: str, rng: random.Random) -> Example:
    """Draw one example of ``task``. Raises ``ValueError`` for an unknown task."""
    if task == "copy":
        d = rng.randrange(10)
        return Example(task, f"copy {d}", str(d))
    if task == "add":
        a, b = rng.randrange(10), rng.randrange(10)
        return Example(task, f"add {a} plus {b}", str((a + b) % 10))
    if task == "max":
        xs = [rng.randrange(10) for _ in range(3)]
        return Example(task, "max " + " ".join(map(str, xs)), str(max(xs)))
    raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")


def make_examples(task: str, n: int, seed: int) -> list[Example]:
    """``n`` examples of ``task`` from a seeded generator (deterministic)."""
    if n < 1:
        raise ValueError(f"need at least one example, got n={n}")
    rng = random.Random(seed)
    return [make_example(task, rng) for _ in range(n)]


def to_verl_row(example: Example, split: str, index: int) -> dict[str, Any]:
    """One row of verl's RL parquet format (chat prompt + rule-based ground truth)."""
    return {
        "data_source": DATA_SOURCE_PREFIX + example.task,
        "prompt": [{"role": "user", "content": example.question}],
        "ability": "toy",
        "reward_model": {"style": "rule", "ground_truth": example.answer},
        "extra_info": {"split": split, "index": index, "task": example.task},
    }


def score(response: str, answer: str) -> float:
    """Exact-match score with partial and format credit (see module docstring)."""
    if answer not in DIGITS:
        raise ValueError(f"ground truth must be a single digit, got {answer!r}")
    words = response.split()
    if not words:
        return 0.0
    if words == [answer]:
        return 1.0
    if words[0] == answer:
        return 0.5
    if words[0] in DIGITS:
        return 0.1
    return 0.0


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, **kwargs: Any
) -> dict[str, float]:
    """verl custom reward entry point: ``{"score": s, "acc": exact-match 0/1}``."""
    s = score(solution_str, str(ground_truth))
    return {"score": s, "acc": float(s == 1.0)}
