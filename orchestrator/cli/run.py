"""``rollcall run CONFIG [dotted.overrides ...]``: run a job until ``run.total_steps``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from rollcall.orchestrator.cli.common import actor, console, options, print_json
from rollcall.orchestrator.errors import UserError
from rollcall.orchestrator.evalstats import gains, pass_changes
from rollcall.orchestrator.folders import replace_folder
from rollcall.orchestrator.settings import rollcall_home

if TYPE_CHECKING:
    from rich.console import Console

    from rollcall.orchestrator.config import RollcallConfig
    from rollcall.orchestrator.db.engine import Database
    from rollcall.orchestrator.runner.driver import RunResult


def run(
    ctx: typer.Context,
    config: Annotated[
        Path, typer.Argument(help="Job config YAML (`rollcall config list`: the shipped ones).")
    ],
    overrides: Annotated[
        list[str] | None,
        typer.Argument(
            help="dotted.key=value overrides, e.g. run.total_steps=50", show_default=False
        ),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue the job from its last committed step.")
    ] = False,
    live: Annotated[
        bool, typer.Option("--live/--no-live", help="Live progress panel on a terminal.")
    ] = True,
    json_out: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Run a job: rollout nodes and the trainer on Ray, the buffer in PostgreSQL.

    Runs the job to run.total_steps. The embedded database is migrated to head on first use
    (as the quickstart does); an external one must be at head already (rollcall db upgrade). A job
    that already trained refuses to start again without --resume, which continues it from its
    last committed step; a job another driver is running is refused (one driver per job). The
    run directory (run.dir, default ROLLCALL_HOME/runs/JOB) holds config.yaml, metrics.jsonl,
    learning_curve.png, weights/, checkpoints/, final/ and driver.log."""
    from rollcall.orchestrator.config import load_config

    cfg = load_config(config, overrides or [])
    result = run_job(ctx, cfg, resume=resume, live=live, upgrade_schema="embedded")
    report(result, json_out)


def run_job(
    ctx: typer.Context,
    cfg: RollcallConfig,
    *,
    resume: bool,
    live: bool,
    upgrade_schema: Literal["always", "embedded"],
    out: Console | None = None,
    fresh_name: bool = False,
) -> RunResult:
    from rollcall.orchestrator.db.engine import open_database
    from rollcall.orchestrator.runner.driver import JobDriver

    opts = options(ctx)
    out = out or console()
    home = rollcall_home(opts.home)
    model_dir = resolve_model(cfg, home, out)
    check_chat(cfg, model_dir)
    check_lora(cfg, model_dir)
    db_url = cfg.database.url.get_secret_value() if cfg.database.url else None
    db = open_database(opts.database_url, db_url, home=opts.home, verify_schema=False)
    driver = None
    try:
        out.print(f"database: {db.describe()}", markup=False)
        prepare_schema(db, out, upgrade=upgrade_schema == "always" or db.target.embedded)
        if fresh_name and not resume:
            cfg = _next_free_name(cfg, db, out)
        driver = JobDriver(
            cfg,
            db,
            model_dir=model_dir,
            home=home,
            resume=resume,
            console=out,
            live=live,
            actor=actor(),
        )
        driver.setup()
        out.print(
            f"job {cfg.job.name}: {cfg.run.mode} mode, {cfg.rollout.nodes} rollout node(s) x "
            f"{cfg.rollout.concurrency} agent loops, {cfg.trainer.ranks} trainer rank(s), "
            f"run directory {driver.run_dir.root}",
            markup=False,
        )
        return driver.run()
    finally:
        if driver is not None:
            driver.close()
        db.dispose()


def prepare_schema(db: Database, out: Console, *, upgrade: bool) -> None:
    """Migrate the database to head where ``upgrade`` (the quickstart's database, and the
    embedded one: this machine's own), then refuse one not at head: an external database is
    migrated by its operator (``rollcall db upgrade``), never by a job as a side effect."""
    from rollcall.orchestrator.db import migrate

    if upgrade:
        with db.migration_connection() as conn:
            was = migrate.upgrade_if_behind(conn)
            conn.commit()
        if was is not None:
            out.print(
                f"database: schema migrated to {migrate.head_revision()} (was {was})",
                markup=False,
            )
    db.verify_schema()


def _next_free_name(cfg: RollcallConfig, db: Any, out: Console) -> RollcallConfig:
    """The config with job.name changed to the first ``NAME-k`` not yet trained."""
    name, k = cfg.job.name, 1
    with db.transaction() as tx:
        while (job := tx.jobs.get_by_name(name)) is not None and job.policy_version > 0:
            k += 1
            name = f"{cfg.job.name}-{k}"
    if name != cfg.job.name:
        out.print(
            f"job {cfg.job.name!r} has run before; this run is job {name!r} "
            f"(continue the old one with --resume)",
            markup=False,
        )
        cfg = cfg.model_copy(update={"job": cfg.job.model_copy(update={"name": name})})
    return cfg


