"""Failure-recovery drills against a running job: inject a fault, wait for recovery, report.

A drill runs in its own process (``rollcall drill``), next to a job driven by ``rollcall run``
on the same machine; it finds its targets through the database (worker rows carry host and
pid) and measures everything on the database:

- **detection**: fault until the worker's row is declared dead;
- **recovery**: fault until a new incarnation of the same slot is alive and holds the version
  that was published at the fault, or a newer one (for the trainer: until a step is committed
  after the fault). Not "the current version": a trainer that publishes faster than the nodes
  beat keeps that a moving target, and the figure would measure the race rather than the
  recovery;
- **in flight**: the episodes the worker held at the fault, and their checkpointed turns;
- **resumed turns**: checkpointed turns of those samples that the next holder kept (progress
  not regenerated);
- **lost**: samples of those episodes whose checkpointed progress disappeared (fewer tokens
  than at the fault, or gone) without being counted as expired or quarantined;
- **duplicated**: violations of "trained once" (a prompt consumed twice, or step counts that
  disagree with the consumed samples), with the rest of the invariant checker.

Every drill records a ``drill.completed`` event with its report.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from orchestrator import procfs
from orchestrator.buffer.invariants import check_invariants
from orchestrator.db.engine import Database
from orchestrator.errors import ConflictError, UserError
from orchestrator.services.jobs import require_job

POLL_S = 0.1


@dataclass
class DrillReport:
    drill: str
    job: str
    target: str
    fault_at: float
    detection_s: float | None = None
    # kill-node: fault until Ray's own node table (the GCS) marks the node dead; None when it
    # could not be observed (a note says why) and for the other drills. ``detection_s`` stays
    # rollcall's: every rollout node of the node declared down
    ray_detection_s: float | None = None
    recovery_s: float | None = None
    in_flight_episodes: int = 0
    in_flight_samples: int = 0
    checkpointed_turns: int = 0
    resumed_turns: int = 0
    # in-flight samples that were not resumed and are not lost: their episode expired as stale
    # during the recovery (its prompt requeued) or was quarantined
    expired_samples: int = 0
    quarantined_samples: int = 0
    lost: int = 0
    duplicated: int = 0
    # agent tasks (docs/agents.md): calls of the in-flight samples recorded in PostgreSQL at the
    # fault, and the calls their resume replayed instead of generating or running them again
    # (counted once those samples are committed, within the drill's timeout)
    agent_calls_recorded: int = 0
    agent_calls_replayed: int = 0
    invariants_ok: bool = True
    invariant_summary: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return (
            self.lost == 0
            and self.duplicated == 0
            and self.invariants_ok
            and self.recovery_s is not None
        )

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


class Drills:
    def __init__(self, db: Database, job_name: str, *, timeout_s: float = 120.0) -> None:
        self.db = db
        with db.transaction() as tx:
            self.job = require_job(tx, job_name)
        self.timeout_s = timeout_s

    # -- targets ------------------------------------------------------------------------------

    def _workers(self, role: str) -> list[dict[str, Any]]:
        with self.db.transaction() as tx:
            return [
                w
                for w in tx.workers.health(self.job.id)
                if w["role"] == role and w["status"] == "alive"
            ]

    def _signal(self, worker: dict[str, Any], sig: signal.Signals) -> None:
        if worker["host"] != socket.gethostname():
            raise UserError(
                f"worker {worker['name']} runs on {worker['host']}; run the drill there"
            )
        try:
            os.kill(int(worker["pid"]), sig)
        except ProcessLookupError:
            raise ConflictError(f"worker {worker['name']} (pid {worker['pid']}) is gone") from None

    def _wait(self, cond: Callable[[], Any]) -> float | None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.timeout_s:
            if cond():
                return time.monotonic()
            time.sleep(POLL_S)
        return None

    def _is_down(self, worker_id: int) -> bool:
        with self.db.transaction() as tx:
            w = tx.workers.get(worker_id)
        return w is None or w.status.value in ("dead", "failed")

    def _slot_alive(self, name: str, after_id: int) -> bool:
        with self.db.transaction() as tx:
            return any(
                w["name"] == name and w["id"] > after_id and w["status"] == "alive"
                for w in tx.workers.health(self.job.id)
            )

    def _published_version(self) -> int:
        with self.db.transaction() as tx:
            published = tx.batches.published_weights(self.job.id)
        return 0 if published is None else published[0]

    def _slot_serving(self, name: str, after_id: int, version: int) -> bool:
        """A new incarnation of slot ``name`` is alive and holds ``version`` or a newer one."""
        with self.db.transaction() as tx:
            for w in tx.workers.health(self.job.id):
                if w["name"] == name and w["id"] > after_id and w["status"] == "alive":
                    return (w["loaded_version"] or 0) >= version
        return False

    # -- drills -------------------------------------------------------------------------------

    def kill_rollout(self, count: int = 1, sig: str = "KILL") -> list[DrillReport]:
        return self._kill_rollouts(count, sig, engine=False)

    def kill_engine(self, count: int = 1, sig: str = "KILL") -> list[DrillReport]:
        """SIGKILL (a crash) or SIGSTOP (a hang) the vLLM EngineCore process of the busiest
        rollout nodes, leaving the Ray actors that host them alive: the node must find its
        engine dead (or the control plane its progress stalled), give its episodes back and
        be restarted. Only for nodes with the ``vllm`` engine, on this host."""
        return self._kill_rollouts(count, sig, engine=True)

    def _engine_core(self, worker: dict[str, Any]) -> int:
        from workers.rollout.engines.vllm import ENGINE_CORE, engine_processes

        if worker["host"] != socket.gethostname():
            raise UserError(
                f"worker {worker['name']} runs on {worker['host']}; run the drill there"
            )
        with self.db.transaction() as tx:
            recorded = tx.workers.info(int(worker["id"])).get("engine_processes") or {}
        cores = [int(recorded["engine_core"])] if recorded.get("engine_core") else []
        if not cores:  # a node that did not record them: look under its process
            cores = [p for p, name in engine_processes(int(worker["pid"])) if name == ENGINE_CORE]
        if not cores:
            raise UserError(
                f"worker {worker['name']} (pid {worker['pid']}) has no vLLM EngineCore process: "
                "kill-engine drills nodes whose rollout.engine.kind is vllm"
            )
        return cores[0]

    def _kill_rollouts(self, count: int, sig: str, *, engine: bool) -> list[DrillReport]:
        signum = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}[sig]
        # wait (up to the timeout) for enough live nodes: one may be restarting
        self._wait(lambda: len(self._workers("rollout")) >= count)
        live = self._workers("rollout")
        if len(live) < count:
            raise ConflictError(
                f"job {self.job.name!r} has {len(live)} live rollout nodes; cannot kill {count}"
            )
        # the busiest nodes first: the drill is about work in flight
        targets = sorted(live, key=lambda w: -w["tokens_generated"])[:count]
        # what gets the signal: the node's process, or its engine's EngineCore process
        victims = {w["id"]: self._engine_core(w) if engine else int(w["pid"]) for w in targets}
        snaps = {}
        with self.db.transaction() as tx:
            for w in targets:
                snaps[w["id"]] = tx.invariants.samples_of_worker(w["id"])
        version = self._published_version()
        t0 = time.monotonic()
        wall0 = time.time()
        for w in targets:
            if engine:
                try:
                    os.kill(victims[w["id"]], signum)
                except ProcessLookupError:
                    raise ConflictError(f"the engine of {w['name']} is gone") from None
            else:
                self._signal(w, signum)
        reports = []
        drill = "kill-engine" if engine else "kill-rollout"
        for w in targets:
            target = f"{w['name']} (EngineCore pid {victims[w['id']]})" if engine else w["name"]
            r = DrillReport(f"{drill} --signal {sig}", self.job.name, target, wall0)
            wid, name = int(w["id"]), str(w["name"])
            dead_at = self._wait(functools.partial(self._is_down, wid))
            r.detection_s = None if dead_at is None else dead_at - t0
            up_at = self._wait(functools.partial(self._slot_serving, name, wid, version))
            r.recovery_s = None if up_at is None else up_at - t0
            if dead_at is None:
                r.notes.append(self._not_declared_dead(wid, name))
            if signum == signal.SIGSTOP:  # the supervisor SIGKILLs a hung node; never leave
                # a stopped process behind if it did not
                try:
                    os.kill(victims[w["id"]], signal.SIGCONT)
                    os.kill(victims[w["id"]], signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self._account(r, snaps[w["id"]])
            reports.append(r)
        for r in reports:
            self._finish(r)
        return reports

    def kill_trainer(self) -> DrillReport:
        def rank0() -> list[dict[str, Any]]:
            return [w for w in self._workers("trainer") if w["name"] == "trainer-0"]

        self._wait(rank0)  # it may be restarting
        live = rank0()
        if not live:
            raise ConflictError(f"job {self.job.name!r} has no live trainer rank")
        w = live[0]
        with self.db.transaction() as tx:
            step0 = tx.batches.job_state(self.job.id).policy_version
        r = DrillReport("kill-trainer", self.job.name, w["name"], time.time())
        t0 = time.monotonic()
        self._signal(w, signal.SIGKILL)
        dead_at = self._wait(functools.partial(self._is_down, int(w["id"])))
        r.detection_s = None if dead_at is None else dead_at - t0

        def stepped() -> bool:
            with self.db.transaction() as tx:
                return tx.batches.job_state(self.job.id).policy_version > step0

        up_at = self._wait(lambda: self._slot_alive(w["name"], w["id"]) and stepped())
        r.recovery_s = None if up_at is None else up_at - t0
        self._account(r, [])
        self._finish(r)
        return r

    def restart_db(self, restart: Callable[[], None]) -> DrillReport:
        """Restart the database (``restart`` does it); nobody may be declared dead for it."""
        with self.db.transaction() as tx:
            before = {w["id"] for w in tx.workers.health(self.job.id) if w["status"] == "alive"}
            step0 = tx.batches.job_state(self.job.id).policy_version
        r = DrillReport("restart-db", self.job.name, "database", time.time())
        t0 = time.monotonic()
        restart()
        self.db.engine.dispose()  # connections to the old server are gone

        def stepped() -> bool:
            try:
                with self.db.transaction() as tx:
                    return tx.batches.job_state(self.job.id).policy_version > step0
            except Exception:
                return False

        up_at = self._wait(stepped)
        r.detection_s = 0.0
        r.recovery_s = None if up_at is None else up_at - t0
        with self.db.transaction() as tx:
            after = {w["id"]: w["status"] for w in tx.workers.health(self.job.id)}
        dead = sorted(i for i in before if after.get(i) in ("dead", "failed"))
        if dead:
            r.notes.append(f"workers declared dead by the outage: {dead}")
        self._account(r, [])
        if dead:
            r.invariants_ok = False
            r.invariant_summary += f"; {len(dead)} workers declared dead by the outage"
        self._finish(r)
        return r

    def kill_node(self, node_id: str | None = None) -> DrillReport:
        """Lose a whole Ray node: SIGKILL its raylet, its agents and every worker process on it
        (as a machine that loses power), on this host. Without ``node_id``, the node hosting
        the most live rollout nodes. The head node (it hosts the GCS, so the job itself) is
        refused. Recovery: every rollout slot that lived on the node is alive again with the
        version published at the fault (or newer), wherever the supervisor could place it."""
        self._wait(lambda: bool(self._workers("rollout")))
        live = self._workers("rollout")
        by_node: dict[str, list[dict[str, Any]]] = {}
        for w in live:
            if w["node_id"]:
                by_node.setdefault(str(w["node_id"]), []).append(w)
        if node_id is None:
            if not by_node:
                raise ConflictError(f"job {self.job.name!r} has no live rollout node on Ray")
            node_id = max(by_node, key=lambda n: len(by_node[n]))
        targets = by_node.get(node_id, [])
        node = find_ray_node(node_id)
        procs = node.processes
        if any(kind == "gcs" for _, kind in procs):
            raise UserError(
                f"node {node_id} is the Ray head (it runs the GCS); losing it ends the job. "
                "Drill a worker node (pass --node, see `ray status`/`rollcall job show`)"
            )
        if not procs:
            raise UserError(
                f"no process of Ray node {node_id} runs on this host; run the drill there"
            )
        snaps: list[dict[str, Any]] = []
        with self.db.transaction() as tx:
            for w in targets:
                snaps += tx.invariants.samples_of_worker(w["id"])
        names = ", ".join(sorted(str(w["name"]) for w in targets)) or "no rollout node"
        r = DrillReport("kill-node", self.job.name, f"node {node_id[:12]} ({names})", time.time())
        version = self._published_version()
        # Ray's own view, from the GCS its raylet names (connected before the kill)
        watch = RayNodeWatch(node_id, node.gcs_address, node.cluster_id)
        t0 = time.monotonic()
        pids = {pid for pid, _ in procs} | {
            int(w["pid"]) for w in targets if w["host"] == socket.gethostname()
        }
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        watch.start(t0, t0 + self.timeout_s)
        r.notes.append(f"killed {len(pids)} processes of node {node_id} ({_kinds(procs)})")
        if node.shared:
            r.notes.append(
                f"left {len(node.shared)} processes of the node's Ray session on this host "
                f"that other nodes here share ({_kinds(node.shared)}): "
                f"pids {', '.join(str(p) for p, _ in node.shared)}"
            )
        dead_at = self._wait(lambda: all(self._is_down(int(w["id"])) for w in targets))
        r.detection_s = None if dead_at is None else dead_at - t0
        up_at = self._wait(
            lambda: all(self._slot_serving(str(w["name"]), int(w["id"]), version) for w in targets)
        )
        r.recovery_s = None if up_at is None else up_at - t0
        r.ray_detection_s = watch.result()
        if r.ray_detection_s is None:
            r.notes.append(f"Ray's detection unknown: {watch.why_not()}")
        self._account(r, snaps)
        self._finish(r)
        return r

    def _not_declared_dead(self, worker_id: int, name: str) -> str:
        """A note for a target the control plane did not declare dead within the timeout:
        what it saw of it at the end of the wait."""
        with self.db.transaction() as tx:
            d = tx.workers.diagnose(worker_id)
        if d is None:
            return f"{name} was not declared dead: its row is gone"
        return (
            f"{name} was not declared dead within {self.timeout_s:g} s: status {d['status']}, "
            f"last beat {d['heartbeat_age_s']} s ago, progress {d['progress_age_s']} s ago, "
            f"its row {'LOCKED by another session' if d['row_locked'] else 'not locked'}; "
            f"{d['idle_in_transaction']} sessions idle in a transaction (the longest "
            f"{d['idle_in_transaction_longest_s']} s)"
        )

    # -- accounting ---------------------------------------------------------------------------

    def _account(self, r: DrillReport, at_fault: list[dict[str, Any]]) -> None:
        episodes = sorted({s["episode_id"] for s in at_fault})
        r.in_flight_episodes = len(episodes)
        samples = [s for s in at_fault if s["sample_index"] is not None]
        r.in_flight_samples = len(samples)
        r.checkpointed_turns = sum(s["num_turns"] or 0 for s in samples)
        r.agent_calls_recorded = sum(
            s.get("agent_calls") or 0 for s in samples if s["status"] == "in_progress"
        )
        if r.agent_calls_recorded:  # an agent task's samples: count the calls their resume
            self._wait(lambda: self._settled(episodes))  # replays, once they are committed
        with self.db.transaction() as tx:
            now = {
                (s["episode_id"], s["sample_index"]): s
                for s in tx.invariants.samples_of_episodes(episodes)
            }
        stale = 0  # recorded calls of samples expired (stale) or quarantined since the fault
        for s in samples:
            cur = now.get((s["episode_id"], s["sample_index"]))
            if cur is None:
                r.lost += 1
                continue
            if cur["episode_status"] in ("expired", "quarantined") or cur["status"] == "expired":
                stale += s.get("agent_calls") or 0 if s["status"] == "in_progress" else 0
                if cur["episode_status"] == "quarantined":
                    r.quarantined_samples += 1
                else:
                    r.expired_samples += 1
                continue  # counted on the task, its prompt requeued or shown to operators
            r.agent_calls_replayed += cur.get("agent_replayed") or 0
            if (cur["num_tokens"] or 0) < (s["num_tokens"] or 0):
                r.lost += 1
            else:
                r.resumed_turns += s["num_turns"] or 0
        if r.agent_calls_recorded:
            r.notes.append(
                f"agent calls: {r.agent_calls_recorded} recorded at the fault; the resumed "
                f"samples replayed {r.agent_calls_replayed} from PostgreSQL instead of "
                "generating or running them again"
                + (f" ({stale} were of samples expired as stale since)" if stale else "")
            )
        report = check_invariants(self.db, self.job.id, skip=("dead_leases",))
        r.invariants_ok = report.ok
        r.invariant_summary = report.summary()
        r.duplicated = len(report.violations.get("trained_once", []))

    def _settled(self, episode_ids: list[int]) -> bool:
        """Whether no sample of these episodes is in progress any more."""
        with self.db.transaction() as tx:
            return all(
                s["status"] != "in_progress" for s in tx.invariants.samples_of_episodes(episode_ids)
            )

    def _finish(self, r: DrillReport) -> None:
        with self.db.transaction() as tx:
            tx.events.add(
                "drill.completed",
                "drill",
                f"drill {r.drill} on {r.target}: detection {r.detection_s}, "
                + (f"Ray's detection {r.ray_detection_s}, " if r.drill == "kill-node" else "")
                + f"recovery {r.recovery_s}, lost {r.lost}, duplicated {r.duplicated}",
                job_id=self.job.id,
                payload=r.to_json(),
            )


def _kinds(procs: list[tuple[int, str]]) -> str:
    """``1 agent, 1 raylet, 3 worker``: how many processes of each kind."""
    return ", ".join(f"{n} {k}" for k, n in sorted(Counter(k for _, k in procs).items()))


# -- a Ray node's processes on this host ---------------------------------------------------------
#
# What Ray 2.60 starts for a node (ray/_private/node.py, services.py), and how each is found:
#
# - the raylet: ``--node_id=``, with the node's per-node sockets (``--raylet_socket_name=``,
#   ``--store_socket_name=``), its session and logs directories (``--session_dir=``,
#   ``--log_dir=``), the cluster's ``--gcs-address=`` and ``--cluster-id=``;
# - the dashboard agent and the runtime env agent, started by the raylet (its children) with
#   ``--node-id=``, then renamed ``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent``;
# - the worker processes (actors, idle workers, and what they start), the raylet's
#   descendants, renamed ``ray::...`` (before that they name the node's sockets);
# - the log monitor (``ray start`` and a head; ``cluster_utils`` starts none for its worker
#   nodes: "one per physical node"), started by the process that starts the node, before the
#   raylet, with no node id: ``--session-dir=``, ``--logs-dir=``, ``--gcs-address=``,
#   ``--node-ip-address=``. ``ray start`` exits once the node is up, so it is init's child;
# - with ``ray start --block``: that process (the parent of the raylet and the log monitor; it
#   kills the rest when one dies) and its reaper;
# - on the head only: the GCS (``--node-id=``), the autoscaler's monitor (``--logs-dir=``),
#   the dashboard (``--session-dir=``), the client server (``--node-id=``).
#
# The session directory is the cluster's (its name comes from the GCS), so nodes on one host
# share it (``cluster_utils``, or several ``ray start`` on one machine): a process that names
# it but no node id is the node's only where no other node of this host uses that session,
# or, where others do, where it is in the raylet's process group (one ``ray start`` from a
# shell) and no other node's raylet is. Otherwise it is left alone and reported as shared.

NODE_ID_FLAGS = ("--node_id", "--node-id")
AGENT_NAMES = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
SCRIPT_KINDS = (  # scripts Ray starts with python, by the end of their path
    ("/_private/log_monitor.py", "log_monitor"),
    ("/dashboard/agent.py", "agent"),
    ("/runtime_env/agent/main.py", "agent"),
    ("/autoscaler/_private/monitor.py", "monitor"),
    ("/dashboard/dashboard.py", "dashboard"),
    ("/_private/ray_process_reaper.py", "reaper"),
)


@dataclass(frozen=True)
class _Proc:
    pid: int
    ppid: int
    pgid: int
    argv: tuple[str, ...]

    def flag(self, *names: str) -> str | None:
        """The value of ``--name=value`` for the first of ``names`` on the command line."""
        for a in self.argv:
            name, eq, value = a.partition("=")
            if eq and name in names:
                return value
        return None

    def names(self, values: set[str]) -> bool:
        """Whether an argument, or a ``--flag=``'s value, is exactly one of ``values``."""
        return any((a.partition("=")[2] if a.startswith("-") else a) in values for a in self.argv)


