"""A rollout node: one inference engine and N concurrent agent loops, fed by the buffer.

``RolloutNode`` is a plain class; ``ray.remote(RolloutNode)`` makes it the Ray actor that
rollcall runs (``rollout_actor``). Its state is disposable: a restarted node registers a new
worker incarnation and gets its work from the database, where requeued episodes carry their
checkpoints. The node is the Ray face (its remote methods, its lifecycle: stop, drain, the end
of its threads) over its concerns, each a module of its own with its own state and lock:

- ``scheduler.py``: its ``concurrency`` agent loops share the claimed episodes' samples: a
  group's samples are rolled out in parallel by as many loops as are free; a loop claims a new
  episode only when no claimed sample waits for a loop and the claims in flight would not
  already fill the idle loops (a node holds at most one group's worth of samples it cannot
  start yet), and, after a claim found no work, not before ``idle_sleep_s`` (one idle claim per
  node, not per loop); each trajectory is checkpointed through the buffer after every turn,
  fenced by the lease;
- ``outcomes.py``: every episode it claims ends in a commit of each sample, or is released (its
  failure is counted; after ``max_attempts`` the buffer quarantines it), or is abandoned because
  its lease moved on (the buffer rejected the write; the new holder continues from the
  checkpoint); the first failure of one of its samples stops the others at their next turn;
  user code that fails on its input is the episode's failure, and may pause its task;
- ``leases.py``: a heartbeat thread renews the node's leases and reports tokens generated and
  other progress; it reads counters only, never waiting on the engine (nor does it read the
  published weights: the upkeep thread does); leases the node holds but no loop works on are
  given back (orphans);
- ``breaker.py``: an engine failure (``EngineFailure``: vLLM's EngineCore died or stopped
  answering, weights that failed to load) is not the episodes' fault: their leases are given
  back without counting an attempt (the engine guard, ``enginehost.py``, makes whatever the
  engine raises such a failure). A dead engine ends the node at once: it stops claiming, gives
  back every lease it holds (``Buffer.give_back``, which also marks it dead), and ``run``
  raises ``EngineFailure``, so the supervisor starts a new node whose claims resume from the
  checkpoints; ``breaker_failures`` episodes failed in a row do the same (``NodeBroken``);
- ``upkeep.py``: the upkeep thread asks the engine whether it died (``failure()``, which never
  blocks) at every pass, so a death while idle is found as fast; it probes an idle engine and
  looks up the job's published weights, loading a newer version;
- ``weightsync.py``: new weights are loaded between engine calls, so in-flight trajectories
  continue under the new version and record it per turn (partial rollout): every claim carries
  the job's published weights (read after the lease was taken), loaded before the claim is
  rolled out, and the upkeep thread looks them up (``load_weights`` loads on demand); with the
  collective transport a version arrives by broadcast (``receive_weights``) and its file is the
  fallback. Weights that failed to load keep the node from claiming until a later version
  loads;
- ``stats.py``: the counters the node's ``report`` returns.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from rollcall.orchestrator import stacks
from rollcall.orchestrator.buffer.rollout import RolloutBuffer
from rollcall.orchestrator.config import (
    BufferConfig,
    EngineConfig,
    HFEngineConfig,
    InputLimitsConfig,
    ToolSandboxConfig,
)
from rollcall.orchestrator.db.engine import IDLE_TX_TIMEOUT_S, Database, open_database
from rollcall.orchestrator.domain import WorkerStatus
from rollcall.workers.episode import tools
from rollcall.workers.episode.trajectory import Limits
from rollcall.workers.rollout.breaker import Breaker
from rollcall.workers.rollout.enginehost import EngineHost
from rollcall.workers.rollout.engines.factory import preload
from rollcall.workers.rollout.leases import Heartbeat, LeaseBook
from rollcall.workers.rollout.outcomes import Outcomes
from rollcall.workers.rollout.scheduler import SampleScheduler
from rollcall.workers.rollout.stats import Counters
from rollcall.workers.rollout.upkeep import Upkeep
from rollcall.workers.rollout.weightsync import WeightSync

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
    lora_rank: int | None = None  # the trainer publishes LoRA adapters of this rank
    # episodes failed in a row after which the node stops claiming, gives its leases back
    # (not counted) and ends, to be restarted: a broken node must not quarantine good inputs
    breaker_failures: int = 3
    # "module:callable[:arg]" applied to the engine once built (``callable(engine[, arg])``): a
    # fault-injection seam for tests and drills (e.g. an engine that fails every call), never
    # set by a config file
    engine_hook: str | None = None
    tool_format: str = "auto"  # the tool-call format (``rollcall.workers.episode.toolcalls``)
    chat_template: str | None = None  # a chat template's source instead of the tokenizer's
    endpoint_host: str = "127.0.0.1"  # where agents' OpenAI-compatible endpoint listens
    # trainer.weights: "collective": new versions arrive by broadcast (``receive_weights``);
    # one not received ``weights_grace_s`` after the node saw it published loads from its file
    weights_transport: str = "files"
    weights_grace_s: float = 120.0
    # connections to PostgreSQL, shared by the loops (a connection per loop does not scale:
    # 64 loops x 16 nodes ran a 300-connection server out of connections)
    db_connections: int = 8
    # User code that fails on an episode's input (``rollcall.workers.episode.usercode``): the
    # episode is
    # claimable again after retry_backoff_s * 2^(attempts-1) (twice that on this node), and a
    # task whose code fails on most inputs is paused: judged from the final outcomes of the last
    # failing_task_window episodes (at least failing_task_min_episodes; 0: off) that ended on
    # this node (``rollcall.workers.rollout.guard``)
    retry_backoff_s: float = 2.0
    failing_task_window: int = 32
    failing_task_min_episodes: int = 6
    # PostgreSQL ends a session of the node left idle inside a transaction this long: a node
    # stopped mid-transaction (SIGSTOP, a frozen machine) would otherwise keep its worker row
    # locked, the dead-worker sweep skip it, and the node never be declared dead. The driver
    # sets control_plane.heartbeat_timeout_s.
    db_idle_tx_timeout_s: float = IDLE_TX_TIMEOUT_S
    # how tools run (rollout.tool_sandbox) and the most bytes of each untrusted input
    # (rollout.input_limits): docs/security.md
    tool_sandbox: ToolSandboxConfig = field(default_factory=ToolSandboxConfig)
    input_limits: InputLimitsConfig = field(default_factory=InputLimitsConfig)


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


class RolloutNode:
    def __init__(
        self, database_url: str, job_id: int, config: NodeConfig, buffer: BufferConfig | None = None
    ) -> None:
        self.config = config
        self._profile = stacks.sampler_from_env("node")  # ROLLCALL_PROFILE_DIR: where its CPU goes
        preload(config.engine)  # before registering: imports stall every thread (see preload)
        self.db = node_database(database_url, config)
        self.buffer = RolloutBuffer(self.db, job_id, buffer or BufferConfig())
        self.buffer.beat_db = node_database(database_url, config, connections=1)
        # Registered ``starting`` before the engine loads, and beating from then on: a node
        # whose start is slow (imports, a model load on a busy machine) shows it is alive, and
        # the supervisor tells it from one that never came up.
        self.worker = self.buffer.register_worker(
            config.name, host=socket.gethostname(), pid=os.getpid(), node_id=_ray_node_id(),
            status=WorkerStatus.STARTING,
        )  # fmt: skip
        self._stop = threading.Event()
        self._draining = threading.Event()  # stop at the next turn boundary, give leases back
        # beats go on while a stopping node finishes its episodes (its leases must stay live),
        # and after a run that ended on its own (the node is still up); they end once the node
        # is stopped and no run is active (``_runs``, under ``_runs_lock``)
        self._beats_stop = threading.Event()
        self._runs = 0
        self._runs_lock = threading.Lock()
        self.declared_dead = False
        # The node's concerns, each with its own state and lock.
        worker_id, buf = self.worker.id, self.buffer
        self.counters = Counters()
        self.host = EngineHost(config)  # built by ``_start_engine``
        self.leases = LeaseBook(buf, worker_id)
        self.breaker = Breaker(config.name, config.breaker_failures, buf, worker_id, self._halt)
        self.weights = WeightSync(config, buf, self.host, self.counters, self.breaker)
        self.outcomes = Outcomes(config, buf, worker_id, self.counters)
        self.scheduler = SampleScheduler(
            config, buf, worker_id, self.host, self.leases, self.counters, self.breaker,
            self.weights, self.outcomes, stop=self._stop, draining=self._draining,
        )  # fmt: skip
        self.heartbeat = Heartbeat(
            buf, worker_id, config.heartbeat_interval_s, self.leases, self.counters, self.host,
            claiming=self.scheduler.claiming_now, on_dead=self._declared_dead,
            stop=self._beats_stop,
        )  # fmt: skip
        self.upkeep = Upkeep(
            config.heartbeat_interval_s, self.host, self.leases, self.counters, self.weights,
            self.breaker, stop=self._stop, beats_stop=self._beats_stop,
        )  # fmt: skip
        self.heartbeat.start()
        try:
            self._start_engine()
        except BaseException:
            self._beats_stop.set()
            raise
        self.upkeep.start()

    def _start_engine(self) -> None:
        config = self.config
        self.host.start()
        self.weights.sync()
        processes = getattr(self.host.base, "processes", None)  # vLLM's own processes
        # what a tool call gets on this machine (the kernel decides), said once at start
        self.tool_sandbox_line = tools.describe(config.tool_sandbox)
        log.info("%s: %s", config.name, self.tool_sandbox_line)
        info: dict[str, Any] = {"tool_sandbox": self.tool_sandbox_line}
        if processes:
            info["engine_processes"] = processes
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
            stacks.write_from_env(self._profile)

    def _run(self, max_episodes: int | None, until_idle_s: float | None) -> dict[str, Any]:
        self.scheduler.run(max_episodes, until_idle_s)
        ended = self.breaker.ended()  # the engine died, or the breaker tripped
        if ended is not None:
            self._beats_stop.set()
            raise ended
        self.heartbeat.beat()
        return self.report()

    def load_weights(self, version: int, location: str) -> int:
        self.weights.load(version, location)
        return version

    def version(self) -> int:
        return self.host.engine.version

    def report(self) -> dict[str, Any]:
        base = self.host.base
        h, b = base.health(), self.host.batcher
        seq = self.counters.next_report()
        return {
            "worker_id": self.worker.id,
            "report_seq": seq,  # orders this incarnation's reports (a late one is older)
            **self.counters.as_dict(),
            "version": h.version,
            "tokens_generated": h.tokens_generated,
            # generate calls the engine received and the requests in them
            "engine_batches": b.batches if b else h.requests,
            "engine_batched_requests": b.batched_requests if b else h.requests,
            # context tokens served from the engine's KV caches vs prefilled (engines that say)
            "kv_reused_tokens": getattr(base, "reused_tokens", 0),
            "kv_prefilled_tokens": getattr(base, "prefilled_tokens", 0),
            # what the control plane costs this node: per buffer operation, its calls, wall and
            # CPU seconds and a latency histogram (orchestrator/buffer/timings.py)
            "buffer_ops": self.buffer.timings.snapshot(),
            # the group commit of its loops' writes: transactions and the writes in them
            "write_batches": self.buffer.group_commit.batches,
            "writes_batched": self.buffer.group_commit.writes,
            "process_cpu_s": time.process_time(),
            "engine_error": self.breaker.engine_error,
            "weights_error": self.weights.error,
            "broken": self.breaker.broken,
            "orphans_released": self.leases.orphans_released,
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
        self.scheduler.wake()

    def weights_missed(self, version: int) -> None:
        """Collective transport: the driver says this node did not get ``version`` by
        broadcast; it loads the version's file at its next weight check."""
        self.weights.missed(version)

    def receive_weights(self, offer: dict[str, Any]) -> dict[str, Any]:
        """Collective transport: join the offer's group and receive its version, then load it
        in place (``WeightSync.receive``). Returns what happened: ``{"loaded": bool, "error":
        str | None, ...}``."""
        return self.weights.receive(offer)

    # -- the lifecycle its parts call ---------------------------------------------------------

    def _halt(self) -> None:
        """The node gives up (its engine died, or its breaker tripped): it claims nothing more
        and its waiting loops wake to end."""
        self._stop.set()
        self.scheduler.wake()

    def _declared_dead(self) -> None:
        """The control plane declared this incarnation dead: it stops, beats included; a new
        incarnation takes over."""
        self.declared_dead = True
        self._stop.set()
        self._beats_stop.set()


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
