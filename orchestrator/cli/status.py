"""``rollcall status``, ``worker list``, ``buffer stats``, ``events``: a running job at a glance.

All four read the database only (``rollcall.orchestrator.services.status``), so they work from any
machine that reaches it, while the job runs or after it stopped.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer

from rollcall.orchestrator.cli.common import (
    col,
    compact_table,
    console,
    one_line,
    open_db,
    print_json,
)

JobOpt = Annotated[
    str | None,
    typer.Option(
        "--job",
        envvar="ROLLCALL_JOB",
        help="Job to show. Default: the job with the most recent activity.",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]

worker_app = typer.Typer(help="Rollout nodes and trainer ranks of a job.", no_args_is_help=True)
buffer_app = typer.Typer(help="The replay buffer of a job.", no_args_is_help=True)


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 120:
        return f"{s:.1f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def render_status(doc: dict[str, Any]) -> Any:
    """What ``rollcall status`` prints: each line and table row fits an 80-column terminal."""
    from rich.console import Group
    from rich.text import Text

    from rollcall.orchestrator.services.status import slot_lines
    from rollcall.orchestrator.terminal import safe_text

    j, tr = doc["job"], doc["trainer"]
    total = f"/{j['total_steps']}" if j["total_steps"] else ""
    state = j["status"]
    if state in ("running", "stopping") and not j["driver"]["alive"]:
        state += ", no live driver (continue with --resume)"
    weights = j["weights_version"] if j["weights_version"] is not None else "-"
    last = "" if j["last_step_age_s"] is None else f" (last {_age(j['last_step_age_s'])} ago)"
    parts: list[Any] = [
        Text.assemble((f"job {j['name']} ", "bold"), f"({j['mode'] or '-'}) {state}"),
        Text(
            f"step {j['steps']}{total}{last}  "
            f"policy v{j['policy_version']}  weights v{weights}  "
            f"trainer busy {_pct(tr['busy_ratio'])}"
        ),
    ]
    if j["metrics_url"]:
        parts.append(Text(f"metrics: {j['metrics_url']}"))
    tasks = compact_table(
        col("task", flex=True),
        "status",
        col("weight", right=True),
        col("quota", right=True),
        col("mix", right=True),
        col("flight", right=True),
        col("stale", right=True),
        col("reward", right=True),
        col("trained", right=True),
        col("exp", right=True),
        col("quar", right=True),
    )
    for t in doc["tasks"]:
        tasks.add_row(
            *one_line(
                t["name"],
                t["status"],
                f"{t['weight']:g}",
                _pct(t["quota_share"]),
                _pct(t["mix_share"]),
                f"{t['inflight']}/{t['max_inflight']}",
                f"{t['ready_staleness']}/{t['max_staleness']}",
                "-" if t["reward"] is None else f"{t['reward']:.3f}",
                str(t["trained_samples"]),
                str(t["counters"]["expired_groups"]),
                str(t["counters"]["quarantined_episodes"]),
            )
        )
    parts.append(Text(""))
    parts.append(tasks if doc["tasks"] else Text("tasks: none registered"))
    for t in doc["tasks"]:
        if t.get("paused"):
            parts.append(safe_text(t["paused"]))
    if doc.get("user_errors"):
        errors = compact_table(col("n", right=True), "task", col("user code failed", flex=True))
        for u in doc["user_errors"]:
            where = f" at {u['location']}" if u["location"] else ""
            errors.add_row(*one_line(str(u["count"]), ",".join(u["tasks"]), f"{u['error']}{where}"))
        parts.append(Text(""))
        parts.append(errors)
        parts.append(Text(f"latest: {doc['user_errors'][0]['last']}"))
    parts.append(Text(""))
    parts.append(_nodes_table(doc["nodes"]) if doc["nodes"] else Text("workers: none yet"))
    parts.extend(safe_text(line) for line in slot_lines(doc["nodes"]))
    parts.append(Text(""))
    parts.extend(_pack("buffer (episodes):", [f"{k} {v}" for k, v in doc["buffer"].items()]))
    if doc["recent_events"]:
        events = compact_table("time", "kind", col("message", flex=True))
        for e in doc["recent_events"]:
            events.add_row(*one_line(e["created_at"][11:19], e["kind"], e["message"]))
        parts.append(Text(""))
        parts.append(events)
    return Group(*parts)


def _pack(label: str, items: list[str], width: int = 80) -> list[Any]:
    """``label`` and ``items`` two spaces apart, on as many lines of at most ``width`` columns
    as they need, the later lines indented under the first item."""
    from rich.text import Text

    lines: list[str] = []
    line, sep = label, " "
    for item in items:
        if len(line) + len(sep) + len(item) > width and sep != " ":
            lines.append(line)
            line, sep = " " * len(label), " "
        line += sep + item
        sep = "  "
    return [Text(x) for x in [*lines, line]]


def _when(iso: str | None) -> str:
    """``2026-12-02T15:01:07.123+00:00`` as ``12-02 15:01:07``."""
    return "-" if iso is None else iso[5:19].replace("T", " ")


def _nodes_table(
    nodes: list[dict[str, Any]], *, ray_node: bool = False, incarnations: bool = False
) -> Any:
    """Workers, one line each. A worker's name carries its role (rollout-N, trainer-N); the
    heartbeat and progress ages are in seconds/minutes/hours ago (database clock). With
    ``ray_node``, the first 8 characters of the Ray node id; with ``incarnations``, each
    incarnation's id and start and stop instead of the ages."""
    cols: list[Any] = ["worker", "status", col("ver", right=True)]
    if incarnations:
        cols = [col("id", right=True), *cols, col("restarts", right=True), "started", "stopped"]
    else:
        cols += [col("beat", right=True), col("progress", right=True), col("restarts", right=True)]
    cols.append(col("host", flex=True))
    if ray_node:
        cols.append("node")
    t = compact_table(*cols)
    for n in nodes:
        row = [
            n["name"],
            n.get("slot") or n["status"],  # a rollout slot's state as the supervisor sees it
            "-" if n["loaded_version"] is None else str(n["loaded_version"]),
        ]
        if incarnations:
            row = [
                str(n["id"]),
                *row,
                str(n["restarts"]),
                _when(n["started_at"]),
                _when(n["stopped_at"]),
            ]
        else:
            progress = _age(n["progress_age_s"]) if n["role"] == "rollout" else "-"
            # a rollout slot: its restarts counted against the budget (machine losses are not)
            restarts = (
                f"{n['budget_restarts']}/{n['max_restarts']}"
                if n.get("slot") is not None
                else str(n["restarts"])
            )
            row += [_age(n["heartbeat_age_s"]), progress, restarts]
        row.append(n["host"] or "-")
        if ray_node:
            row.append((n["node_id"] or "-")[:8])
        t.add_row(*one_line(*row))
    return t