def _kind(argv: tuple[str, ...]) -> str:
    head = argv[0] if argv else ""
    if head.startswith("ray::"):  # renamed by Ray (setproctitle)
        return "agent" if head.startswith(AGENT_NAMES) else "worker"
    exe = Path(head).name
    if "gcs_server" in exe:
        return "gcs"
    if "raylet" in exe:
        return "raylet"
    if _is_ray_start(argv):
        return "ray_start"
    for suffix, kind in SCRIPT_KINDS:
        if any(a.endswith(suffix) for a in argv[1:]):
            return kind
    if "ray.util.client.server" in argv:
        return "client_server"
    return "worker"


def _is_ray_start(argv: tuple[str, ...]) -> bool:
    """``ray start ...`` (``python .../bin/ray start``)."""
    return "start" in argv and any(Path(a).name == "ray" for a in argv[: argv.index("start")])


RAY_PACKAGE_DIRS = tuple(f"/ray/{d}/" for d in ("_private", "autoscaler", "core", "dashboard"))


def _runs_ray(argv: tuple[str, ...]) -> bool:
    """A program of Ray's package (``.../ray/_private/log_monitor.py``, ``-m ray.util...``),
    not one that only names Ray's temporary files (``/tmp/ray/session_*``)."""
    return any(a.startswith("ray.") or any(d in a for d in RAY_PACKAGE_DIRS) for a in argv[:3])


