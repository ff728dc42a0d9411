"""The user-code guard: when a task's code fails on most of its inputs, pause the task.

A rollout node keeps, per task, the **final** outcome of the last ``window`` episodes that
ended on it: committed (success) or quarantined after their attempts because the task's code
failed every time (failure). An episode has one final outcome job-wide, so no episode counts
twice (its retries on other nodes included), and a failure that depends on the sampled output
rather than the input (a parser that chokes on odd text now and then) mostly succeeds on a
retry and does not count. A failure that cannot depend on the input at all
(``UserCodeError.input_independent``: a wrong return type, a function that cannot be called as
``fn(ctx, prompt)``) pauses the task at once.

Otherwise the task is to be paused when its failures are strong evidence that most of its
inputs fail: at least ``min_episodes`` outcomes, at least four fifths of them failures, and a
one-sided binomial test against "half of the inputs fail" at ``ALPHA`` (``needed``). So six
quarantines in a row pause a task, as do 8 of 8, 13 of 16 or 26 of 32. A task one prompt in
four of which fails deterministically is paused with a probability of 2e-4 at its start (its
first six final outcomes all failures) and about 4e-11 per full window after it; one in
three: 1.4e-3 and 4e-8 (``tests/unit/test_user_code_errors.py`` simulates them).

The node then pauses the task through the buffer with one sentence (``Verdict.sentence``); the
buffer refuses when an operator resumed the task after the failures the verdict counts (then,
and after a pause, the guard forgets the task and judges it afresh).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass
from datetime import datetime
from functools import cache

from rollcall.workers.episode.usercode import UserCodeError

ALPHA = 1 / 64  # the binomial test's level: P(so many failures | half the inputs fail)
MIN_FRACTION = 0.8


@cache
def needed(n: int) -> int:
    """Failures among ``n`` outcomes that pause a task: at least ``MIN_FRACTION`` of them and
    unlikely (``<= ALPHA``) if only half of the task's inputs failed."""
    k = math.ceil(MIN_FRACTION * n)
    while k <= n and sum(math.comb(n, i) for i in range(k, n + 1)) / 2**n > ALPHA:
        k += 1
    return k


@dataclass(frozen=True)
class Verdict:
    """Why a task is to be paused: ``failed`` of its last ``seen`` final outcomes were failures
    of its code, most often ``error`` at ``location`` (``count`` times); ``since``: when the
    oldest of those failures happened (database clock; None when unknown)."""

    failed: int
    seen: int
    error: str
    location: str
    count: int
    input_independent: bool
    since: datetime | None = None

    def sentence(self) -> str:
        where = f" at {self.location}" if self.location else ""
        if self.input_independent:
            return (
                f"{self.error}{where}; this fails on every input, so the task was paused at "
                "its first occurrence"
            )
        return (
            f"its code failed on {self.failed} of the last {self.seen} episodes that ended "
            f"(each quarantined after its attempts; most often, {self.count} times: "
            f"{self.error}{where})"
        )


@dataclass(frozen=True)
class _Outcome:
    error: UserCodeError | None
    at: datetime | None


class TaskGuard:
    def __init__(self, window: int = 32, min_episodes: int = 6) -> None:
        self.window = window  # 0: off (only input-independent errors pause)
        self.min_episodes = max(1, min(min_episodes, window)) if window else 0
        self._tasks: dict[int, deque[_Outcome]] = {}  # the last ``window`` outcomes per task

    def record(
        self, task_id: int, error: UserCodeError | None, at: datetime | None = None
    ) -> Verdict | None:
        """An episode of the task ended for good: ``error`` None (committed), or quarantined
        after its code failed with ``error`` at ``at``. Returns a verdict when the task is to
        be paused (and forgets the task's outcomes: one verdict per run of failures)."""
        if error is not None and error.input_independent:
            return Verdict(1, 1, error.message, error.location, 1, True, at)
        if not self.window:
            return None
        outcomes = self._tasks.setdefault(task_id, deque(maxlen=self.window))
        outcomes.append(_Outcome(error, at))
        failures = [o for o in outcomes if o.error is not None]
        seen = len(outcomes)
        if seen < self.min_episodes or len(failures) < needed(seen):
            return None
        by_signature = Counter(o.error.signature for o in failures if o.error is not None)
        signature, count = by_signature.most_common(1)[0]
        last = next(
            o.error for o in reversed(failures) if o.error and o.error.signature == signature
        )
        times = [o.at for o in failures if o.at is not None]
        since = min(times) if times else None
        self.forget(task_id)  # one verdict: the outcomes after it are judged afresh
        return Verdict(len(failures), seen, last.message, last.location, count, False, since)

    def forget(self, task_id: int) -> None:
        """Judge the task afresh (it was paused, or resumed since the failures counted)."""
        self._tasks.pop(task_id, None)
