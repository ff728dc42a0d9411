"""The job driver: ``rollcall run`` and ``rollcall quickstart``.

``JobDriver.setup()`` opens the database (and verifies its schema), creates or resumes the job,
registers the config's tasks with their quotas, starts or joins Ray, builds the trainer (from the
last checkpoint when resuming), launches the rollout nodes and the evaluator, and starts the
control-plane scheduler jobs (seeding, lease sweep, staleness expiry, dead-worker sweep and
the rollout nodes' supervisor, each on the scheduler's threads). ``run()`` then trains until
``run.total_steps``: claim a full batch from the buffer, plan it (advantages, packing), train,
checkpoint, publish the new weights and commit the step (one transaction: the batch is
consumed, the step recorded, the policy version bumped, the weights published). Rollout nodes
pick the new version up between turns. A trainer call that fails or does not return within
``trainer.call_timeout_s`` is a failed trainer: restarted from the last checkpoint, the batch
replayed. Components get their collaborators passed in; none of them knows about the driver.

One driver per job (``orchestrator.runner.lifecycle``): ``setup()`` refuses a second driver
of a running job before it changes anything, and moves the job's status through ``running``,
``stopping`` (``rollcall job stop``) and ``finished``/``stopped``/``failed`` (``close()``).

Modes: ``async`` (rollout never stops; data up to each task's ``max_staleness`` versions old)
and ``sync`` (the same machinery with every task's staleness bound at 0: the nodes generate one
batch with the current policy, the trainer trains on it, repeat).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from orchestrator.buffer.service import Buffer
from orchestrator.config import RollcallConfig, read_chat_template
from orchestrator.db.engine import Database
from orchestrator.db.notify import GroupsListener
from orchestrator.domain import JobStatus
from orchestrator.errors import (
    ConflictError,
    DriverFencedError,
    JobFailedError,
    NotFoundError,
    TasksPausedError,
    UserError,
)
from orchestrator.runner import raylog
from orchestrator.runner.broadcast import Broadcaster
from orchestrator.runner.drift import DRIFT_EVENT, IsWeightWatch
from orchestrator.runner.lifecycle import JobLifecycle
from orchestrator.runner.progress import Pace, Progress, Snapshot
from orchestrator.runner.rundir import RunDir
from orchestrator.runner.trainer_control import TrainerControl, is_trainer_failure
from orchestrator.runner.usererrors import UserErrorReport

if TYPE_CHECKING:
    from workers.rollout.node import NodeConfig

log = logging.getLogger(__name__)
# Waiting for a full batch: the loop claims again when rollout nodes completed as many groups
# as the batch lacked (LISTEN/NOTIFY), and at the latest after WAIT_POLL_S.
WAIT_POLL_S = 0.25
NODE_STOP_TIMEOUT_S = 60.0
# How often the driver reads the nodes' new user-code failures (orchestrator/runner/usererrors)
USER_ERRORS_INTERVAL_S = 1.0
# How often the wait for a batch looks whether every task is paused (_check_tasks_left)
TASKS_CHECK_INTERVAL_S = 2.0
# How long a step's bookkeeping waits for the rollout nodes' reports (_node_metrics).
NODE_REPORT_WAIT_S = 10.0
# A control-plane run that starts late (a loaded machine) still runs unless it is this late
# (the process was frozen): then it is dropped, logged to driver.log and counted.
MISFIRE_GRACE_S = 60
# Every control-plane job: runs that piled up while the process was busy run once, not in a
# burst (coalesce); a pass is skipped while the previous one of the same job still runs.
SCHEDULER_JOB_DEFAULTS = {
    "misfire_grace_time": MISFIRE_GRACE_S,
    "coalesce": True,
    "max_instances": 1,
}


@dataclass
class RunResult:
    job: str
    run_dir: str
    steps: int
    version: int
    wall_s: float
    train_s: float
    busy_frac: float
    trained_samples: int
    trained_by_task: dict[str, int] = field(default_factory=dict)  # trajectories, this run
    evals: list[dict[str, Any]] = field(default_factory=list)
    final_dir: str | None = None
    stopped_early: bool = False


class JobDriver(TrainerControl):
    def __init__(
        self,
        config: RollcallConfig,
        db: Database,
        *,
        model_dir: Path,
        home: Path,
        resume: bool = False,
        console: Console | None = None,
        live: bool = True,
        actor: str = "driver",
    ) -> None:
        self.cfg = config
        self.db = db
        self.model_dir = model_dir
        self.chat_template = read_chat_template(config.model.chat_template)
        self.home = home
        self.resume = resume
        self.console = console or Console()
        self.live = live
        self.actor = actor
        self.supervisor: Any = None
        self.user_errors: UserErrorReport | None = None  # user-code failures, as they come
        self._tasks_checked_at = 0.0  # when the wait for a batch last looked at the tasks
        weights = config.trainer.weights
        self.broadcaster = (
            Broadcaster(weights, config.trainer.device)
            if weights.transport == "collective"
            else None
        )
        self.trainer_restarts = 0
        self.trainer_failures: list[float] = []
        # Fault-injection seam for chaos tests and drills: called by name at points of a step
        # ("after_train": the optimizer stepped, nothing checkpointed or committed yet).
        self.fault_hooks: dict[str, Callable[[JobDriver], None]] = {}
        # ... and per rollout node slot, a "module:callable" that wraps its engine
        self.engine_hooks: dict[int, str] = {}
        self._stop_requested = threading.Event()
        self.trainer: Any = None
        self.evaluator: Any = None
        self.scheduler: Any = None
        self.metrics: Any = None  # the Prometheus exporter (orchestrator/runner/metrics.py)
        self._unanswered: dict[str, Any] = {}  # node actor id -> its report request still owed
        self.missed_runs: Any = None  # the scheduler's dropped runs (metrics.MissedRuns)
        self._release_logs: Callable[[], None] | None = None
        self._release_ray_messages: Callable[[], None] | None = None
        self.started_ray = False
        self.placement: Any = None  # the job's reserved slots (orchestrator/runner/placement.py)
        self.pending_evals: list[tuple[int, Any]] = []
        self.pace = Pace()  # the progress line's ETA
        self.lifecycle: JobLifecycle | None = None  # this driver's hold on its job
        self._outcome: JobStatus | None = None  # how run() ended, for the job's status
        self._failure: BaseException | None = None  # what ended a failed run()
        self.is_weight_watch = IsWeightWatch(
            config.trainer.is_weight_tolerance, config.trainer.is_weight_warn_every
        )

    # -- set-up -------------------------------------------------------------------------------

    def setup(self) -> None:
        from orchestrator.quotas import BatchPolicy
        from orchestrator.services.jobs import create_job
        from orchestrator.services.tasks import check_agent_tasks, ensure_tasks

        cfg = self.cfg
        sync = cfg.run.mode == "sync"
        if not cfg.tasks:
            raise UserError("the config has no tasks; add at least one under tasks:")
        cp = cfg.control_plane
        room = cp.progress_timeout_s - cp.heartbeat_timeout_s
        check_agent_tasks(cfg.tasks, cfg.run.eval.episodes, room)
        # Ray and the job's reservation first: a job the cluster cannot hold is refused before
        # it writes anything to the database. From here on (Ray's start, the trainer's, the
        # nodes', the scheduler's), what libraries log or warn goes to the run directory's
        # driver.log, not the user's terminal.
        # What refuses this run without Ray is checked first (and again under the lock).
        with self.db.transaction() as tx:
            running = self._refusal(tx, tx.jobs.get_by_name(cfg.job.name), early=True)
        if running is not None:  # another driver runs it (the lock would refuse this one)
            from orchestrator.runner.lifecycle import refuse

            info = {"pid": os.getpid(), "host": socket.gethostname(), "actor": self.actor}
            raise refuse(self.db, running, cfg.job.name, self.actor, info)
        self.run_dir = RunDir(
            Path(cfg.run.dir) if cfg.run.dir else self.home / "runs" / cfg.job.name
        )
        self._release_logs = self.run_dir.capture_logs()
        self._start_ray()
        with self.db.transaction() as tx:
            job = tx.jobs.get_by_name(cfg.job.name)
            self._refusal(tx, job)
            if job is None:
                job = create_job(
                    tx, cfg.job.name, config=cfg.model_dump(mode="json"), actor=self.actor
                )
            # One driver per job: a second one is refused here, before it changes anything.
            self.lifecycle = JobLifecycle(
                self.db,
                job.id,
                job.name,
                actor=self.actor,
                on_stop=self.request_stop,
                say=lambda m: self.console.print(m, markup=False),
                retry_window_s=cfg.buffer.retry_window,
            )
            # where operators' commands reach this job's Ray (``rollcall node drain``)
            self.lifecycle.info["ray_address"] = _gcs_address()
            self.lifecycle.acquire()
            self._refusal(tx, tx.jobs.get(job.id) or job)
            policy = BatchPolicy(cfg.buffer.batch_groups, cfg.trainer.sync_every, sync)
            for line in ensure_tasks(
                tx, job_name=job.name, tasks=cfg.tasks, actor=self.actor, sync=sync, policy=policy
            ):
                self.console.print(line, markup=False)
            epoch = self.lifecycle.start(tx, resume=self.resume)
        self.lifecycle.watch()  # stop requests, the lock after a database restart, fencing
        self.job_id = job.id
        self.buffer = Buffer(self.db, job.id, cfg.buffer, driver_epoch=epoch)
        self._recover_previous_run()  # only now that this driver holds the job
        self.buffer.set_fleet_size(cfg.rollout.nodes)  # a new run's fleet: the config's
        self.run_dir.write_config(cfg.model_dump(mode="json"))
        self.run_dir.start_trackers(
            cfg.run, job.name, lambda m: self.console.print(m, markup=False)
        )
        # what the nodes report of user code from here on (not what earlier runs saw)
        self.user_errors = UserErrorReport(
            self.buffer.events_after,
            self.buffer.last_event_id(),
            lambda m: self.console.print(m, markup=False),
        )
        self._start_trainer()
        self._start_nodes()
        self._start_evaluator()
        self._start_scheduler()
        self._start_metrics()

    def _refusal(self, tx: Any, job: Any, *, early: bool = False) -> int | None:
        """Refuse a run of a job that does not exist with --resume and of a job that already
        trained without it. ``early`` (before Ray starts; the driver lock decides later):
        the id of the job when another driver runs it, for the caller to refuse."""
        name = self.cfg.job.name
        if job is None and self.resume:
            raise NotFoundError(
                f"job {name!r} does not exist, so there is nothing to resume; drop --resume "
                "to start it"
            )
        if job is None:
            return None
        if early and tx.jobs.driver_alive(job.id):
            return int(job.id)
        if not self.resume and job.policy_version > 0:
            raise ConflictError(
                f"job {name!r} already trained {job.policy_version} steps; pass --resume to "
                "continue it, or set job.name to start a new job"
            )
        return None

    def _recover_previous_run(self) -> None:
        """Work a previous driver of this job left behind goes through the normal paths: its
        workers' leases are requeued (the next claimer resumes from the checkpoints), and a
        batch claimed but not committed returns to ``ready``, reserved for the same step."""
        from orchestrator.domain import WorkerStatus

        for w in self.buffer.node_health():
            if w["status"] in ("starting", "alive"):
                self.buffer.requeue_worker(w["id"], WorkerStatus.DEAD)
        self.buffer.release_trainer_claims()

    def _start_ray(self) -> None:
        import ray

        started = not ray.is_initialized()
        if not ray.is_initialized() and self.cfg.ray.address:
            # the actors' output stays in Ray's session logs; Ray's own log records go to
            # driver.log (configure_logging=False: no handler of Ray's on the terminal)
            ray.init(address=self.cfg.ray.address, log_to_driver=False, configure_logging=False)
        elif not ray.is_initialized():
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            # Ray starts its workers at niceness 15 by default: beside ordinary work (nice 0)
            # on a busy machine the job's own actors would get next to no CPU, and heartbeats,
            # starts and steps would stall. The job is the machine's work: run them at 0.
            os.environ.setdefault("RAY_worker_niceness", "0")
            # log_to_driver=False: the actors' stdout and stderr stay in Ray's session logs
            # (/tmp/ray/session_*/logs); their errors reach the driver as exceptions of the
            # calls. The raylet's own error messages ("(raylet) A worker died ...") are printed
            # whatever the options: raylog below sends them to driver.log.
            ray.init(
                address="local",  # a new local Ray, never one left behind by `ray start`
                num_cpus=self.cfg.ray.num_cpus,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
            self.started_ray = True
        # the cluster's error paragraphs too ("(raylet) A worker died ..."): rollcall says
        # in one line what happened to its actor
        self._release_ray_messages = raylog.route_to_log()
        if started:
            # Ray's logger does not propagate, and with configure_logging=False it has no
            # handler: Python's last resort would print its warnings on the terminal. Up to the
            # root logger they go to driver.log (RunDir.capture_logs).
            logging.getLogger("ray").propagate = True
        self._reserve()

    def _reserve(self) -> None:
        """Reserve every trainer rank's and rollout node's slot before starting any (placement
        groups, ``orchestrator/runner/placement.py``); a job the cluster cannot hold is refused
        with one sentence, before the job writes anything."""
        from orchestrator.runner.placement import reserve

        self.placement = reserve(self.cfg, timeout_s=self.cfg.ray.placement_timeout_s)
        self.console.print(self._placed(), markup=False)

    def _placed(self) -> str:
        """One line: which Ray node holds the trainer's and each rollout slot's bundles."""
        from orchestrator.runner import raynodes
        from orchestrator.runner.placement import group_state

        table = raynodes.nodes()
        where: dict[str, list[str]] = {}
        p = self.placement
        for name, group in [("trainer", p.group)] + [
            (f"rollout-{i}", g) for i, g in enumerate(p.slots)
        ]:
            node = group_state(group)[1]
            where.setdefault(raynodes.host(table, node), []).append(name)
        return "placed: " + "; ".join(f"{', '.join(v)} on {k}" for k, v in where.items())

    def request_stop(self) -> None:
        """Finish after the current step (then stop the nodes, evaluate, save the policy);
        ``--resume`` continues later."""
        self._stop_requested.set()

    def _start_nodes(self) -> None:
        from orchestrator.runner.supervisor import Supervisor

        r = self.cfg.rollout
        self.supervisor = Supervisor(
            self.buffer,
            self._make_node,
            nodes=r.nodes,
            max_restarts=r.max_restarts,
            restart_window_s=r.restart_window_s,
            backoff_base_s=r.restart_backoff_s,
            start_timeout_s=r.start_timeout_s,
            engine_start_timeout_s=r.engine_start_timeout_s,
            machine_verdict_s=r.machine_verdict_s,
            drain_timeout_s=r.drain_timeout_s,
            placement=self.placement,
            say=lambda m: self.console.print(m, markup=False),
        )

    def node_config(self, index: int) -> NodeConfig:
        """The ``NodeConfig`` of rollout slot ``index``, from the job's config."""
        from workers.rollout.agent import Limits
        from workers.rollout.node import NodeConfig

        r = self.cfg.rollout
        return NodeConfig(
            name=f"rollout-{index}",
            model_dir=str(self.model_dir),
            concurrency=r.concurrency,
            heartbeat_interval_s=r.heartbeat_interval_s,
            tool_timeout_s=r.tool_timeout_s,
            limits=Limits(
                max_tokens_per_turn=r.max_tokens_per_turn,
                max_tokens=r.max_tokens,
                temperature=r.temperature,
            ),
            engine=r.engine,
            seed=self.cfg.run.seed * 1000 + index,
            threads=max(1, int(r.cpus_per_node)),
            breaker_failures=r.breaker_failures,
            retry_backoff_s=self.cfg.buffer.retry_backoff_s,
            failing_task_window=r.failing_task_window,
            failing_task_min_episodes=r.failing_task_min_episodes,
            tool_format=self.cfg.model.tool_format,
            chat_template=self.chat_template,
            engine_hook=self.engine_hooks.get(index),
            endpoint_host=r.agent_endpoint_host,
            weights_transport=self.cfg.trainer.weights.transport,
            weights_grace_s=self.cfg.trainer.weights.grace_s,
            db_connections=r.db_connections,
            db_idle_tx_timeout_s=self.cfg.control_plane.heartbeat_timeout_s,
        )

    def _make_node(self, index: int, strategy: Any = None) -> Any:
        """Slot ``index``'s actor, in its placement group's bundle (``strategy``)."""
        from workers.rollout.node import rollout_actor

        r = self.cfg.rollout
        actor = rollout_actor(
            num_cpus=r.cpus_per_node,
            num_gpus=r.gpus_per_node,
            resources=r.resources,
            scheduling_strategy=strategy,
        )
        return actor.remote(
            self.db.url.render_as_string(hide_password=False),
            self.job_id,
            self.node_config(index),
            self.cfg.buffer,
        )

    def _supervise(self) -> None:
        """A scheduler job, so supervision never waits on the loop (a trainer call may take
        up to ``trainer.call_timeout_s``)."""
        supervisor = self.supervisor
        if supervisor is not None:
            supervisor.check()

    def _start_evaluator(self) -> None:
        """The evaluator asks Ray for no resources (``num_cpus=0``), so it takes no reserved
        slot and always has somewhere to go."""
        from workers.evaluation import evaluator_actor

        if self.cfg.run.eval.episodes == 0:  # no evaluation (e.g. a benchmark's timing model)
            return
        r = self.cfg.rollout
        self.evaluator = evaluator_actor().remote(
            str(self.model_dir),
            max_tokens_per_turn=r.max_tokens_per_turn,
            max_tokens=r.max_tokens,
            temperature=self.cfg.run.eval.temperature,
            seed=self.cfg.run.seed + 7,
            tool_format=self.cfg.model.tool_format,
            chat_template=self.chat_template,
        )

    def _start_scheduler(self) -> None:
        from apscheduler.schedulers.background import BackgroundScheduler

        from orchestrator.runner.metrics import MissedRuns

        cp = self.cfg.control_plane
        # What libraries log (APScheduler's missed runs, the retries of a database outage)
        # goes to the run directory's driver.log, not the user's terminal (set up by setup()).
        if self._release_logs is None:
            self._release_logs = self.run_dir.capture_logs()
        # A pass that overlaps the previous one of the same job is skipped by design
        # (max_instances=1: e.g. supervision while a node starts); APScheduler warns about
        # each skip, which is noise here.
        logging.getLogger("apscheduler.scheduler").addFilter(SKIPPED_RUN_FILTER)  # once
        s = BackgroundScheduler(daemon=True, job_defaults=SCHEDULER_JOB_DEFAULTS)
        self.missed_runs = MissedRuns(s)
        # The control plane's calls see database outages: each one becomes an event and a
        # line once the database is back.
        self.buffer.record_outages = True
        self.buffer.on_outage = lambda o: self.console.print(o.describe(), markup=False)
        jobs = [
            (self.buffer.seed, cp.seed_interval_s, "seed"),
            (self.buffer.sweep_expired_leases, cp.lease_sweep_interval_s, "lease-sweep"),
            (self.buffer.expire_stale, cp.staleness_interval_s, "staleness-expiry"),
            (self._sweep_dead, cp.dead_sweep_interval_s, "dead-worker-sweep"),
            (self._supervise, cp.supervise_interval_s, "supervise"),
            (self.buffer.drop_old_payloads, cp.retention_interval_s, "payload-retention"),
            (self._report_user_errors, USER_ERRORS_INTERVAL_S, "user-errors"),
        ]
        for fn, every, name in jobs:
            s.add_job(fn, "interval", seconds=every, id=name)
        s.start()
        self.scheduler = s
        self.buffer.seed()

    def _start_metrics(self) -> None:
        from orchestrator.runner.metrics import start_exporter

        self.metrics = start_exporter(
            self.cfg,
            self.db,
            self.job_id,
            scheduler=self.scheduler,
            node_actors=lambda: self.supervisor.actors if self.supervisor is not None else [],
            missed_runs=self.missed_runs,
            say=lambda m: self.console.print(m, markup=False),
        )

    def _report_user_errors(self) -> None:
        if self.user_errors is not None:
            self.user_errors.poll()

    def _sweep_dead(self) -> None:
        cp = self.cfg.control_plane
        for d in self.buffer.sweep_dead_workers(cp.heartbeat_timeout_s, cp.progress_timeout_s):
            self.console.print(
                f"{d.name}: declared dead ({d.reason}); {d.swept.requeued} leases requeued",
                markup=False,
            )

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> RunResult:
        try:
            return self._run()
        except DriverFencedError:  # another driver has the job: its status is not ours
            raise
        except TasksPausedError:  # every task paused: stopped, resumable once they are fixed
            self._outcome = JobStatus.STOPPED
            raise
        except Exception as e:  # the job failed (the trainer over its budget, no node left)
            self._outcome = JobStatus.FAILED
            self._failure = e
            raise

    def _run(self) -> RunResult:
        cfg = self.cfg
        total = cfg.run.total_steps
        progress = Progress(self.console, enabled=self.live)
        started = time.monotonic()
        train_s = 0.0
        trained = 0
        trained_by_task: dict[str, int] = {}
        snap = Snapshot(cfg.job.name, cfg.run.mode, self.step, total, self.step, 0.0)
        stopped_early = False
        steps_this_run = 0
        refreshed = 0.0
        groups = GroupsListener(self.db.url, self.job_id)
        # A committed step's bookkeeping (``_after_step``) runs on this thread, in step order.
        # It starts once the next batch is claimed (or the loop waits for one), so it runs
        # while the trainer trains instead of competing with the claim for the CPU.
        after_step = ThreadPoolExecutor(max_workers=1, thread_name_prefix="after-step")
        pending: deque[Future[None]] = deque()
        after: tuple[Any, ...] | None = None

        def start_after_step() -> None:
            nonlocal after
            if after is not None:
                pending.append(after_step.submit(self._after_step, *after))
                after = None

        def raise_failed(*, wait: bool = False) -> None:
            """Re-raise a failed after-step pass (e.g. the database was down for longer than
            its retries), as the step itself would have; with ``wait``, of every pending one."""
            while pending and (wait or pending[0].done()):
                pending.popleft().result()

        try:
            if not self.run_dir.records("eval") or self.step == 0:
                self._evaluate(self.step, None)
            while self.step < total and not self._stop_requested.is_set():
                raise_failed()
                self._collect_evals(snap, block=False)
                batch = self.buffer.claim_batch(self.step, min_groups=cfg.buffer.batch_groups)
                start_after_step()
                if not batch.groups:
                    self._check_nodes_left()
                    self._check_tasks_left()
                    if time.monotonic() - refreshed >= WAIT_POLL_S:
                        snap.waiting = self._waiting_for()
                        self._refresh(snap, started, train_s, steps_this_run)
                        progress.update(snap)
                        refreshed = time.monotonic()
                    groups.wait(WAIT_POLL_S, count=batch.shortfall)
                    continue
                snap.waiting = ""
                try:
                    record = self._train_step(batch)
                except Exception as e:
                    if not is_trainer_failure(e):
                        raise
                    self._recover_trainer(e)
                    continue
                train_s += record["train_s"] + record["publish_s"] + record["checkpoint_s"]
                trained += batch.num_trajectories
                for g in batch.groups:
                    key = f"samples/{g.task_name}"
                    record[key] = record.get(key, 0) + len(g.trajectories)
                    trained_by_task[g.task_name] = trained_by_task.get(g.task_name, 0) + len(
                        g.trajectories
                    )
                steps_this_run += 1
                self.step += 1
                record.update(
                    trained_samples=trained, busy_frac=train_s / (time.monotonic() - started)
                )
                mix = {
                    v["name"]: v["groups"] for v in batch.task_mix.values() if isinstance(v, dict)
                }
                after = (record, mix, snap, progress, (started, train_s, steps_this_run))
                every = cfg.run.eval.every
                if every and self.step % every == 0 and self.step < total:
                    self._evaluate(self.step, record.get("weights_uri"))
            start_after_step()
            raise_failed(wait=True)
        except KeyboardInterrupt:
            stopped_early = True
            progress.message(
                f"interrupted at step {self.step}; continue with `rollcall run CONFIG --resume`"
            )
        finally:
            start_after_step()  # interrupted or failed: a committed step is still recorded
            after_step.shutdown(wait=True)
            groups.close()
            progress.close()
        wall = time.monotonic() - started
        if self.lifecycle is not None and self.lifecycle.fenced:  # another driver has the job
            raise DriverFencedError(self.lifecycle.fenced)
        final_dir = None
        if not stopped_early:
            self._stop_nodes()
            published = self.buffer.published_weights()
            self._evaluate(self.step, published[1] if published else None)
            self._collect_evals(snap, block=True)
            final_dir = self.trainer.save_final(str(self.run_dir.final))
            self.run_dir.plot(f"{cfg.job.name}: held-out reward ({cfg.run.mode})")
        self._outcome = JobStatus.FINISHED if self.step >= total else JobStatus.STOPPED
        return RunResult(
            job=cfg.job.name,
            run_dir=str(self.run_dir.root),
            steps=self.step,
            version=self.step,
            wall_s=wall,
            train_s=train_s,
            busy_frac=train_s / wall if wall > 0 else 0.0,
            trained_samples=trained,
            trained_by_task=trained_by_task,
            evals=self.run_dir.records("eval"),
            final_dir=final_dir,
            stopped_early=stopped_early,
        )

    def _check_nodes_left(self) -> None:
        """Every rollout node slot is over its restart budget, or none could be placed for
        ``rollout.capacity_wait_s``: nothing will fill a batch."""
        sup = self.supervisor
        waited = sup.waiting_for_capacity() if sup is not None else None
        limit = self.cfg.rollout.capacity_wait_s
        if waited is not None and waited > limit:
            from orchestrator.runner.placement import rollout_bundle

            bundle = ", ".join(f"{v:g} {k}" for k, v in rollout_bundle(self.cfg).items())
            self.buffer.event(
                "job.no_capacity",
                f"no rollout node could run for {waited:.0f} s; the job stops at step {self.step}",
                {"step": self.step, "waited_s": waited},
            )
            raise JobFailedError(
                f"job {self.cfg.job.name!r} stopped at step {self.step}: no rollout node could "
                f"run for {waited:.0f} s (rollout.capacity_wait_s {limit:g}): no machine in the "
                f"Ray cluster has room for one ({bundle}); add machines, or lower "
                "rollout.cpus_per_node, rollout.gpus_per_node or rollout.resources, and "
                "continue with --resume"
            )
        if sup is not None and sup.all_failed:
            why = "; ".join(sup.failures())
            self.buffer.event(
                "job.no_rollout_nodes",
                f"every rollout node failed; the job stops at step {self.step}: {why}",
                {"step": self.step, "failures": sup.failures()},
            )
            raise JobFailedError(
                f"job {self.cfg.job.name!r} stopped at step {self.step}: every rollout node "
                f"failed over its restart budget (rollout.max_restarts); fix the cause and "
                f"continue with --resume ({why})"
            )

    def _waiting_for(self) -> str:
        """What the trainer loop waits for, for the progress line."""
        sup = self.supervisor
        waited = sup.waiting_for_capacity() if sup is not None else None
        if waited is not None:
            return (
                f"waiting for capacity: no rollout node can run ({waited:.0f} s of "
                f"rollout.capacity_wait_s {self.cfg.rollout.capacity_wait_s:g})"
            )
        return "waiting for a full batch from the rollout nodes"

    def _check_tasks_left(self) -> None:
        """Every task is paused, at least one by the user-code guard, and nothing is in flight:
        nothing will fill a batch. The job stops with the reasons (after the last user-code
        errors are shown); it continues with ``--resume`` once the tasks are resumed."""
        from orchestrator.domain import TaskStatus, paused_sentence

        now = time.monotonic()
        if now - self._tasks_checked_at < TASKS_CHECK_INTERVAL_S:
            return
        self._tasks_checked_at = now
        tasks = self.buffer.tasks()
        if not tasks or any(t.status is not TaskStatus.PAUSED for t in tasks):
            return
        guarded = [t for t in tasks if t.status_reason]
        if not guarded or self.buffer.depth().get("leased", 0):
            return
        if self.user_errors is not None:
            self.user_errors.close()
        reasons = "; ".join(
            paused_sentence(t.name, t.job_name, t.status_reason or "") for t in guarded
        )
        self.buffer.event(
            "job.tasks_paused",
            f"every task is paused; the job stops at step {self.step}: {reasons}",
            {"step": self.step, "tasks": {t.name: t.status_reason for t in guarded}},
        )
        raise TasksPausedError(
            f"job {self.cfg.job.name!r} stopped at step {self.step}: every task is paused. "
            f"{reasons}"
        )

    def _train_step(self, batch: Any) -> dict[str, Any]:
        """The step's critical path, up to its commit: plan, train, checkpoint, publish,
        commit. What only reports on it is ``_after_step``'s."""
        from workers.trainer.batch import plan_step

        cfg = self.cfg.trainer
        step = batch.step
        t0 = time.monotonic()
        plan = plan_step(
            batch,
            cfg.loss,
            ranks=cfg.ranks,
            micro_batch_tokens=cfg.micro_batch_tokens,
            mini_batches=cfg.mini_batches,
        )
        t1 = time.monotonic()
        metrics = self.trainer.train(plan)
        if hook := self.fault_hooks.get("after_train"):
            hook(self)
        t2 = time.monotonic()
        last = step + 1 == self.cfg.run.total_steps
        ckpt = None
        if (step + 1) % cfg.checkpoint_every == 0 or last:
            ckpt = self.trainer.save_checkpoint(str(self.run_dir.checkpoint_path(step)), step)
        t3 = time.monotonic()
        weights_uri = None
        if (step + 1) % cfg.sync_every == 0 or last:
            if self.broadcaster is None:
                weights_uri = self.trainer.publish(str(self.run_dir.weights), step + 1)
            else:
                # the file is written off the critical path when this step's checkpoint holds
                # the same weights; else it is what a restarted trainer resumes from: at once
                weights_uri = self.trainer.publish(
                    str(self.run_dir.weights), step + 1, background=ckpt is not None
                )
        t4 = time.monotonic()
        record: dict[str, Any] = {
            "kind": "step",
            "step": step,
            "policy_version": step + 1,
            **plan.metrics,
            **metrics,
            "plan_s": t1 - t0,
            "train_s": t2 - t1,
            "checkpoint_s": t3 - t2,
            "publish_s": t4 - t3,
            "checkpoint_uri": ckpt,
            "weights_uri": weights_uri,
            "replayed": batch.replayed,
            "expired_groups": batch.expired_groups,
            "prefetched_groups": batch.prefetched_groups,
        }
        self.buffer.commit_step(
            step,
            checkpoint_uri=ckpt,
            weights_uri=weights_uri,
            metrics={k: v for k, v in record.items() if isinstance(v, int | float)},
        )
        record["commit_s"] = time.monotonic() - t4
        if weights_uri is not None and self.broadcaster is not None:
            t5 = time.monotonic()
            self._broadcast(step + 1)
            record["broadcast_s"] = time.monotonic() - t5
        return record

    def _broadcast(self, version: int) -> None:
        """Collective transport: the committed version to the live nodes (``broadcast.py``).
        Never fails the step, which is committed: whoever missed the version loads its file."""
        from orchestrator.runner import broadcast

        assert self.broadcaster is not None
        try:
            result = self.broadcaster.run(version, self.trainer, self.supervisor.members())
        except Exception as e:  # the trainer died: found by its next call
            log.warning("broadcasting version %s failed: %s", version, e)
            result = {
                "version": version,
                "members": [],
                "epochs": [],
                "loaded": [],
                "dropped": [],
                "errors": {"trainer": f"{type(e).__name__}: {e}"[:300]},
            }
        self.buffer.event(broadcast.EVENT, broadcast.describe(result), result)
        # the nodes up that did not get it load its file now rather than after grace_s
        for name, actor in self.supervisor.named_actors():
            if name not in result["loaded"]:
                actor.weights_missed.remote(version)

    def _after_step(
        self,
        record: dict[str, Any],
        mix: dict[str, int],
        snap: Snapshot,
        progress: Progress,
        timing: tuple[float, float, int],
    ) -> None:
        """A committed step's bookkeeping, on the after-step thread: the consumed groups'
        admission slots are filled again (first: in sync mode the next batch waits for it),
        the nodes' reports go into the step's record and the record into ``metrics.jsonl``,
        old checkpoints are pruned, up to a batch of finished groups is read ahead of the
        next claim, and the display moves on."""
        self.buffer.seed()
        record.update(self._node_metrics())
        self._check_is_weight(record, progress)
        self.run_dir.append(record)
        if record["checkpoint_uri"] is not None:
            self.run_dir.prune_checkpoints(self.cfg.trainer.keep_checkpoints)
        self.buffer.prefetch_groups(self.cfg.buffer.batch_groups)
        snap.reward = {k.split("/", 1)[1]: v for k, v in record.items() if k.startswith("reward/")}
        snap.mix = mix
        snap.staleness_mean = record["staleness_mean"]
        snap.staleness_max = record["staleness_max"]
        self._refresh(snap, *timing, step=record["policy_version"])
        progress.step_done(snap)

    def _check_is_weight(self, record: dict[str, Any], progress: Progress) -> None:
        """The rollout/trainer agreement watch (``orchestrator.runner.drift``): a warning (log,
        display, a ``trainer.is_weight_drift`` event) when the step's on-policy importance
        weight leaves the tolerance, rate-limited; ``is_weight_drift`` in the record."""
        watch = self.is_weight_watch
        notice = watch.check(record["step"], record)
        record["is_weight_drift"] = 1.0 if watch.drifting else 0.0
        if notice is None:
            return
        if notice.warning:
            log.warning("%s", notice.message)
            payload = {"step": record["step"], "weight": notice.weight}
            self.buffer.event(DRIFT_EVENT, notice.message, payload)
        else:
            log.info("%s", notice.message)
        progress.message(notice.message)

    def _node_metrics(self) -> dict[str, float]:
        """Weight-load latency and progress of the rollout nodes (their own reports), waited
        for up to ``NODE_REPORT_WAIT_S``. A node that has not answered the last step's request
        (frozen, or swamped) is not asked nor waited for again until it has: a hung node holds
        up one step's bookkeeping, not every step's until it is declared dead. The figures are
        of the nodes that answered (none: no figures); the others show in their heartbeats."""
        import ray

        asked: dict[str, Any] = {}
        owing: dict[str, Any] = {}
        for actor in self.supervisor.actors:
            key = actor._actor_id.hex()
            last = self._unanswered.get(key)
            if last is not None and not ray.wait([last], timeout=0)[0]:
                owing[key] = last
            else:
                asked[key] = actor.report.remote()
        refs = list(asked.values())
        ready = ray.wait(refs, num_returns=len(refs), timeout=NODE_REPORT_WAIT_S)[0] if refs else []
        answered = {ref.hex() for ref in ready}
        self._unanswered = owing | {k: r for k, r in asked.items() if r.hex() not in answered}
        reports = []
        for ref in ready:
            with contextlib.suppress(Exception):  # a node that died: its heartbeat shows it
                reports.append(ray.get(ref, timeout=0))
        if (refs or owing) and not reports:
            return {}
        if self.metrics is not None:
            self.metrics.take_reports(reports)
        loads = [r["weight_load_s_last"] for r in reports if r["weight_loads"]]
        return {
            "weight_load_s_max": max(loads) if loads else 0.0,
            "node_versions_min": float(min(r["version"] for r in reports)) if reports else 0.0,
            "tokens_generated": float(sum(r["tokens_generated"] for r in reports)),
        }

    def _refresh(
        self, snap: Snapshot, started: float, train_s: float, steps: int, step: int | None = None
    ) -> None:
        step = self.step if step is None else step
        elapsed = time.monotonic() - started
        snap.step = snap.version = step
        snap.elapsed_s = elapsed
        snap.busy_frac = train_s / elapsed if elapsed > 0 else 0.0
        left = self.cfg.run.total_steps - step
        snap.eta_s = self.pace.eta_s(elapsed_s=elapsed, steps=steps, left=left)
        snap.depth = self.buffer.depth()
        snap.nodes = [n for n in self.buffer.node_health() if n["role"] == "rollout"]

    # -- evaluation ---------------------------------------------------------------------------

    def _evaluate(self, step: int, location: str | None) -> None:
        from workers.evaluation import EvalTask

        if self.evaluator is None:
            return
        tasks = [EvalTask(t.name, t.plugin, t.spec) for t in self.cfg.tasks]
        ref = self.evaluator.evaluate.remote(tasks, self.cfg.run.eval.episodes, step, location)
        self.pending_evals.append((step, ref))

    def _collect_evals(self, snap: Snapshot, *, block: bool) -> None:
        import ray

        keep = []
        for step, ref in self.pending_evals:
            ready, _ = ray.wait([ref], timeout=None if block else 0)
            if not ready:
                keep.append((step, ref))
                continue
            try:
                reward = ray.get(ref)
            except ray.exceptions.RayError as e:
                # evaluation is not the job: a lost evaluator (its machine died) is replaced,
                # and this point of the learning curve is missing
                self.console.print(
                    f"evaluation at step {step} failed ({type(e).__name__}); "
                    "restarting the evaluator",
                    markup=False,
                )
                with contextlib.suppress(Exception):
                    ray.kill(self.evaluator)
                self._start_evaluator()
                continue
            # the mean per task, and each held-out episode's reward (for intervals and gains)
            means = {task: sum(rs) / len(rs) for task, rs in reward.items() if rs}
            self.run_dir.append({"kind": "eval", "step": step, "reward": means, "rewards": reward})
            snap.heldout = means
        self.pending_evals = keep

    # -- teardown -----------------------------------------------------------------------------

    def _stop_nodes(self) -> None:
        from orchestrator.domain import WorkerStatus

        if self.supervisor is None:
            return
        for wid in self.supervisor.stop():  # anything still leased goes back to the queue
            self.buffer.requeue_worker(wid, WorkerStatus.STOPPED)
        if self.metrics is not None:  # the nodes' last word (their final weight loads)
            self.metrics.take_reports(self.supervisor.final_reports)
        self.supervisor = None

    def close(self) -> None:
        """Stop everything this driver started, then record how the job ended (``finished``
        or ``stopped`` as ``run()`` ended; ``failed`` when an exception is on its way out,
        i.e. close() runs in the ``finally`` of a failed set-up or run) and release the job."""
        error = sys.exc_info()[1] or self._failure
        try:
            self._close_components()
        finally:
            self._end_lifecycle(error)

    def _end_lifecycle(self, error: BaseException | None) -> None:
        if self.lifecycle is None:
            return
        lifecycle, self.lifecycle = self.lifecycle, None
        step = getattr(self, "step", None)
        if self._outcome is not None:
            status = self._outcome
        elif error is None or isinstance(error, KeyboardInterrupt):
            status = JobStatus.STOPPED
        else:
            status = JobStatus.FAILED
        reason = "" if error is None else f"{type(error).__name__}: {str(error).splitlines()[0]}"
        if status is JobStatus.FINISHED:
            message = f"job finished at step {step}"
        elif status is JobStatus.STOPPED:
            message = f"job stopped at step {step}; `rollcall run CONFIG --resume` continues it"
        else:
            message = f"job failed at step {step}: {reason[:300]}"
        lifecycle.end(status, message, {"step": step, "reason": reason or None})

    def _close_components(self) -> None:
        import ray

        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.scheduler is not None:
            self.scheduler.shutdown(wait=True)  # a job mid-retry finishes its (bounded) window
            self.scheduler = None
        if self.user_errors is not None:
            self.user_errors.close()  # the counts not yet shown
            self.user_errors = None
        try:
            self._stop_nodes()
        except Exception:
            log.exception("stopping the rollout nodes failed")
        if self.trainer is not None:
            try:
                self.trainer.shutdown()
            except Exception:
                log.exception("stopping the trainer failed")
            self.trainer = None
        if self.evaluator is not None:
            ray.kill(self.evaluator)
            self.evaluator = None
        if self.placement is not None:
            self.placement.remove()
            self.placement = None
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False
        run_dir: RunDir | None = getattr(self, "run_dir", None)  # set by setup()
        if run_dir is not None:
            run_dir.close_trackers()
        if self._release_ray_messages is not None:
            self._release_ray_messages()
            self._release_ray_messages = None
        if self._release_logs is not None:
            self._release_logs()
            self._release_logs = None


class _SkippedRunFilter(logging.Filter):
    """Drops APScheduler's warning that a run was skipped because the previous one of the same
    job is still running; everything else it logs passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "maximum number of running instances reached" not in record.getMessage()


SKIPPED_RUN_FILTER = _SkippedRunFilter()


def _gcs_address() -> str | None:
    import ray

    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:  # only informs operators' commands
        return None
