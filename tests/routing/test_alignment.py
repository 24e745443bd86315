"""Routing-row alignment checked against verl's own input preparation.

Every reference here is verl itself: a micro-batch whose ``input_ids`` are token *codes* (1-based packed index) is
run through verl's real ``FSDPEngineWithLMHead.prepare_model_inputs`` (padded, packed, ``pad_to_length``, Ulysses
with a fake process group per rank) and through ``left_right_2_no_padding``; the routing rows aligned by
``verl_stable.routing.alignment`` must carry the same codes in the same order, and be marked "no data" exactly
where verl put a pad token.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torch.testing._internal.distributed.fake_pg import FakeStore
from verl.utils import tensordict_utils as tu
from verl.utils import ulysses
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.utils.padding import left_right_2_no_padding

from verl_stable.routing import alignment as al

LAYERS, TOPK = 3, 2


def _codes_to_rows(codes: torch.Tensor) -> torch.Tensor:
    """Routing rows that encode their token code: ids[n, l, k] = code * 8 + l * 2 + k (distinct within a row)."""
    grid = torch.arange(LAYERS).view(1, LAYERS, 1) * 2 + torch.arange(TOPK).view(1, 1, TOPK)
    return codes.view(-1, 1, 1) * 8 + grid


def _rows_to_codes(rows: al.AlignedRows) -> torch.Tensor:
    """Token code of each aligned row (0 for rows without data), checking the row is an untouched encoding."""
    codes = rows.ids[:, 0, 0] // 8
    assert torch.equal(rows.ids, torch.where(rows.has_data.view(-1, 1, 1), _codes_to_rows(codes), 0))
    return torch.where(rows.has_data, codes, 0)


def _micro_batch(lengths: list[int], use_remove_padding: bool) -> TensorDict:
    total = sum(lengths)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    input_ids = torch.nested.nested_tensor_from_jagged(torch.arange(1, total + 1), offsets=offsets)
    positions = torch.cat([torch.arange(n) for n in lengths])
    position_ids = torch.nested.nested_tensor_from_jagged(positions, offsets=offsets)
    td = TensorDict({"input_ids": input_ids, "position_ids": position_ids}, batch_size=[len(lengths)])
    tu.assign_non_tensor(td, use_remove_padding=use_remove_padding, temperature=1.0, pad_token_id=0)
    return td


def _bare_engine(sp_size: int = 1, pad_to_length: bool = False, bucket: int = 8) -> FSDPEngineWithLMHead:
    # prepare_model_inputs only reads these attributes; building a real engine needs a model and a process group.
    engine = FSDPEngineWithLMHead.__new__(FSDPEngineWithLMHead)
    engine.pad_to_length = pad_to_length
    engine.pad_to_length_bucket = bucket
    engine.ulysses_sequence_parallel_size = sp_size
    engine.use_ulysses_sp = sp_size > 1
    engine.module = torch.nn.Module()
    engine.module.config = type("TextConfig", (), {})()
    return engine


class _FakeRank:
    """A process group of ``world`` ranks in which this process plays ``rank`` (no communication needed)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def __enter__(self):
        dist.init_process_group("fake", store=FakeStore(), rank=self.rank, world_size=self.world)
        ulysses.set_ulysses_sequence_parallel_group(dist.group.WORLD)

    def __exit__(self, *exc):
        ulysses.set_ulysses_sequence_parallel_group(None)
        dist.destroy_process_group()


def _verl_packed_codes(lengths, sp_size=1, sp_rank=0, pad_to_length=False, bucket=8):
    engine = _bare_engine(sp_size, pad_to_length, bucket)
    mb = _micro_batch(lengths, use_remove_padding=True)
    if sp_size > 1:
        with _FakeRank(sp_rank, sp_size):
            inputs, out_args = engine.prepare_model_inputs(mb)
    else:
        inputs, out_args = engine.prepare_model_inputs(mb)
    return inputs["input_ids"].reshape(-1), out_args["pad_size"], mb


def _our_packed(lengths, sp_size=1, sp_rank=0, static_pad=0):
    total = sum(lengths)
    rows = _codes_to_rows(torch.arange(1, total + 1))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    aligned = al.packed_layout(rows, cu, static_pad=static_pad)
    return al.ulysses_shard(aligned, sp_size, sp_rank)


