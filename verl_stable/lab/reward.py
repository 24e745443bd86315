"""The lab's reward: exact match, binary.

``1.0`` when the whole response is exactly the answer digit (:func:`verl_stable.toy.tasks.score` gives it full credit),
``0.0`` otherwise -- no partial or format credit, as the lab's verifiable task asks. Used as verl's
``reward.custom_reward_function.path`` with ``name=compute_score``; verl loads this file by path, so it only imports
installed modules.
"""

from __future__ import annotations

from typing import Any

from verl_stable.toy import tasks


def exact_match(response: str, answer: str) -> float:
    """``1.0`` if the response's words are exactly ``[answer]``, else ``0.0``. Raises ``ValueError`` for a bad answer."""
    return 1.0 if tasks.score(response, answer) == 1.0 else 0.0


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, **kwargs: Any
) -> dict[str, float]:
    """verl custom reward entry point: ``{"score": r, "acc": r}`` with ``r`` the binary exact match."""
    r = exact_match(solution_str, str(ground_truth))
    return {"score": r, "acc": r}
