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
replayed. Components get their collaborators passed in; none of them knows about the driver
(the trainer's start and recovery: ``trainer_control.py``; a step: ``trainstep.py``, then
``afterstep.py``; Ray: ``raystart.py``; the scheduler: ``scheduler.py``; the nodes: ``nodes.py``).

One driver per job (``rollcall.orchestrator.runner.lifecycle``): ``setup()`` refuses a second driver
of a running job before it changes anything, and moves the job's status through ``running``,
``stopping`` (``rollcall job stop``) and ``finished``/``stopped``/``failed`` (``close()``).

Modes: ``async`` (rollout never stops; data up to each task's ``max_staleness`` versions old)
and ``sync`` (the same machinery with every task's staleness bound at 0: the nodes generate one
batch with the current policy, the trainer trains on it, repeat).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from rollcall.orchestrator.buffer.control import ControlPlaneBuffer
from rollcall.orchestrator.buffer.trainer import TrainerBuffer
from rollcall.orchestrator.config import RollcallConfig, read_chat_template
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.db.notify import GroupsListener
from rollcall.orchestrator.domain import JobStatus, WorkerStatus
from rollcall.orchestrator.errors import DriverFencedError, TasksPausedError, UserError
from rollcall.orchestrator.quotas import BatchPolicy
from rollcall.orchestrator.runner import admission, raystart, scheduler, sessionlogs
from rollcall.orchestrator.runner.afterstep import StepBookkeeping
from rollcall.orchestrator.runner.broadcast import Broadcaster
from rollcall.orchestrator.runner.drift import IsWeightWatch
from rollcall.orchestrator.runner.dynamic import DynamicSampler
from rollcall.orchestrator.runner.evals import Evaluations
from rollcall.orchestrator.runner.lifecycle import JobLifecycle
from rollcall.orchestrator.runner.metrics import start_exporter
from rollcall.orchestrator.runner.nodes import NodeReports, make_node, make_supervisor, node_config
from rollcall.orchestrator.runner.outcome import RunResult, job_end
from rollcall.orchestrator.runner.progress import Pace, Progress, Snapshot
from rollcall.orchestrator.runner.rundir import RunDir
from rollcall.orchestrator.runner.stalls import StallChecks
from rollcall.orchestrator.runner.trainer_control import TrainerControl, is_trainer_failure
from rollcall.orchestrator.runner.trainstep import broadcast_version, train_step
from rollcall.orchestrator.runner.usererrors import UserErrorReport
from rollcall.orchestrator.services.jobs import create_job
from rollcall.orchestrator.services.tasks import check_agent_tasks, ensure_tasks
from rollcall.orchestrator.terminal import SafeConsole

if TYPE_CHECKING:
    from rollcall.workers.rollout.node import NodeConfig

log = logging.getLogger(__name__)
# Waiting for a full batch: the loop claims again when rollout nodes completed as many groups
# as the batch lacked (LISTEN/NOTIFY), and at the latest after WAIT_POLL_S.
WAIT_POLL_S = 0.25


class JobDriver:
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
        self.console = console or SafeConsole()
        self.live = live
        self.actor = actor
        self.supervisor: Any = None
        self.user_errors: UserErrorReport | None = None  # user-code failures, as they come
        self.stalls: StallChecks | None = None  # what the wait for a batch checks (setup)
        self.bookkeeping: StepBookkeeping | None = None  # a committed step's (setup)
        weights = config.trainer.weights
        self.broadcaster = (
            Broadcaster(weights, config.trainer.device)
            if weights.transport == "collective"
            else None
        )
        # the driver's buffers (setup): its trainer loop's (``trainer_buffer``) and its control
        # plane's (``control_buffer``)
        self.trainer_control: TrainerControl | None = None  # starts and recovers the trainer
        # Fault-injection seam for chaos tests and drills: called by name at points of a step
        # ("after_train": the optimizer stepped, nothing checkpointed or committed yet).
        self.fault_hooks: dict[str, Callable[[JobDriver], None]] = {}
        # ... and per rollout node slot, a "module:callable" that wraps its engine
        self.engine_hooks: dict[int, str] = {}
        self._stop_requested = threading.Event()
        self.evals: Evaluations | None = None  # the held-out evaluations (setup)
        self.scheduler: Any = None
        self.metrics: Any = None  # the Prometheus exporter (orchestrator/runner/metrics.py)
        self.node_reports = NodeReports()  # the nodes' reports, asked for after each step
        self.missed_runs: Any = None  # the scheduler's dropped runs (metrics.MissedRuns)
        self._release_logs: Callable[[], None] | None = None
        self._release_ray_messages: Callable[[], None] | None = None
        self.started_ray = False
        self.placement: Any = None  # the job's reserved slots (orchestrator/runner/placement.py)
        self.pace = Pace()  # the progress line's ETA
        self.lifecycle: JobLifecycle | None = None  # this driver's hold on its job
        self._outcome: JobStatus | None = None  # how run() ended, for the job's status
        self._failure: BaseException | None = None  # what ended a failed run()
        self.is_weight_watch = IsWeightWatch(
            config.trainer.is_weight_tolerance, config.trainer.is_weight_warn_every
        )

    # -- set-up -------------------------------------------------------------------------------

    def setup(self) -> None:

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
        admission.refuse_early(self.db, cfg.job.name, resume=self.resume, actor=self.actor)
        self.run_dir = RunDir(
            Path(cfg.run.dir) if cfg.run.dir else self.home / "runs" / cfg.job.name
        )
        self._release_logs = self._capture_logs()
        self._start_ray()
        with self.db.transaction() as tx:
            job = tx.jobs.get_by_name(cfg.job.name)
            admission.refusal(tx, job, cfg.job.name, resume=self.resume)
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
            self.lifecycle.info["ray_address"] = raystart.gcs_address()
            self.lifecycle.acquire()
            admission.refusal(tx, tx.jobs.get(job.id) or job, cfg.job.name, resume=self.resume)
            policy = BatchPolicy(cfg.buffer.batch_groups, cfg.trainer.sync_every, sync)
            for line in ensure_tasks(
                tx, job_name=job.name, tasks=cfg.tasks, actor=self.actor, sync=sync, policy=policy
            ):
                self.console.print(line, markup=False)
            epoch = self.lifecycle.start(tx, resume=self.resume)
        self.lifecycle.watch()  # stop requests, the lock after a database restart, fencing
        self.job_id = job.id
        control = self.control_buffer = ControlPlaneBuffer(self.db, job.id, cfg.buffer)
        control.prompt_bytes = cfg.rollout.input_limits.prompt_bytes
        # beside the control plane's: one view of the database's outages, one cost record
        self.trainer_buffer = TrainerBuffer(
            self.db, job.id, cfg.buffer, driver_epoch=epoch, beside=control
        )
        self.trainer_control = TrainerControl(
            cfg,
            self.db,
            job.id,
            self.trainer_buffer,
            model_dir=self.model_dir,
            placement=self.placement,
            console=self.console,
        )
        self.stalls = StallChecks(cfg, control)
        self.bookkeeping = StepBookkeeping(
            cfg,
            self.run_dir,
            control,
            self.trainer_buffer,
            node_metrics=self._node_metrics,
            pace=self.pace,
            is_weight_watch=self.is_weight_watch,
        )
        self.evals = Evaluations(
            cfg,
            self.run_dir,
            model_dir=self.model_dir,
            chat_template=self.chat_template,
            console=self.console,
        )
        self._recover_previous_run()  # only now that this driver holds the job
        control.set_fleet_size(cfg.rollout.nodes)  # a new run's fleet: the config's
        self.run_dir.write_config(cfg.model_dump(mode="json"))
        self.run_dir.start_trackers(
            cfg.run, job.name, lambda m: self.console.print(m, markup=False)
        )
        # what the nodes report of user code from here on (not what earlier runs saw)
        self.user_errors = UserErrorReport(
            control.events_after,
            control.last_event_id(),
            lambda m: self.console.print(m, markup=False),
        )
        self._start_trainer()
        self._start_nodes()
        self._start_evaluator()
        self._start_scheduler()
        self._start_metrics()

    def _recover_previous_run(self) -> None:
        """Work a previous driver of this job left behind goes through the normal paths: its
        workers' leases are requeued (the next claimer resumes from the checkpoints), and a
        batch claimed but not committed returns to ``ready``, reserved for the same step."""
        for w in self.control_buffer.node_health():
            if w["status"] in ("starting", "alive"):
                self.control_buffer.requeue_worker(w["id"], WorkerStatus.DEAD)
        self.trainer_buffer.release_trainer_claims()

    @property
    def trainer(self) -> Any:
        """The trainer group (None: not started, or stopped)."""
        return self.trainer_control.trainer if self.trainer_control is not None else None

    def _start_trainer(self) -> None:
        control = self.trainer_control
        assert control is not None
        try:
            control.start()
        finally:  # the job's step, read by the start, even when restoring it failed
            if control.version is not None:
                self.step = control.version

    def _start_ray(self) -> None:
        self.started_ray, self._release_ray_messages = raystart.start(
            self.cfg, self.home, self.console
        )
        self.placement = raystart.reserve(self.cfg, self.console)

    def request_stop(self) -> None:
        """Finish after the current step (then stop the nodes, evaluate, save the policy);
        ``--resume`` continues later."""
        self._stop_requested.set()

    def _start_nodes(self) -> None:
        self.supervisor = make_supervisor(
            self.cfg,
            self.control_buffer,
            self._make_node,
            self.placement,
            lambda m: self.console.print(m, markup=False),
        )

    def node_config(self, index: int) -> NodeConfig:
        """The ``NodeConfig`` of rollout slot ``index``, from the job's config."""
        return node_config(
            self.cfg,
            index,
            model_dir=self.model_dir,
            chat_template=self.chat_template,
            engine_hook=self.engine_hooks.get(index),
        )

    def _make_node(self, index: int, strategy: Any = None) -> Any:
        """Slot ``index``'s actor, in its placement group's bundle (``strategy``)."""
        url = self.db.url.render_as_string(hide_password=False)
        return make_node(
            self.cfg, url, self.job_id, self.node_config(index), self.cfg.buffer, strategy
        )

    def _start_evaluator(self) -> None:
        assert self.evals is not None
        self.evals.start()

    def _capture_logs(self) -> Callable[[], None]:
        """driver.log, rotated at ``run.log_max_mb`` with ``run.log_backups`` kept."""
        run = self.cfg.run
        return self.run_dir.capture_logs(run.log_max_mb * 1_000_000, run.log_backups)

    def _start_scheduler(self) -> None:
        control = self.control_buffer
        # What libraries log (APScheduler's missed runs, the retries of a database outage)
        # goes to the run directory's driver.log, not the user's terminal (set up by setup()).
        if self._release_logs is None:
            self._release_logs = self._capture_logs()
        s, self.missed_runs = scheduler.make_scheduler()
        # The control plane's calls (and the trainer buffer's beside them) see database
        # outages: each one becomes an event and a line once the database is back.
        control.record_outages = True
        control.on_outage = lambda o: self.console.print(o.describe(), markup=False)
        jobs = scheduler.control_plane_jobs(
            self.cfg,
            control,
            supervisor=lambda: self.supervisor,
            user_errors=lambda: self.user_errors,
            say=lambda m: self.console.print(m, markup=False),
            ray_logs=sessionlogs.pruner(self.cfg.ray, self.started_ray),
        )
        scheduler.start_jobs(s, jobs)
        self.scheduler = s
        control.seed()

    def _start_metrics(self) -> None:

        self.metrics = start_exporter(
            self.cfg,
            self.db,
            self.job_id,
            scheduler=self.scheduler,
            node_actors=lambda: self.supervisor.book.actors if self.supervisor is not None else [],
            missed_runs=self.missed_runs,
            say=lambda m: self.console.print(m, markup=False),
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
        # A committed step's bookkeeping (``afterstep.py``) runs on this thread, in step order.
        # It starts once the next batch is claimed (or the loop waits for one), so it runs
        # while the trainer trains instead of competing with the claim for the CPU.
        after_step = ThreadPoolExecutor(max_workers=1, thread_name_prefix="after-step")
        pending: deque[Future[None]] = deque()
        after: tuple[Any, ...] | None = None
        evals, stalls, books = self.evals, self.stalls, self.bookkeeping
        assert evals is not None and stalls is not None and books is not None
        assert self.trainer_control is not None

        def start_after_step() -> None:
            nonlocal after
            if after is not None:
                pending.append(after_step.submit(books.after_step, *after))
                after = None

        def raise_failed(*, wait: bool = False) -> None:
            """Re-raise a failed after-step pass (e.g. the database was down for longer than
            its retries), as the step itself would have; with ``wait``, of every pending one."""
            while pending and (wait or pending[0].done()):
                pending.popleft().result()

        def wait_for_groups(shortfall: int) -> None:
            """Wait for rollout to finish up to ``shortfall`` groups (at most WAIT_POLL_S),
            after checking that something can still finish them."""
            nonlocal refreshed
            stalls.check_nodes_left(self.supervisor, self.step)
            stalls.check_tasks_left(self.step, self.user_errors)
            if time.monotonic() - refreshed >= WAIT_POLL_S:
                snap.waiting = stalls.waiting_for(self.supervisor)
                books.refresh(snap, self.step, started, train_s, steps_this_run)
                progress.update(snap)
                refreshed = time.monotonic()
            groups.wait(WAIT_POLL_S, count=shortfall)

        sampler = (
            DynamicSampler(
                cfg.trainer.loss,
                cfg.buffer.batch_groups,
                self.trainer_buffer,
                job=cfg.job.name,
                say=progress.message,
            )
            if cfg.trainer.loss.dynamic_sampling is not None
            else None
        )
        try:
            if not self.run_dir.records("eval") or self.step == 0:
                evals.evaluate(self.step, None)
            while self.step < total and not self._stop_requested.is_set():
                raise_failed()
                evals.collect(snap, block=False)
                batch = self.trainer_buffer.claim_batch(
                    self.step, min_groups=cfg.buffer.batch_groups
                )
                start_after_step()
                if not batch.groups:
                    wait_for_groups(batch.shortfall)
                    continue
                if sampler is not None:  # dynamic sampling: groups with variance, or more
                    filled = sampler.fill(
                        batch, wait=wait_for_groups, stopped=self._stop_requested.is_set
                    )
                    if filled is None:  # stopped: the reservation is replayed by --resume
                        break
                    batch = filled
                snap.waiting = ""
                try:
                    record = train_step(
                        batch,
                        cfg,
                        self.trainer,
                        self.run_dir,
                        self.trainer_buffer,
                        collective=self.broadcaster is not None,
                        after_train=self._after_train,
                        broadcast=self._broadcast,
                    )
                except Exception as e:
                    if not is_trainer_failure(e):
                        raise
                    self.step = self.trainer_control.recover(e, self.step)
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
                    evals.evaluate(self.step, record.get("weights_uri"))
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
            published = self.trainer_buffer.published_weights()
            evals.evaluate(self.step, published[1] if published else None)
            evals.collect(snap, block=True)
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

    def _after_train(self) -> None:
        """The fault-injection seam of a step: the optimizer stepped, nothing checkpointed or
        committed yet."""
        if hook := self.fault_hooks.get("after_train"):
            hook(self)

    def _broadcast(self, version: int) -> None:
        assert self.broadcaster is not None
        broadcast_version(
            self.broadcaster, version, self.trainer, self.supervisor, self.trainer_buffer
        )

    def _node_metrics(self) -> dict[str, float]:
        """The rollout nodes' reports for the step's record (``NodeReports``)."""
        return self.node_reports.collect(self.supervisor.book.actors, self.metrics)

    # -- teardown -----------------------------------------------------------------------------

    def _stop_nodes(self) -> None:

        if self.supervisor is None:
            return
        for wid in self.supervisor.stop():  # anything still leased goes back to the queue
            self.control_buffer.requeue_worker(wid, WorkerStatus.STOPPED)
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
        lifecycle.end(*job_end(self._outcome, error, getattr(self, "step", None)))

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
        if self.trainer_control is not None:
            self.trainer_control.shutdown()
        if self.evals is not None:
            self.evals.close()
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