@pytest.mark.parametrize("lengths", [[5], [3, 7, 1], [4, 4, 4, 4]])
def test_packed_rows_match_verl_remove_padding_input(lengths):
    verl_ids, pad, _ = _verl_packed_codes(lengths)
    ours, sp_pad = _our_packed(lengths)
    assert pad == 0 and sp_pad == 0
    assert torch.equal(_rows_to_codes(ours), verl_ids)
    assert bool(ours.has_data.all())


@pytest.mark.parametrize("lengths", [[5], [3, 7, 1]])
def test_packed_rows_match_verl_pad_to_length(lengths):
    engine = _bare_engine(pad_to_length=True, bucket=8)
    static_pad = engine._get_packed_pad_size(sum(lengths))
    assert static_pad > 0
    verl_ids, pad, _ = _verl_packed_codes(lengths, pad_to_length=True, bucket=8)
    ours, _ = _our_packed(lengths, static_pad=static_pad)
    assert pad == static_pad
    assert torch.equal(_rows_to_codes(ours), verl_ids)
    assert torch.equal(ours.has_data, verl_ids != 0)


@pytest.mark.parametrize("sp_size", [2, 3])
@pytest.mark.parametrize("lengths", [[5], [3, 7, 1], [2, 2]])
def test_ulysses_shards_match_verl_slicing_on_every_rank(sp_size, lengths):
    shards = []
    for rank in range(sp_size):
        verl_ids, pad, _ = _verl_packed_codes(lengths, sp_size=sp_size, sp_rank=rank)
        ours, our_pad = _our_packed(lengths, sp_size=sp_size, sp_rank=rank)
        assert our_pad == pad
        assert torch.equal(_rows_to_codes(ours), verl_ids), f"rank {rank}"
        assert torch.equal(ours.has_data, verl_ids != 0)
        shards.append(ours.ids)
    # The inverse (what the engine does to recorded routing after its all-gather) restores the packed rows.
    total = sum(lengths)
    assert torch.equal(al.unshard_ulysses(shards, pad), _codes_to_rows(torch.arange(1, total + 1)))


def test_ulysses_with_static_pad_matches_verl():
    lengths, sp = [3, 6], 2
    engine = _bare_engine(sp, pad_to_length=True, bucket=4)
    static_pad = engine._get_packed_pad_size(sum(lengths))
    for rank in range(sp):
        verl_ids, pad, _ = _verl_packed_codes(lengths, sp_size=sp, sp_rank=rank, pad_to_length=True, bucket=4)
        ours, sp_pad = _our_packed(lengths, sp_size=sp, sp_rank=rank, static_pad=static_pad)
        assert pad == static_pad + sp_pad
        assert torch.equal(_rows_to_codes(ours), verl_ids)


@pytest.mark.parametrize("lengths", [[5], [3, 7, 1], [1, 6]])
def test_padded_rows_match_verl_padded_input(lengths):
    engine = _bare_engine()
    mb = _micro_batch(lengths, use_remove_padding=False)
    inputs, _ = engine.prepare_model_inputs(mb)
    verl_ids = inputs["input_ids"]  # [B, S_max], right-padded with pad_token_id 0
    rows = _codes_to_rows(torch.arange(1, sum(lengths) + 1))
    ours = al.padded_layout(rows, mb["input_ids"].offsets())
    assert torch.equal(_rows_to_codes(ours), verl_ids.reshape(-1))
    assert torch.equal(ours.has_data, (inputs["attention_mask"].reshape(-1) != 0))
    assert torch.equal(al.rows_from_padded_layout(ours.ids, mb["input_ids"].offsets(), verl_ids.shape[1]), rows)


