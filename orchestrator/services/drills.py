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

Every drill records a ``drill.completed`` event with its report. What ``kill-node`` finds of a
Ray node (its processes here, Ray's node table) is ``nodeloss``; vLLM's processes, which
``kill-engine`` signals, ``rollcall.orchestrator.engineprocs``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from rollcall.orchestrator import procfs
from rollcall.orchestrator.buffer.invariants import check_invariants
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.engineprocs import ENGINE_CORE, engine_processes
from rollcall.orchestrator.errors import ConflictError, UserError
from rollcall.orchestrator.services.jobs import require_job
from rollcall.orchestrator.services.nodeloss import RayNodeWatch, find_ray_node

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
        cores: dict[int, int] = {}
        if engine:  # in a mixed fleet (rollout.node_engines), the nodes that run vLLM
            for w in live:
                with contextlib.suppress(UserError):
                    cores[w["id"]] = self._engine_core(w)
            if not cores:  # none: say why, for the first
                self._engine_core(live[0])
            live = [w for w in live if w["id"] in cores]
            if len(live) < count:
                raise ConflictError(
                    f"job {self.job.name!r} has {len(live)} live vLLM nodes; cannot kill {count}"
                )
        # the busiest nodes first: the drill is about work in flight
        targets = sorted(live, key=lambda w: -w["tokens_generated"])[:count]
        # what gets the signal: the node's process, or its engine's EngineCore process
        victims = {w["id"]: cores[w["id"]] if engine else int(w["pid"]) for w in targets}
        # which processes they are: a stopped one is killed at the end only if it is still the
        # one stopped (the supervisor kills a hung node, and its pid may be another's by then)
        idents = {wid: procfs.identity(pid) for wid, pid in victims.items()}
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
                procfs.signal_same(idents[w["id"]], signal.SIGCONT)
                procfs.signal_same(idents[w["id"]], signal.SIGKILL)
            self.account(r, snaps[w["id"]])
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
        self.account(r, [])
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
        self.account(r, [])
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
        watch = RayNodeWatch(node_id, node.gcs_address, node.cluster_id, self.db.target.home)
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
        self.account(r, snaps)
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

    def account(self, r: DrillReport, at_fault: list[dict[str, Any]]) -> None:
        """Fill the report's accounting of the samples in flight at the fault (``at_fault``,
        their snapshots then) against what the database holds now: lost, expired or
        quarantined samples, resumed turns, agent calls recorded and replayed, and the
        invariants (duplicated: trained twice). The drills and the soak's own faults
        (``ops/soak.py``) call it once recovery is done."""
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