def _scan() -> dict[int, _Proc]:
    """Every process with a command line (not kernel threads or zombies), but this one and its
    ancestors: a drill never kills itself or what runs it."""
    procs: dict[int, _Proc] = {}
    for st in procfs.processes():
        try:
            raw = (procfs.PROC / str(st.pid) / "cmdline").read_bytes()
        except OSError:  # ended meanwhile
            continue
        if raw.strip(b"\0"):
            argv = tuple(raw.decode(errors="replace").rstrip("\0").split("\0"))
            procs[st.pid] = _Proc(st.pid, st.ppid, int(st.fields[2]), argv)
    pid = os.getpid()
    while pid > 1:
        p = procs.pop(pid, None)
        pid = p.ppid if p is not None else (procfs.parent_of(pid) or 0)
    return procs


@dataclass(frozen=True)
class RayNodeOnHost:
    """One Ray node's processes on this host (``find_ray_node``)."""

    node_id: str
    processes: list[tuple[int, str]]  # (pid, kind), the drill's to kill
    # processes of the node's Ray session here that other nodes on this host use too (a head's
    # log monitor under cluster_utils): left alone
    shared: list[tuple[int, str]]
    gcs_address: str | None  # the cluster's GCS, as the node's raylet names it
    cluster_id: str | None


