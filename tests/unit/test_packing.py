"""Sequence packing: bin packing, rank balance, the packed layout and its mask."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollcall.workers.trainer.packing import (
    first_fit_decreasing,
    pack,
    pack_values,
    padded_slots,
    plan_micro_batches,
)


def test_first_fit_decreasing_by_hand() -> None:
    # lengths [5,4,3,3,2,2,1], budget 8, taken longest first:
    # 5 -> bin0 (5); 4 -> bin1 (4); 3 -> bin0 (8); 3 -> bin1 (7); 2 -> bin2 (2);
    # 2 -> bin2 (4); 1 -> bin1 (8).
    assert first_fit_decreasing([5, 4, 3, 3, 2, 2, 1], 8) == [[0, 2], [1, 3, 6], [4, 5]]


def test_a_sequence_over_budget_gets_its_own_bin() -> None:
    assert first_fit_decreasing([3, 20, 4], 8) == [[1], [2, 0]]


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="budget"):
        first_fit_decreasing([1], 0)
    with pytest.raises(ValueError, match="at least one token"):
        first_fit_decreasing([1, 0], 4)
    with pytest.raises(ValueError, match="nothing"):
        pack([])


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 100), min_size=0, max_size=60),
    budget=st.integers(100, 400),
    ranks=st.integers(1, 8),
)
def test_plans_cover_every_sequence_once_within_budget(
    lengths: list[int], budget: int, ranks: int
) -> None:
    bins = first_fit_decreasing(lengths, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= budget for b in bins)
    # first fit never leaves two bins at most half full: bins <= ceil(2 * total / budget)
    assert len(bins) <= max(1, math.ceil(2 * sum(lengths) / budget))
    assert len(bins) >= math.ceil(sum(lengths) / budget)
    plan = plan_micro_batches(lengths, budget, ranks)
    assert len(plan) == ranks and len({len(r) for r in plan}) == 1
    assert sorted(i for r in plan for b in r for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= budget for r in plan for b in r)
    loads = [sum(lengths[i] for b in r for i in b) for r in plan]
    assert max(loads) - min(loads) <= max(lengths, default=0)


def test_ranks_get_balanced_token_loads() -> None:
    # Longest first to the lighter rank (ties to rank 0):
    # 9->r0 (9), 8->r1 (8), 7->r1 (15), 6->r0 (15), 5->r0 (20), 5->r1 (20), 4->r0 (24),
    # 3->r1 (23), 2->r1 (25). Then FFD with budget 10 per rank:
    # r0 [9,6,5,4] -> [9] [6,4] [5];  r1 [8,7,5,3,2] -> [8,2] [7,3] [5].
    lengths = [9, 8, 7, 6, 5, 5, 4, 3, 2]
    plan = plan_micro_batches(lengths, 10, ranks=2)
    assert plan == [[[0], [3, 6], [4]], [[1, 8], [2, 7], [5]]]
    # more ranks than sequences: the idle rank gets one empty micro-batch
    assert plan_micro_batches([3, 4], 10, ranks=3) == [[[1]], [[0]], [[]]]
    # unequal counts are padded with empty micro-batches
    assert plan_micro_batches([10, 10, 10], 10, ranks=2) == [[[0], [2]], [[1], []]]


def test_pack_layout_and_block_diagonal_mask() -> None:
    p = pack([[7, 8], [9], [4, 5, 6]])
    assert p.input_ids.tolist() == [[7, 8, 9, 4, 5, 6]]
    assert p.position_ids.tolist() == [[0, 1, 0, 0, 1, 2]]
    assert p.sequence_ids().tolist() == [0, 0, 1, 2, 2, 2]
    mask = p.attention_mask(torch.float32)
    assert mask.shape == (1, 1, 6, 6)
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 1, 1, 1],
    ]
    assert float(mask.min()) == torch.finfo(torch.float32).min
    values = pack_values([torch.tensor([0.1, 0.2]), torch.tensor([0.3]), torch.tensor([1, 2, 3.0])])
    parts = p.unpack(values)
    assert [t.tolist() for t in parts] == [
        pytest.approx([0.1, 0.2]),
        pytest.approx([0.3]),
        [1.0, 2.0, 3.0],
    ]
    with pytest.raises(ValueError, match="expected 6 tokens"):
        p.unpack(torch.zeros(5))


def test_padded_slots() -> None:
    # micro-batches {10, 2} and {7}: padded to their longest: 2 * 10 + 1 * 7 = 27
    assert padded_slots([10, 2, 7], [[0, 1], [2]]) == 27
