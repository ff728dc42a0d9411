"""A job's run directory: what a run leaves behind for people and tools.

config.yaml          the resolved config (database password masked)
metrics.jsonl        one JSON object per train step and per evaluation
learning_curve.png   held-out reward per task against step, with 95% intervals as bands
weights/vNNNNNN/     published policy versions (the last few)
checkpoints/step-N/  trainer checkpoints (model, optimizer, scheduler, step)
final/               the final policy, ``save_pretrained`` format with its tokenizer
driver.log           the driver's log records (library warnings, retries, errors in detail),
                     rotated by size: driver.log.1 .. driver.log.N are the older ones
tensorboard/         TensorBoard event files (run.trackers; with the others: wandb/, mlflow.db,
                     mlflow-artifacts/, trackers.json)
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import math
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import yaml

from rollcall.orchestrator.bounds import LOG_BACKUPS_DEFAULT, LOG_MB_DEFAULT
from rollcall.orchestrator.evalstats import mean_interval
from rollcall.orchestrator.runner.trackers import open_trackers
from rollcall.orchestrator.settings import mask_url
from rollcall.orchestrator.terminal import EscapingFormatter, escape_controls

if TYPE_CHECKING:
    from rollcall.orchestrator.config import RunConfig
    from rollcall.orchestrator.runner.trackers import Trackers


class RunDir:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.metrics_path = root / "metrics.jsonl"
        self.weights = root / "weights"
        self.checkpoints = root / "checkpoints"
        self.final = root / "final"
        self.curve = root / "learning_curve.png"
        self.log_path = root / "driver.log"
        self._append_lock = threading.Lock()  # steps and evaluations append from two threads
        self.trackers: Trackers | None = None
        self._config: tuple[dict[str, Any], str] | None = None

    def capture_logs(
        self,
        max_bytes: int = LOG_MB_DEFAULT * 1_000_000,
        backups: int = LOG_BACKUPS_DEFAULT,
    ) -> Callable[[], None]:
        """Send this process's log records to ``driver.log`` instead of the terminal (where
        Python prints warnings when no handler is set up: APScheduler's missed runs, the
        retry layer's retries), and Python's warnings too (``warnings.warn``: a library's
        FutureWarning or DeprecationWarning, as ``logging.captureWarnings`` logs them, under
        ``py.warnings``); an error still shows on stderr as one line naming the log. Returns
        the function that undoes it (warnings print as before again).

        The file rotates by size (``run.log_max_mb``, ``run.log_backups``): past
        ``max_bytes`` it becomes ``driver.log.1`` (the older ones move up, the oldest beyond
        ``backups`` is deleted) and a new ``driver.log`` starts, so a job of weeks keeps at
        most ``(backups + 1) * max_bytes`` of log. A record is written after the rollover it
        causes: an error's details are always in ``driver.log``, the file its line names."""
        root = logging.getLogger()
        to_file = logging.handlers.RotatingFileHandler(
            self.log_path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8", delay=True
        )
        to_file.setFormatter(  # a message's control characters escaped (tools', users')
            EscapingFormatter("%(asctime)s %(levelname)s %(name)s [%(threadName)s] %(message)s")
        )
        errors = _ErrorLine(self.log_path)
        root.addHandler(to_file)
        root.addHandler(errors)
        shown = warnings.showwarning  # what prints a warning now, put back by release()

        def to_log(
            message: Warning | str,
            category: type[Warning],
            filename: str,
            lineno: int,
            file: TextIO | None = None,
            line: str | None = None,
        ) -> None:
            if file is not None:  # written to a file on purpose: as before
                shown(message, category, filename, lineno, file, line)
                return
            text = warnings.formatwarning(message, category, filename, lineno, line)
            logging.getLogger("py.warnings").warning("%s", text.rstrip())

        warnings.showwarning = to_log

        def release() -> None:
            if warnings.showwarning is to_log:  # not replaced since by someone else
                warnings.showwarning = shown
            for h in (to_file, errors):
                root.removeHandler(h)
            to_file.close()

        return release

    def write_config(self, resolved: dict[str, Any]) -> Path:
        data = json.loads(json.dumps(resolved))  # plain types only
        url = data.get("database", {}).get("url")
        if url:
            data["database"]["url"] = mask_url(url)
        tracking = data.get("run", {}).get("tracking", {})
        if tracking.get("mlflow_uri"):
            tracking["mlflow_uri"] = mask_url(tracking["mlflow_uri"])
        path = self.root / "config.yaml"
        text = yaml.safe_dump(data, sort_keys=False)
        path.write_text(text)
        self._config = (data, text)
        return path

    def start_trackers(self, run: RunConfig, job: str, say: Callable[[str], None]) -> None:
        """Start ``run.trackers`` (orchestrator/runner/trackers.py) and give them the config
        written last; from now on every appended record goes to them too."""
        self.trackers = open_trackers(run.trackers, run.tracking, self.root, job=job, say=say)
        if self._config is not None:
            self.trackers.config(*self._config)

    def close_trackers(self) -> None:
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None

    def append(self, record: dict[str, Any]) -> None:
        record = {"time": round(time.time(), 3), **record}
        line = json.dumps(record) + "\n"
        with self._append_lock:
            with self.metrics_path.open("a") as f:
                f.write(line)
            if self.trackers is not None:
                self.trackers.record(record)

    def records(self, kind: str | None = None) -> list[dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        out = [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line]
        return [r for r in out if kind is None or r.get("kind") == kind]

    def checkpoint_path(self, step: int) -> Path:
        return self.checkpoints / f"step-{step:06d}"

    def prune_checkpoints(self, keep: int) -> None:
        found = sorted(p for p in self.checkpoints.glob("step-*") if p.is_dir())
        for old in found[: max(0, len(found) - keep)]:
            shutil.rmtree(old, ignore_errors=True)

    def plot(self, title: str) -> Path | None:
        """Held-out reward per task against step, from the ``eval`` records."""
        evals = self.records("eval")
        if not evals:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        tasks = sorted({t for r in evals for t in r["reward"]})
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)

        for task in tasks:
            pts = sorted(
                [
                    (r["step"], r["reward"][task], r.get("rewards", {}).get(task))
                    for r in evals
                    if task in r["reward"]
                ],
                key=lambda p: p[0],
            )
            (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=task)
            # with several samples per prompt: the largest k's pass@k, dashed
            passes = sorted(
                (r["step"], r["pass"][task]) for r in evals if task in (r.get("pass") or {})
            )
            if passes:
                name = max(
                    (k for k in passes[-1][1] if k.startswith("pass@")),
                    default=None,
                    key=lambda k: int(k[5:]),
                )
                if name is not None:
                    ax.plot(
                        [p[0] for p in passes],
                        [p[1].get(name, math.nan) for p in passes],
                        linestyle="--",
                        color=line.get_color(),
                        label=f"{task} {name}",
                    )
            # the 95% interval of each evaluation's mean, where the episodes' rewards are kept
            band = [(p[0], mean_interval(p[2])) for p in pts if p[2]]
            if band:
                ax.fill_between(
                    [b[0] for b in band],
                    [b[1].low for b in band],
                    [b[1].high for b in band],
                    color=line.get_color(),
                    alpha=0.18,
                    linewidth=0,
                )
        ax.set_xlabel("step (policy version)")
        ax.set_ylabel("mean reward, held-out prompts")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title(title)
        fig.tight_layout()
        fig.savefig(self.curve)
        plt.close(fig)
        if self.trackers is not None:
            self.trackers.image("learning_curve", max(r["step"] for r in evals), self.curve)
        return self.curve


class _ErrorLine(logging.Handler):
    """An error on the terminal: one line (its traceback is in the log file)."""

    def __init__(self, log_path: Path) -> None:
        super().__init__(logging.ERROR)
        self.log_path = log_path

    def emit(self, record: logging.LogRecord) -> None:
        try:
            first = record.getMessage().splitlines()[0] if record.getMessage() else ""
            sys.stderr.write(f"error: {escape_controls(first)} (details in {self.log_path})\n")
        except Exception:
            self.handleError(record)
