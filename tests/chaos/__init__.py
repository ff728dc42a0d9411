"""Fault-injection tests (SIGKILL, hangs, database restarts) that check the invariants of
ARCHITECTURE.md against the database afterwards."""
