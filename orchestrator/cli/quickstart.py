"""``rollcall quickstart``: the README's first command.

It brings up the control plane for ``configs/quickstart.yaml``: starts the embedded PostgreSQL
(unless the config names a database), migrates it to head, creates the job and registers its
tasks (idempotent: a task already registered with the same plugin is left as it is).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from orchestrator.cli.common import actor, console, options

REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def quickstart(
    ctx: typer.Context,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", help="Job config (default: configs/quickstart.yaml).", show_default=False
        ),
    ] = None,
) -> None:
    """Set up and run the quickstart job (CPU, embedded PostgreSQL)."""
    from orchestrator.config import load_config
    from orchestrator.db import migrate
    from orchestrator.db.engine import open_database
    from orchestrator.errors import ConflictError, UserError
    from orchestrator.services.jobs import create_job
    from orchestrator.services.tasks import register_task

    path = config or REPO_CONFIGS / "quickstart.yaml"
    if not path.exists():
        raise UserError(f"quickstart config {path} does not exist; pass --config FILE")
    cfg = load_config(path)
    opts = options(ctx)
    out = console()
    db_url = cfg.database.url.get_secret_value() if cfg.database.url else None
    db = open_database(opts.database_url, db_url, home=opts.home, verify_schema=False)
    try:
        out.print(f"database: {db.describe()}", markup=False)
        with db.engine.connect() as conn:
            migrate.upgrade(conn)
            conn.commit()
        db.verify_schema()
        with db.transaction() as tx:
            job = tx.jobs.get_by_name(cfg.job.name) or create_job(tx, cfg.job.name, actor=actor())
            for t in cfg.tasks:
                existing = tx.tasks.get_by_name(job.id, t.name)
                if existing is not None and existing.status.value != "retired":
                    if existing.plugin != t.plugin:
                        raise ConflictError(
                            f"task {t.name!r} exists in job {job.name!r} with plugin "
                            f"{existing.plugin!r}, but the config says {t.plugin!r}; "
                            "rename the task"
                        )
                    out.print(
                        f"task {t.name}: already registered ({existing.status.value})", markup=False
                    )
                    continue
                task = register_task(
                    tx,
                    job_name=job.name,
                    name=t.name,
                    plugin=t.plugin,
                    weight=t.weight,
                    max_inflight=t.max_inflight,
                    max_staleness=t.max_staleness,
                    spec_data=t.spec,
                    actor=actor(),
                )
                out.print(
                    f"task {task.name}: registered (plugin {task.plugin}, weight {task.weight:g})",
                    markup=False,
                )
    finally:
        db.dispose()
    out.print(
        f"Job {cfg.job.name!r} is registered and its control plane is ready. This release has no "
        "trainer yet, so the quickstart does not train; inspect the job with "
        f"`rollcall job show {cfg.job.name}` and `rollcall task list --job {cfg.job.name}`.",
        markup=False,
    )
