"""What the operator sees of user code that fails: each distinct error once, then counts.

The rollout nodes record every failure of user code as an ``episode.user_error`` event (its
message, where in the user's code, the traceback, a ``signature`` per distinct fault) and a task
the user-code guard paused as a ``task.paused`` event. ``UserErrorReport.poll`` (a scheduler
job of the driver) reads the events that are new since it last looked and:

- prints the first occurrence of each signature on the terminal, one line with the user's
  ``file:line``, and writes its traceback to driver.log;
- counts later occurrences (each one a line in driver.log) and prints how many more there were
  at most every ``repeat_every_s`` while they keep coming, without the input-specific message;
- prints every pause of a task by the guard, with the sentence that says how to go on;
- prints each group quarantined at a batch claim for a NaN or infinite reward (stored by an
  older rollcall, before rewards were checked where they are produced).

``close()`` prints the counts not yet printed. The events stay in PostgreSQL, where ``rollcall
events`` and ``rollcall status`` show them after the run too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollcall.orchestrator.domain import EventView

log = logging.getLogger(__name__)

KINDS = ("episode.user_error", "task.paused", "episode.quarantined")
LOOKBACK_IDS = 1000
REPEAT_EVERY_S = 60.0


@dataclass
class _Seen:
    tasks: list[str]
    head: str
    location: str
    count: int = 1
    printed: int = 1  # occurrences the terminal has been told of
    printed_at: float = 0.0


class UserErrorReport:
    def __init__(
        self,
        events_after: Callable[[int, tuple[str, ...]], list[EventView]],
        after_id: int,
        say: Callable[[str], None],
        *,
        repeat_every_s: float = REPEAT_EVERY_S,
    ) -> None:
        self._events_after = events_after
        self._after = after_id  # only what happens in this run
        self._top = after_id  # the highest id read
        self._read: set[int] = set()  # ids read, above _top - LOOKBACK_IDS
        self._say = say
        self.repeat_every_s = repeat_every_s
        self._seen: dict[str, _Seen] = {}
        self._lock = threading.Lock()

    def poll(self) -> None:
        """Read what is new. Event ids come from a sequence and concurrent transactions commit
        out of order, so an event may appear below the highest id already read: each poll
        reads again from ``LOOKBACK_IDS`` below it and skips the ids it has seen."""
        with self._lock:
            floor = max(self._after, self._top - LOOKBACK_IDS)
            cursor = floor
            while True:
                batch = self._events_after(cursor, KINDS)
                for e in batch:
                    cursor = max(cursor, e.id)
                    if e.id in self._read:
                        continue
                    self._read.add(e.id)
                    self._top = max(self._top, e.id)
                    self._one(e)
                if len(batch) < 500:
                    break
            keep = self._top - LOOKBACK_IDS
            self._read = {i for i in self._read if i > keep}
            self._repeats(time.monotonic(), final=False)

    def close(self) -> None:
        """The last counts (the job's end)."""
        try:
            self.poll()
        except Exception:  # the database is away: the events are there for `rollcall events`
            log.warning("could not read the last user-code events", exc_info=True)
        with self._lock:
            self._repeats(time.monotonic(), final=True)

    def _one(self, e: EventView) -> None:
        p: dict[str, Any] = e.payload
        if e.kind == "episode.quarantined":  # shown: a NaN reward stored by an older rollcall
            if p.get("reason") == "non-finite reward":
                self._say(e.message)
            return
        if e.kind == "task.paused":
            if p.get("reason"):  # paused by the guard (an operator's pause has no reason)
                self._say(e.message)
                log.warning("%s", e.message)
            return
        signature = str(p.get("signature", ""))
        task = str(p.get("task", "?"))
        seen = self._seen.get(signature)
        if seen is None:
            self._seen[signature] = _Seen(
                [task], str(p.get("head", "")), str(p.get("location", "")),
                printed_at=time.monotonic(),
            )  # fmt: skip
            where = f" ({p['location']})" if p.get("location") else ""
            self._say(
                f"{task}: user code failed: {p.get('error', e.message)}{where}; "
                f"episode {p.get('episode_id')} (prompt {p.get('prompt_index')}) "
                + ("quarantined" if p.get("quarantined") else "to be retried")
                + "; traceback in driver.log"
            )
            log.warning("%s\n%s", e.message, p.get("traceback", ""))
            return
        seen.count += 1
        if task not in seen.tasks:
            seen.tasks.append(task)
        log.warning("%s", e.message)

    def _repeats(self, now: float, *, final: bool) -> None:
        for s in self._seen.values():
            new = s.count - s.printed
            if new <= 0 or (not final and now - s.printed_at < self.repeat_every_s):
                continue
            where = f" at {s.location}" if s.location else ""
            tasks = ",".join(s.tasks)
            self._say(f"{tasks}: {s.head}{where}: {new} more time(s), {s.count} in all")
            s.printed, s.printed_at = s.count, now
