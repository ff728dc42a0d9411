"""A job's lifecycle as its driver lives it: one driver per job, the job's status, stop
requests from another terminal.

``acquire()`` takes the job's driver lock (``rollcall.orchestrator.db.driver_lock``) or refuses this
driver with one sentence (and a ``job.driver_refused`` event) while another one runs the job.
``start(tx)`` then bumps the job's driver epoch (step commits are fenced by it), sets the job
``running`` and records ``job.driver_started``. ``watch()`` starts a thread that every
``WATCH_INTERVAL_S`` checks the lock (taking it again after a database restart dropped its
connection) and reads the job row: ``stopping`` (``rollcall job stop``) calls the driver's
``on_stop``; a newer epoch (another driver took the job while this one's lock was lost) fences
this driver: ``fenced`` says why and ``on_stop`` ends its loop. ``end()`` writes the final
status (``finished``, ``stopped`` or ``failed``, fenced by the epoch) with its event, stops the
watch and releases the lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from rollcall.orchestrator.db.driver_lock import DriverLock
from rollcall.orchestrator.db.engine import Database, Tx
from rollcall.orchestrator.db.retry import retry_transient
from rollcall.orchestrator.domain import JobStatus
from rollcall.orchestrator.errors import ConflictError
from rollcall.orchestrator.services.jobs import describe_driver

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 1.0
ACTOR = "driver"


class JobLifecycle:
    def __init__(
        self,
        db: Database,
        job_id: int,
        job_name: str,
        *,
        actor: str,
        on_stop: Callable[[], None],
        say: Callable[[str], None],
        retry_window_s: float = 30.0,
    ) -> None:
        self.db = db
        self.job_id = job_id
        self.job_name = job_name
        self.actor = actor
        self.on_stop = on_stop
        self.say = say
        self.retry_window_s = retry_window_s
        self.info: dict[str, Any] = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "actor": actor,
        }
        self.lock = DriverLock(
            db.url, job_id, application_name=f"rollcall-driver pid {os.getpid()}"
        )
        self.epoch: int | None = None  # set once this driver has taken the job
        self.fenced: str | None = None  # why this driver lost the job to another
        self.stop_seen = False
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost_lock = False

    # -- taking the job ----------------------------------------------------------------------

    def acquire(self) -> None:
        """Take the job's driver lock, or refuse this driver: another one runs the job."""
        if self.lock.acquire():
            return
        self.lock.close()
        raise refuse(self.db, self.job_id, self.job_name, self.actor, self.info)

    def start(self, tx: Tx, *, resume: bool) -> int:
        """This driver holds the lock: take the job (in the caller's transaction)."""
        self.info["started_at"] = tx.workers.db_now().isoformat()
        epoch = tx.jobs.take_driver(self.job_id, self.info)
        tx.events.add(
            "job.driver_started",
            self.actor,
            f"driver started (pid {self.info['pid']} on {self.info['host']}, driver epoch "
            f"{epoch}{', resuming' if resume else ''})",
            job_id=self.job_id,
            payload={**self.info, "epoch": epoch, "resume": resume},
        )
        self.epoch = epoch
        return epoch

    # -- while it runs -----------------------------------------------------------------------

    def watch(self) -> None:
        self._thread = threading.Thread(
            target=self._watch, name=f"job-watch-{self.job_id}", daemon=True
        )
        self._thread.start()

    def _watch(self) -> None:
        while not self._closing.wait(WATCH_INTERVAL_S):
            try:
                if not self.tick():
                    return
            except Exception:  # the watch must outlive anything unexpected
                log.exception("job %s: watching the job row failed", self.job_name)

    def tick(self) -> bool:
        """One look at the lock and the job row; False once this driver is fenced."""
        check = self.lock.check()
        if not check.reachable:
            if not self._lost_lock:
                log.warning(
                    "job %s: the database is unreachable; the driver keeps the job and takes "
                    "its lock again when the database is back",
                    self.job_name,
                )
            self._lost_lock = True
            return True
        if check.epoch is not None and check.epoch != self.epoch:
            self._fence(check.epoch)
            return False
        if check.retaken:
            self._lost_lock = False
            log.warning("job %s: driver lock taken again after a lost connection", self.job_name)
            self._event(
                "job.driver_relocked",
                f"driver (pid {self.info['pid']}) took its lock again after its connection "
                "to the database was lost",
                {"epoch": self.epoch},
            )
        elif not check.held:
            # Some session holds the lock without having taken the job (yet): a driver between
            # its lock and its epoch bump, whose bump then fences this one, or this driver's
            # own session that the server has not yet seen die. Keep trying.
            self._lost_lock = True
        if check.status == JobStatus.STOPPING.value and not self.stop_seen:
            self.stop_seen = True
            self.say(
                f"job {self.job_name}: stop requested (rollcall job stop); finishing the step "
                "in progress, then stopping the nodes, evaluating and saving the policy"
            )
            self.on_stop()
        return True

    def _fence(self, epoch: int) -> None:
        self.fenced = (
            f"job {self.job_name!r} was taken over by another driver (driver epoch {epoch}; "
            f"this one's was {self.epoch}) while this driver's lock was lost; this driver "
            "stopped without committing more steps"
        )
        self.say(self.fenced)
        self._event("job.driver_fenced", self.fenced, {"epoch": self.epoch, "newer": epoch})
        self.on_stop()

    def _event(self, kind: str, message: str, payload: dict[str, Any]) -> None:
        # an event is not worth failing the driver for
        with contextlib.suppress(Exception), self.db.transaction() as tx:
            tx.events.add(
                kind,
                self.actor,
                message,
                job_id=self.job_id,
                payload={**payload, "pid": self.info["pid"], "host": self.info["host"]},
            )

    # -- the end -----------------------------------------------------------------------------

    def end(self, status: JobStatus, message: str, payload: dict[str, Any]) -> None:
        """Stop watching, record the job's end (unless this driver never took the job, or
        lost it to another) and release the lock."""
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        try:
            if self.epoch is not None and self.fenced is None:
                try:
                    self._write_end(status, message, payload)
                except Exception:
                    log.exception("job %s: recording its end (%s) failed", self.job_name, status)
        finally:
            self.lock.close()

    @retry_transient
    def _write_end(self, status: JobStatus, message: str, payload: dict[str, Any]) -> None:
        assert self.epoch is not None
        with self.db.transaction() as tx:
            if tx.jobs.set_driver_status(self.job_id, self.epoch, status.value):
                tx.events.add(
                    f"job.{status.value}",
                    self.actor,
                    message,
                    job_id=self.job_id,
                    payload={**payload, "epoch": self.epoch, "pid": self.info["pid"]},
                )


def refuse(db: Database, job_id: int, name: str, actor: str, info: dict[str, Any]) -> ConflictError:
    """A second driver for job ``name`` is refused: the ``job.driver_refused`` event (in its
    own transaction) and the error to raise."""
    with db.transaction() as tx:
        job = tx.jobs.get(job_id)
        holder = describe_driver(job.driver if job else None)
        tx.events.add(
            "job.driver_refused",
            actor,
            f"a second driver (pid {info['pid']} on {info['host']}) was refused: job {name!r} "
            f"is run by {holder}",
            job_id=job_id,
            payload={"refused": info, "holder": job.driver if job else None},
        )
    return already_running(name, job.driver if job else None)


def already_running(name: str, driver: dict[str, Any] | None) -> ConflictError:
    """The refusal of a second driver for job ``name`` (``driver``: the holder's details)."""
    return ConflictError(
        f"job {name!r} is already running under another driver ({describe_driver(driver)}); "
        f"a second one would take its work, so stop it first with `rollcall job stop {name}` "
        "(or wait for it to end) and run again with --resume"
    )
