"""What a router replay actually did, measured from the routers' own outputs: pure torch, no verl import.

An engine that replays routing itself (verl's Megatron engine: each router holds target top-k ids and, under R3, a
per-row replay mask) reports nothing about whether the experts the router ended up using are the targets it was
given. These functions compare the two, one router call at a time, and classify the rows the router saw for the
replay coverage (the classes of :mod:`verl_stable.routing.replay_pass`):

* :func:`token_classes`: per packed token, prompt / response / not-needed (:data:`ROW_PROMPT`, :data:`ROW_RESPONSE`,
  :data:`ROW_NOT_NEEDED`); rows of the model input that are no token are :data:`ROW_PADDING`;
* :func:`class_runs`: the same classes of a packed buffer (each sample followed by its pad rows) as runs
  (:class:`RowRuns`), and :func:`packed_row_classes` laid out row by row;
* :func:`used_vs_target`: how many rows were replayed and how many of them used another expert set than the target;
* :func:`rows_with_data`: which target rows hold a routing at all (an engine that replays zero rows, as verl's
  Megatron replay does with the rows a rollout did not route, forces expert 0 there: for the coverage that row fell
  back, it did not get the rollout's routing);
* :func:`coverage_row_counts`: one router call's rows by class, and how many of each class were replayed, in the
  order of :data:`~verl_stable.metric_names.COVERAGE_COUNTS` (summed over the MoE layers they give (token, layer)
  rows);
* :func:`run_coverage_counts`: the same from runs, without a class per row;
* :func:`layer_counts`: the first two and the router's own choice for all MoE layers of a micro-batch at once;
* :func:`disagreement_metrics`: the disagreement per MoE layer, its maximum and the overall fraction from counts.

Counts stay tensors on the router's device (no host synchronisation per router call); the caller sums them over
layers, micro-batch slices and ranks before reading them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from verl_stable.metric_names import COVERAGE_COUNTS

ROW_PADDING = 0
"""A row of the model input that is no token (packing pad)."""
ROW_PROMPT = 1
"""A prompt token before its sample's last trained token (its routing feeds a trained log-prob)."""
ROW_RESPONSE = 2
"""A response token before its sample's last trained token."""
ROW_NOT_NEEDED = 3
"""A token from its sample's last trained token on: its routing feeds no trained log-prob."""
NUM_ROW_CLASSES = 4


