"""``rollcall drill``: failure-recovery drills against a running job (same machine)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from rollcall.orchestrator.cli.common import (
    col,
    compact_table,
    console,
    one_line,
    open_db,
    print_json,
)
from rollcall.orchestrator.errors import UserError

if TYPE_CHECKING:
    from rollcall.orchestrator.services.drills import DrillReport

app = typer.Typer(
    help="Inject a fault into a running job, wait for recovery, report what was lost (0).",
    no_args_is_help=True,
)

JobOpt = Annotated[
    str, typer.Option("--job", envvar="ROLLCALL_JOB", help="The running job to drill.")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the report as JSON.")]
TimeoutOpt = Annotated[
    float, typer.Option("--timeout", help="Seconds to wait for detection and for recovery.")
]
YesOpt = Annotated[
    bool, typer.Option("--yes", help="Confirm: the drill kills processes of the running job.")
]


def _confirm(what: str, yes: bool) -> None:
    """Drills are destructive (they kill or stop the job's processes): refused without
    ``--yes``, before anything is opened or touched."""
    if not yes:
        raise UserError(f"`drill {what}` {_EFFECT[what]} of the running job; pass --yes to confirm")


def _check_numbers(timeout: float, count: int | None = None) -> None:
    """--timeout and --count within their bounds, before anything is opened or touched."""
    from rollcall.orchestrator import bounds

    bounds.SECONDS.check("--timeout", timeout)
    bounds.DRILL_COUNT.check("--count", count)


_EFFECT = {
    "kill-rollout": "kills (or stops) rollout nodes",
    "kill-engine": "kills (or stops) the vLLM engine processes of rollout nodes",
    "kill-trainer": "SIGKILLs a trainer rank",
    "restart-db": "restarts the database under the processes",
    "kill-node": "SIGKILLs every process on a Ray node",
}


def _show(reports: list[DrillReport], json_out: bool) -> None:
    if json_out:
        print_json([r.to_json() for r in reports] if len(reports) > 1 else reports[0].to_json())
    else:
        console().print(drill_table(reports))
        for r in reports:
            if not r.invariants_ok:  # whole, where the table cuts it short
                console().print(
                    f"{r.drill}: invariants broken: {r.invariant_summary}", markup=False
                )
            for note in r.notes:
                console().print(f"note: {note}", markup=False)
    if not all(r.passed for r in reports):
        raise typer.Exit(1)


def drill_table(reports: list[DrillReport]) -> Any:
    """The drill reports as a table: in flight as episodes/samples, lost/duplicated
    trajectories (``--json``: every field whole, by name). Detection is rollcall's (every
    worker of the target declared down); a kill-node report adds Ray's (``ray s``: until Ray's
    node table marks the node dead, ``-`` when that could not be seen)."""
    ray = any(r.drill == "kill-node" for r in reports)
    t = compact_table(
        "drill",
        col("target", flex=True),
        col("detect s", right=True),
        *([col("ray s", right=True)] if ray else []),
        col("recover s", right=True),
        col("in flight", right=True),
        col("resumed", right=True),
        col("lost/dup", right=True),
        col("invariants", flex=True),
    )
    for r in reports:
        ray_s = (
            [] if not ray else ["-" if r.ray_detection_s is None else f"{r.ray_detection_s:.2f}"]
        )
        t.add_row(
            *one_line(
                r.drill,
                r.target,
                "-" if r.detection_s is None else f"{r.detection_s:.2f}",
                *ray_s,
                "timed out" if r.recovery_s is None else f"{r.recovery_s:.2f}",
                f"{r.in_flight_episodes}/{r.in_flight_samples}",
                str(r.resumed_turns),
                f"{r.lost}/{r.duplicated}",
                "ok" if r.invariants_ok else r.invariant_summary,
            )
        )
    return t


@app.command("kill-rollout")
def kill_rollout(
    ctx: typer.Context,
    job: JobOpt,
    count: Annotated[int, typer.Option("--count", help="Nodes to kill.")] = 1,
    sig: Annotated[
        str, typer.Option("--signal", help="KILL (crash) or STOP (hang).", case_sensitive=False)
    ] = "KILL",
    timeout: TimeoutOpt = 120.0,
    json_out: JsonOpt = False,
    yes: YesOpt = False,
) -> None:
    """Kill (or hang) the busiest rollout nodes of a running job."""
    from rollcall.orchestrator.services.drills import Drills

    _confirm("kill-rollout", yes)
    _check_numbers(timeout, count)
    sig = sig.upper()
    if sig not in ("KILL", "STOP"):
        raise UserError(f"--signal {sig} is not supported; use KILL or STOP")
    db = open_db(ctx)
    try:
        reports = Drills(db, job, timeout_s=timeout).kill_rollout(count, sig)
    finally:
        db.dispose()
    _show(reports, json_out)


@app.command("kill-engine")
def kill_engine(
    ctx: typer.Context,
    job: JobOpt,
    count: Annotated[int, typer.Option("--count", help="Engines to kill.")] = 1,
    sig: Annotated[
        str, typer.Option("--signal", help="KILL (crash) or STOP (hang).", case_sensitive=False)
    ] = "KILL",
    timeout: TimeoutOpt = 180.0,
    json_out: JsonOpt = False,
    yes: YesOpt = False,
) -> None:
    """Kill (or hang) the vLLM EngineCore process of the busiest rollout nodes, leaving their
    Ray actors alive (nodes with the vllm engine, on this host)."""
    from rollcall.orchestrator.services.drills import Drills

    _confirm("kill-engine", yes)
    _check_numbers(timeout, count)
    sig = sig.upper()
    if sig not in ("KILL", "STOP"):
        raise UserError(f"--signal {sig} is not supported; use KILL or STOP")
    db = open_db(ctx)
    try:
        reports = Drills(db, job, timeout_s=timeout).kill_engine(count, sig)
    finally:
        db.dispose()
    _show(reports, json_out)


@app.command("kill-trainer")
def kill_trainer(
    ctx: typer.Context,
    job: JobOpt,
    timeout: TimeoutOpt = 180.0,
    json_out: JsonOpt = False,
    yes: YesOpt = False,
) -> None:
    """SIGKILL trainer rank 0; recovery is the next step committed by a restarted trainer."""
    from rollcall.orchestrator.services.drills import Drills

    _confirm("kill-trainer", yes)
    _check_numbers(timeout)
    db = open_db(ctx)
    try:
        report = Drills(db, job, timeout_s=timeout).kill_trainer()
    finally:
        db.dispose()
    _show([report], json_out)


@app.command("restart-db")
def restart_db(
    ctx: typer.Context,
    job: JobOpt,
    timeout: TimeoutOpt = 180.0,
    json_out: JsonOpt = False,
    yes: YesOpt = False,
) -> None:
    """Restart the embedded PostgreSQL under a running job; nobody may be declared dead."""
    from rollcall.orchestrator.db.embedded import EmbeddedPostgres
    from rollcall.orchestrator.services.drills import Drills

    _confirm("restart-db", yes)
    _check_numbers(timeout)
    db = open_db(ctx)
    try:
        if not db.target.embedded:
            raise UserError(
                "restart-db restarts the embedded PostgreSQL only; restart an external server "
                "with its own tools and watch `rollcall job show`"
            )
        server = EmbeddedPostgres(db.target.home)

        def restart() -> None:
            server.stop()
            server.ensure_running()

        report = Drills(db, job, timeout_s=timeout).restart_db(restart)
    finally:
        db.dispose()
    _show([report], json_out)


@app.command("kill-node")
def kill_node(
    ctx: typer.Context,
    job: JobOpt,
    node: Annotated[
        str | None,
        typer.Option("--node", help="Ray node id (hex); default: the one with most rollout nodes."),
    ] = None,
    timeout: TimeoutOpt = 180.0,
    json_out: JsonOpt = False,
    yes: YesOpt = False,
) -> None:
    """Lose a whole Ray worker node (SIGKILL its raylet, agents and workers, on this host);
    recovery is every rollout node it hosted serving the current version again elsewhere."""
    from rollcall.orchestrator.services.drills import Drills

    _confirm("kill-node", yes)
    _check_numbers(timeout)
    db = open_db(ctx)
    try:
        report = Drills(db, job, timeout_s=timeout).kill_node(node)
    finally:
        db.dispose()
    _show([report], json_out)
