"""``rollcall task``: register and steer the tasks of a job."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from rollcall.orchestrator.cli.common import (
    actor,
    col,
    compact_table,
    console,
    one_line,
    open_db,
    print_json,
)
from rollcall.orchestrator.cli.common import table as make_table
from rollcall.orchestrator.defaults import (
    DEFAULT_MAX_INFLIGHT,
    DEFAULT_MAX_STALENESS,
    DEFAULT_WEIGHT,
)

if TYPE_CHECKING:
    from rollcall.orchestrator.domain import TaskView

app = typer.Typer(
    help="Task registry: register, list, pause, resume, drain, set quotas, retire.",
    no_args_is_help=True,
)

JobOpt = Annotated[
    str, typer.Option("--job", envvar="ROLLCALL_JOB", help="Job the task belongs to.")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
NameArg = Annotated[str, typer.Argument(help="Task name.")]


def _summary(t: TaskView) -> str:
    return (
        f"task {t.name!r} [{t.status.value}] plugin={t.plugin} weight={t.weight:g} "
        f"max_inflight={t.max_inflight} max_staleness={t.max_staleness}"
    )


@app.command()
def register(
    ctx: typer.Context,
    name: NameArg,
    plugin: Annotated[
        str, typer.Option("--plugin", help="Registered plugin name (see `task plugins`).")
    ],
    job: JobOpt = "default",
    weight: Annotated[
        float, typer.Option(help="Share of rollout claims and batch groups (1e-6 to 1e6).")
    ] = DEFAULT_WEIGHT,
    max_inflight: Annotated[
        int, typer.Option(help="Most episodes leased at once (1 to 100000).")
    ] = DEFAULT_MAX_INFLIGHT,
    max_staleness: Annotated[
        int, typer.Option(help="Most policy versions a trained trajectory may lag (0 to 1000).")
    ] = DEFAULT_MAX_STALENESS,
    spec: Annotated[
        Path | None,
        typer.Option("--spec", help="YAML file with the plugin's task spec.", show_default=False),
    ] = None,
) -> None:
    """Register a task into a job (creates its trajectory partition).

    Defaults: weight 1, max-inflight 8, max-staleness 2, job default. A quota that would leave
    the job's batch unfillable under the config the job was created with is refused."""
    from rollcall.orchestrator.services.tasks import register_task, resolve_plugin, validate_quota

    # Reject bad input before touching the database at all.
    resolve_plugin(plugin)
    validate_quota(weight, max_inflight, max_staleness)
    db = open_db(ctx)
    try:
        with db.transaction() as tx:
            task = register_task(
                tx,
                job_name=job,
                name=name,
                plugin=plugin,
                weight=weight,
                max_inflight=max_inflight,
                max_staleness=max_staleness,
                spec_file=spec,
                actor=actor(),
            )
    finally:
        db.dispose()
    console().print(
        f"Registered {_summary(task)} in job {job!r}; partition {task.partition}.", markup=False
    )


@app.command()
def plugins(json_out: JsonOpt = False) -> None:
    """List the task plugins available (built-in and installed entry points), with their spec
    schema."""
    from rollcall.tasks import registry

    rows: list[dict[str, Any]] = []
    for info in registry.available().values():
        plugin = registry.get(info.name)
        rows.append(
            {
                "name": info.name,
                "source": info.source,
                "description": plugin.description,
                "spec_schema": plugin.Spec.model_json_schema(),
            }
        )
    if json_out:
        print_json(rows)
        return
    table = make_table("plugin", "source", "description")
    for r in rows:
        table.add_row(r["name"], r["source"], r["description"])
    console().print(table)


@app.command("list")
def list_(ctx: typer.Context, job: JobOpt = "default", json_out: JsonOpt = False) -> None:
    """List the tasks of a job, retired ones included."""
    from rollcall.orchestrator.services.jobs import require_job

    db = open_db(ctx)
    try:
        with db.transaction() as tx:
            tasks = tx.tasks.list(require_job(tx, job).id)
    finally:
        db.dispose()
    if json_out:
        print_json([t.to_json() for t in tasks])
        return
    console().print(tasks_table([t.to_json() for t in tasks]))


def tasks_table(tasks: list[dict[str, Any]]) -> Any:
    """``task list`` as a table, from the rows of its ``--json`` output."""
    table = compact_table(
        col("name", flex=True),
        "plugin",
        "status",
        col("weight", right=True),
        col("inflight", right=True),
        col("stale", right=True),
        "partition",
    )
    for t in tasks:
        table.add_row(
            *one_line(
                t["name"],
                t["plugin"],
                t["status"],
                f"{t['weight']:g}",
                str(t["max_inflight"]),
                str(t["max_staleness"]),
                t["partition"],
            )
        )
    return table


