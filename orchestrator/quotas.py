"""Quota and admission arithmetic: pure functions of plain values, no IO.

Semantics (documented in the README's "Quotas" section):

- **Weight** is a task's share, among the tasks competing at that moment, of rollout claims
  (``claim_order``) and of the groups in each training batch (``allocate_batch``).
- **Admission** (``seed_counts``): a task's outstanding work (queued + leased episodes + finished
  groups not yet trained) stays within ``ceil((max_staleness + 1) * batch_share)`` groups, where
  ``batch_share = batch_groups * weight / total weight`` of the seeding tasks. More would be
  generated faster than the trainer can consume it inside the staleness bound, i.e. go stale.
- **Claim order**: among tasks with queued work and fewer than ``max_inflight`` episodes leased,
  the one with the largest deficit against its weighted fair share of recent claims goes first
  (under constant weights every task stays within about one claim of its share).
- **Batch allocation**: a deficit-carrying largest-remainder split. Each task with eligible data
  gets ``batch_groups * weight / total weight`` groups on average; the fractional remainder is
  carried to the next step, so over any run of steps each task's total stays within one group
  of its share. A task without eligible data is skipped for that step (its slots go to the
  others, recorded as ``shortfall``) and its carry is frozen, so it neither owes nor is owed
  groups when its data returns.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


def batch_shares(weights: Mapping[int, float], batch_groups: int) -> dict[int, float]:
    """Groups per batch that each task is entitled to: ``batch_groups * w / sum(w)``."""
    total = sum(weights.values())
    if total <= 0:
        return {t: 0.0 for t in weights}
    return {t: batch_groups * w / total for t, w in weights.items()}


def admission_cap(max_staleness: int, share_groups: float) -> int:
    """Most groups a task may have outstanding: ``ceil((max_staleness + 1) * share)``, >= 1.

    Example: batch of 8 groups, weights 2:1 -> shares 16/3 and 8/3; with max_staleness 2 the
    caps are ceil(3 * 5.33) = 16 and ceil(3 * 2.67) = 8.
    """
    return max(1, math.ceil((max_staleness + 1) * share_groups - 1e-9))


@dataclass(frozen=True)
class SeedInput:
    task_id: int
    weight: float
    max_staleness: int
    outstanding: int  # queued + leased episodes + finished groups not yet trained


def seed_counts(inputs: Sequence[SeedInput], batch_groups: int) -> dict[int, int]:
    """Episodes to add per task so that each reaches (and never exceeds) its admission cap."""
    shares = batch_shares({i.task_id: i.weight for i in inputs}, batch_groups)
    return {
        i.task_id: max(0, admission_cap(i.max_staleness, shares[i.task_id]) - i.outstanding)
        for i in inputs
    }


@dataclass(frozen=True)
class TaskLoad:
    task_id: int
    weight: float
    leased: int
    max_inflight: int
    queued: int
    recent_claims: float  # recent claims (a decayed count)


def claim_order(loads: Sequence[TaskLoad]) -> list[int]:
    """Task ids a claimer should try, best first; ineligible tasks are left out.

    Eligible: ``queued > 0`` and ``leased < max_inflight``. Deficit of task i among the eligible
    set E: ``w_i / W_E * (R_E + 1) - r_i`` (its fair share of the recent claims plus the one
    being made, minus what it got). Ties go to the smaller ``r_i / w_i``, then the lower id.
    """
    eligible = [x for x in loads if x.queued > 0 and x.leased < x.max_inflight]
    if not eligible:
        return []
    total_w = sum(x.weight for x in eligible)
    total_r = sum(x.recent_claims for x in eligible)

    def key(x: TaskLoad) -> tuple[float, float, int]:
        deficit = x.weight / total_w * (total_r + 1) - x.recent_claims
        return (-deficit, x.recent_claims / x.weight, x.task_id)

    return [x.task_id for x in sorted(eligible, key=key)]


@dataclass(frozen=True)
class Allocation:
    groups: dict[int, int]  # task -> groups in this batch
    targets: dict[int, float]  # task -> fair share of this batch (tasks with data only)
    carry: dict[int, float]  # task -> deficit carried to the next step (all tasks)
    shortfall: dict[int, float]  # task -> share of the batch it could not use (too little data)


def allocate_batch(
    weights: Mapping[int, float],
    available: Mapping[int, int],
    carry: Mapping[int, float],
    batch_groups: int,
) -> Allocation:
    """Split ``batch_groups`` among tasks by weight, limited by the groups available to each.

    ``x_i = target_i + carry_i``; each task first gets ``floor(x_i)``, then the remaining slots
    go one by one to the largest ``x_i - given_i``. Slots a task cannot fill (not enough data)
    go to the others the same way. The new carry is ``x_i - given_i`` for tasks that had data.

    Example: weights 1:1:1, 4 groups, no carry -> targets 4/3 each; floors 1,1,1; the last slot
    goes to task 1 (remainders tie at 1/3; ties by id) -> [2,1,1], carries [-2/3, 1/3, 1/3].
    Step 2: x = [2/3, 5/3, 5/3], floors [0,1,1], remainders all 2/3, so the two free slots go to
    tasks 1 and 2 -> [1,2,1], carries [-1/3, -1/3, 2/3]. Step 3: x = [1, 1, 2] -> [1,1,2].
    Over the three steps each task gets exactly 4 groups.
    """
    present = {t: w for t, w in weights.items() if available.get(t, 0) > 0 and w > 0}
    targets = batch_shares(present, batch_groups) if present else {}
    x = {t: targets[t] + carry.get(t, 0.0) for t in present}
    given = {t: min(available[t], max(0, math.floor(x[t] + 1e-9))) for t in present}
    remaining = batch_groups - sum(given.values())
    while remaining > 0:
        open_tasks = [t for t in present if given[t] < available[t]]
        if not open_tasks:
            break
        best = max(open_tasks, key=lambda t: (x[t] - given[t], weights[t], -t))
        given[best] += 1
        remaining -= 1
    # Taking more than floor(x) cannot happen above unless slots were left over; if the floors
    # alone exceed the batch (large positive carries), trim from the smallest remainders.
    while sum(given.values()) > batch_groups:
        worst = min((t for t in present if given[t] > 0), key=lambda t: (x[t] - given[t], -t))
        given[worst] -= 1
    new_carry = dict(carry)
    for t in present:
        # Bound the carry: a task that could not take its share (too little data) is not owed
        # the difference later.
        new_carry[t] = max(-1.0, min(1.0, x[t] - given[t]))
    # What each task would get if all had data, minus what it got when data limited it.
    full = batch_shares({t: w for t, w in weights.items() if w > 0}, batch_groups)
    shortfall = {}
    for t, share in full.items():
        got = given.get(t, 0)
        if got >= available.get(t, 0) and share - got > 1e-9:
            shortfall[t] = share - got
    return Allocation(
        groups={t: n for t, n in given.items() if n > 0},
        targets=targets,
        carry=new_carry,
        shortfall=shortfall,
    )
