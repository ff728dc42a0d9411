"""Bounds of every number a user gives rollcall: config values, CLI options, service inputs.

One place for them. The config models (``rollcall.orchestrator.config``,
``rollcall.orchestrator.algorithms``)
build their pydantic constraints from these ranges (``Range.field()``); the CLI commands and the
task services check options and arguments with ``Range.check``, which raises a ``UserError`` of
one sentence that names the option. An integer the database stores is bounded by its column
(``integer``: int32) and by what makes sense; floats must be finite everywhere (the config
models also set ``allow_inf_nan=False``).

Standard library and ``rollcall.orchestrator.errors`` only: the CLI imports this before it decides
to load pydantic or SQLAlchemy (``rollcall --help`` stays fast).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rollcall.orchestrator.errors import UserError

INT32_MAX = 2**31 - 1  # PostgreSQL ``integer``
WEEK_S = 7 * 24 * 3600.0


def _num(v: float) -> str:
    return str(v) if isinstance(v, int) else f"{v:g}"


@dataclass(frozen=True)
class Range:
    """``lo <= x <= hi`` (``lo < x`` with ``lo_open``, ``x < hi`` with ``hi_open``), finite."""

    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below

    def describe(self) -> str:
        lo = f"greater than {_num(self.lo)}" if self.lo_open else f"at least {_num(self.lo)}"
        hi = f"less than {_num(self.hi)}" if self.hi_open else f"at most {_num(self.hi)}"
        return f"{lo} and {hi}"

    def check(self, name: str, value: float | None, hint: str = "") -> None:
        """Raise a one-sentence ``UserError`` naming ``name`` unless ``value`` is in range
        (None: not given, nothing to check)."""
        if value is None or value in self:
            return
        got = _num(value) if isinstance(value, int | float) else repr(value)
        raise UserError(
            f"{name} must be {'a finite number ' if _is_nonfinite(value) else ''}"
            f"{self.describe()} (got {got})" + (f"; {hint}" if hint else "")
        )

    def field(self) -> Any:
        """The pydantic constraint, for ``Annotated[int | float, RANGE.field()]``."""
        from pydantic import Field

        lo, hi = self.lo, self.hi
        return Field(
            gt=lo if self.lo_open else None,
            ge=None if self.lo_open else lo,
            lt=hi if self.hi_open else None,
            le=None if self.hi_open else hi,
        )


def _is_nonfinite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


# -- task quotas (tasks.weight: double precision; max_inflight, max_staleness: integer) -------
WEIGHT = Range(1e-6, 1e6)
MAX_INFLIGHT = Range(1, 100_000)
MAX_STALENESS = Range(0, 1_000)

# -- the buffer -------------------------------------------------------------------------------
BATCH_GROUPS = Range(1, 100_000)
# The admission caps of a job's tasks together (each ``ceil((max_staleness + 1) * share)``):
# the first seed queues that many episodes in one transaction, so it must stay modest.
MAX_ADMITTED_GROUPS = 100_000
ATTEMPTS = Range(1, 1_000)
# Extra batch claims of one train step while it lacks groups with variance (dynamic sampling).
EXTRA_CLAIMS = Range(1, 1_000)
# Buckets of a weight broadcast (MB): 64 kB to 16 GB.
BUCKET_MB = Range(0.0625, 16_384.0)
# Steps whose consumed payloads retention keeps (0: dropped at the next pass).
RETENTION_STEPS = Range(0, 10_000_000)
# A job's audit log (events): kept this long (at least the hour retention never touches, up
# to ten years), and at most this many per job.
EVENT_RETENTION_S = Range(3_600, 3_650 * 86_400)
EVENT_RETENTION_COUNT = Range(1_000, 1_000_000_000)

# -- durations (seconds) ----------------------------------------------------------------------
SECONDS = Range(1e-3, WEEK_S)  # timeouts, intervals, windows, leases
SECONDS_OR_ZERO = Range(0, WEEK_S)  # retry windows, simulated costs
TIME_SCALE = Range(1e-6, 1e3)  # real seconds per simulated second (benchmarks)
SECONDS_PER_TOKEN = Range(0, 3_600)

# -- counts -----------------------------------------------------------------------------------
STEPS = Range(1, 10_000_000)  # train_steps.step, policy versions: integer
STEPS_OR_ZERO = Range(0, 10_000_000)
KEEP = Range(1, 1_000)  # checkpoints / published weight versions kept
LOG_MB = Range(1, 1_000_000)  # the size driver.log rotates at (MB)
LOG_BACKUPS = Range(1, 1_000)  # rotated driver.log files kept
LOG_MB_DEFAULT = 20
LOG_BACKUPS_DEFAULT = 5
RAY_LOG_MB_DEFAULT = 50  # each of a local Ray's log files (Ray's own default: 512 MB)
RAY_LOG_BACKUPS_DEFAULT = 5
DEAD_WORKER_LOGS = Range(0, 1_000_000)  # exited Ray workers whose log files are kept
RESTARTS = Range(0, 10_000)
NODES = Range(1, 4_096)  # rollout nodes, trainer ranks, agent loops per node
CONNECTIONS = Range(1, 1_000)  # a process's database connections
CPUS = Range(1, 100_000)  # a local Ray's num_cpus
RAY_AMOUNT = Range(0, 10_000)  # CPUs, GPUs or custom resources of one actor (0: none)
RAY_AMOUNT_MIN = 1e-4  # Ray's resolution: a non-zero amount below it is an error
MAX_TOKENS = 2**24  # token counts (trajectories.num_tokens: integer)
EPISODES = Range(0, 100_000)
EVAL_SAMPLES = Range(1, 1_024)  # samples per held-out prompt (pass@k)
REWARD = Range(-1e6, 1e6)
SEED = Range(0, 1_000_000)  # node seeds are seed * 1000 + index: within numpy's uint32
PORT = Range(0, 65_535)
BYTES = Range(1, INT32_MAX)  # a benchmark's published weights: up to 2 GiB per version
INPUT_BYTES = Range(1_024, 1_073_741_824)  # a limit on one untrusted input: 1 KiB to 1 GiB
SANDBOX_CPU_S = Range(1, 86_400)  # a tool call's CPU seconds (RLIMIT_CPU: whole seconds)
SANDBOX_MB = Range(16, 1_048_576)  # a tool process's address space or largest file, MiB
SANDBOX_COUNT = Range(1, 1_000_000)  # a tool process's processes or open files
PREFIX_CACHE_ENTRIES = Range(0, 10_000_000)
GPUS_PER_ENGINE = Range(1, 1_024)
MAX_NUM_SEQS = Range(1, 65_536)
CPU_KV_CACHE_GIB = Range(1, 1_024)
MINI_BATCHES = Range(1, 10_000)

# -- optimisation and sampling ----------------------------------------------------------------
TEMPERATURE = Range(1e-3, 1e3)
LR = Range(0, 1, lo_open=True)
WEIGHT_DECAY = Range(0, 1)
BETA = Range(0, 1, hi_open=True)  # AdamW refuses 1 and above
FRACTION = Range(0, 1)
GPU_MEMORY_UTILIZATION = Range(0.01, 1)
GRAD_CLIP = Range(0, 1e6, lo_open=True)
COEF = Range(0, 1e3)  # KL and entropy coefficients, slopes
CLIP_LOW = Range(0, 1, lo_open=True, hi_open=True)
CLIP_HIGH = Range(0, 10, lo_open=True)
IS_CAP = Range(1, 1e6)  # importance-weight caps
EPS = Range(1e-12, 1)
LORA_RANK = Range(1, 4_096)
LORA_ALPHA = Range(1, 1_000_000)
LORA_DROPOUT = Range(0, 1, hi_open=True)
LOGPROB = Range(-100, 0)

# -- CLI-only options -------------------------------------------------------------------------
WATCH_INTERVAL = Range(0.1, 86_400)
REFRESHES = Range(0, 1_000_000)
EVENTS_SHOWN = Range(0, 10_000)
EVENTS_LIMIT = Range(1, 100_000)
DRILL_COUNT = NODES
PREVIEW_EPISODES = Range(1, 1_000)
MODEL_HIDDEN = Range(32, 8_192)
MODEL_LAYERS = Range(1, 128)
MODEL_HEADS = Range(1, 256)
SFT_STEPS = Range(0, 1_000_000)
SINCE_MAX_S = 100 * 365 * 86_400.0  # --since: at most a century back


def tokens(lo: int) -> Range:
    """A token count of at least ``lo``, at most ``MAX_TOKENS``."""
    return Range(lo, MAX_TOKENS)


def ray_amount(value: float) -> float:
    """A pydantic after-validator: 0, or at least Ray's resolution."""
    if 0 < value < RAY_AMOUNT_MIN:
        raise ValueError(f"a non-zero resource amount must be at least {RAY_AMOUNT_MIN:g}")
    return value
