"""The contract every task plugin implements.

A plugin has a registered ``name``, a one-line ``description`` and a ``Spec``: a pydantic model
(``extra="forbid"``) that validates the YAML given to ``rollcall task register --spec``. Its
prompt stream is deterministic: ``prompt(spec, index)`` is a pure function of the spec and the
index, so a restart that resumes from a persisted cursor neither repeats nor skips prompts.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field


class TaskSpec(BaseModel):
    """Fields every task spec has; plugins subclass it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    group_size: int = Field(default=4, ge=1, le=1024, description="samples per prompt (GRPO group)")
    seed: int = Field(default=0, description="seed of the prompt stream")


@runtime_checkable
class TaskPlugin(Protocol):
    name: ClassVar[str]
    description: ClassVar[str]
    Spec: ClassVar[type[TaskSpec]]

    def prompt(self, spec: TaskSpec, index: int) -> dict[str, Any]:
        """The ``index``-th prompt of the stream (a JSON-serialisable mapping)."""
        ...

    def reward(self, spec: TaskSpec, prompt: dict[str, Any], completion: str) -> float:
        """Pure, deterministic reward of a finished completion."""
        ...
