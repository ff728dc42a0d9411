"""The ``job`` and ``tasks`` sections: the job's name, and each task with its quota."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from rollcall.orchestrator import bounds as b
from rollcall.orchestrator.config.base import StrictModel, check_name
from rollcall.orchestrator.defaults import (
    DEFAULT_MAX_INFLIGHT,
    DEFAULT_MAX_STALENESS,
    DEFAULT_WEIGHT,
)


class JobSection(StrictModel):
    """The job this config runs (created on first run, continued with ``--resume``)."""

    name: str = Field(
        default="default",
        description="1-63 lowercase letters, digits, '-' or '_', starting with a letter",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v, "job.name")


class TaskConfig(StrictModel):
    """One task of a job, with its quota."""

    name: str = Field(description="unique within the job; a valid name, as job.name")
    plugin: str = Field(
        description="a registered plugin name (see `rollcall task plugins`); set to agent by "
        "tasks[].agent"
    )
    agent: str | None = Field(
        default=None,
        description="your own async agent function instead of a plugin: "
        "'package.module:function' or 'path/to/file.py:function' (docs/agents.md); needs "
        "tasks[].prompts",
    )
    prompts: dict[str, Any] | None = Field(
        default=None,
        description="the agent's prompt source: {path: FILE-OR-GLOB (.jsonl, .parquet)} or "
        "{dataset: NAME-OR-FOLDER, split: train}, with key (the column that splits off held-out "
        "rows) and held_out_per_mille (default 100)",
    )
    weight: Annotated[float, b.WEIGHT.field()] = Field(
        default=DEFAULT_WEIGHT,
        description="share, among the tasks competing at that moment, of rollout claims and of "
        "the groups in each training batch; a task with nothing to offer gives its share to the "
        "others for that moment (recorded as shortfall in the step's task mix, not owed later)",
    )
    max_inflight: Annotated[int, b.MAX_INFLIGHT.field()] = Field(
        default=DEFAULT_MAX_INFLIGHT,
        description="most episodes of this task leased at once (checked at every claim)",
    )
    max_staleness: Annotated[int, b.MAX_STALENESS.field()] = Field(
        default=DEFAULT_MAX_STALENESS,
        description="most policy versions a trained trajectory's oldest turn may lag; finished "
        "groups that fall out of the bound are expired and their prompts queued again",
    )
    spec: dict[str, Any] = Field(
        default_factory=dict,
        description="the task's settings, validated by the plugin's Spec model (e.g. "
        "group_size, max_turns)",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v, "tasks[].name")

    @model_validator(mode="before")
    @classmethod
    def _agent(cls, data: Any) -> Any:
        """``agent`` and ``prompts`` are the agent plugin's spec, said at the task's level."""
        if not isinstance(data, dict) or data.get("agent") is None:
            if isinstance(data, dict) and data.get("prompts") is not None:
                raise ValueError("tasks[].prompts is for agent tasks; set tasks[].agent too")
            return data
        plugin = data.get("plugin", "agent")
        if plugin != "agent":
            raise ValueError(
                f"tasks[].agent runs your own agent function; it cannot be combined with plugin "
                f"{plugin!r}"
            )
        if data.get("prompts") is None:
            raise ValueError("tasks[].agent needs tasks[].prompts, e.g. {path: prompts.jsonl}")
        spec = dict(data.get("spec") or {})
        spec.update(agent=data["agent"], prompts=data["prompts"])
        return {**data, "plugin": "agent", "spec": spec}