def status(
    ctx: typer.Context,
    job: JobOpt = None,
    watch: Annotated[
        bool, typer.Option("--watch", help="Refresh until interrupted (Ctrl-C).")
    ] = False,
    interval: Annotated[
        float, typer.Option("--interval", help="Seconds between refreshes (--watch).")
    ] = 2.0,
    count: Annotated[
        int, typer.Option("--count", help="With --watch: stop after N refreshes (0: never).")
    ] = 0,
    events: Annotated[int, typer.Option("--events", help="Recent events to show.")] = 10,
    json_out: JsonOpt = False,
) -> None:
    """A job at a glance: progress, tasks with quotas and live mix, nodes with heartbeat age
    and restarts, buffer depth, recent events. With --watch --json, one JSON object per line.

    Also the trainer's busy fraction and each task's in-flight episodes and staleness. Reads the
    database only, so it works from any machine that reaches it, during the job or after."""
    from rollcall.orchestrator import bounds
    from rollcall.orchestrator.db.retry import is_transient
    from rollcall.orchestrator.services.status import status_document

    bounds.WATCH_INTERVAL.check("--interval", interval)
    bounds.REFRESHES.check("--count", count)
    bounds.EVENTS_SHOWN.check("--events", events)
    db = open_db(ctx)
    out = console()
    live: Any = None
    try:
        shown = 0
        while True:
            try:
                with db.transaction() as tx:
                    doc = status_document(tx, job, events=events)
            except Exception as e:
                if not (watch and is_transient(e)):
                    raise
                doc = None  # the database is down; keep watching
                out.print(f"database unreachable ({type(e).__name__}); retrying", markup=False)
            if doc is not None:
                if json_out:
                    if watch:
                        typer.echo(json.dumps(doc, default=str))
                    else:
                        print_json(doc)
                elif watch and out.is_terminal:
                    if live is None:
                        from rich.live import Live

                        live = Live(console=out, auto_refresh=False)
                        live.start()
                    live.update(render_status(doc), refresh=True)
                else:
                    out.print(render_status(doc))
            shown += 1
            if not watch or (count and shown >= count):
                return
            time.sleep(interval)
    except KeyboardInterrupt:
        return
    finally:
        if live is not None:
            live.stop()
        db.dispose()


@worker_app.command("list")
def worker_list(
    ctx: typer.Context,
    job: JobOpt = None,
    all_: Annotated[
        bool, typer.Option("--all", help="Every incarnation, not only the latest of each slot.")
    ] = False,
    json_out: JsonOpt = False,
) -> None:
    """Rollout nodes and trainer ranks: status, served version, heartbeat age (database
    clock), restarts, host and Ray node.

    Also the progress age (database clock); --all lists every incarnation of each slot."""
    from rollcall.orchestrator.services.status import workers

    db = open_db(ctx)
    try:
        with db.transaction() as tx:
            doc = workers(tx, job, all_incarnations=all_)
    finally:
        db.dispose()
    if json_out:
        print_json(doc)
        return
    console().print(render_workers(doc, incarnations=all_))


def render_workers(doc: dict[str, Any], *, incarnations: bool = False) -> Any:
    from rich.console import Group
    from rich.text import Text

    return Group(
        Text(f"job {doc['job']}"),
        _nodes_table(doc["workers"], ray_node=not incarnations, incarnations=incarnations),
    )


