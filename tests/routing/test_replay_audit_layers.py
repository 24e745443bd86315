"""``layer_counts``: the MoE layers of a micro-batch counted at once equal the per-call functions, layer by layer.

References: a hand-made two-layer case whose counts are written out, and for random cases the per-router-call
functions (``used_vs_target``, ``rows_with_data``, ``expert_sets_differ``, each tested on hand-made rows) looped over
the layers; the coverage of several calls summed by ``coverage_row_counts`` on ``[layers, rows]`` flags equals the sum
of its per-call counts.
"""

from __future__ import annotations

import pytest
import torch

from verl_stable.routing.disagreement import expert_sets_differ
from verl_stable.routing.replay_audit import (
    ROW_NOT_NEEDED,
    ROW_PADDING,
    ROW_PROMPT,
    ROW_RESPONSE,
    coverage_row_counts,
    layer_counts,
    rows_with_data,
    used_vs_target,
)


def _maps(ids: torch.Tensor, experts: int) -> torch.Tensor:
    return torch.zeros(*ids.shape[:-1], experts, dtype=torch.bool).scatter_(-1, ids.long(), True)


def test_two_layers_by_hand():
    targets = torch.tensor([[[1, 2], [3, 4], [0, 0]], [[5, 6], [7, 1], [2, 3]]])
    used = torch.tensor([[[2, 1], [3, 5], [0, 0]], [[5, 6], [7, 1], [2, 4]]])  # layer 0 row 1 and layer 1 row 2 differ
    native = torch.tensor([[[1, 2], [0, 4], [1, 2]], [[6, 5], [7, 1], [2, 3]]])  # own choice differs: layer 0 row 1
    mask = torch.tensor([[True, True, True], [True, True, False]])  # layer 1 row 2 not replayed
    counts, covered = layer_counts(_maps(used, 8), targets, mask, native)
    # [replayed, differ, with data, own]: layer 0 row 2 is a zero row (no data); layer 1 row 2 is not replayed
    assert counts.tolist() == [[3, 1, 2, 1], [2, 0, 2, 0]]
    assert covered.tolist() == [[True, True, False], [True, True, False]]
    # without the router's own choice: neither with-data nor own counted; without a mask: every row replayed
    counts, covered = layer_counts(_maps(used, 8), targets)
    assert counts.tolist() == [[3, 1, 0, 0], [3, 1, 0, 0]]
    assert covered.tolist() == [[True, True, False], [True, True, True]]


# expert counts whose routing maps layer_counts compares 8, 4 or 2 flags at a time (16, 12, 6) or one at a time (7)
@pytest.mark.parametrize("experts", [16, 12, 6, 7])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_random_layers_equal_the_per_call_functions(seed, top_k, experts):
    gen = torch.Generator().manual_seed(seed)
    layers, rows = 5, 37

    def draw() -> torch.Tensor:
        return torch.rand(layers, rows, experts, generator=gen).argsort(dim=-1)[..., :top_k]

    targets, used, native = draw(), draw(), draw()
    agree = torch.rand(layers, rows, generator=gen) < 0.6  # most rows used their target, some their own choice
    used = torch.where(agree[..., None], targets, used)
    native = torch.where((torch.rand(layers, rows, generator=gen) < 0.5)[..., None], targets, native)
    targets[:, :3] = 0  # zero rows: no data at top_k >= 2
    mask = torch.rand(layers, rows, generator=gen) < 0.8
    maps = _maps(used, experts)
    counts, covered = layer_counts(maps, targets, mask, native)
    for layer in range(layers):
        replayed, differ = used_vs_target(maps[layer], targets[layer], mask[layer])
        expected_covered = rows_with_data(targets[layer]) & mask[layer]
        own = (expert_sets_differ(native[layer], targets[layer]) & expected_covered).sum()
        assert counts[layer].tolist() == [int(replayed), int(differ), int(expected_covered.sum()), int(own)]
        assert torch.equal(covered[layer], expected_covered)
    classes = torch.randint(0, 4, (rows,), generator=gen)
    assert torch.equal(
        coverage_row_counts(classes, covered), sum(coverage_row_counts(classes, covered[layer]) for layer in range(5))
    )


def test_maps_that_are_views_count_as_their_copies():
    """A routing map whose flags cannot be read a word at a time (a slice starting mid-row, a transpose) counts as its
    contiguous copy."""
    gen = torch.Generator().manual_seed(3)
    targets = torch.rand(3, 20, 16, generator=gen).argsort(dim=-1)[..., :4]
    used = torch.rand(3, 20, 16, generator=gen).argsort(dim=-1)[..., :4]
    used[:, ::2] = targets[:, ::2]
    native = targets.flip(-1)
    native[:, ::3] = used[:, ::3]
    expected = layer_counts(_maps(used, 16), targets, None, native)
    sliced = _maps(used + 1, 17)[..., 1:]  # expert e at column e + 1 of a wider map: rows start one flag in
    transposed = _maps(used, 16).transpose(0, 1).contiguous().transpose(0, 1)
    for maps in (sliced, transposed):
        assert not maps.is_contiguous() and torch.equal(maps, _maps(used, 16))
        for got, want in zip(layer_counts(maps, targets, None, native), expected, strict=True):
            assert torch.equal(got, want)


def test_coverage_of_several_calls_by_class():
    classes = torch.tensor([ROW_PROMPT, ROW_RESPONSE, ROW_RESPONSE, ROW_NOT_NEEDED, ROW_PADDING])
    covered = torch.tensor([[True, True, False, False, False], [True, False, False, True, False]])
    # response rows, replayed response rows, prompt rows, replayed prompt rows, not needed, padding (over 2 calls)
    assert coverage_row_counts(classes, covered).tolist() == [4, 1, 2, 2, 2, 2]


def test_shapes_that_are_not_the_same_layers_and_rows_are_refused():
    targets = torch.zeros(2, 3, 2, dtype=torch.long)
    maps = torch.zeros(2, 3, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match="not the same"):
        layer_counts(maps[:, :2], targets)
    with pytest.raises(ValueError, match="replay masks"):
        layer_counts(maps, targets, torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="native ids"):
        layer_counts(maps, targets, None, targets[:, :, :1])
    with pytest.raises(ValueError, match="one per row"):
        coverage_row_counts(torch.zeros(3, dtype=torch.long), torch.zeros(2, 4, dtype=torch.bool))
