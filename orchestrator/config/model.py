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
    cluster to join, e.g. ``ray://head:10001`` or ``auto``."""

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
