"""A rollout node's sample scheduler: its ``concurrency`` agent loops and the samples they share.

A group's samples are rolled out in parallel by as many loops as are free; a loop claims a new
episode only when no claimed sample waits for a loop and the claims in flight would not already
fill the idle loops (a node holds at most one group's worth of samples it cannot start yet),
and, after a claim found no work, not before ``idle_sleep_s`` (one idle claim per node, not per
loop). Each sample's trajectory is checkpointed through the buffer after every turn, fenced by
the lease; the first failure of one of an episode's samples stops the others at their next
turn. The scheduler's state (the claimed episodes' samples waiting for a loop, what the loops
are doing) is under its own condition, ``_work_cv``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollcall.orchestrator.buffer.rollout import RolloutBuffer
from rollcall.orchestrator.buffer.types import ClaimedEpisode, Lease
from rollcall.orchestrator.domain import SampleState
from rollcall.orchestrator.errors import StaleLeaseError
from rollcall.orchestrator.inputs import prompt_problem
from rollcall.tasks import registry
from rollcall.tasks.agent import validated_once
from rollcall.tasks.base import Task, TaskSpec
from rollcall.workers.episode import tools
from rollcall.workers.episode.engine import EngineFailure
from rollcall.workers.episode.play import player
from rollcall.workers.episode.tools import ToolRunner
from rollcall.workers.episode.trajectory import Limits, Trajectory
from rollcall.workers.episode.usercode import UserCodeError
from rollcall.workers.rollout.breaker import Breaker
from rollcall.workers.rollout.enginehost import EngineHost
from rollcall.workers.rollout.leases import LeaseBook
from rollcall.workers.rollout.outcomes import Outcomes
from rollcall.workers.rollout.stats import Counters
from rollcall.workers.rollout.weightsync import WeightSync

if TYPE_CHECKING:
    from rollcall.workers.rollout.node import NodeConfig

log = logging.getLogger(__name__)


@dataclass
class Work:
    """A claimed episode whose samples the node's agent loops share."""

    claim: ClaimedEpisode
    plugin: Task
    spec: TaskSpec
    limits: Limits
    todo: deque[SampleState]  # samples not started yet
    running: int = 0  # samples being rolled out now
    failed: bool = False  # released or abandoned: no further sample starts
    drained: bool = False  # a drain stopped a sample: given back once none runs


class LeaseLost(Exception):
    """The node's lease on the episode moved on; its work is abandoned, not committed."""


class Drained(Exception):
    """The node is draining: the sample stops at a turn boundary, its last turn checkpointed,
    and its episode's lease is given back (not counted)."""


