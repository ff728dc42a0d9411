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


class SchemaError(UserError):
    """The database schema is not at the head revision this rollcall expects."""

    exit_code = 5


class DatabaseUnavailableError(UserError):
    """The database could not be reached or started."""

    exit_code = 6
