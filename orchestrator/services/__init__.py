"""Operator-facing actions, shared by the CLI and the runtime. Each takes a ``Tx`` (the caller
owns the transaction), validates its input before writing anything, and records an event."""
