"""Experiment trackers (``run.trackers``): what ``metrics.jsonl`` gets, also in TensorBoard (the
default), Weights & Biases and MLflow.

Every record the run directory appends goes to each tracker: a train step's numbers as
``train/KEY`` at that step, an evaluation as ``eval/TASK/reward`` with its 95% interval
(``eval/TASK/low``, ``eval/TASK/high``); the resolved config once per start, and the learning
curve when it is drawn. A resumed job continues the same runs: their ids are kept in the run
directory (``trackers.json``). A tracker that fails while the job runs is dropped with one line
on the terminal and its error in driver.log: tracking never stops training. One that cannot
start (its package missing, wandb not logged in) refuses the job before anything runs.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from rollcall.orchestrator.config import TrackingConfig
from rollcall.orchestrator.errors import UserError
from rollcall.orchestrator.evalstats import mean_interval
from rollcall.orchestrator.settings import mask_url

log = logging.getLogger(__name__)

IDS_FILE = "trackers.json"  # in the run directory: the runs a resumed job continues
EXTRAS = {"wandb": "rollcall[wandb]", "mlflow": "rollcall[mlflow]", "tensorboard": "tensorboard"}


class Tracker(Protocol):
    name: str

    def config(self, config: dict[str, Any], text: str) -> None: ...
    def scalars(self, section: str, step: int, values: dict[str, float]) -> None: ...
    def image(self, tag: str, step: int, path: Path) -> None: ...
    def close(self) -> None: ...


def scalars_of(record: dict[str, Any]) -> tuple[str, int, dict[str, float]] | None:
    """A metrics.jsonl record as (section, step, {tag: value}), or None when it has none."""

    step = record.get("step")
    if not isinstance(step, int):
        return None
    if record.get("kind") == "eval":
        values: dict[str, float] = {}
        for task, mean in (record.get("reward") or {}).items():
            values[f"eval/{task}/reward"] = float(mean)
            rewards = (record.get("rewards") or {}).get(task)
            if rewards:
                ci = mean_interval(rewards)
                values[f"eval/{task}/low"], values[f"eval/{task}/high"] = ci.low, ci.high
            for name, value in (record.get("pass") or {}).get(task, {}).items():
                values[f"eval/{task}/{name}"] = float(value)  # pass@k, mean@n
        return ("eval", step, values) if values else None
    values = {
        f"train/{k}": float(v)
        for k, v in record.items()
        if k not in ("step", "time", "kind")
        and isinstance(v, int | float)
        and not isinstance(v, bool)
        and math.isfinite(v)
    }
    return ("train", step, values) if values else None


class Trackers:
    """The job's trackers, fed from one thread of their own: a slow or unreachable tracker
    server delays its records, never a train step. Each call goes to every tracker; one that
    raises is dropped."""

    def __init__(self, trackers: Iterable[Tracker], say: Callable[[str], None]) -> None:
        self.active = list(trackers)
        self.say = say
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="rollcall-trackers", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            job()

    def _each(self, what: str, call: Callable[[Tracker], None]) -> None:
        def run() -> None:
            for t in list(self.active):
                try:
                    call(t)
                except Exception as e:
                    log.exception("tracker %s failed (%s); dropped", t.name, what)
                    self.active.remove(t)
                    self.say(
                        f"tracker {t.name}: {type(e).__name__} ({what}); dropped, see driver.log"
                    )

        self._queue.put(run)

    def config(self, config: dict[str, Any], text: str) -> None:
        self._each("config", lambda t: t.config(config, text))

    def record(self, record: dict[str, Any]) -> None:
        got = scalars_of(record)
        if got is not None:
            section, step, values = got
            self._each(f"step {step}", lambda t: t.scalars(section, step, values))

    def image(self, tag: str, step: int, path: Path) -> None:
        self._each(tag, lambda t: t.image(tag, step, path))

    def close(self, timeout_s: float = 120.0) -> None:
        """Write what is queued and close every tracker, waiting at most ``timeout_s``."""
        if not self._thread.is_alive():
            return
        self._each("close", lambda t: t.close())
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            names = ", ".join(t.name for t in self.active)
            self.say(f"trackers ({names}) still writing after {timeout_s:.0f} s; left behind")


def open_trackers(
    names: Sequence[str],
    cfg: TrackingConfig,
    root: Path,
    *,
    job: str,
    say: Callable[[str], None],
) -> Trackers:
    """Start the named trackers for the run directory ``root``; a UserError naming the fix when
    one cannot start (then none is left running)."""
    ids_path = root / IDS_FILE
    try:
        ids: dict[str, Any] = json.loads(ids_path.read_text()) if ids_path.exists() else {}
    except ValueError:
        ids = {}
    started: list[Tracker] = []
    makers: dict[str, Callable[[], Tracker]] = {
        "tensorboard": lambda: TensorBoardTracker(root / "tensorboard"),
        "wandb": lambda: WandbTracker(cfg, root, job, ids),
        "mlflow": lambda: MlflowTracker(cfg, root, job, ids),
    }
    try:
        for name in names:
            try:
                started.append(makers[name]())
            except ImportError as e:
                raise UserError(
                    f"run.trackers names {name}, which is not installed ({e.name} is missing); "
                    f"pip install '{EXTRAS[name]}'"
                ) from None
            except UserError:
                raise
            except Exception as e:
                raise UserError(
                    f"run.trackers: {name} could not start: {type(e).__name__}: "
                    f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                ) from e
    except BaseException:
        for t in started:
            try:
                t.close()
            except Exception:
                log.exception("closing tracker %s", t.name)
        raise
    if ids:
        ids_path.write_text(json.dumps(ids, indent=2) + "\n")
    return Trackers(started, say)


class TensorBoardTracker:
    """Event files in ``run_dir/tensorboard`` (``tensorboard --logdir RUN_DIR/tensorboard``)."""

    name = "tensorboard"

    def __init__(self, logdir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(logdir), flush_secs=10)

    def config(self, config: dict[str, Any], text: str) -> None:
        self.writer.add_text("config", "```yaml\n" + text + "\n```")
        self.writer.flush()

    def scalars(self, section: str, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)

    def image(self, tag: str, step: int, path: Path) -> None:
        import matplotlib.image

        self.writer.add_image(tag, matplotlib.image.imread(path), step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A wandb run in the project ``run.tracking.project``, named after the job; its folder is
    ``run_dir/wandb`` (offline: ``wandb sync`` it later)."""

    name = "wandb"

    def __init__(self, cfg: TrackingConfig, root: Path, job: str, ids: dict[str, Any]) -> None:
        import os

        # wandb's terminal lines ignore Settings(silent=True) in places: its advert for Weave
        # when an LLM client (openai: an agent task) is imported, printed at init and exit
        os.environ.setdefault("WANDB_SILENT", "true")
        os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
        import wandb

        run_id = ids.setdefault("wandb", {}).setdefault("id", _new_id())
        self.run = wandb.init(
            project=cfg.project,
            name=job,
            id=run_id,
            resume="allow",
            dir=str(root),
            mode=cfg.wandb_mode,
            # no wrapping of the terminal (the live panel), no banners: rollcall's lines only
            settings=wandb.Settings(console="off", silent=True, disable_git=True),
        )
        # evaluations arrive after later train steps: each section has its own step axis
        self.run.define_metric("train/step")
        self.run.define_metric("train/*", step_metric="train/step")
        self.run.define_metric("eval/step")
        self.run.define_metric("eval/*", step_metric="eval/step")

    def config(self, config: dict[str, Any], text: str) -> None:
        self.run.config.update(config, allow_val_change=True)

    def scalars(self, section: str, step: int, values: dict[str, float]) -> None:
        self.run.log({f"{section}/step": step, **values})

    def image(self, tag: str, step: int, path: Path) -> None:
        import wandb

        self.run.log({"eval/step": step, f"eval/{tag}": wandb.Image(str(path))})

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run in the experiment ``run.tracking.project``, named after the job: metrics
    with their steps, the flattened config as parameters, config.yaml and the learning curve
    as artifacts."""

    name = "mlflow"

    def __init__(self, cfg: TrackingConfig, root: Path, job: str, ids: dict[str, Any]) -> None:
        import os

        # MLflow's import would otherwise take over the loggers of mlflow, sqlalchemy.engine and
        # alembic (its own handler on stderr, no propagation): they stay the job's (driver.log)
        os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
        from mlflow import MlflowClient

        uri = cfg.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
        # the local store: the database and the artifacts both in the run directory (a sqlite
        # store's default artifact root is ./mlruns, relative to wherever the job started)
        artifacts = None
        if not uri:
            uri = f"sqlite:///{(root / 'mlflow.db').resolve()}"
            artifacts = (root / "mlflow-artifacts").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        mine = ids.setdefault("mlflow", {})
        # the store is remembered by its URI with any password masked (trackers.json is a
        # plain file in the run directory)
        store = mask_url(uri)
        known: str | None = mine.get("run_id") if mine.get("uri") == store else None
        self.fresh = known is None
        if known is None:
            exp = self.client.get_experiment_by_name(cfg.project)
            exp_id = (
                exp.experiment_id
                if exp
                else self.client.create_experiment(cfg.project, artifact_location=artifacts)
            )
            known = str(self.client.create_run(exp_id, run_name=job).info.run_id)
            mine.update(uri=store, run_id=known)
        else:
            self.client.update_run(known, status="RUNNING")
        self.run_id = known

    def config(self, config: dict[str, Any], text: str) -> None:
        from mlflow.entities import Param

        if self.fresh:  # parameters cannot change: those of the run's first start
            params = [Param(k, str(v)[:6000]) for k, v in _flatten(config).items()]
            for i in range(0, len(params), 100):  # MLflow's batch limit
                self.client.log_batch(self.run_id, params=params[i : i + 100])
        self.client.log_text(self.run_id, text, "config.yaml")

    def scalars(self, section: str, step: int, values: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def image(self, tag: str, step: int, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _new_id() -> str:
    return uuid.uuid4().hex[:16]


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: data}