@buffer_app.command("stats")
def buffer_stats(ctx: typer.Context, job: JobOpt = None, json_out: JsonOpt = False) -> None:
    """Episodes and samples by state per task, in-flight vs cap, staleness of the waiting and
    of the trained groups, the buffer's counters, and its storage.

    Per task: the oldest waiting group's staleness and age, the trained-staleness histogram,
    and the counters (fenced rejections, expired groups, quarantined episodes, requeued
    leases). Storage: the job's payload segments and bytes, the trajectories whose payload
    retention dropped, and the database's tables by size."""
    from rollcall.orchestrator.services.status import buffer_stats

    db = open_db(ctx)
    try:
        with db.transaction() as tx:
            doc = buffer_stats(tx, job)
    finally:
        db.dispose()
    if json_out:
        print_json(doc)
        return
    console().print(render_buffer(doc))


def render_buffer(doc: dict[str, Any]) -> Any:
    """Two tables, one line per task in each: episodes by state; then in flight, the oldest
    waiting group (versions behind, age), the trained groups' mean staleness and counters."""
    from rich.console import Group
    from rich.text import Text

    from rollcall.orchestrator.services.status import EPISODE_STATES

    states = compact_table(col("task", flex=True), *(col(s, right=True) for s in EPISODE_STATES))
    flow = compact_table(
        col("task", flex=True),
        col("in flight", right=True),
        col("oldest ready", right=True),
        col("trained staleness", right=True),
        col("fenced", right=True),
        col("requeued", right=True),
    )
    for task in doc["tasks"]:
        e = task["episodes"]
        mean = task["trained_staleness_mean"]
        states.add_row(*one_line(task["name"], *(str(e[s]) for s in EPISODE_STATES)))
        flow.add_row(
            *one_line(
                task["name"],
                f"{task['inflight']}/{task['max_inflight']}",
                f"{task['ready_staleness']} versions, {_age(task['ready_age_s'])}"
                if e["ready"]
                else "-",
                "-" if mean is None else f"{mean:.2f} (bound {task['max_staleness']})",
                str(task["counters"]["fenced_rejections"]),
                str(task["counters"]["requeued_leases"]),
            )
        )
    states.add_row(*one_line("total", *(str(doc["total"][s]) for s in EPISODE_STATES)))
    st = doc["storage"]
    sizes = compact_table(col("table", flex=True), col("size", right=True))
    for name, nbytes in st["tables"].items():
        if name != "database":
            sizes.add_row(*one_line(name, _bytes(nbytes)))
    per_step = st["database_bytes_per_step"]
    return Group(
        Text(f"job {doc['job']}: policy version {doc['policy_version']}"),
        Text(""),
        Text("episodes by state"),
        states,
        Text(""),
        flow,
        Text(""),
        Text(
            f"storage: {st['trajectories']} trajectories, {st['payloads_dropped']} payloads "
            "dropped by retention"
            + (
                f"; {st['compacted_trajectories']} more compacted (steps through "
                f"{st['compacted_through_step']})"
                if st.get("compacted_trajectories")
                else ""
            )
        ),
        Text(
            f"payloads: {st['segments']} segments, {_bytes(st['payload_bytes'])}; database "
            f"{_bytes(st['tables']['database'])}"
            + ("" if per_step is None else f", {_bytes(per_step)} per step")
        ),
        sizes,
    )


def _bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def events(
    ctx: typer.Context,
    job: Annotated[
        str | None,
        typer.Option(
            "--job", envvar="ROLLCALL_JOB", help="Only this job's events.", show_default=False
        ),
    ] = None,
    since: Annotated[
        str | None,
        typer.Option(
            "--since", help="A duration back (30s, 15m, 2h, 1d) or an ISO time.", show_default=False
        ),
    ] = None,
    kind: Annotated[
        str | None,
        typer.Option(
            "--kind",
            help="One kind (worker.restarting) or a prefix ending in a dot (worker.).",
            show_default=False,
        ),
    ] = None,
    limit: Annotated[int, typer.Option("--limit", help="Most recent N events.")] = 100,
    json_out: JsonOpt = False,
) -> None:
    """The audit log: operator actions, restarts, quarantines, drills, oldest first."""
    from rollcall.orchestrator import bounds
    from rollcall.orchestrator.services.status import list_events, parse_since

    bounds.EVENTS_LIMIT.check("--limit", limit)
    if since is not None:  # bad input is refused before the database is opened
        from datetime import UTC, datetime

        parse_since(since, datetime.now(UTC))
    db = open_db(ctx)
    try:
        with db.transaction() as tx:
            rows = list_events(tx, job, since=since, kind=kind, limit=limit)
    finally:
        db.dispose()
    if json_out:
        print_json(rows)
        return
    console().print(render_events(rows))


def render_events(rows: list[dict[str, Any]]) -> Any:
    t = compact_table("time", "kind", "actor", col("message", flex=True))
    for e in rows:
        t.add_row(*one_line(_when(e["created_at"]), e["kind"], e["actor"], e["message"]))
    return t
