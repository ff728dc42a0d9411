"""A rollout node: one inference engine and N concurrent agent loops, fed by the buffer.

``RolloutNode`` is a plain class; ``ray.remote(RolloutNode)`` makes it the Ray actor that
rollcall runs (``rollout_actor``). Its state is disposable: a restarted node registers a new
worker incarnation and gets its work from the database, where requeued episodes carry their
checkpoints. What it guarantees:

- its ``concurrency`` agent loops share the claimed episodes' samples: a group's samples are
  rolled out in parallel by as many loops as are free; a loop claims a new episode only when
  no claimed sample waits for a loop and the claims in flight would not already fill the idle
  loops (a node holds at most one group's worth of samples it cannot start yet), and, after a
  claim found no work, not before ``idle_sleep_s`` (one idle claim per node, not per loop);
- every episode it claims ends in a commit of each sample, or is released (its failure is
  counted; after ``max_attempts`` the buffer quarantines it), or is abandoned because its lease
  moved on (the buffer rejected the write; the new holder continues from the checkpoint); the
  first failure of one of its samples stops the others at their next turn;
- each trajectory is checkpointed through the buffer after every turn, fenced by the lease;
- a heartbeat thread renews the node's leases and reports tokens generated (progress);
- an engine failure (``EngineFailure``: vLLM's EngineCore died or stopped answering, weights
  that failed to load) is not the episodes' fault: their leases are given back without counting
  an attempt. A dead engine ends the node at once: it stops claiming, gives back every lease it
  holds (``Buffer.give_back``, which also marks it dead), and ``run`` raises ``EngineFailure``,
  so the supervisor starts a new node whose claims resume from the checkpoints. The heartbeat
  asks the engine (``failure()``, which never blocks) at every beat, so a death while idle is
  found as fast; weights that failed to load keep the node from claiming until a later
  version loads;
- new weights are loaded between engine calls, so in-flight trajectories continue under the
  new version and record it per turn (partial rollout): every claim carries the job's
  published weights (read after the lease was taken) and the heartbeat looks them up; the node
  loads a newer version before rolling the claim out (``load_weights`` does so on demand).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import socket
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from orchestrator.buffer.service import Buffer
from orchestrator.buffer.types import ClaimedEpisode, Lease
from orchestrator.config import BufferConfig, EngineConfig, HFEngineConfig
from orchestrator.db.engine import IDLE_TX_TIMEOUT_S, Database, open_database
from orchestrator.domain import SampleState, WorkerStatus
from orchestrator.errors import StaleLeaseError
from tasks import registry
from tasks.agent import AgentSpec
from tasks.base import TaskPlugin, TaskSpec
from workers.agents.runtime import AgentRun
from workers.rollout import tools
from workers.rollout.agent import AgentLoop, Limits, Trajectory
from workers.rollout.chat import chat_for
from workers.rollout.engines.base import (
    Engine,
    EngineFailure,
    EngineHealth,
    Generation,
    GenerationRequest,
)
from workers.rollout.engines.batching import BatchingEngine
from workers.rollout.engines.factory import make_engine, preload
from workers.rollout.guard import TaskGuard, Verdict
from workers.rollout.tools import ToolRunner
from workers.rollout.usercode import UserCodeError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeConfig:
    name: str
    model_dir: str
    concurrency: int = 4
    heartbeat_interval_s: float = 2.0
    idle_sleep_s: float = 0.2
    tool_timeout_s: float = 5.0
    limits: Limits = field(default_factory=Limits)
    engine: EngineConfig = field(default_factory=HFEngineConfig)
    seed: int = 0
    threads: int = 0  # torch threads of the engine (0: torch's default)
    # episodes failed in a row after which the node stops claiming, gives its leases back
    # (not counted) and ends, to be restarted: a broken node must not quarantine good inputs
    breaker_failures: int = 3
    # "module:callable[:arg]" applied to the engine once built (``callable(engine[, arg])``): a
    # fault-injection seam for tests and drills (e.g. an engine that fails every call), never
    # set by a config file
    engine_hook: str | None = None
    tool_format: str = "auto"  # the tool-call format (``workers.rollout.toolcalls``)
    chat_template: str | None = None  # a chat template's source instead of the tokenizer's
    endpoint_host: str = "127.0.0.1"  # where agents' OpenAI-compatible endpoint listens
    # trainer.weights: "collective": new versions arrive by broadcast (``receive_weights``);
    # one not received ``weights_grace_s`` after the node saw it published loads from its file
    weights_transport: str = "files"
    weights_grace_s: float = 120.0
    # connections to PostgreSQL, shared by the loops (a connection per loop does not scale:
    # 64 loops x 16 nodes ran a 300-connection server out of connections)
    db_connections: int = 8
    # User code that fails on an episode's input (``workers.rollout.usercode``): the episode is
    # claimable again after retry_backoff_s * 2^(attempts-1) (twice that on this node), and a
    # task whose code fails on most inputs is paused: judged from the final outcomes of the last
    # failing_task_window episodes (at least failing_task_min_episodes; 0: off) that ended on
    # this node (``workers.rollout.guard``)
    retry_backoff_s: float = 2.0
    failing_task_window: int = 32
    failing_task_min_episodes: int = 6
    # PostgreSQL ends a session of the node left idle inside a transaction this long: a node
    # stopped mid-transaction (SIGSTOP, a frozen machine) would otherwise keep its worker row
    # locked, the dead-worker sweep skip it, and the node never be declared dead. The driver
    # sets control_plane.heartbeat_timeout_s.
    db_idle_tx_timeout_s: float = IDLE_TX_TIMEOUT_S


def node_database(
    database_url: str, config: NodeConfig, *, connections: int | None = None
) -> Database:
    """The node's database: a pool of ``db_connections`` (or ``connections``), no overflow; a
    call waits for a free connection (a checkpoint holds one for a few milliseconds). A
    transaction left idle ``db_idle_tx_timeout_s`` is ended by the server."""
    return open_database(
        database_url,
        pool_size=config.db_connections if connections is None else connections,
        max_overflow=0,
        idle_tx_timeout_s=config.db_idle_tx_timeout_s,
    )


@dataclass
class _Work:
    """A claimed episode whose samples the node's agent loops share."""

    claim: ClaimedEpisode
    plugin: TaskPlugin
    spec: TaskSpec
    limits: Limits
    todo: deque[SampleState]  # samples not started yet
    running: int = 0  # samples being rolled out now
    failed: bool = False  # released or abandoned: no further sample starts
    drained: bool = False  # a drain stopped a sample: given back once none runs