def find_ray_node(node_id: str) -> RayNodeOnHost:
    """The processes of Ray node ``node_id`` on this host, with their kind: ``gcs`` (the head),
    ``raylet``, ``agent`` (dashboard and runtime env agents), ``log_monitor``, ``worker``
    (actors, idle workers and what they started), ``ray_start`` and ``reaper`` (``ray start
    --block``), and on a head ``monitor``, ``dashboard``, ``client_server``; never a process of
    another node on this host (see above). Linux (``/proc``)."""
    procs = _scan()
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    owner: dict[int, str] = {}  # pid -> the node it belongs to

    def claim(root: int, nid: str) -> None:
        """``root`` and its descendants that are not another node's."""
        owner.setdefault(root, nid)
        todo = list(children.get(root, []))
        while todo:
            pid = todo.pop()
            if pid not in owner:
                owner[pid] = nid
                todo += children.get(pid, [])

    # the processes that name a node id, each its node's, and then what runs under them
    named = {pid: nid for pid, p in procs.items() if (nid := p.flag(*NODE_ID_FLAGS))}
    owner.update(named)
    for pid, nid in named.items():
        claim(pid, nid)
    raylets = {nid: procs[pid] for pid, nid in named.items() if _kind(procs[pid].argv) == "raylet"}
    shared: list[int] = []
    raylet = raylets.get(node_id)
    if raylet is not None:
        # `ray start --block` stays the parent of what it started (its log monitor, its
        # reaper) and kills the rest when one dies: the node's, as everything on the machine
        parent = procs.get(raylet.ppid)
        if parent is not None and raylet.ppid not in owner and _is_ray_start(parent.argv):
            claim(raylet.ppid, node_id)
        # a worker process that has not renamed itself yet names the node's sockets
        sockets = {raylet.flag("--raylet_socket_name"), raylet.flag("--store_socket_name")}
        for pid, p in procs.items():
            if pid not in owner and p.names({s for s in sockets if s}):
                claim(pid, node_id)
        # the log monitor (and a head's monitor and dashboard) name the session only
        session_dir = raylet.flag("--session_dir")
        dirs = {d for d in (session_dir, raylet.flag("--log_dir")) if d}
        sharing = {
            r.pgid
            for nid, r in raylets.items()
            if nid != node_id and r.flag("--session_dir") == session_dir
        }
        for pid, p in sorted(procs.items()):
            if pid in owner or not p.names(dirs) or not _runs_ray(p.argv):
                continue  # (an operator's `ls` of the logs is no process of the node)
            if not sharing or (p.pgid == raylet.pgid and raylet.pgid not in sharing):
                claim(pid, node_id)
            else:
                shared.append(pid)

    kinds: dict[int, str] = {}

    def kind(pid: int) -> str:
        """A process's kind; what a log monitor, agent or monitor started is of its kind."""
        if pid not in kinds:
            k = _kind(procs[pid].argv)
            parent = procs[pid].ppid
            if k == "worker" and owner.get(parent) == owner[pid] and parent in procs:
                pk = kind(parent)
                k = k if pk in ("raylet", "gcs") else pk
            kinds[pid] = k
        return kinds[pid]

    return RayNodeOnHost(
        node_id,
        sorted((pid, kind(pid)) for pid, nid in owner.items() if nid == node_id),
        [(pid, _kind(procs[pid].argv)) for pid in shared],
        raylet.flag("--gcs-address") if raylet is not None else None,
        raylet.flag("--cluster-id") if raylet is not None else None,
    )