def token_classes(offsets: torch.Tensor, is_prompt: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """The coverage class of every packed token (``ROW_PROMPT``, ``ROW_RESPONSE`` or ``ROW_NOT_NEEDED``).

    A token is needed iff it lies before its sample's last trained token (the log-prob at position ``p`` comes from
    the hidden state at ``p - 1``); a sample without a trained token needs none.

    Args:
        offsets: ``[B + 1]`` cu_seqlens of the packed samples.
        is_prompt: ``[tokens]`` bool, prompt tokens.
        trained: ``[tokens]`` bool, tokens whose log-prob is trained (``response_mask == 1``).

    Returns:
        ``[tokens]`` int64 class codes on ``is_prompt``'s device.

    Raises:
        ValueError: If the flags do not have one entry per token of ``offsets``.
    """
    tokens = int(offsets[-1])
    if is_prompt.shape != (tokens,) or trained.shape != (tokens,):
        raise ValueError(
            f"token classes need one prompt / trained flag per token ({tokens}), got {tuple(is_prompt.shape)} and "
            f"{tuple(trained.shape)}"
        )
    device = is_prompt.device
    lengths = offsets.diff().to(device)
    sample = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
    position = torch.arange(tokens, device=device)
    last_trained = torch.full((lengths.numel(),), -1, dtype=torch.long, device=device)
    last_trained.scatter_reduce_(0, sample, torch.where(trained.to(device).bool(), position, -1), reduce="amax")
    needed = position < last_trained[sample]
    classes = torch.full((tokens,), ROW_NOT_NEEDED, dtype=torch.long, device=device)
    classes[needed & is_prompt.bool()] = ROW_PROMPT
    classes[needed & ~is_prompt.bool()] = ROW_RESPONSE
    return classes


@dataclass(frozen=True)
class RowRuns:
    """A packed buffer's coverage classes as runs: ``lengths[i]`` rows of class ``codes[i]``, run after run.

    Within a packed sample the classes come in runs (needed prompt rows, needed response rows, not-needed rows, then
    the sample's pad rows), so a micro-batch's layout is a few integers per sample, known on the host, and its
    coverage can be counted from run boundaries (:func:`run_coverage_counts`) instead of a class per row.
    """

    codes: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def rows(self) -> int:
        return sum(self.lengths)

    def classes(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[rows]`` int64 class codes, one per row."""
        codes = torch.tensor(self.codes, dtype=torch.long, device=device)
        return torch.repeat_interleave(codes, torch.tensor(self.lengths, dtype=torch.long, device=device))

    def window(self, start: int, stop: int) -> RowRuns:
        """The runs of rows ``[start, stop)`` (a sequence-parallel rank's slice of the buffer)."""
        codes, lengths, position = [], [], 0
        for code, length in zip(self.codes, self.lengths, strict=True):
            kept = min(position + length, stop) - max(position, start)
            if kept > 0:
                codes.append(code)
                lengths.append(kept)
            position += length
        return RowRuns(tuple(codes), tuple(lengths))


def class_runs(
    lengths: torch.Tensor,
    response_lengths: torch.Tensor,
    trained: torch.Tensor,
    slot_lengths: Sequence[int] | None = None,
) -> RowRuns:
    """The coverage classes of packed samples, each followed by its pad rows, as runs.

    With ``P`` prompt tokens and the sample's last trained token at position ``t`` (``-1`` when none is trained),
    positions ``[0, min(P, t))`` are ``ROW_PROMPT``, ``[P, t)`` ``ROW_RESPONSE`` and the rest ``ROW_NOT_NEEDED``;
    then ``slot_lengths[b] - lengths[b]`` rows of ``ROW_PADDING``. Laid out row by row (:meth:`RowRuns.classes`) this
    is :func:`token_classes` (the per-token definition) placed at each sample's slot.

    Args:
        lengths: ``[B]`` tokens per sample.
        response_lengths: ``[B]`` response tokens per sample (the tail of each sample), at most ``lengths``.
        trained: ``[sum(response_lengths)]`` bool, the response tokens whose log-prob is trained, sample after
            sample.
        slot_lengths: rows each sample occupies in the packed buffer (its tokens, then pad rows); ``None``: no pad.

    Returns:
        Four runs per sample (some may be empty).

    Raises:
        ValueError: If the shapes or lengths do not describe the same samples.
    """
    count = lengths.numel()
    if response_lengths.shape != (count,) or trained.shape != (int(response_lengths.sum()),):
        raise ValueError(
            f"{count} samples need one response length each and one trained flag per response token, got "
            f"{tuple(response_lengths.shape)} and {tuple(trained.shape)}"
        )
    sizes, responses = lengths.tolist(), response_lengths.tolist()
    if any(r > n for r, n in zip(responses, sizes, strict=True)):
        raise ValueError(f"response lengths {responses} exceed the sample lengths {sizes}")
    slots = sizes if slot_lengths is None else list(slot_lengths)
    if len(slots) != count or any(slot < n for slot, n in zip(slots, sizes, strict=True)):
        raise ValueError(f"slots {slots} do not hold the samples {sizes}")
    # the last trained response token of each sample: 1-based index into ``trained``, 0 where none is
    last = torch.zeros(count, dtype=torch.long)
    if trained.numel():
        flat = torch.arange(1, trained.numel() + 1) * trained.cpu().long()
        last.scatter_reduce_(0, torch.repeat_interleave(torch.arange(count), response_lengths.cpu()), flat, "amax")
    runs: list[int] = []
    start = 0
    for size, response, slot, last_index in zip(sizes, responses, slots, last.tolist(), strict=True):
        prompt = size - response
        needed = prompt + last_index - start - 1 if last_index > start else -1  # t: the last trained position
        start += response
        needed_prompt = max(min(prompt, needed), 0)
        needed_response = max(needed - prompt, 0)
        runs += [needed_prompt, needed_response, size - needed_prompt - needed_response, slot - size]
    return RowRuns(tuple(_RUN_CODES * count), tuple(runs))


def packed_row_classes(
    lengths: torch.Tensor,
    response_lengths: torch.Tensor,
    trained: torch.Tensor,
    slot_lengths: Sequence[int] | None = None,
) -> torch.Tensor:
    """``[rows]`` int64 class codes of :func:`class_runs`, one per row of the packed buffer, on the host."""
    return class_runs(lengths, response_lengths, trained, slot_lengths).classes()


# the class of each run of class_runs, per sample
_RUN_CODES = [ROW_PROMPT, ROW_RESPONSE, ROW_NOT_NEEDED, ROW_PADDING]


def used_vs_target(
    routing_map: torch.Tensor, target_ids: torch.Tensor, replay_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replayed rows of one router call, and how many of them used another expert set than their target.

    Sets are compared, so a target with a repeated id (a zero placeholder row) matches the one expert it names.

    Args:
        routing_map: ``[rows, experts]`` bool, the experts each row was dispatched to (the router's output).
        target_ids: ``[rows, top_k]`` integer expert ids the replay was told to use.
        replay_mask: ``[rows]`` bool, the rows that were to be replayed; ``None``: every row.

    Returns:
        ``(replayed, differ)``: two 0-d int64 tensors on ``routing_map``'s device.

    Raises:
        ValueError: If the shapes do not describe the same rows.
    """
    if routing_map.dim() != 2 or target_ids.dim() != 2 or target_ids.shape[0] != routing_map.shape[0]:
        raise ValueError(
            f"routing map {tuple(routing_map.shape)} and targets {tuple(target_ids.shape)} are not the same rows"
        )
    if replay_mask is not None and replay_mask.shape != (routing_map.shape[0],):
        raise ValueError(f"replay mask {tuple(replay_mask.shape)} is not one flag per row ({routing_map.shape[0]})")
    used = routing_map.bool()
    target = torch.zeros_like(used).scatter_(1, target_ids.to(device=used.device, dtype=torch.long), True)
    differ = (used != target).any(dim=-1)
    if replay_mask is None:
        return torch.tensor(used.shape[0], dtype=torch.long, device=used.device), differ.sum()
    mask = replay_mask.to(used.device).bool()
    return mask.sum(), (differ & mask).sum()


def rows_with_data(target_ids: torch.Tensor) -> torch.Tensor:
    """``[rows, top_k]`` target ids -> ``[rows]`` bool: the rows that hold a routing (``top_k`` distinct experts).

    Rollout engines leave tokens they did not route as zero rows and packing pads with zeros; a genuine top-k choice
    with ``top_k >= 2`` never repeats an expert. With ``top_k == 1`` a zero row cannot be told from a choice of
    expert 0 in one layer alone, so every row counts as data.
    """
    if target_ids.dim() != 2:
        raise ValueError(f"target ids must be [rows, top_k], got {tuple(target_ids.shape)}")
    if target_ids.shape[1] < 2:
        return torch.ones(target_ids.shape[0], dtype=torch.bool, device=target_ids.device)
    ordered = target_ids.sort(dim=-1).values
    return (ordered[:, 1:] != ordered[:, :-1]).all(dim=-1)


def coverage_row_counts(row_classes: torch.Tensor, replayed: torch.Tensor | None) -> torch.Tensor:
    """One router call's rows by coverage class, in the order of :data:`COVERAGE_COUNTS`.

    Args:
        row_classes: ``[rows]`` class codes (``ROW_*``), one per row the router saw.
        replayed: ``[rows]`` bool, rows that took the replayed routing, or ``[layers, rows]`` for several router
            calls on the same rows (their counts summed); ``None``: every row.

    Returns:
        ``[6]`` int64 on ``row_classes``' device: response rows, replayed response rows, prompt rows, replayed prompt
        rows, not-needed rows, padding rows.

    Raises:
        ValueError: If ``replayed`` is not one flag per row.
    """
    codes = row_classes.to(torch.long)
    if replayed is None:
        flags = torch.ones_like(codes)
    else:
        if replayed.dim() not in (1, 2) or replayed.shape[-1:] != codes.shape:
            raise ValueError(f"replayed flags {tuple(replayed.shape)} are not one per row {tuple(codes.shape)}")
        flags = replayed.to(codes.device).to(torch.long)
    # one count over class * 2 + replayed; scatter_add into a fixed size, where bincount would read the maximum back
    # to the host (a synchronisation per router call on an accelerator); slot 2 * NUM_ROW_CLASSES stays 0
    index = (codes * 2 + flags).reshape(-1)
    table = torch.zeros(2 * NUM_ROW_CLASSES + 1, dtype=torch.long, device=codes.device)
    table = table.scatter_add_(0, index, torch.ones_like(index))
    # each count is table[a] + table[b]: a class's total is its two slots, a replayed count one slot and the zero
    picks = torch.tensor(_COVERAGE_PICKS, device=codes.device)
    counts = table[picks].sum(dim=1)
    assert counts.numel() == len(COVERAGE_COUNTS)
    return counts


_ZERO_SLOT = 2 * NUM_ROW_CLASSES
# the two slots of coverage_row_counts' table summed into each count, in the order of COVERAGE_COUNTS
_COVERAGE_PICKS = [
    [2 * ROW_RESPONSE, 2 * ROW_RESPONSE + 1],  # response rows
    [2 * ROW_RESPONSE + 1, _ZERO_SLOT],  # replayed response rows
    [2 * ROW_PROMPT, 2 * ROW_PROMPT + 1],  # prompt rows
    [2 * ROW_PROMPT + 1, _ZERO_SLOT],  # replayed prompt rows
    [2 * ROW_NOT_NEEDED, 2 * ROW_NOT_NEEDED + 1],  # not-needed rows
    [2 * ROW_PADDING, 2 * ROW_PADDING + 1],  # padding rows
]


def run_coverage_counts(runs: RowRuns, replayed: torch.Tensor) -> torch.Tensor:
    """:func:`coverage_row_counts` of ``runs.classes()``, counted from the runs' boundaries.

    A class's rows are the sum of its run lengths (times the router calls), known on the host; its replayed rows are
    differences of the cumulative replayed count at the runs' ends and starts. A fixed number of small tensor
    operations per micro-batch, none over ``[calls, rows]`` but one sum.

    Args:
        runs: the classes of the rows, as runs.
        replayed: ``[rows]`` or ``[calls, rows]`` bool (see :func:`coverage_row_counts`).

    Returns:
        ``[6]`` int64 on ``replayed``'s device, as :func:`coverage_row_counts`.

    Raises:
        ValueError: If ``replayed`` is not one flag per row.
    """
    if replayed.dim() not in (1, 2) or replayed.shape[-1] != runs.rows:
        raise ValueError(f"replayed flags {tuple(replayed.shape)} are not one per row ({runs.rows} rows)")
    calls = replayed.shape[0] if replayed.dim() == 2 else 1
    totals = [0] * NUM_ROW_CLASSES
    bounds: list[list[int]] = [[], []]  # per counted class (response, prompt): run ends, then run starts
    position = 0
    for code, length in zip(runs.codes, runs.lengths, strict=True):
        totals[code] += length * calls
        if length and code in (ROW_RESPONSE, ROW_PROMPT):
            bounds[code == ROW_PROMPT].append((position + length, position))
        position += length
    device = replayed.device
    counts = torch.tensor(
        [totals[ROW_RESPONSE], 0, totals[ROW_PROMPT], 0, totals[ROW_NOT_NEEDED], totals[ROW_PADDING]],
        dtype=torch.long,
        device=device,
    )
    if not bounds[0] and not bounds[1]:
        return counts
    per_row = replayed.sum(dim=0) if replayed.dim() == 2 else replayed.long()
    cumulative = torch.cat([per_row.new_zeros(1), per_row.cumsum(dim=0)])  # cumulative[i]: replayed before row i
    index, sign, slot = [], [], []
    for target, spans in ((1, bounds[0]), (3, bounds[1])):  # COVERAGE_COUNTS slots of the replayed counts
        for stop, start in spans:
            index += [stop, start]
            sign += [1, -1]
            slot += [target, target]
    plan = torch.tensor([index, sign, slot], dtype=torch.long, device=device)
    return counts.index_add_(0, plan[2], cumulative[plan[0]] * plan[1])


def layer_counts(
    routing_maps: torch.Tensor,
    target_ids: torch.Tensor,
    replay_masks: torch.Tensor | None = None,
    native_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router calls of several MoE layers on the same rows (one micro-batch), counted in one batched pass.

    Per layer ``l`` it equals, in a handful of tensor operations for all layers together (a per-layer loop costs
    the same few operations once per MoE layer, which is what the metrics cost on a small model):

    * ``replayed, differ = used_vs_target(routing_maps[l], target_ids[l], replay_masks[l])``;
    * ``covered = rows_with_data(target_ids[l]) & replay_masks[l]`` (the rows replayed from a real routing);
    * ``with_data = covered.sum()`` and ``own = (expert_sets_differ(native_ids[l], target_ids[l]) & covered).sum()``:
      how often the router's own choice differs from the replayed one, where that choice is known (``native_ids``;
      without it both are 0).

    Args:
        routing_maps: ``[layers, rows, experts]`` bool, the experts each row was dispatched to.
        target_ids: ``[layers, rows, top_k]`` integer ids the replay was told to use.
        replay_masks: ``[layers, rows]`` bool, the rows that were to be replayed; ``None``: every row.
        native_ids: ``[layers, rows, top_k]`` integer ids the routers chose themselves; ``None``: unknown.

    Returns:
        ``(counts, covered)``: ``[layers, 4]`` int64 ``[replayed, differ, with_data, own]`` and ``[layers, rows]``
        bool ``covered``, on ``routing_maps``' device.

    Raises:
        ValueError: If the shapes do not describe the same layers and rows.
    """
    if routing_maps.dim() != 3 or target_ids.dim() != 3 or target_ids.shape[:2] != routing_maps.shape[:2]:
        raise ValueError(
            f"routing maps {tuple(routing_maps.shape)} and targets {tuple(target_ids.shape)} are not the same "
            "[layers, rows]"
        )
    if replay_masks is not None and replay_masks.shape != routing_maps.shape[:2]:
        raise ValueError(f"replay masks {tuple(replay_masks.shape)} are not [layers, rows] {routing_maps.shape[:2]}")
    if native_ids is not None and native_ids.shape != target_ids.shape:
        raise ValueError(f"native ids {tuple(native_ids.shape)} are not shaped as the targets {target_ids.shape}")
    used = routing_maps.bool()
    device = used.device
    top_k = target_ids.shape[-1]
    targets = target_ids.to(device=device, dtype=torch.long)
    mask = torch.ones(used.shape[:2], dtype=torch.bool, device=device) if replay_masks is None else replay_masks
    mask = mask.to(device).bool()
    # every comparison through the targets' expert map, which the used-vs-target test needs anyway: a row holds a
    # routing iff its map has top_k experts (top_k distinct ids); a top-k choice of distinct ids equals such a row's
    # set iff the map holds each of them
    target_map = torch.zeros_like(used).scatter_(2, targets, True)
    differ = _rows_differ(used, target_map) & mask
    if top_k < 2:  # top-1: a zero row cannot be told from a choice of expert 0 (rows_with_data)
        covered = mask
    else:
        covered = (target_map.sum(dim=-1) == top_k) & mask
    if native_ids is None:
        with_data = own = torch.zeros_like(covered)
    else:
        native = native_ids.to(device=device, dtype=torch.long)
        with_data, own = covered, _any_last(~target_map.gather(2, native)) & covered
    counts = torch.stack([mask, differ, with_data, own], dim=-1).sum(dim=1)
    return counts, covered


def _words(flags: torch.Tensor) -> torch.Tensor | None:
    """A bool tensor's last dimension read as whole integer words (8, 4 or 2 flags each; a word is nonzero iff one of
    its flags is), or ``None`` where its layout does not allow that view."""
    size = flags.shape[-1] if flags.dim() else 0
    if size == 0 or not flags.is_contiguous():
        return None
    for width, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if size % width == 0 and flags.storage_offset() % width == 0:
            return flags.view(dtype)
    return None


def _any_last(flags: torch.Tensor) -> torch.Tensor:
    """``flags.any(dim=-1)`` for a bool tensor. A CPU reduction over a short last dimension (the top-k, the experts)
    costs several times a comparison of whole words, so the flags are read a word at a time where they can be."""
    words = _words(flags)
    if words is None:
        return flags.any(dim=-1)
    return words.squeeze(-1) != 0 if words.shape[-1] == 1 else (words != 0).any(dim=-1)


def _rows_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a != b).any(dim=-1)`` for two bool tensors of one shape, a word of flags at a time where they allow it."""
    words_a, words_b = _words(a), _words(b)
    if words_a is None or words_b is None or words_a.dtype != words_b.dtype:
        return _any_last(a != b)
    return _any_last(words_a != words_b)


def disagreement_metrics(replayed: Sequence[float], differ: Sequence[float]) -> dict[str, float]:
    """Disagreement of the used experts with the replay targets, from per-MoE-layer counts.

    Args:
        replayed: replayed rows per MoE layer (ordinal order).
        differ: of those, rows whose used expert set differs from the target.

    Returns:
        ``{"disagreement": overall, "disagreement/layer_<i>": per layer, "disagreement/layer_max": their maximum}``;
        a layer without replayed rows counts 0 (nothing replayed, nothing disagrees), as does the overall value.

    Raises:
        ValueError: If the lists differ in length or a layer has more differing than replayed rows.
    """
    if len(replayed) != len(differ):
        raise ValueError(f"{len(replayed)} replayed counts for {len(differ)} differing counts")
    per_layer = []
    for i, (n, d) in enumerate(zip(replayed, differ, strict=True)):
        if d > n or d < 0:
            raise ValueError(f"MoE layer {i}: {d} differing rows of {n} replayed")
        per_layer.append(d / n if n > 0 else 0.0)
    total = sum(replayed)
    metrics = {"disagreement": sum(differ) / total if total > 0 else 0.0}
    metrics.update({f"disagreement/layer_{i}": value for i, value in enumerate(per_layer)})
    metrics["disagreement/layer_max"] = max(per_layer, default=0.0)
    return metrics
