"""Default quota values, shared by the config models and the CLI (no imports: keeps --help fast)."""

DEFAULT_WEIGHT = 1.0
DEFAULT_MAX_INFLIGHT = 8
DEFAULT_MAX_STALENESS = 2
