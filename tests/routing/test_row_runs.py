"""``class_runs`` / ``run_coverage_counts``: a packed micro-batch's coverage classes as runs, counted from run bounds.

References: :func:`token_classes` (the per-token definition, tested on hand-made samples in
tests/integration/test_replay_coverage.py) placed at each sample's slot by hand, and :func:`coverage_row_counts` on
the per-row classes; a hand-made micro-batch whose runs and counts are written out.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_stable.routing.replay_audit import (
    ROW_NOT_NEEDED,
    ROW_PADDING,
    ROW_PROMPT,
    ROW_RESPONSE,
    RowRuns,
    class_runs,
    coverage_row_counts,
    packed_row_classes,
    run_coverage_counts,
    token_classes,
)

P, R, N, D = ROW_PROMPT, ROW_RESPONSE, ROW_NOT_NEEDED, ROW_PADDING


def test_a_micro_batch_by_hand():
    # sample 0: 3 prompt + 3 response tokens, trained [1, 1, 0]: the last trained token is at position 4, so
    # positions 0-2 prompt, 3 response, 4-5 not needed, then 2 pad rows; sample 1: 2 prompt + 2 response, nothing
    # trained: all 4 not needed, 1 pad row
    runs = class_runs(
        torch.tensor([6, 4]), torch.tensor([3, 2]), torch.tensor([True, True, False, False, False]), [8, 5]
    )
    assert runs.classes().tolist() == [P, P, P, R, N, N, D, D, N, N, N, N, D]
    assert runs.rows == 13
    covered = torch.tensor(
        [
            [1, 1, 0, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0],
            [1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        ],
        dtype=torch.bool,
    )
    # response rows, replayed response rows, prompt rows, replayed prompt rows, not needed, padding (2 calls)
    assert run_coverage_counts(runs, covered).tolist() == [2, 2, 6, 3, 12, 6]
    assert run_coverage_counts(runs, covered[0]).tolist() == [1, 1, 3, 2, 6, 3]


@st.composite
def micro_batches(draw):
    count = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(1, 9), min_size=count, max_size=count))
    responses = [draw(st.integers(0, n)) for n in lengths]
    trained = draw(st.lists(st.booleans(), min_size=sum(responses), max_size=sum(responses)))
    slots = [n + draw(st.integers(0, 3)) for n in lengths]
    return lengths, responses, trained, slots


def _per_token(lengths, responses, trained):
    """token_classes' inputs, written out token by token."""
    is_prompt, flags, k = [], [], 0
    for n, r in zip(lengths, responses, strict=True):
        for position in range(n):
            is_prompt.append(position < n - r)
            flags.append(False if position < n - r else trained[k])
            k += position >= n - r
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return token_classes(offsets, torch.tensor(is_prompt), torch.tensor(flags, dtype=torch.bool)), offsets


@settings(max_examples=300, deadline=None)
@given(micro_batches(), st.integers(1, 3), st.randoms(use_true_random=False))
def test_runs_equal_the_per_token_classes_in_their_slots(batch, calls, rng):
    lengths, responses, trained = batch[:3]
    slots = batch[3]
    args = (torch.tensor(lengths), torch.tensor(responses), torch.tensor(trained, dtype=torch.bool))
    tokens, offsets = _per_token(lengths, responses, trained)
    expected = []
    for i, (n, slot) in enumerate(zip(lengths, slots, strict=True)):
        expected += tokens[offsets[i] : offsets[i + 1]].tolist() + [ROW_PADDING] * (slot - n)
    runs = class_runs(*args, slots)
    assert runs.classes().tolist() == expected
    assert packed_row_classes(*args).tolist() == tokens.tolist()  # no slots: no pad rows
    rows = runs.classes()
    covered = torch.tensor([[rng.random() < 0.6 for _ in range(runs.rows)] for _ in range(calls)], dtype=torch.bool)
    assert torch.equal(run_coverage_counts(runs, covered), coverage_row_counts(rows, covered))
    assert torch.equal(run_coverage_counts(runs, covered[0]), coverage_row_counts(rows, covered[0]))
    start = rng.randint(0, runs.rows)
    stop = rng.randint(start, runs.rows)
    window = runs.window(start, stop)  # a sequence-parallel rank's slice
    assert torch.equal(window.classes(), rows[start:stop])
    if stop > start:
        assert torch.equal(
            run_coverage_counts(window, covered[:, start:stop]),
            coverage_row_counts(rows[start:stop], covered[:, start:stop]),
        )


def test_inputs_that_do_not_describe_the_samples_are_refused():
    lengths, responses = torch.tensor([4, 3]), torch.tensor([2, 1])
    with pytest.raises(ValueError, match="one trained flag per response token"):
        class_runs(lengths, responses, torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="exceed the sample lengths"):
        class_runs(lengths, torch.tensor([5, 1]), torch.ones(6, dtype=torch.bool))
    with pytest.raises(ValueError, match="do not hold the samples"):
        class_runs(lengths, responses, torch.ones(3, dtype=torch.bool), [4, 2])
    with pytest.raises(ValueError, match="one per row"):
        run_coverage_counts(RowRuns((P, D), (2, 1)), torch.ones(2, 4, dtype=torch.bool))
