"""The ``database``, ``model`` and ``ray`` sections."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import Field, SecretStr

from rollcall.orchestrator import bounds as b
from rollcall.orchestrator.config.base import Seconds, StrictModel


class DatabaseConfig(StrictModel):
    """Where the control plane lives. ``url`` unset: the embedded PostgreSQL in ROLLCALL_HOME."""

    url: SecretStr | None = Field(
        default=None,
        description="postgresql://USER:PASSWORD@HOST:5432/DB (PostgreSQL 14 or newer); unset: the "
        "embedded PostgreSQL. --database-url / ROLLCALL_DATABASE_URL take precedence. The "
        "password is never printed or logged; the run directory keeps it masked",
    )


# the models rollcall provides by name (ROLLCALL_HOME/models/<name>, put there on first use)
BuiltinModel = Literal["tiny", "smollm2-135m"]
BUILTIN_MODELS: tuple[str, ...] = get_args(BuiltinModel)


class ModelConfig(StrictModel):
    """The policy to train. ``path`` unset: the built-in model ``builtin`` in
    ROLLCALL_HOME/models: ``tiny`` copied from the package (what ``rollcall model init`` builds)
    or ``smollm2-135m`` imported (``rollcall model import smollm2``) on first use."""

    path: str | None = Field(
        default=None,
        description="a transformers (save_pretrained) folder; unset: "
        "ROLLCALL_HOME/models/<builtin>",
    )
    builtin: BuiltinModel = Field(
        default="tiny",
        description="the model used when path is unset: tiny (the build of `rollcall model init` "
        "shipped with the package, copied in if missing) or smollm2-135m (imported by "
        "`rollcall model import smollm2` if missing)",
    )
    tool_format: Literal["auto", "hermes", "json", "rollcall"] = Field(
        default="auto",
        description="how the model writes tool calls; auto: rollcall for the tiny model, hermes "
        "for Qwen, Llama (SmolLM2), Mistral and SmolLM3 models, json otherwise",
    )
    chat_template: str | None = Field(
        default=None,
        description="a Jinja chat template file to use instead of the tokenizer's own",
    )


class RayConfig(StrictModel):
    """``address`` unset: a local Ray started for the job (``num_cpus`` caps it); otherwise the
    cluster to join, e.g. ``ray://head:10001`` or ``auto``. The ``log_*`` and
    ``dead_worker_logs*`` bounds apply to a local Ray only: a joined cluster's session is its
    operator's."""

    address: str | None = Field(
        default=None,
        description="unset: a local Ray started for the job; or a cluster to join: auto, "
        "ray://head:10001",
    )
    num_cpus: Annotated[int, b.CPUS.field()] | None = Field(
        default=None, description="CPUs of the local Ray (unset: the machine's)"
    )
    placement_timeout_s: Seconds = Field(
        default=120.0,
        description="the job's reserved resources must be placed by then at start, and a "
        "restarted trainer's ranks in their reserved slots",
    )
    log_max_mb: Annotated[int, b.LOG_MB.field()] = Field(
        default=b.RAY_LOG_MB_DEFAULT,
        description="a local Ray's log files (each worker's output, the raylet's, GCS's) "
        "rotate when they would grow past this many MB; RAY_ROTATION_MAX_BYTES in the "
        "environment wins; a joined cluster: set where `ray start` runs",
    )
    log_backups: Annotated[int, b.LOG_BACKUPS.field()] = Field(
        default=b.RAY_LOG_BACKUPS_DEFAULT,
        description="rotated files kept of each of a local Ray's log files; "
        "RAY_ROTATION_BACKUP_COUNT in the environment wins",
    )
    dead_worker_logs: Annotated[int, b.DEAD_WORKER_LOGS.field()] | None = Field(
        default=20,
        description="a local Ray's log files of worker processes that have exited are deleted "
        "(every control_plane.retention_interval_s), except those of the newest this many "
        "and those written within dead_worker_logs_s; null: all kept",
    )
    dead_worker_logs_s: Seconds = Field(
        default=3_600.0,
        description="an exited Ray worker's log files written to within this many seconds "
        "are kept (see dead_worker_logs)",
    )