class _Guarded:
    """The engine as the agent loops see it: an exception raised inside the engine (not by the
    task's code) becomes ``EngineFailure`` (not fatal), so it is never counted as an attempt of
    the episode; a dead engine's fatal ``EngineFailure`` passes as it is."""

    def __init__(self, engine: Engine) -> None:
        self.inner = engine
        self.tokenizer = engine.tokenizer

    @property
    def version(self) -> int:
        return self.inner.version

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        try:
            return self.inner.generate(requests)
        except EngineFailure:
            raise
        except Exception as e:  # out of memory, a kernel error, a broken engine
            raise EngineFailure(f"the engine raised {type(e).__name__}: {e}", fatal=False) from e

    def load_weights(self, version: int, location: str) -> None:
        self.inner.load_weights(version, location)

    def health(self) -> EngineHealth:
        return self.inner.health()


class LeaseLost(Exception):
    """The node's lease on the episode moved on; its work is abandoned, not committed."""


class Drained(Exception):
    """The node is draining: the sample stops at a turn boundary, its last turn checkpointed,
    and its episode's lease is given back (not counted)."""


@dataclass
class NodeStats:
    episodes_committed: int = 0
    samples_committed: int = 0
    samples_resumed: int = 0
    episodes_released: int = 0
    episodes_abandoned: int = 0
    turns: int = 0
    weight_loads: int = 0
    weight_load_s_last: float = 0.0
    weight_load_s_total: float = 0.0
    agent_calls_replayed: int = 0  # agent tasks: calls answered from the record after a resume
    agent_calls_live: int = 0  # ... calls served now
    agent_generations: int = 0  # ... chat calls that ran the engine
    agent_divergences: int = 0  # ... replays that diverged (the sample restarted from scratch)
    user_errors: int = 0  # episodes failed by user code (the input's fault, not the node's)
    agent_runs_abandoned: int = 0  # agent runs past their timeout that could not be cancelled
    # (their threads are left to end on their own: each one still holds what it holds)
    tasks_paused: int = 0  # tasks this node paused because their code failed on most inputs
    episodes_handed_back: int = 0  # episodes given back at a turn boundary by a drain
    weights_received: int = 0  # versions loaded from a broadcast (collective transport)
    weights_receive_failed: int = 0  # broadcasts that did not complete here


class NodeBroken(EngineFailure):
    """The node's breaker tripped: it failed ``breaker_failures`` episodes in a row. The node
    gives its leases back (not counted) and ends; the supervisor restarts it (counted)."""


