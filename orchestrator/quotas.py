"""Quota and admission arithmetic: pure functions of plain values, no IO.

Semantics (documented in docs/architecture.md, "Quotas and the replay buffer"):

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


@dataclass(frozen=True)
class BatchPolicy:
    """What a job's trainer needs of its tasks: ``batch_groups`` per step, weights published
    every ``sync_every`` steps, every staleness bound 0 in sync mode."""

    batch_groups: int
    sync_every: int = 1
    sync_mode: bool = False

    @classmethod
    def from_config(cls, data: Mapping[str, object]) -> BatchPolicy | None:
        """From a job's stored config (``jobs.config``, the JSON of a ``RollcallConfig``);
        None when the job has none (created by ``rollcall job create``)."""
        if not data:
            return None
        try:
            buffer, trainer, run = (dict(data.get(k) or {}) for k in ("buffer", "trainer", "run"))  # type: ignore[call-overload]
            return cls(
                int(buffer.get("batch_groups", 8)),
                int(trainer.get("sync_every", 1)),
                run.get("mode") == "sync",
            )
        except (AttributeError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class QuotaInput:
    name: str
    weight: float
    max_staleness: int


def batch_problem(
    tasks: Sequence[QuotaInput], policy: BatchPolicy, max_admitted: int
) -> str | None:
    """Why the trainer can never get a full batch from these (seeding) tasks, or None.

    Weights are published every ``k = sync_every`` steps, so at the last step before a
    publication (version ``p + k - 1``, weights ``p``) only groups at most ``k - 1`` versions
    old are trainable: only tasks with ``max_staleness >= k - 1`` can supply that step, and
    each holds at most its admission cap. The batch can be filled iff those caps add up to
    ``batch_groups`` (all the caps together always do: each is at least the task's share).
    Too large caps are a problem of their own: the first seed queues them all at once.
    """
    if not tasks:
        return None
    k = policy.sync_every
    if policy.sync_mode and k > 1:
        return (
            f"trainer.sync_every must be 1 with run.mode sync (got {k}): sync mode trains "
            "on-policy data only, so the weights must be published after every step"
        )
    shares = batch_shares({i: t.weight for i, t in enumerate(tasks)}, policy.batch_groups)
    staleness = [0 if policy.sync_mode else t.max_staleness for t in tasks]
    caps = [admission_cap(s, shares[i]) for i, s in enumerate(staleness)]
    if sum(caps) > max_admitted:
        return (
            f"the tasks' admission caps add up to {sum(caps)} groups (each task may hold "
            f"(max_staleness + 1) x its share of buffer.batch_groups ({policy.batch_groups})), "
            f"more than the {max_admitted} a job may hold; lower buffer.batch_groups or the "
            "tasks' max_staleness"
        )
    fit = [i for i, s in enumerate(staleness) if s >= k - 1]
    held = sum(caps[i] for i in fit)
    if held >= policy.batch_groups:
        return None
    names = ", ".join(tasks[i].name for i in fit)
    who = (
        f"the tasks with a max_staleness of at least {k - 1} ({names}) hold"
        if fit
        else f"no task has a max_staleness of at least {k - 1}, so they hold"
    )
    return (
        f"buffer.batch_groups ({policy.batch_groups}) cannot be filled: weights are published "
        f"every trainer.sync_every ({k}) steps, so the last step before a publication trains "
        f"only data at most {k - 1} versions old, and {who} at most {held} groups; give tasks a "
        f"max_staleness of at least {k - 1}, or lower trainer.sync_every or buffer.batch_groups"
    )
