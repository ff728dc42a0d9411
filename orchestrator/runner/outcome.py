"""How a run ended: what ``JobDriver.run()`` returns (``RunResult``), and the status and
sentence its job ends with (``job_end``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollcall.orchestrator.domain import JobStatus


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


def job_end(
    outcome: JobStatus | None, error: BaseException | None, step: int | None
) -> tuple[JobStatus, str, dict[str, Any]]:
    """The job's status, event message and payload: ``outcome`` (how ``run()`` ended) when
    it ended, else ``stopped`` (no error, or an interrupt) or ``failed`` (``error``)."""
    if outcome is not None:
        status = outcome
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
    return status, message, {"step": step, "reason": reason or None}
