"""Task registry actions: register, pause/resume/drain, set-quota, retire.

Every check runs before the first write, and every action runs inside the caller's
transaction, so a refused action leaves no row, partition or event behind. Each applied
action writes one ``task.*`` event with the values before and after.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rollcall.orchestrator import bounds
from rollcall.orchestrator.config import (
    TaskConfig,
    check_name,
    format_validation_error,
    read_yaml_mapping,
)
from rollcall.orchestrator.db.engine import Tx
from rollcall.orchestrator.defaults import (
    DEFAULT_MAX_INFLIGHT,
    DEFAULT_MAX_STALENESS,
    DEFAULT_WEIGHT,
)
from rollcall.orchestrator.domain import TaskStatus, TaskView
from rollcall.orchestrator.errors import ConflictError, NotFoundError, UserError
from rollcall.orchestrator.quotas import BatchPolicy, QuotaInput, batch_problem
from rollcall.orchestrator.services.jobs import require_job
from rollcall.tasks import registry
from rollcall.tasks.agent import AgentSpec, prompt_rows

# action -> (statuses it applies to, resulting status)
TRANSITIONS: dict[str, tuple[frozenset[TaskStatus], TaskStatus]] = {
    "pause": (frozenset({TaskStatus.ACTIVE, TaskStatus.DRAINING}), TaskStatus.PAUSED),
    "resume": (frozenset({TaskStatus.PAUSED, TaskStatus.DRAINING}), TaskStatus.ACTIVE),
    "drain": (frozenset({TaskStatus.ACTIVE, TaskStatus.PAUSED}), TaskStatus.DRAINING),
}
EVENT_KIND = {"pause": "task.paused", "resume": "task.resumed", "drain": "task.draining"}


def validate_quota(
    weight: float | None, max_inflight: int | None, max_staleness: int | None
) -> None:
    """Each value within its bounds (``rollcall.orchestrator.bounds``), before anything is
    written."""
    bounds.WEIGHT.check("--weight", weight, "pass e.g. --weight 1")
    bounds.MAX_INFLIGHT.check(
        "--max-inflight", max_inflight, "to stop claims, pause the task instead"
    )
    bounds.MAX_STALENESS.check("--max-staleness", max_staleness, "0 means on-policy only")


def check_job_progress(
    tx: Tx,
    job_id: int,
    change: QuotaInput | None = None,
    policy: BatchPolicy | None = None,
) -> None:
    """Refuse a quota change (``change``: the task's values after it, active) that would leave
    the job's batch unfillable (``quotas.batch_problem``), judged with the job's own config
    (``policy``, else ``jobs.config``); a job without a config has nothing to judge by."""
    if policy is None:
        job = tx.jobs.get(job_id)
        policy = BatchPolicy.from_config(job.config) if job is not None else None
    if policy is None:
        return
    active = [
        QuotaInput(t.name, t.weight, t.max_staleness)
        for t in tx.tasks.list(job_id, include_retired=False)
        if t.status == TaskStatus.ACTIVE and (change is None or t.name != change.name)
    ]
    problem = batch_problem(
        active + ([change] if change else []), policy, bounds.MAX_ADMITTED_GROUPS
    )
    if problem:
        what = f"the quota of task {change.name!r}" if change else "the tasks' quotas"
        raise ConflictError(f"{what} would stall the job: {problem}")


def check_quota_change(
    weight: float | None, max_inflight: int | None, max_staleness: int | None
) -> None:
    if weight is None and max_inflight is None and max_staleness is None:
        raise UserError("set-quota needs at least one of --weight, --max-inflight, --max-staleness")
    validate_quota(weight, max_inflight, max_staleness)


def check_retire_confirmed(name: str, confirmed: bool) -> None:
    if not confirmed:
        raise UserError(
            f"retiring task {name!r} detaches its trajectory partition and cannot be undone; "
            "pass --yes to confirm"
        )


def validate_spec(plugin_name: str, data: dict[str, Any], source: str) -> dict[str, Any]:
    """Validate a spec against the plugin's Spec model; returns it with defaults filled in."""
    plugin = registry.get(plugin_name)
    try:
        spec = plugin.Spec.model_validate(data)
    except ValidationError as e:
        raise UserError(
            f"task spec for plugin {plugin_name!r} is invalid: "
            + format_validation_error(e, source)
        ) from None
    return spec.model_dump(mode="json")


def check_agent_tasks(
    tasks: list[Any], eval_episodes: int, progress_room_s: float = float("inf")
) -> None:
    """Agent tasks' specs checked before a job is created (their function, their prompts),
    with evaluation on, that their prompts hold held-out rows, and that their tool timeout
    stays within ``progress_room_s`` (the progress timeout less the heartbeat timeout)."""
    for t in tasks:
        if t.plugin != "agent":
            continue
        spec = AgentSpec.model_validate(validate_spec(t.plugin, t.spec, f"tasks {t.name}"))
        if spec.tool_timeout_s >= progress_room_s:
            raise UserError(
                f"task {t.name}: spec.tool_timeout_s ({spec.tool_timeout_s:g}) must stay below "
                "control_plane.progress_timeout_s - control_plane.heartbeat_timeout_s "
                f"({progress_room_s:g}): a node whose agents all wait on tools would read as hung"
            )
        if eval_episodes > 0 and not prompt_rows(spec.prompts)[1]:
            raise UserError(
                f"task {t.name}: its prompts have no held-out rows to evaluate on; raise "
                "prompts.held_out_per_mille or set run.eval.episodes to 0"
            )


def resolve_plugin(name: str) -> None:
    try:
        registry.get(name)
    except registry.UnknownPluginError as e:
        raise UserError(f"--plugin: {e}") from None


def require_task(tx: Tx, job_name: str, name: str, *, for_update: bool = False) -> TaskView:
    job = require_job(tx, job_name)
    task = tx.tasks.get_by_name(job.id, name, for_update=for_update)
    if task is None:
        raise NotFoundError(
            f"task {name!r} does not exist in job {job_name!r}; see `rollcall task list --job "
            f"{job_name}`"
        )
    return task


def register_task(
    tx: Tx,
    *,
    job_name: str,
    name: str,
    plugin: str,
    actor: str,
    weight: float = DEFAULT_WEIGHT,
    max_inflight: int = DEFAULT_MAX_INFLIGHT,
    max_staleness: int = DEFAULT_MAX_STALENESS,
    spec_file: Path | None = None,
    spec_data: dict[str, Any] | None = None,
    check_progress: bool = True,
) -> TaskView:
    try:
        check_name(name, "task name")
    except ValueError as e:
        raise UserError(str(e)) from None
    resolve_plugin(plugin)
    validate_quota(weight, max_inflight, max_staleness)
    if spec_file is not None:
        data = read_yaml_mapping(spec_file, "spec")
        source = str(spec_file)
    else:
        data = spec_data or {}
        source = "spec"
    spec = validate_spec(plugin, data, source)
    job = require_job(tx, job_name)
    if check_progress:
        check_job_progress(tx, job.id, QuotaInput(name, weight, max_staleness))
    task = tx.tasks.create(
        job_id=job.id,
        name=name,
        plugin=plugin,
        spec=spec,
        weight=weight,
        max_inflight=max_inflight,
        max_staleness=max_staleness,
    )
    tx.events.add(
        "task.registered",
        actor,
        f"task {name!r} registered with plugin {plugin!r}",
        job_id=job.id,
        task_id=task.id,
        payload={
            "plugin": plugin,
            "weight": weight,
            "max_inflight": max_inflight,
            "max_staleness": max_staleness,
            "spec": spec,
            "partition": task.partition,
        },
    )
    return task


def change_status(
    tx: Tx, *, job_name: str, name: str, action: str, actor: str
) -> tuple[TaskView, bool]:
    """Apply pause/resume/drain. Returns the task and whether anything changed."""
    allowed, target = TRANSITIONS[action]
    task = require_task(tx, job_name, name, for_update=True)
    if task.status == target:
        return task, False
    if task.status not in allowed:
        raise ConflictError(
            f"cannot {action} task {name!r}: it is {task.status.value}"
            + ("; a retired task takes no actions" if task.status == TaskStatus.RETIRED else "")
        )
    updated = tx.tasks.set_status(task.id, target)
    tx.events.add(
        EVENT_KIND[action],
        actor,
        f"task {name!r}: {task.status.value} -> {target.value}",
        job_id=task.job_id,
        task_id=task.id,
        payload={"from": task.status.value, "to": target.value},
    )
    return updated, True


def set_quota(
    tx: Tx,
    *,
    job_name: str,
    name: str,
    actor: str,
    weight: float | None = None,
    max_inflight: int | None = None,
    max_staleness: int | None = None,
    check_progress: bool = True,
) -> TaskView:
    check_quota_change(weight, max_inflight, max_staleness)
    task = require_task(tx, job_name, name, for_update=True)
    if task.status == TaskStatus.RETIRED:
        raise ConflictError(f"task {name!r} is retired; its quota cannot change")
    if check_progress and task.status == TaskStatus.ACTIVE:
        changed = QuotaInput(
            name,
            task.weight if weight is None else weight,
            task.max_staleness if max_staleness is None else max_staleness,
        )
        check_job_progress(tx, task.job_id, changed)
    updated = tx.tasks.set_quota(
        task.id, weight=weight, max_inflight=max_inflight, max_staleness=max_staleness
    )
    before = {k: getattr(task, k) for k in ("weight", "max_inflight", "max_staleness")}
    after = {k: getattr(updated, k) for k in ("weight", "max_inflight", "max_staleness")}
    tx.events.add(
        "task.quota_changed",
        actor,
        f"task {name!r} quota changed",
        job_id=task.job_id,
        task_id=task.id,
        payload={"before": before, "after": after},
    )
    return updated


def retire_task(tx: Tx, *, job_name: str, name: str, confirmed: bool, actor: str) -> TaskView:
    check_retire_confirmed(name, confirmed)
    tx.tasks.lock_registry(require_job(tx, job_name).id)
    task = require_task(tx, job_name, name, for_update=True)
    if task.status == TaskStatus.RETIRED:
        raise ConflictError(f"task {name!r} is already retired")
    outstanding = tx.tasks.episodes_outstanding(task.id)
    if outstanding:
        raise ConflictError(
            f"task {name!r} still has {outstanding} queued or leased episodes; run `rollcall task "
            f"drain {name}` and retire it once they have finished"
        )
    reserved = tx.tasks.groups_reserved_by_trainer(task.id)
    if reserved:
        raise ConflictError(
            f"the trainer holds {reserved} groups of task {name!r} for a step it has not "
            "committed yet; retry once that step is committed"
        )
    # Finished groups that will now never be trained end as expired (counted), not in limbo.
    expired = tx.tasks.expire_untrained_groups(task.id)
    updated = tx.tasks.retire(task.id)
    tx.events.add(
        "task.retired",
        actor,
        f"task {name!r} retired; partition {task.partition} detached"
        + (f"; {expired} untrained groups expired" if expired else ""),
        job_id=task.job_id,
        task_id=task.id,
        payload={"from": task.status.value, "partition": task.partition, "expired_groups": expired},
    )
    return updated


def ensure_tasks(
    tx: Tx,
    *,
    job_name: str,
    tasks: list[TaskConfig],
    actor: str,
    sync: bool = False,
    policy: BatchPolicy | None = None,
) -> list[str]:
    """Register the config's tasks that the job lacks and bring the others' quotas to the
    config's values (``max_staleness`` 0 in sync mode: every sample is on-policy). A task
    registered with another plugin is a conflict. With ``policy`` (the running config's),
    the job's active tasks, registered outside the config too, must then be able to fill
    its batch. Returns one line per change."""
    lines = []
    for t in tasks:
        staleness = 0 if sync else t.max_staleness
        existing = tx.tasks.get_by_name(require_job(tx, job_name).id, t.name)
        if existing is None or existing.status == TaskStatus.RETIRED:
            task = register_task(
                tx,
                job_name=job_name,
                name=t.name,
                plugin=t.plugin,
                weight=t.weight,
                max_inflight=t.max_inflight,
                max_staleness=staleness,
                spec_data=t.spec,
                actor=actor,
                check_progress=False,
            )
            lines.append(
                f"task {task.name}: registered (plugin {task.plugin}, weight {t.weight:g})"
            )
            continue
        if existing.plugin != t.plugin:
            raise ConflictError(
                f"task {t.name!r} exists in job {job_name!r} with plugin {existing.plugin!r}, "
                f"but the config says {t.plugin!r}; rename the task"
            )
        wanted = {"weight": t.weight, "max_inflight": t.max_inflight, "max_staleness": staleness}
        if any(getattr(existing, k) != v for k, v in wanted.items()):
            set_quota(
                tx,
                job_name=job_name,
                name=t.name,
                actor=actor,
                check_progress=False,
                **wanted,  # type: ignore[arg-type]
            )
            lines.append(f"task {t.name}: quota set to {wanted}")
        else:
            lines.append(f"task {t.name}: already registered ({existing.status.value})")
    if policy is not None:  # once, on the final quotas: one change at a time may pass a bad state
        check_job_progress(tx, require_job(tx, job_name).id, policy=policy)
    return lines
