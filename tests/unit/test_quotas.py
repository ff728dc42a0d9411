"""Quota and admission arithmetic: hand-derived cases and hypothesis properties."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollcall.orchestrator.quotas import (
    SeedInput,
    TaskLoad,
    admission_cap,
    allocate_batch,
    batch_shares,
    claim_order,
    seed_counts,
)


def test_batch_shares_hand_derived() -> None:
    # 8 groups split 2:1 -> 16/3 and 8/3.
    shares = batch_shares({1: 2.0, 2: 1.0}, 8)
    assert shares == pytest.approx({1: 16 / 3, 2: 8 / 3})


def test_admission_cap_hand_derived() -> None:
    # (2 + 1) * 16/3 = 16 exactly; (2 + 1) * 8/3 = 8 exactly; (0 + 1) * 0.5 -> ceil 0.5 = 1.
    assert admission_cap(2, 16 / 3) == 16
    assert admission_cap(2, 8 / 3) == 8
    assert admission_cap(0, 0.5) == 1
    assert admission_cap(1, 2.2) == 5  # ceil(4.4)
    assert admission_cap(3, 0.0) == 1  # never zero: a task always gets to start something


def test_seed_counts_fill_to_cap_and_never_beyond() -> None:
    inputs = [
        SeedInput(task_id=1, weight=2.0, max_staleness=2, outstanding=10),  # cap 16 -> +6
        SeedInput(task_id=2, weight=1.0, max_staleness=2, outstanding=9),  # cap 8 -> over: 0
        SeedInput(task_id=3, weight=1.0, max_staleness=0, outstanding=0),  # cap ceil(2) = 2
    ]
    # shares with batch 8 over weights 2:1:1 -> 4, 2, 2.
    assert seed_counts(inputs, 8) == {1: 12 - 10, 2: 0, 3: 2}


def test_claim_order_prefers_largest_deficit() -> None:
    loads = [
        # weights 3:1, 8 recent claims. Deficits (R+1=9): t1 = 3/4*9 - 5 = 1.75, t2 = 1/4*9 - 3 = -0.75
        TaskLoad(task_id=1, weight=3.0, leased=0, max_inflight=4, queued=5, recent_claims=5),
        TaskLoad(task_id=2, weight=1.0, leased=0, max_inflight=4, queued=5, recent_claims=3),
    ]
    assert claim_order(loads) == [1, 2]


def test_claim_order_skips_capped_and_empty_tasks() -> None:
    loads = [
        TaskLoad(
            task_id=1, weight=5.0, leased=4, max_inflight=4, queued=9, recent_claims=0
        ),  # capped
        TaskLoad(
            task_id=2, weight=5.0, leased=0, max_inflight=4, queued=0, recent_claims=0
        ),  # empty
        TaskLoad(task_id=3, weight=1.0, leased=3, max_inflight=4, queued=1, recent_claims=50),
    ]
    assert claim_order(loads) == [3]
    assert claim_order([]) == []


def test_allocate_hand_derived_three_steps() -> None:
    # Weights 1:1:1, 4 groups: see the docstring of allocate_batch.
    w = {1: 1.0, 2: 1.0, 3: 1.0}
    avail = {1: 99, 2: 99, 3: 99}
    a1 = allocate_batch(w, avail, {}, 4)
    assert a1.groups == {1: 2, 2: 1, 3: 1}
    assert a1.carry == pytest.approx({1: -2 / 3, 2: 1 / 3, 3: 1 / 3})
    a2 = allocate_batch(w, avail, a1.carry, 4)
    assert a2.groups == {1: 1, 2: 2, 3: 1}
    a3 = allocate_batch(w, avail, a2.carry, 4)
    assert a3.groups == {1: 1, 2: 1, 3: 2}
    total = Counter(a1.groups) + Counter(a2.groups) + Counter(a3.groups)
    assert total == {1: 4, 2: 4, 3: 4}


def test_allocate_redistributes_missing_task_and_records_it() -> None:
    # Task 2 has no data: its 4/8 share goes to tasks 1 and 3 (weights 2:2 of the rest) and it
    # is recorded as shortfall; its carry is left as it was.
    a = allocate_batch({1: 2.0, 2: 4.0, 3: 2.0}, {1: 50, 2: 0, 3: 50}, {2: 0.25}, 8)
    assert a.groups == {1: 4, 3: 4}
    assert a.shortfall == pytest.approx({2: 4.0})
    assert a.carry[2] == 0.25


def test_allocate_limited_data_gives_rest_to_others() -> None:
    # Task 1 would get 4 of 8 but has 1 group; the other 3 slots go to task 2.
    a = allocate_batch({1: 1.0, 2: 1.0}, {1: 1, 2: 50}, {}, 8)
    assert a.groups == {1: 1, 2: 7}
    assert a.shortfall == pytest.approx({1: 3.0})
    assert a.carry[1] == 1.0  # bounded: it is not owed the 3 groups later


def test_allocate_nothing_available() -> None:
    a = allocate_batch({1: 1.0}, {1: 0}, {}, 8)
    assert a.groups == {}


weights_st = st.dictionaries(
    st.integers(min_value=1, max_value=6),
    st.floats(min_value=0.1, max_value=10.0, allow_nan=False),
    min_size=1,
    max_size=5,
)


@settings(max_examples=200, deadline=None)
@given(weights=weights_st, batch=st.integers(min_value=1, max_value=32), steps=st.integers(1, 40))
def test_allocation_tracks_weights_within_one_group(
    weights: dict[int, float], batch: int, steps: int
) -> None:
    avail = {t: 10**6 for t in weights}
    carry: dict[int, float] = {}
    total: Counter[int] = Counter()
    for _ in range(steps):
        a = allocate_batch(weights, avail, carry, batch)
        assert sum(a.groups.values()) == batch
        carry = a.carry
        total.update(a.groups)
    shares = batch_shares(weights, batch)
    for t in weights:
        assert abs(total[t] - steps * shares[t]) <= 1.0 + 1e-6, (t, total[t], steps * shares[t])


@settings(max_examples=200, deadline=None)
@given(
    weights=weights_st,
    batch=st.integers(min_value=1, max_value=32),
    data=st.data(),
)
def test_allocation_respects_availability(
    weights: dict[int, float], batch: int, data: st.DataObject
) -> None:
    avail = {t: data.draw(st.integers(0, 10)) for t in weights}
    carry = {t: data.draw(st.floats(-1, 1)) for t in weights}
    a = allocate_batch(weights, avail, carry, batch)
    for t, n in a.groups.items():
        assert 0 < n <= avail[t]
    assert sum(a.groups.values()) == min(batch, sum(avail.values()))
    assert all(-1.0 <= c <= 1.0 for c in a.carry.values())


@settings(max_examples=300, deadline=None)
@given(weights=weights_st, claims=st.integers(1, 300))
def test_claims_follow_weights(weights: dict[int, float], claims: int) -> None:
    # The greedy largest-deficit order keeps every task within (just over) one claim of its
    # share; hypothesis found 1.019 (5 tasks, 182 claims), so the bound asserted is 1.5.
    recent: Counter[int] = Counter()
    for _ in range(claims):
        loads = [TaskLoad(t, w, 0, 10, 10, recent[t]) for t, w in weights.items()]
        recent[claim_order(loads)[0]] += 1
    total_w = sum(weights.values())
    for t, w in weights.items():
        assert abs(recent[t] - claims * w / total_w) < 1.5


@settings(max_examples=200, deadline=None)
@given(
    weights=weights_st,
    batch=st.integers(1, 64),
    staleness=st.integers(0, 8),
    data=st.data(),
)
def test_seeding_never_exceeds_cap(
    weights: dict[int, float], batch: int, staleness: int, data: st.DataObject
) -> None:
    inputs = [
        SeedInput(t, w, staleness, data.draw(st.integers(0, 200))) for t, w in weights.items()
    ]
    counts = seed_counts(inputs, batch)
    shares = batch_shares(weights, batch)
    for i in inputs:
        cap = math.ceil((staleness + 1) * shares[i.task_id] - 1e-9)
        assert i.outstanding + counts[i.task_id] == max(i.outstanding, max(1, cap))


def test_batch_problem_is_exact_at_the_boundary() -> None:
    from rollcall.orchestrator.quotas import BatchPolicy, QuotaInput, batch_problem

    every_4 = BatchPolicy(batch_groups=8, sync_every=4)
    # only "patient" (max_staleness 3) can supply the step before a publication: its cap is
    # ceil(4 x share); share 2 (weights 3:1) -> 8 groups, a full batch; share 1.6 -> 7
    fits = [QuotaInput("fresh", 3.0, 0), QuotaInput("patient", 1.0, 3)]
    assert batch_problem(fits, every_4, 100_000) is None
    short = [QuotaInput("fresh", 4.0, 0), QuotaInput("patient", 1.0, 3)]
    assert "(patient) hold at most 7 groups" in (batch_problem(short, every_4, 100_000) or "")
    assert batch_problem(short, BatchPolicy(8, 1), 100_000) is None  # every step: fine
    # the caps together (6 + 8 groups) are what the first seed queues: bounded per job
    assert batch_problem(fits, BatchPolicy(8, 1), 14) is None
    assert "add up to 14 groups" in (batch_problem(fits, BatchPolicy(8, 1), 13) or "")
    # sync mode: every staleness bound is 0, so weights after every step
    assert "sync_every must be 1" in (batch_problem(fits, BatchPolicy(8, 2, True), 100) or "")
    # from a job's stored config; a job created without one has nothing to judge by
    stored = {"buffer": {"batch_groups": 5}, "trainer": {"sync_every": 2}, "run": {"mode": "sync"}}
    assert BatchPolicy.from_config(stored) == BatchPolicy(5, 2, True)
    assert BatchPolicy.from_config({}) is None and BatchPolicy.from_config({"buffer": 3}) is None
