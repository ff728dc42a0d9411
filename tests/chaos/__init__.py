"""Fault-injection tests (SIGKILL, hangs, database restarts) that check the invariants of
docs/architecture.md against the database afterwards."""