@app.command()
def show(
    ctx: typer.Context, name: NameArg, job: JobOpt = "default", json_out: JsonOpt = False
) -> None:
    """Show a task: quota, spec, work by status, recent events.

    Its episodes and trajectories by status, and its counters (fenced rejections, expired
    groups, quarantined episodes, requeued leases)."""
    from rollcall.orchestrator.services.tasks import require_task

    db = open_db(ctx)
    try:
        with db.transaction() as tx:
            task = require_task(tx, job, name)
            counts = tx.tasks.counts(task.id)
            events = tx.events.list(task_id=task.id, limit=10)
    finally:
        db.dispose()
    data = {
        **task.to_json(),
        "partition_attached": counts.partition_attached,
        "episodes": counts.episodes,
        "trajectories": counts.trajectories,
        "recent_events": [e.to_json() for e in events],
    }
    if json_out:
        print_json(data)
        return
    out = console()
    out.print(_summary(task), markup=False)
    out.print(
        f"  job {task.job_name}; partition {task.partition} "
        f"({'attached' if counts.partition_attached else 'detached'}); "
        f"prompt cursor {task.prompt_cursor}",
        markup=False,
    )
    out.print(f"  spec: {task.spec}", markup=False)
    out.print(f"  episodes: {counts.episodes or 'none'}", markup=False)
    out.print(f"  trajectories: {counts.trajectories or 'none'}", markup=False)
    out.print(
        "  counters: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in task.counters.items()),
        markup=False,
    )
    for e in events:
        out.print(f"  {e.created_at:%Y-%m-%d %H:%M:%S}  {e.kind}  {e.message}", markup=False)


def _transition(ctx: typer.Context, name: str, job: str, action: str) -> None:
    from rollcall.orchestrator.services.tasks import change_status

    db = open_db(ctx)
    try:
        with db.transaction() as tx:
            task, changed = change_status(tx, job_name=job, name=name, action=action, actor=actor())
    finally:
        db.dispose()
    if changed:
        console().print(f"Task {name!r} is now {task.status.value}.", markup=False)
    else:
        console().print(
            f"Task {name!r} is already {task.status.value}; nothing changed.", markup=False
        )


@app.command()
def pause(ctx: typer.Context, name: NameArg, job: JobOpt = "default") -> None:
    """Stop new claims for the task; episodes in flight finish."""
    _transition(ctx, name, job, "pause")


@app.command()
def resume(ctx: typer.Context, name: NameArg, job: JobOpt = "default") -> None:
    """Return a paused or draining task to active."""
    _transition(ctx, name, job, "resume")


@app.command()
def drain(ctx: typer.Context, name: NameArg, job: JobOpt = "default") -> None:
    """Finish the task's outstanding work and seed no more (then it can be retired)."""
    _transition(ctx, name, job, "drain")


@app.command("set-quota")
def set_quota(
    ctx: typer.Context,
    name: NameArg,
    job: JobOpt = "default",
    weight: Annotated[
        float | None, typer.Option(help="New weight (1e-6 to 1e6).", show_default=False)
    ] = None,
    max_inflight: Annotated[
        int | None, typer.Option(help="New in-flight cap (1 to 100000).", show_default=False)
    ] = None,
    max_staleness: Annotated[
        int | None, typer.Option(help="New staleness bound (0 to 1000).", show_default=False)
    ] = None,
) -> None:
    """Change a task's quota; takes effect on the next claim."""
    from rollcall.orchestrator.services import tasks as svc

    svc.check_quota_change(weight, max_inflight, max_staleness)
    db = open_db(ctx)
    try:
        with db.transaction() as tx:
            task = svc.set_quota(
                tx,
                job_name=job,
                name=name,
                weight=weight,
                max_inflight=max_inflight,
                max_staleness=max_staleness,
                actor=actor(),
            )
    finally:
        db.dispose()
    console().print(f"Updated {_summary(task)}.", markup=False)


@app.command()
def retire(
    ctx: typer.Context,
    name: NameArg,
    job: JobOpt = "default",
    yes: Annotated[bool, typer.Option("--yes", help="Confirm: retiring cannot be undone.")] = False,
) -> None:
    """Retire a drained task and detach its trajectory partition (rows are kept).

    Only a task with no queued or leased episodes and no groups reserved by an uncommitted
    step: finished groups never trained are expired, the partition is detached (its rows kept
    in trajectories_tN, N the task's id) and the task's name becomes free."""
    from rollcall.orchestrator.services.tasks import check_retire_confirmed, retire_task

    check_retire_confirmed(name, yes)
    db = open_db(ctx)
    try:
        with db.transaction() as tx:
            task = retire_task(tx, job_name=job, name=name, confirmed=yes, actor=actor())
    finally:
        db.dispose()
    console().print(f"Task {name!r} retired; partition {task.partition} detached.", markup=False)