def resolve_model(cfg: RollcallConfig, home: Path, out: Console) -> Path:
    """The configured model folder, or the built-in model ``model.builtin``: the tiny local
    model (when missing, the shipped build is copied in, or where this installation has none,
    it is built) or SmolLM2-135M-Instruct (imported when missing)."""

    if cfg.model.path is not None:
        path = Path(cfg.model.path).expanduser()
        if not (path / "config.json").exists():
            raise UserError(
                f"model.path {path} holds no transformers model (no config.json); build one with "
                "`rollcall model init --out DIR` or point model.path at a save_pretrained folder"
            )
        return path
    return builtin_model(cfg.model.builtin, home, out)


def builtin_model(name: str, home: Path, out: Console) -> Path:
    """The folder of the built-in model ``name`` (``tiny`` or ``smollm2-135m``) in
    ``home/models``, put there on first use."""
    if name == "smollm2-135m":
        from rollcall.workers.realmodel import default_dir, import_smollm2, imported_dtype

        path = default_dir(home)
        if imported_dtype(path) is None:
            out.print(f"importing SmolLM2-135M-Instruct into {path} (once)", markup=False)
            import_smollm2(path, log=lambda line: out.print(line, markup=False))
        return path
    path = home / "models" / "tiny"
    if not (path / "config.json").exists():
        from rollcall.workers.tiny_model import install_shipped, shipped_build

        if shipped_build() is not None:  # the build `rollcall model init` makes, shipped
            install_shipped(path)
            out.print(f"tiny model: the shipped build, copied to {path}", markup=False)
            return path
        from rollcall.orchestrator.cli.model import init

        out.print(f"building the tiny model in {path} (once; a few minutes)", markup=False)

        # exactly `rollcall model init --out DIR` with its defaults
        replace_folder(path, lambda tmp: init(out=tmp))
    return path


def check_chat(cfg: RollcallConfig, model_dir: Path) -> None:
    """Refuse, before anything starts, a model whose chat template or tool-call format the
    agent loop cannot use (``rollcall.workers.episode.chat.Chat`` checks prefix stability)."""
    from transformers import AutoTokenizer

    from rollcall.orchestrator.config import read_chat_template
    from rollcall.workers.episode.chat import Chat, ChatTemplateError

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    try:
        Chat(
            tokenizer,
            tool_format=cfg.model.tool_format,
            template=read_chat_template(cfg.model.chat_template),
        )
    except ChatTemplateError as e:
        raise UserError(f"model {model_dir}: {e}") from None


def check_lora(cfg: RollcallConfig, model_dir: Path) -> None:
    """Refuse, before anything starts, LoRA target modules the model does not have."""
    if cfg.trainer.lora is None:
        return
    from rollcall.workers.lora import check_targets

    try:
        check_targets(model_dir, cfg.trainer.lora.target_modules)
    except ValueError as e:
        raise UserError(str(e)) from None


def report(result: RunResult, json_out: bool) -> None:
    from dataclasses import asdict

    say = console()
    if json_out:
        print_json(asdict(result))
        return
    say.print(
        f"job {result.job}: {result.steps} steps, {result.trained_samples} samples trained this "
        f"run in {result.wall_s:.0f} s (trainer busy {result.busy_frac:.0%})",
        markup=False,
    )
    for line in summary_lines(result):
        say.print(line, markup=False)
    say.print(f"run directory: {result.run_dir}", markup=False)
    if result.final_dir:
        say.print(f"final policy (transformers): {result.final_dir}", markup=False)
    say.print(f"learning curve: {result.run_dir}/learning_curve.png", markup=False)
    say.print("next:", markup=False)
    for line in NEXT_STEPS:
        say.print(f"  {line}", markup=False)


# What a new user may run after the quickstart (shown at the end of every run).
NEXT_STEPS = (
    "rollcall status                        the last job at a glance (--watch)",
    "rollcall drill kill-rollout            kill a rollout node; nothing is lost",
    "rollcall run configs/smollm2.yaml      a real instruct model with tool calls",
    "rollcall run configs/quickstart-vllm.yaml   the quickstart on vLLM (CPU)",
    "rollcall config show NAME > FILE       a shipped config to edit (config list)",
)


def summary_lines(result: RunResult) -> list[str]:
    """The final summary: per task the held-out reward at the first and the last evaluation,
    the paired gain with its 95% interval, the samples trained and the time (at most 80
    columns)."""

    rows = gains(result.evals)
    if not rows:
        return []
    lines = [
        f"  {'task':<12} {'held-out':>14}  {'gain [95% interval]':<24} {'samples':>7} {'time':>6}"
    ]
    for g in rows:
        span = f"{g.start:.3f} -> {g.end:.3f}"
        if g.gain is None:
            gain = f"{g.end - g.start:+.3f}"
        else:
            gain = f"{g.gain.mean:+.3f} [{g.gain.low:+.3f}, {g.gain.high:+.3f}]"
        samples = result.trained_by_task.get(g.task, 0)
        lines.append(
            f"  {g.task[:12]:<12} {span:>14}  {gain:<24} {samples:>7} {result.wall_s:>5.0f}s"
        )
    for task, changes in pass_changes(result.evals):  # several samples per held-out prompt
        shown = [f"{name} {a:.2f}->{b:.2f}" for name, a, b in changes[:3]]
        lines.append(f"  {task[:12]:<12} " + "  ".join(shown))
    return lines