class RolloutNode:
    def __init__(
        self, database_url: str, job_id: int, config: NodeConfig, buffer: BufferConfig | None = None
    ) -> None:
        self.config = config
        preload(config.engine)  # before registering: imports stall every thread (see preload)
        self.db = node_database(database_url, config)
        self.buffer = Buffer(self.db, job_id, buffer or BufferConfig())
        self.buffer.beat_db = node_database(database_url, config, connections=1)
        # Registered ``starting`` before the engine loads, and beating from then on: a node
        # whose start is slow (imports, a model load on a busy machine) shows it is alive, and
        # the supervisor tells it from one that never came up.
        self.worker = self.buffer.register_worker(
            config.name, host=socket.gethostname(), pid=os.getpid(), node_id=_ray_node_id(),
            status=WorkerStatus.STARTING,
        )  # fmt: skip
        self.stats = NodeStats()
        self._lock = threading.Lock()  # the stats and the lease sets; never held across I/O
        self._load_lock = threading.Lock()
        self._lost: set[tuple[int, int]] = set()
        self._active: set[tuple[int, int]] = set()
        # Claimed episodes' samples waiting for a loop, and what the loops are doing
        # (``_work_cv`` guards them; ``_lock`` the stats and the lease sets).
        self._work_cv = threading.Condition()
        self._pending: deque[_Work] = deque()
        self._running = 0  # samples being rolled out
        self._claiming = 0  # loops inside a claim
        # samples the last claimed episode brought (claims are one at a time until known)
        self._group_hint = max(1, config.concurrency)
        self._no_work_until = 0.0  # after a claim that found no work, the next one waits
        self._stop = threading.Event()
        self._draining = threading.Event()  # stop at the next turn boundary, give leases back
        # beats go on while a stopping node finishes its episodes (its leases must stay live),
        # and after a run that ended on its own (the node is still up); they end once the node
        # is stopped and no run is active (``_runs``, under ``_runs_lock``)
        self._beats_stop = threading.Event()
        self._runs = 0
        self._runs_lock = threading.Lock()
        self.declared_dead = False
        self._engine_error: str | None = None  # the engine died: the node ends
        self._broken: str | None = None  # the breaker tripped: the node ends
        self._weights_error: str | None = None  # the last load failed: no claims until one works
        self._bad_version = -1  # the version whose load failed (not retried)
        # collective transport: when each newer published version was first seen, the versions
        # whose broadcast failed here (loaded from files at once), and the first check done
        self._seen_at: dict[int, float] = {}
        self._missed: set[int] = set()
        self._checked_once = False
        self._streak = 0  # episodes failed in a row (the breaker)
        # tasks whose code fails on most inputs are paused (under ``_lock``)
        self._guard = TaskGuard(config.failing_task_window, config.failing_task_min_episodes)
        self._probe_tokens = -1  # tokens generated at the last upkeep pass
        self._loading = False  # a weight load is in progress
        self._progress = 0  # probes and weight loads that ended (progress without tokens)
        self._reported_progress = 0
        self._reported_tokens = 0
        self._unknown: set[tuple[int, int]] = set()  # leases held that no loop works on
        self._claims_started = 0  # claims begun (orphans are judged between beats' claims)
        self.orphans_released = 0
        self._reports = 0  # reports made (their sequence numbers)
        self._heartbeat = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._heartbeat.start()
        try:
            self._start_engine()
        except BaseException:
            self._beats_stop.set()
            raise
        self._upkeep = threading.Thread(target=self._tend, name="upkeep", daemon=True)
        self._upkeep.start()

    def _start_engine(self) -> None:
        config = self.config
        engine = make_engine(
            config.engine, config.model_dir, seed=config.seed, threads=config.threads
        )
        if config.engine_hook:  # fault injection (tests, drills): wraps the engine
            module, _, rest = config.engine_hook.partition(":")
            name, _, arg = rest.partition(":")
            hook = getattr(importlib.import_module(module), name)
            engine = hook(engine, arg) if arg else hook(engine)
        self.base_engine = engine
        # The agent loops share one generate call (BatchingEngine), unless the engine batches
        # concurrent requests itself (vLLM): then each loop's request goes to it directly.
        self.batcher: BatchingEngine | None = None
        if not getattr(engine, "batches_itself", False):
            self.batcher = BatchingEngine(engine, max_batch=max(1, config.concurrency))
        # Whatever the engine raises is the engine's failure, not the episode's (not counted)
        self.engine: Engine = _Guarded(self.batcher or engine)
        self.tokenizer = engine.tokenizer
        self.chat = chat_for(self.tokenizer, config.tool_format, config.chat_template)
        self._sync_weights()
        processes = getattr(engine, "processes", None)  # vLLM's own processes
        info = {"engine_processes": processes} if processes else None
        if not self.buffer.mark_worker_alive(self.worker.id, info):
            raise RuntimeError(f"{config.name}: declared dead while its engine started")

    # -- remote API ---------------------------------------------------------------------------

    def worker_id(self) -> int:
        return self.worker.id

    def run(
        self, max_episodes: int | None = None, until_idle_s: float | None = None
    ) -> dict[str, Any]:
        """Run the agent loops until ``max_episodes`` episodes were handled, the buffer had no
        work for ``until_idle_s`` seconds, or ``stop()``."""
        with self._runs_lock:
            self._runs += 1
        try:
            return self._run(max_episodes, until_idle_s)
        finally:
            with self._runs_lock:
                self._runs -= 1
                if self._stop.is_set() and self._runs == 0:
                    self._beats_stop.set()

    def _run(self, max_episodes: int | None, until_idle_s: float | None) -> dict[str, Any]:
        budget = threading.Semaphore(max_episodes) if max_episodes is not None else None
        loops = [
            threading.Thread(target=self._loop, args=(budget, until_idle_s), name=f"agent-{i}")
            for i in range(self.config.concurrency)
        ]
        for t in loops:
            t.start()
        for t in loops:
            t.join()
        if self._engine_error is not None:
            self._beats_stop.set()
            raise EngineFailure(f"{self.config.name}: {self._engine_error}")
        if self._broken is not None:
            self._beats_stop.set()
            raise NodeBroken(f"{self.config.name}: {self._broken}")
        self._beat_once()
        return self.report()

    def load_weights(self, version: int, location: str) -> int:
        with self._load_lock:
            self._load(version, location)
        return version

    def version(self) -> int:
        return self.engine.version

    def report(self) -> dict[str, Any]:
        h, b = self.base_engine.health(), self.batcher
        with self._lock:
            self._reports += 1
            seq = self._reports
        return {
            "worker_id": self.worker.id,
            "report_seq": seq,  # orders this incarnation's reports (a late one is older)
            **asdict(self.stats),
            "version": h.version,
            "tokens_generated": h.tokens_generated,
            # generate calls the engine received and the requests in them
            "engine_batches": b.batches if b else h.requests,
            "engine_batched_requests": b.batched_requests if b else h.requests,
            # context tokens served from the engine's KV caches vs prefilled (engines that say)
            "kv_reused_tokens": getattr(self.base_engine, "reused_tokens", 0),
            "kv_prefilled_tokens": getattr(self.base_engine, "prefilled_tokens", 0),
            # what the control plane costs this node: per buffer operation, its calls, wall and
            # CPU seconds and a latency histogram (orchestrator/buffer/timings.py)
            "buffer_ops": self.buffer.timings.snapshot(),
            "process_cpu_s": time.process_time(),
            "engine_error": self._engine_error,
            "weights_error": self._weights_error,
            "broken": self._broken,
            "orphans_released": self.orphans_released,
        }

    def stop(self) -> None:
        """End the node: a ``run`` in progress finishes its episodes (beating meanwhile) and
        returns, then the beats end; with no run in progress they end now."""
        with self._runs_lock:
            self._stop.set()
            if self._runs == 0:
                self._beats_stop.set()

    def drain(self) -> None:
        """End the node soon, losing no generated token (its machine is being drained, or the
        job's fleet shrinks): it claims nothing more, every sample stops at its next turn
        boundary once that turn is checkpointed (a sample whose turn ends it commits), the
        episodes' leases are given back without counting an attempt, and ``run`` returns."""
        self._draining.set()
        self.stop()
        with self._work_cv:
            self._work_cv.notify_all()

    # -- internals ------------------------------------------------------------------------------

    def _loop(self, budget: threading.Semaphore | None, until_idle_s: float | None) -> None:
        runner = ToolRunner(timeout_s=self.config.tool_timeout_s)
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
                    job = self._admit(claim)
                    if job is None:
                        continue
                idle_since = time.monotonic()
                self._run_sample(*job, runner)
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
            if self._weights_error is not None:  # serve nothing until a later version loads
                with self._work_cv:
                    self._no_work_until = time.monotonic() + self.config.idle_sleep_s
                return True, None
            if budget is not None and not budget.acquire(blocking=False):
                return False, None
            with self._lock:
                self._claims_started += 1
            claim = self.buffer.claim(self.worker.id)
            if claim is not None:
                with self._lock:  # known from here on (the beats renew it and do not orphan it)
                    self._active.add((claim.lease.episode_id, claim.lease.epoch))
                self._load_if_newer(claim.published_weights)
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

    def _next_sample(self) -> tuple[_Work, SampleState] | None:
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

    def _admit(self, claim: ClaimedEpisode) -> tuple[_Work, SampleState] | None:
        """Register a claimed episode: its samples to run become pending for the node's loops;
        the first is returned to the claiming loop (None when none is left to run)."""
        lease = claim.lease
        try:
            plugin = registry.get(claim.plugin)
            spec = plugin.Spec.model_validate(claim.spec)
            tools.preload(type(plugin).__module__)
        except Exception as e:  # the task cannot be read here (its agent does not import):
            log.exception("episode %s cannot be started", lease.episode_id)  # its code's fault
            with self._lock:
                self._active.discard((lease.episode_id, lease.epoch))
            self._user_failed(claim, None, UserCodeError.raised("the task's spec", e))
            return None
        limits = Limits(
            max_turns=spec.max_turns,
            max_tokens_per_turn=self.config.limits.max_tokens_per_turn,
            max_tokens=self.config.limits.max_tokens,
            temperature=self.config.limits.temperature,
        )
        todo = deque(s for s in claim.samples if s.status != "ready")
        work = _Work(claim, plugin, spec, limits, todo)
        with self._work_cv:
            self._active.add((lease.episode_id, lease.epoch))
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

    def _episode(self, claim: ClaimedEpisode, runner: ToolRunner) -> None:
        """Roll out every sample of a claimed episode on the calling thread."""
        job = self._admit(claim)
        while job is not None:
            work = job[0]
            self._run_sample(*job, runner)
            with self._work_cv:
                if work.failed or not work.todo:
                    return
                job = (work, work.todo.popleft())
                work.running += 1
                self._running += 1

    def _run_sample(self, work: _Work, sample: SampleState, runner: ToolRunner) -> None:
        claim, lease = work.claim, work.claim.lease
        try:
            if self._draining.is_set():  # not started: nothing to keep, give it back
                raise Drained(lease.episode_id)
            if sample.checkpoint is not None:
                with self._lock:
                    self.stats.samples_resumed += 1
            loop: AgentLoop | AgentRun
            if isinstance(work.spec, AgentSpec):
                loop = AgentRun(
                    self.engine, self.chat, work.spec, claim.prompt, runner, work.limits,
                    endpoint_host=self.config.endpoint_host,
                    on_divergence=functools.partial(self._diverged, claim, sample.sample_index),
                    episode_id=lease.episode_id, sample_index=sample.sample_index,
                )  # fmt: skip
            else:
                loop = AgentLoop(
                    self.engine, self.tokenizer, work.plugin, work.spec, claim.prompt, runner,
                    work.limits, self.chat,
                )  # fmt: skip
            try:
                outcome = loop.run(
                    resume=sample.checkpoint,
                    on_turn=functools.partial(self._checkpoint, lease, sample.sample_index),
                )
            finally:
                if isinstance(loop, AgentRun):
                    with self._lock:
                        self.stats.agent_calls_replayed += loop.stats.replayed
                        self.stats.agent_calls_live += loop.stats.live
                        self.stats.agent_generations += loop.stats.generated
                        self.stats.agent_runs_abandoned += int(loop.abandoned)
            t = outcome.trajectory
            info = {"turns": outcome.turns, "stop_reason": t.stop_reason, "answer": t.answer}
            if isinstance(loop, AgentRun):
                info |= {"calls": t.state.get("calls", {}), "info": t.state.get("info", {})}
            self.buffer.commit(lease, sample.sample_index, t.payload(), outcome.reward, info)
            with self._lock:
                self.stats.samples_committed += 1
                self._streak = 0
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
                    self._lost.add((lease.episode_id, lease.epoch))
            if first:
                self._user_failed(claim, sample.sample_index, e)
        except EngineFailure as e:  # the engine's failure, not the episode's: not counted
            if e.fatal:
                self._engine_died(str(e))
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
                self._hand_back(lease)

    def _fail(self, work: _Work, error: Exception | None, *, counted: bool = True) -> None:
        """The episode's first failure: its other samples stop (at their next turn) and are
        not started; the lease is released (an error: requeued, counted unless ``counted`` is
        False) or, when it moved on, the work is abandoned."""
        lease = work.claim.lease
        with self._work_cv:
            if work.failed:
                return
            work.failed = True
            work.todo.clear()
            self._lost.add((lease.episode_id, lease.epoch))
        trip = None
        # A failure while the weights are being replaced or failed to load is explained by them
        # (the node already stops claiming until a later version loads): not the breaker's.
        weights = isinstance(error, EngineFailure) and (
            self._weights_error is not None or self._loading
        )
        if error is not None and not weights:
            with self._lock:
                self._streak += 1
                streak = self._streak
            # After a failure, the node itself is suspect: a second failure in a row is not
            # counted against the episode (a poison input fails on every node; a broken node
            # fails every input), and ``breaker_failures`` in a row trip the breaker.
            counted = counted and streak == 1
            if streak >= self.config.breaker_failures:
                trip = f"{streak} episodes failed in a row (last: {type(error).__name__}: {error})"
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
        with self._lock:
            if released:
                self.stats.episodes_released += 1
            else:
                self.stats.episodes_abandoned += 1
        if trip is not None:
            self._give_up(trip, broken=True)

    def _hand_back(self, lease: Lease) -> None:
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
        with self._lock:
            self.stats.episodes_handed_back += 1

    def _user_failed(
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
        with self._lock:
            self.stats.user_errors += 1
            if outcome is not None:
                self.stats.episodes_released += 1
            else:
                self.stats.episodes_abandoned += 1
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
                self.stats.tasks_paused += 1
        if result == "paused":
            log.error("paused task %s: %s", claim.task_name, verdict.sentence())

    def _finish(self, work: _Work) -> None:
        """Called with ``_work_cv`` held when the episode's last sample is done."""
        key = (work.claim.lease.episode_id, work.claim.lease.epoch)
        if not work.failed:
            with self._lock:
                self.stats.episodes_committed += 1
                self._guard.record(work.claim.lease.task_id, None)
        with self._lock:
            self._active.discard(key)
            self._lost.discard(key)

    def _diverged(
        self, claim: ClaimedEpisode, sample_index: int, why: str, regenerated: int
    ) -> None:
        """An agent's replay diverged: counted, and an event for operators (the sample starts
        again from scratch)."""
        with self._lock:
            self.stats.agent_divergences += 1
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
                    "worker_id": self.worker.id,
                },
            )
        except Exception:  # the database is away: the count stays in the node's report
            log.warning("could not record a replay divergence", exc_info=True)

    def _checkpoint(self, lease: Lease, sample_index: int, t: Trajectory) -> None:
        with self._lock:
            self.stats.turns += 1
            lost = (lease.episode_id, lease.epoch) in self._lost
        if lost:
            raise LeaseLost(lease.episode_id)
        if not t.finished:  # the final state goes in with the commit
            self.buffer.checkpoint(lease, sample_index, t.payload())
            if self._draining.is_set():  # the turn is kept: stop here, the lease goes back
                raise Drained(lease.episode_id)

    def _sync_weights(self) -> None:
        """Load the job's latest published weights if they are newer than the engine's."""
        self._load_if_newer(self.buffer.published_weights())

    def _load_if_newer(self, published: tuple[int, str] | None) -> None:
        if published is None or published[0] <= max(self.engine.version, self._bad_version):
            self._checked_once = True
            return
        if self._awaiting_broadcast(published[0]):
            return
        with self._load_lock:
            if published[0] > max(self.engine.version, self._bad_version):
                self._loading = True
                try:
                    self._load(*published)
                    self._weights_error = None
                except FileNotFoundError:  # pruned while we looked: the next one will be there
                    log.warning("weights of version %s are gone; waiting for the next", published)
                except EngineFailure as e:
                    if e.fatal:
                        self._engine_died(str(e))
                        return
                    self._weights_failed(published[0], e)
                except Exception as e:  # a corrupt or incomplete file: wait for the next one
                    self._weights_failed(published[0], e)
                finally:
                    self._loading = False

    def _awaiting_broadcast(self, version: int) -> bool:
        """Collective transport: a version published while this node runs arrives by
        broadcast; its file is loaded only when the broadcast failed here, or has not come
        ``weights_grace_s`` after the version was first seen. The first check after the node
        starts loads from the file at once (catching up)."""
        if self.config.weights_transport != "collective":
            return False
        first = not self._checked_once
        self._checked_once = True
        if first or version in self._missed:
            return False
        seen = self._seen_at.setdefault(version, time.monotonic())
        return time.monotonic() - seen < self.config.weights_grace_s

    def weights_missed(self, version: int) -> None:
        """Collective transport: the driver says this node did not get ``version`` by
        broadcast; it loads the version's file at its next weight check."""
        self._missed.add(version)

    def receive_weights(self, offer: dict[str, Any]) -> dict[str, Any]:
        """Collective transport: join the offer's group and receive its version, then load it
        in place (the engine's lock, as a file load). A broadcast that fails here leaves the
        engine's weights as they were and the version to its file (at the node's next weight
        check). Returns what happened: ``{"loaded": bool, "error": str | None, ...}``."""
        from workers import collective

        # A member always takes part (the group needs every rank), also when it has the
        # version already (from its file, after a failed attempt): it then only discards it.
        o = collective.Offer.from_json(offer)
        t0 = time.perf_counter()
        try:
            receive = getattr(self.base_engine, "receive_weights", None)
            if receive is not None:  # the engine receives in its own process (vLLM's worker)
                with self._load_lock:
                    self._loading = True
                    try:
                        receive(o, who=self.config.name, address=collective.local_address())
                    finally:
                        self._loading = False
                    loaded = True
            else:
                staged = collective.receive(o, who=self.config.name)
                with self._load_lock:
                    loaded = o.version > self.engine.version
                    if loaded:
                        self._loading = True
                        try:
                            load_state = getattr(self.base_engine, "load_state", None)
                            if load_state is None:
                                raise collective.BroadcastFailed(
                                    f"the {type(self.base_engine).__name__} engine takes no "
                                    "broadcast weights"
                                )
                            load_state(o.version, staged)
                        finally:
                            self._loading = False
        except collective.BroadcastFailed as e:
            self._missed.add(o.version)
            with self._lock:
                self.stats.weights_receive_failed += 1
            log.warning("%s: %s; loading it from its file instead", self.config.name, e)
            return {"loaded": False, "error": str(e)}
        if not loaded:  # had it already
            return {"loaded": False, "error": None, "already": True}
        took = time.perf_counter() - t0
        with self._lock:
            self._progress += 1
            self.stats.weights_received += 1
            self.stats.weight_loads += 1
            self.stats.weight_load_s_last = took
            self.stats.weight_load_s_total += took
        self._weights_error = None
        return {"loaded": True, "error": None, "seconds": took}

    def _weights_failed(self, version: int, error: Exception) -> None:
        """A load failed inside the engine, which now serves nothing (its weights may be half
        replaced): claim nothing until a later version loads."""
        self._bad_version = version
        self._weights_error = f"version {version}: {type(error).__name__}: {error}"
        log.error("loading weights failed (%s); waiting for the next version", self._weights_error)

    def _engine_died(self, reason: str) -> None:
        """The engine is dead: stop claiming, give back every lease at once (not counted as
        attempts) and end; ``run`` raises so the supervisor restarts the node."""
        self._give_up(reason, broken=False)

    def _give_up(self, reason: str, *, broken: bool) -> None:
        """The engine died, or (``broken``) the breaker tripped: stop claiming, give back every
        lease at once (not counted as attempts), with an event, and end: ``run`` raises, so the
        supervisor restarts the node (a new engine, counted against the slot's budget)."""
        with self._lock:
            if self._engine_error is not None or self._broken is not None:
                return
            if broken:
                self._broken = reason
            else:
                self._engine_error = reason
        what = "breaker tripped" if broken else "engine failed"
        log.error("%s: %s (%s); giving back its episodes", self.config.name, what, reason)
        self._stop.set()
        with self._work_cv:
            self._work_cv.notify_all()
        kind = "worker.breaker_tripped" if broken else "worker.engine_failed"
        try:
            self.buffer.give_back(self.worker.id, reason, kind)
        except Exception:  # the database is away: the sweep requeues them once it is back
            log.warning("could not give back the leases of a broken node", exc_info=True)

    def _load(self, version: int, location: str) -> None:
        t0 = time.perf_counter()
        self.engine.load_weights(version, location)
        took = time.perf_counter() - t0
        with self._lock:
            self._progress += 1
            self.stats.weight_loads += 1
            self.stats.weight_load_s_last = took
            self.stats.weight_load_s_total += took

    def _beat_once(self) -> None:
        """One heartbeat: liveness, lease renewal and the progress made since the last beat.
        It reads counters only: it never waits on the engine, a weight load or an agent loop,
        so a slow or busy node keeps beating (a hung one stops making progress instead)."""
        engine = getattr(self, "base_engine", None)
        tokens = engine.health().tokens_generated if engine is not None else 0
        version = engine.version if engine is not None else None
        with self._lock:  # only episodes admitted before the beat's query can be missing from it
            before = set(self._active)
            progress = self._progress
            claims = self._claims_started
        alive, leases = self.buffer.beat(
            self.worker.id,
            tokens - self._reported_tokens,
            loaded_version=version,
            progress=progress != self._reported_progress,
        )
        held = set(leases)
        self._reported_tokens = tokens
        self._reported_progress = progress
        with self._lock:
            self._lost |= {k for k in before & self._active if k not in held}
            # A lease the database says this node holds but no loop works on (a claim whose
            # answer was lost after the database committed it; a loop that died holding it)
            # is an orphan: seen at two beats in a row with no claim begun between them, it
            # is given back (not counted) instead of being renewed for the node's whole life.
            unknown = {k for k in held if k not in self._active}
            quiet = claims == self._claims_started and not self._claiming_now()
            orphans = (unknown & self._unknown) if quiet else set()
            self._unknown = unknown
        for episode_id, epoch in sorted(orphans):
            self._release_orphan(episode_id, epoch)
        if not alive:  # declared dead (e.g. after a hang): stop; a new incarnation takes over
            log.warning("worker %s was declared dead; stopping", self.worker.id)
            self.declared_dead = True
            self._stop.set()
            self._beats_stop.set()

    def _claiming_now(self) -> bool:
        return self._claiming > 0  # a claim in flight may bring a lease not yet admitted

    def _release_orphan(self, episode_id: int, epoch: int) -> None:
        lease = Lease(episode_id, 0, epoch, self.worker.id)
        try:
            self.buffer.release(lease, "orphan lease: the node works on no such episode",
                                counted=False)  # fmt: skip
        except StaleLeaseError:
            return
        except Exception:
            log.warning("could not give back orphan lease %s", episode_id, exc_info=True)
            return
        with self._lock:
            self.orphans_released += 1
        log.warning("gave back orphan lease of episode %s (epoch %s)", episode_id, epoch)

    def _probe(self) -> None:
        """When idle, or busy but without a token generated since the last pass (the loops wait
        on user code), a one-token generation proves the engine still works (progress). It runs
        on the upkeep thread: a hung engine blocks it, so progress stops (not the beats) and
        the control plane declares the node hung after ``progress_timeout_s``."""
        tokens = self.base_engine.health().tokens_generated
        with self._lock:
            idle = not self._active
        # idle, or busy without generating (its loops wait on the user's code: slow tools,
        # synchronous work in an agent): the probe shows the engine itself still works
        stalled, self._probe_tokens = tokens == self._probe_tokens, tokens
        if idle or stalled:
            probe = getattr(self.base_engine, "probe", None)
            if probe is not None:  # the engine's own probe (works while weights are broken)
                probe()
            else:
                eos = self.tokenizer.eos_token_id or 0
                self.engine.generate([GenerationRequest([eos], max_new_tokens=1)])
            with self._lock:
                self._progress += 1

    def _beat(self) -> None:
        """The heartbeat thread: beats only (see ``_beat_once``)."""
        while not self._beats_stop.wait(self.config.heartbeat_interval_s):
            try:
                self._beat_once()
            except Exception:  # a missed beat is survivable; the lease budget covers it
                log.exception("heartbeat failed")

    def _tend(self) -> None:
        """The upkeep thread: asks the engine whether it died (never blocks), probes it when
        idle, and loads newer weights. It may wait on the engine; the beats do not."""
        while not self._beats_stop.wait(self.config.heartbeat_interval_s):
            try:
                failure = getattr(self.base_engine, "failure", None)
                reason = failure() if failure is not None else None
                if reason is not None:
                    self._engine_died(reason)
                    continue
                if self._stop.is_set():
                    continue
                self._probe()
                self._sync_weights()
            except EngineFailure as e:
                if e.fatal:
                    self._engine_died(str(e))
            except Exception:
                log.exception("upkeep failed")


def _excerpt(prompt: Any, limit: int = 300) -> str:
    """A prompt as short JSON text for an event (a prompt may be megabytes)."""
    import json

    text = json.dumps(prompt, default=str, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _ray_node_id() -> str | None:
    try:
        import ray

        if ray.is_initialized():
            return str(ray.get_runtime_context().get_node_id())
    except Exception:
        return None
    return None


def rollout_actor(
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    resources: dict[str, float] | None = None,
    scheduling_strategy: Any = None,
) -> Any:
    """The Ray actor class for rollout nodes. Threaded, so ``stop``, ``report`` and
    ``load_weights`` run while ``run`` does. Ray does not restart it: the driver's supervisor
    does, with backoff and a budget (a new incarnation rebuilds from the database).
    ``scheduling_strategy``: where Ray places it (the driver: the slot's reserved bundle,
    ``orchestrator/runner/placement.py``); None: anywhere with room."""
    import ray

    placement = {} if scheduling_strategy is None else {"scheduling_strategy": scheduling_strategy}
    return ray.remote(  # type: ignore[call-overload]
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        resources=resources or {},
        max_restarts=0,
        max_task_retries=0,
        max_concurrency=8,
        **placement,
    )(RolloutNode)