def ray_node_processes(node_id: str) -> list[tuple[int, str]]:
    """The processes of Ray node ``node_id`` on this host with their kind (``find_ray_node``)."""
    return find_ray_node(node_id).processes


class RayNodeWatch:
    """When Ray's own node table (the GCS) marks a node dead, timed from the fault. The drill
    is no Ray driver (``rollcall drill`` does not join the cluster), so this is a GCS client of
    its own on the address the node's raylet names, polled from a thread. Whatever fails here
    leaves the figure unknown (``why_not``), never the drill."""

    def __init__(self, node_id: str, gcs_address: str | None, cluster_id: str | None) -> None:
        self.node_id = node_id
        self._client: Any = None
        self._why = ""
        self._dead_at: float | None = None
        self._t0 = self._deadline = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if not gcs_address:
            self._why = "the node's raylet names no GCS address"
            return
        try:
            from ray._raylet import GcsClient  # type: ignore[attr-defined]
            from ray.core.generated.gcs_service_pb2 import (  # type: ignore[attr-defined]
                GetAllNodeInfoRequest,
            )

            self._selector = GetAllNodeInfoRequest.NodeSelector(node_id=bytes.fromhex(node_id))
            self._client = GcsClient(address=gcs_address, cluster_id=cluster_id)
            state = self._state()
        except Exception as e:
            self._client = None
            self._why = f"Ray's node table at {gcs_address} could not be read: {e!r}"
            return
        if state != "alive":
            self._client = None
            self._why = f"Ray's node table at {gcs_address} " + (
                "had the node dead before the fault" if state else "does not list the node"
            )

    def _state(self) -> str | None:
        """``alive``, ``dead``, or None when the table does not list the node."""
        from ray.core.generated.gcs_pb2 import GcsNodeInfo  # type: ignore[attr-defined]

        infos = self._client.get_all_node_info(timeout=2.0, node_selectors=[self._selector])
        for nid, info in infos.items():
            if nid.hex() == self.node_id:
                return "dead" if info.state == GcsNodeInfo.DEAD else "alive"
        return None

    def start(self, t0: float, deadline: float) -> None:
        """Poll from now (the fault was at ``t0``, monotonic) until ``deadline``."""
        self._t0, self._deadline = t0, deadline
        if self._client is not None:
            self._thread = threading.Thread(target=self._poll, name="ray-node-watch", daemon=True)
            self._thread.start()

    def _poll(self) -> None:
        error = ""
        while not self._stop.is_set() and time.monotonic() < self._deadline:
            try:
                if self._state() == "dead":
                    self._dead_at = time.monotonic()
                    return
            except Exception as e:  # the GCS away for a moment: try again
                error = f" (the last read failed: {e!r})"
            self._stop.wait(POLL_S)
        self._why = (
            f"Ray's node table did not mark the node dead within "
            f"{self._deadline - self._t0:g} s{error}"
        )

    def result(self) -> float | None:
        """Seconds from the fault until Ray marked the node dead (waiting for it up to the
        deadline), None when that was not seen."""
        if self._thread is not None:
            self._thread.join(max(0.0, self._deadline - time.monotonic()) + 5.0)
            self._stop.set()
        return None if self._dead_at is None else self._dead_at - self._t0

    def why_not(self) -> str:
        return self._why or "not observed"
