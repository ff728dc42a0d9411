"""The user-code guard: when a task's code fails on most of its inputs, pause the task.

A rollout node keeps, per task, the outcome of the last ``window`` distinct episodes it ran,
in the order it first saw them end. An episode retried after a failure counts once, in its
first place, with its latest outcome while it is in the window, and not again once it has left
it: the retries of a few bad prompts do not read as a broken task. The task is to be paused
when at least ``min_episodes`` episodes are in the window and more than half of them failed in
user code, or at once when the failure cannot depend on the input
(``UserCodeError.input_independent``: a wrong return type, a function that cannot be called).
The node then pauses it through the buffer with one sentence (``Verdict.sentence``) and the
guard forgets the task, so a task an operator resumes is judged afresh. Each node judges from
the episodes it ran itself.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from workers.rollout.usercode import UserCodeError


@dataclass(frozen=True)
class Verdict:
    """Why a task is to be paused: ``failed`` of its last ``seen`` episodes failed in user code,
    most often with ``error`` at ``location`` (``count`` times)."""

    failed: int
    seen: int
    error: str
    location: str
    count: int
    input_independent: bool

    def sentence(self) -> str:
        where = f" at {self.location}" if self.location else ""
        if self.input_independent:
            return (
                f"{self.error}{where}; this fails on every input, so the task was paused at "
                "its first occurrence"
            )
        return (
            f"its code failed on {self.failed} of its last {self.seen} episodes (most often, "
            f"{self.count} times: {self.error}{where})"
        )


# Episodes that left a window, remembered so that their retries are not counted again.
GONE_KEPT = 4096


@dataclass
class _Window:
    outcomes: OrderedDict[int, UserCodeError | None] = field(default_factory=OrderedDict)
    gone: OrderedDict[int, None] = field(default_factory=OrderedDict)


class TaskGuard:
    def __init__(self, window: int = 8, min_episodes: int = 4) -> None:
        self.window = window  # 0: the guard is off (only input-independent errors pause)
        self.min_episodes = max(1, min(min_episodes, window)) if window else 0
        self._tasks: dict[int, _Window] = {}

    def record(self, task_id: int, episode_id: int, error: UserCodeError | None) -> Verdict | None:
        """The latest outcome of one episode of the task (``error`` None: it committed). Returns
        a verdict when the task is to be paused (and forgets the task)."""
        if error is not None and error.input_independent:
            self._tasks.pop(task_id, None)
            return Verdict(1, 1, error.message, error.location, 1, True)
        if not self.window:
            return None
        w = self._tasks.setdefault(task_id, _Window())
        # An episode keeps its place (its first outcome's) when it is retried, and one that has
        # left the window does not come back: the few bad prompts that fail again and again,
        # later each time (backoff), must not crowd the good ones out of the window.
        if episode_id in w.gone:
            return None
        w.outcomes[episode_id] = error
        while len(w.outcomes) > self.window:
            gone, _ = w.outcomes.popitem(last=False)
            w.gone[gone] = None
            while len(w.gone) > GONE_KEPT:
                w.gone.popitem(last=False)
        errors = [e for e in w.outcomes.values() if e is not None]
        seen = len(w.outcomes)
        if seen < self.min_episodes or 2 * len(errors) <= seen:
            return None
        by_signature = Counter(e.signature for e in errors)
        signature, count = by_signature.most_common(1)[0]
        last = next(e for e in reversed(errors) if e.signature == signature)
        self._tasks.pop(task_id, None)
        return Verdict(len(errors), seen, last.message, last.location, count, False)

    def forget(self, task_id: int) -> None:
        self._tasks.pop(task_id, None)