def test_unpad_rows_matches_verl_left_right_2_no_padding():
    # Legacy trainer layout: left-padded prompt (width 4) + right-padded response (width 3).
    prompt_mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]])
    response_mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    codes = torch.arange(1, attention_mask.numel() + 1).view(attention_mask.shape) * attention_mask
    routed = _codes_to_rows(codes.reshape(-1)).view(*codes.shape, LAYERS, TOPK)
    td = TensorDict(
        {
            "input_ids": codes.clone(),
            "attention_mask": attention_mask,
            "response_mask": response_mask,
            "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
            "routed_experts": routed.to(torch.int16),
        },
        batch_size=[3],
    )
    verl = left_right_2_no_padding(td)
    rows, cu = al.unpad_rows(routed, attention_mask)
    assert torch.equal(cu, verl["input_ids"].offsets())
    assert torch.equal(rows[:, 0, 0] // 8, verl["input_ids"].values())
    assert torch.equal(rows.to(torch.int16), verl["routed_experts"].values())


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    sp_size=st.integers(1, 4),
    static_pad=st.integers(0, 5),
)
def test_shards_partition_the_packed_sequence(lengths, sp_size, static_pad):
    rows = _codes_to_rows(torch.arange(1, sum(lengths) + 1))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packed = al.packed_layout(rows, cu, static_pad=static_pad)
    shards = [al.ulysses_shard(packed, sp_size, r) for r in range(sp_size)]
    pads = {p for _, p in shards}
    assert len(pads) == 1
    (pad,) = pads
    assert (packed.num_rows + pad) % sp_size == 0 and pad < sp_size
    assert torch.equal(al.unshard_ulysses([s.ids for s, _ in shards], pad + static_pad), rows)
    assert sum(s.num_missing for s, _ in shards) == pad + static_pad


def test_rows_with_data_marks_zero_and_repeated_rows():
    ids = torch.tensor(
        [
            [[1, 2], [3, 0]],  # real
            [[0, 0], [0, 0]],  # unrecorded token (zero row)
            [[4, 4], [1, 2]],  # one layer repeats an expert: not a genuine top-k
        ]
    )
    assert al.rows_with_data(ids).tolist() == [[True, True], [False, False], [False, True]]
    top1 = torch.tensor([[[0], [3]], [[0], [0]]])
    assert al.rows_with_data(top1).tolist() == [[True, True], [False, False]]


@settings(max_examples=60, deadline=None)
@given(
    k=st.sampled_from([2, 3, 8, 16, 17, 20]),
    rows=st.integers(0, 9),
    layers=st.integers(1, 3),
    experts=st.integers(2, 24),
    dtype=st.sampled_from([torch.uint8, torch.int16, torch.int64]),
    seed=st.integers(0, 2**16),
)
def test_rows_with_data_is_every_id_distinct_at_any_top_k(k, rows, layers, experts, dtype, seed):
    """Pairwise compares (K <= 16) and the sort (K > 16) against a per-row set count."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, max(experts, k), (rows, layers, k), generator=gen).to(dtype)
    if rows:
        ids[0, 0] = torch.randperm(max(experts, k), generator=gen)[:k].to(dtype)  # at least one genuine row
    expected = [[len(set(ids[n, lyr].tolist())) == k for lyr in range(layers)] for n in range(rows)]
    assert al.rows_with_data(ids).tolist() == expected


def test_layer_select_and_scatter_round_trip():
    rows = torch.randint(0, 8, (5, 4, 2))
    moe = [1, 3]
    sel = al.select_layers(rows, moe)
    assert torch.equal(sel, rows[:, [1, 3]])
    back = al.scatter_layers(sel, moe, 4)
    assert torch.equal(back[:, moe], sel) and not back[:, [0, 2]].any()


def test_bad_inputs_raise_clear_errors():
    rows = torch.zeros(5, 2, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="cu_seqlens ends at 4 tokens but the routing holds 5 rows"):
        al.packed_layout(rows, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"\[tokens, layers, top_k\]"):
        al.packed_layout(torch.zeros(5, 2, dtype=torch.long), torch.tensor([0, 5]))
    with pytest.raises(TypeError, match="integer expert ids"):
        al.packed_layout(rows.float(), torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="sp_rank must be in"):
        al.ulysses_shard(al.packed_layout(rows, torch.tensor([0, 5])), 2, 2)
    with pytest.raises(ValueError, match="max_seq_len=2 is shorter"):
        al.padded_layout(rows, torch.tensor([0, 5]), max_seq_len=2)
    with pytest.raises(ValueError, match="do not fit routing with 2 decoder layers"):
        al.select_layers(rows, [0, 3])
    with pytest.raises(ValueError, match="same number of rows"):
        al.unshard_ulysses([torch.zeros(2, 1, 1), torch.zeros(3, 1, 1)], 0)
    with pytest.raises(ValueError, match="attention_mask"):
        al.unpad_rows(torch.zeros(2, 3, 1, 1), torch.ones(2, 4))
