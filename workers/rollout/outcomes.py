"""How a rollout node's episodes end when they are not committed, and what it tells of them.

An episode the node gives up is released (its failure counted as an attempt unless the node,
not the episode, is to blame; after ``max_attempts`` the buffer quarantines it) or abandoned
(its lease moved on: the buffer refused the release). A drain gives the lease back not counted
(``hand_back``). User code that fails on the episode's input releases it as a counted attempt
with a backoff and an ``episode.user_error`` event (``user_failed``); the node's ``TaskGuard``
(``guard.py``), judging the final outcomes of each task's episodes, may pause the task. An
agent's replay that diverged is an event (``diverged``).
"""

from __future__ import annotations

import json
import logging
import threading
from typing import TYPE_CHECKING, Any

from rollcall.orchestrator.buffer.rollout import RolloutBuffer
from rollcall.orchestrator.buffer.types import ClaimedEpisode, Lease
from rollcall.orchestrator.errors import StaleLeaseError
from rollcall.workers.episode.usercode import UserCodeError
from rollcall.workers.rollout.guard import TaskGuard, Verdict
from rollcall.workers.rollout.stats import Counters

if TYPE_CHECKING:
    from rollcall.workers.rollout.node import NodeConfig

log = logging.getLogger(__name__)


class Outcomes:
    """The node's episode outcomes that are not commits; the task guard under its own lock."""

    def __init__(
        self, config: NodeConfig, buffer: RolloutBuffer, worker_id: int, counters: Counters
    ) -> None:
        self.config = config
        self.buffer = buffer
        self.worker_id = worker_id
        self.counters = counters
        # tasks whose code fails on most inputs are paused (under ``_lock``)
        self._lock = threading.Lock()
        self._guard = TaskGuard(config.failing_task_window, config.failing_task_min_episodes)

    def committed(self, task_id: int) -> None:
        """Every sample of an episode of the task was committed: a good outcome for the guard."""
        self.counters.add(episodes_committed=1)
        with self._lock:
            self._guard.record(task_id, None)

    def release(self, lease: Lease, error: Exception | None, *, counted: bool) -> None:
        """An episode's first failure (``error``; None: its lease was lost): released (an
        error: requeued, counted unless ``counted`` is False) or, when the lease moved on,
        abandoned. The database away: a lost lease is swept like any other; an error raises."""
        released = False
        # An error: the episode goes back to the queue, counted as an attempt. A lost lease:
        # normally it has moved on and the release is refused; if this node still holds it
        # after all, releasing it keeps a live node from renewing a lease it will never use.
        reason = f"{type(error).__name__}: {error}" if error is not None else "lease lost"
        try:
            self.buffer.release(lease, reason, counted=counted)
            released = error is not None
        except StaleLeaseError:
            pass
        except Exception:  # the database is away: a lost lease is swept like any other
            if error is not None:
                raise
            log.warning("could not release lost episode %s", lease.episode_id, exc_info=True)
        if released:
            self.counters.add(episodes_released=1)
        else:
            self.counters.add(episodes_abandoned=1)

    def hand_back(self, lease: Lease) -> None:
        """A drain stopped the episode: every sample of it that ran has stopped at a turn
        boundary with its last turn checkpointed (or committed, when that turn ended it), so
        its lease goes back, not counted; the next holder resumes from the checkpoints."""
        try:
            self.buffer.release(lease, "its rollout node is draining", counted=False)
        except StaleLeaseError:  # it moved on meanwhile
            return
        except Exception:  # the database is away: the lease expires and is swept instead
            log.warning("could not give back drained episode %s", lease.episode_id, exc_info=True)
            return
        self.counters.add(episodes_handed_back=1)

    def user_failed(
        self, claim: ClaimedEpisode, sample_index: int | None, error: UserCodeError
    ) -> None:
        """User code failed on the episode's input: the episode is released as a counted
        attempt with a backoff (or quarantined), with an ``episode.user_error`` event carrying
        the traceback; the node's breaker is not touched. The guard may pause the task."""
        lease = claim.lease
        log.warning(
            "task %s, episode %s (prompt %s): %s at %s\n%s", claim.task_name, lease.episode_id,
            claim.prompt_index, error.message, error.location or "?", error.trace,
        )  # fmt: skip
        failure = {
            **error.payload(),
            "task": claim.task_name,
            "prompt_index": claim.prompt_index,
            "prompt_excerpt": _excerpt(claim.prompt),
            "sample": sample_index,
            "worker": self.config.name,
        }
        outcome = None
        try:
            outcome = self.buffer.fail_user_code(
                lease, failure, backoff_s=self.config.retry_backoff_s
            )
        except StaleLeaseError:
            pass
        except Exception:  # the database is away: the lease is swept like any other
            log.warning("could not release episode %s", lease.episode_id, exc_info=True)
        if outcome is not None:
            self.counters.add(user_errors=1, episodes_released=1)
        else:
            self.counters.add(user_errors=1, episodes_abandoned=1)
        with self._lock:
            # the guard counts an episode's final outcome (quarantined here), or at once a
            # failure that cannot depend on the input
            final = outcome is not None and outcome.quarantined
            verdict = None
            if final or error.input_independent:
                at = outcome.at if outcome is not None else None
                verdict = self._guard.record(lease.task_id, error, at)
        if verdict is not None:
            self._pause(claim, verdict, error)

    def _pause(self, claim: ClaimedEpisode, verdict: Verdict, error: UserCodeError) -> None:
        """Pause the task (the guard's verdict), unless it was resumed since the failures the
        verdict counts; either way the guard judges the task afresh from here."""
        task_id = claim.lease.task_id
        try:
            result = self.buffer.pause_task(
                task_id,
                verdict.sentence(),
                f"{self.config.name} (user-code guard)",
                {"error": verdict.error, "location": verdict.location, "failed": verdict.failed,
                 "seen": verdict.seen, "signature": error.signature,
                 "input_independent": verdict.input_independent},
                failures_since=verdict.since,
            )  # fmt: skip
        except Exception:
            log.warning("could not pause task %s", claim.task_name, exc_info=True)
            return
        with self._lock:
            self._guard.forget(task_id)  # judged afresh (paused, or resumed since)
        if result == "paused":
            self.counters.add(tasks_paused=1)
            log.error("paused task %s: %s", claim.task_name, verdict.sentence())

    def diverged(
        self, claim: ClaimedEpisode, sample_index: int, why: str, regenerated: int
    ) -> None:
        """An agent's replay diverged: counted, and an event for operators (the sample starts
        again from scratch)."""
        self.counters.add(agent_divergences=1)
        lease = claim.lease
        try:
            self.buffer.event(
                "agent.replay_diverged",
                f"task {claim.task_name}, episode {lease.episode_id}, sample {sample_index}: "
                f"{why}; the sample restarts from scratch",
                {
                    "task": claim.task_name,
                    "episode_id": lease.episode_id,
                    "sample": sample_index,
                    "chat_calls_discarded": regenerated,
                    "worker_id": self.worker_id,
                },
            )
        except Exception:  # the database is away: the count stays in the node's report
            log.warning("could not record a replay divergence", exc_info=True)


def _excerpt(prompt: Any, limit: int = 300) -> str:
    """A prompt as short JSON text for an event (a prompt may be megabytes)."""
    text = json.dumps(prompt, default=str, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."