class SampleScheduler:
    """The node's agent loops: claims, admission of claimed episodes, and each sample's
    rollout. ``stop``: claim nothing more; ``draining``: also stop every sample at its next
    turn boundary."""

    def __init__(
        self,
        config: NodeConfig,
        buffer: RolloutBuffer,
        worker_id: int,
        host: EngineHost,
        leases: LeaseBook,
        counters: Counters,
        breaker: Breaker,
        weights: WeightSync,
        outcomes: Outcomes,
        *,
        stop: threading.Event,
        draining: threading.Event,
    ) -> None:
        self.config = config
        self.buffer = buffer
        self.worker_id = worker_id
        self.host = host
        self.leases = leases
        self.counters = counters
        self.breaker = breaker
        self.weights = weights
        self.outcomes = outcomes
        self._stop = stop
        self._draining = draining
        # Claimed episodes' samples waiting for a loop, and what the loops are doing (under
        # ``_work_cv``).
        self._work_cv = threading.Condition()
        self._pending: deque[Work] = deque()
        self._running = 0  # samples being rolled out
        self._claiming = 0  # loops inside a claim
        # samples the last claimed episode brought (claims are one at a time until known)
        self._group_hint = max(1, config.concurrency)
        self._no_work_until = 0.0  # after a claim that found no work, the next one waits

    def run(self, max_episodes: int | None, until_idle_s: float | None) -> None:
        """Run the agent loops until ``max_episodes`` episodes were handled, the buffer had no
        work for ``until_idle_s`` seconds, or the node stops."""
        budget = threading.Semaphore(max_episodes) if max_episodes is not None else None
        loops = [
            threading.Thread(target=self._loop, args=(budget, until_idle_s), name=f"agent-{i}")
            for i in range(self.config.concurrency)
        ]
        for t in loops:
            t.start()
        for t in loops:
            t.join()

    def wake(self) -> None:
        """Wake the loops waiting for work (the node stops, or drains)."""
        with self._work_cv:
            self._work_cv.notify_all()

    def claiming_now(self) -> bool:
        return self._claiming > 0  # a claim in flight may bring a lease not yet admitted

    def _loop(self, budget: threading.Semaphore | None, until_idle_s: float | None) -> None:
        runner = ToolRunner(
            timeout_s=self.config.tool_timeout_s,
            sandbox=self.config.tool_sandbox,
            observation_bytes=self.config.input_limits.observation_bytes,
        )
        idle_since = time.monotonic()
        try:
            while True:
                job = self._next_sample()
                if job is None:  # nothing pending: this loop claims a new episode
                    go_on, claim = self._claim(budget)
                    if not go_on:
                        return
                    if claim is None:
                        idle_s = time.monotonic() - idle_since
                        if until_idle_s is not None and idle_s > until_idle_s:
                            return
                        continue
                    job = self.admit(claim)
                    if job is None:
                        continue
                idle_since = time.monotonic()
                self.run_sample(*job, runner)
        except BaseException:  # a dead loop's episode is released by the lease reconciliation
            log.exception("agent loop died")
        finally:
            runner.close()

    def _claim(self, budget: threading.Semaphore | None) -> tuple[bool, ClaimedEpisode | None]:
        """One claim by a loop that ``_next_sample`` let claim: (False, None) when the loop
        stops (stop requested, episode budget spent), else (True, the episode or None: no
        work, and the whole node waits ``idle_sleep_s`` before its next claim)."""
        try:
            if self._stop.is_set():
                return False, None
            if self.weights.error is not None:  # serve nothing until a later version loads
                with self._work_cv:
                    self._no_work_until = time.monotonic() + self.config.idle_sleep_s
                return True, None
            if budget is not None and not budget.acquire(blocking=False):
                return False, None
            self.leases.claim_started()
            claim = self.buffer.claim(self.worker_id)
            if claim is not None:
                # known from here on (the beats renew it and do not orphan it)
                self.leases.admit((claim.lease.episode_id, claim.lease.epoch))
                self.weights.load_if_newer(claim.published_weights)
            if claim is None:
                if budget is not None:
                    budget.release()
                with self._work_cv:
                    self._no_work_until = time.monotonic() + self.config.idle_sleep_s
            return True, claim
        finally:
            with self._work_cv:
                self._claiming -= 1
                self._work_cv.notify_all()

    def _next_sample(self) -> tuple[Work, SampleState] | None:
        """A pending sample of a claimed episode (taken: it now counts as running), or None
        when this loop should claim a new episode (then counted in ``_claiming``). A loop
        waits instead of claiming while the claims in flight will bring enough samples for
        the idle loops (so a node never claims more than it can start), and for
        ``idle_sleep_s`` after a claim found no work (one idle claim per node, not per loop)."""
        with self._work_cv:
            while True:
                while self._pending:
                    work = self._pending[0]
                    if work.failed or not work.todo:
                        self._pending.popleft()
                        continue
                    sample = work.todo.popleft()
                    work.running += 1
                    self._running += 1
                    return work, sample
                if self._stop.is_set():
                    self._claiming += 1
                    return None
                wait = self._no_work_until - time.monotonic()
                idle = self.config.concurrency - self._running
                if wait <= 0 and self._claiming * self._group_hint < idle:
                    self._claiming += 1
                    return None
                self._work_cv.wait(timeout=wait if wait > 0 else self.config.idle_sleep_s)

    def admit(self, claim: ClaimedEpisode) -> tuple[Work, SampleState] | None:
        """Register a claimed episode: its samples to run become pending for the node's loops;
        the first is returned to the claiming loop (None when none is left to run)."""
        lease = claim.lease
        key = (lease.episode_id, lease.epoch)
        try:
            plugin = registry.get(claim.plugin)
            spec = validated_once(plugin.Spec, claim.spec)  # file I/O: once per node
            tools.preload(type(plugin).__module__)
        except Exception as e:  # the task cannot be read here (its agent does not import):
            log.exception("episode %s cannot be started", lease.episode_id)  # its code's fault
            self.leases.discard(key)
            self.outcomes.user_failed(claim, None, UserCodeError.raised("the task's spec", e))
            return None
        problem = prompt_problem(claim.prompt, self.config.input_limits.prompt_bytes)
        if problem is not None:  # the input's fault, said in one sentence; the job goes on
            self.leases.discard(key)
            self.outcomes.user_failed(claim, None, UserCodeError(problem, kind="limit"))
            return None
        inputs = self.config.input_limits
        limits = Limits(
            max_turns=spec.max_turns,
            max_tokens_per_turn=self.config.limits.max_tokens_per_turn,
            max_tokens=self.config.limits.max_tokens,
            temperature=self.config.limits.temperature,
            tool_arguments_bytes=inputs.tool_arguments_bytes,
            observation_bytes=inputs.observation_bytes,
            step_result_bytes=inputs.step_result_bytes,
            request_body_bytes=inputs.request_body_bytes,
            network=claim.task_name in self.config.tool_sandbox.network_tasks,
        )
        todo = deque(s for s in claim.samples if s.status != "ready")
        work = Work(claim, plugin, spec, limits, todo)
        with self._work_cv:
            self.leases.admit(key)
            self._group_hint = max(1, claim.group_size)
            if not todo:
                self._finish(work)
                return None
            first = todo.popleft()
            work.running += 1
            self._running += 1
            if todo:
                self._pending.append(work)
                self._work_cv.notify_all()
        return work, first

    def run_sample(self, work: Work, sample: SampleState, runner: ToolRunner) -> None:
        """Roll out one sample of an admitted episode (taken by this loop: counted running)."""
        claim, lease = work.claim, work.claim.lease
        host = self.host
        try:
            if self._draining.is_set():  # not started: nothing to keep, give it back
                raise Drained(lease.episode_id)
            if sample.checkpoint is not None:
                self.counters.add(samples_resumed=1)
            loop = player(
                host.engine, host.chat, work.plugin, work.spec, claim.prompt, runner,
                work.limits, endpoint_host=self.config.endpoint_host,
                on_divergence=functools.partial(
                    self.outcomes.diverged, claim, sample.sample_index
                ),
                episode_id=lease.episode_id, sample_index=sample.sample_index,
            )  # fmt: skip
            try:
                outcome = loop.run(
                    resume=sample.checkpoint,
                    on_turn=functools.partial(self._checkpoint, lease, sample.sample_index),
                )
            finally:
                self.counters.add(
                    agent_calls_replayed=loop.stats.replayed,
                    agent_calls_live=loop.stats.live,
                    agent_generations=loop.stats.generated,
                    agent_runs_abandoned=int(loop.abandoned),
                )
            t = outcome.trajectory
            info = {"turns": outcome.turns, "stop_reason": t.stop_reason, "answer": t.answer}
            info |= {"calls": t.state.get("calls", {}), "info": t.state.get("info", {})}
            self.buffer.commit(lease, sample.sample_index, t.payload(), outcome.reward, info)
            self.counters.add(samples_committed=1)
            self.breaker.succeeded()
        except Drained:  # stopped at a turn boundary; the lease goes back once none runs
            with self._work_cv:
                work.drained = True
                work.todo.clear()
        except (LeaseLost, StaleLeaseError):
            self._fail(work, None)
        except UserCodeError as e:  # the input's fault: counted, never the breaker's
            with self._work_cv:
                first = not work.failed
                if first:
                    work.failed = True
                    work.todo.clear()
                    self.leases.lose((lease.episode_id, lease.epoch))
            if first:
                self.outcomes.user_failed(claim, sample.sample_index, e)
        except EngineFailure as e:  # the engine's failure, not the episode's: not counted
            if e.fatal:
                self.breaker.engine_died(str(e))
            self._fail(work, e, counted=False)
        except Exception as e:  # a failure of this episode's rollout: give it back, counted
            log.exception("episode %s failed", lease.episode_id)
            self._fail(work, e)
        except BaseException as e:  # the loop itself dies: give the episode back, not counted
            self._fail(work, EngineFailure(f"agent loop died: {e!r}", fatal=False), counted=False)
            raise
        finally:
            hand_back = False
            with self._work_cv:
                work.running -= 1
                self._running -= 1
                if work.running == 0 and work.drained and not work.failed:
                    work.failed = True  # not committed: given back below
                    hand_back = True
                if work.running == 0 and (work.failed or not work.todo):
                    self._finish(work)
                self._work_cv.notify_all()
            if hand_back:
                self.outcomes.hand_back(lease)

    def _fail(self, work: Work, error: Exception | None, *, counted: bool = True) -> None:
        """The episode's first failure: its other samples stop (at their next turn) and are
        not started; the lease is released (an error: requeued, counted unless ``counted`` is
        False) or, when it moved on, the work is abandoned."""
        lease = work.claim.lease
        with self._work_cv:
            if work.failed:
                return
            work.failed = True
            work.todo.clear()
            self.leases.lose((lease.episode_id, lease.epoch))
        trip = None
        # A failure while the weights are being replaced or failed to load is explained by them
        # (the node already stops claiming until a later version loads): not the breaker's.
        if error is not None and not self.weights.explains(error):
            counted, trip = self.breaker.failed(error, counted)
        self.outcomes.release(lease, error, counted=counted)
        if trip is not None:
            self.breaker.trip(trip)

    def _finish(self, work: Work) -> None:
        """Called with ``_work_cv`` held when the episode's last sample is done."""
        lease = work.claim.lease
        if not work.failed:
            self.outcomes.committed(lease.task_id)
        self.leases.finish((lease.episode_id, lease.epoch))

    def _checkpoint(self, lease: Lease, sample_index: int, t: Trajectory) -> None:
        self.counters.add(turns=1)
        if self.leases.is_lost((lease.episode_id, lease.epoch)):
            raise LeaseLost(lease.episode_id)
        if not t.finished:  # the final state goes in with the commit
            self.buffer.checkpoint(lease, sample_index, t.payload())
            if self._draining.is_set():  # the turn is kept: stop here, the lease goes back
                raise Drained(lease.episode_id)
