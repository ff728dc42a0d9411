"""Errors an operator can act on.

A ``UserError`` carries one sentence that names the field at fault and the fix; the CLI prints
it and exits non-zero. Raising one inside a transaction rolls the transaction back, so bad
input never leaves a half-written row or partition behind.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input or a refused action; the message is shown to the operator as is."""

    exit_code = 2


class NotFoundError(UserError):
    """A named job or task does not exist."""

    exit_code = 3


class ConflictError(UserError):
    """The action conflicts with existing state (duplicate name, wrong status)."""

    exit_code = 4


class DriverFencedError(ConflictError):
    """Another driver took the job over (its driver epoch is newer): this driver's claim or
    step commit was refused, nothing of it written, and this driver must stop."""


class SchemaError(UserError):
    """The database schema is not at the head revision this rollcall expects."""

    exit_code = 5


class JobFailedError(UserError):
    """The job cannot go on (every rollout node is over its restart budget)."""

    exit_code = 7


class TasksPausedError(UserError):
    """Every task of the job is paused, at least one by the user-code guard (its code failed on
    most inputs): nothing can fill a batch. The job stops (resumable) with the reasons."""

    exit_code = 8


class StaleLeaseError(Exception):
    """A write by a worker whose lease on the episode has moved on (fencing). Nothing of the
    write was applied; the rejection is counted on the task (``fenced_rejections``)."""

    def __init__(self, episode_id: int, epoch: int, reason: str) -> None:
        self.episode_id = episode_id
        self.epoch = epoch
        self.reason = reason
        super().__init__(f"episode {episode_id}: write with lease epoch {epoch} rejected: {reason}")


class DatabaseUnavailableError(UserError):
    """The database could not be reached or started."""

    exit_code = 6


class PayloadMissingError(Exception):
    """A trajectory's stored segments do not cover its tokens: its payload was dropped by
    retention, or the table was changed by hand. Never expected on the job's own paths."""
