"""The log files of exited Ray worker processes in the session of a local Ray the driver
started: pruned, so that a long job's session folder stops growing once its window has passed.

Ray writes files for every worker process it starts and deletes none of them when the process
exits (its log monitor at most moves some into ``logs/old/``): the process's output
(``worker-<id>-<job>-<pid>.out`` and ``.err``), its core worker's log
(``python-core-worker-<id>_<pid>.log``; a driver's ``python-core-driver-...``), and its event
files (``events/event_CORE_WORKER_<pid>.log``, ``export_events/event_EXPORT_TASK_<pid>.log``),
each with its rotated copies. Every restart of a node or trainer rank adds a set. Ray puts
the process's pid in each name: a file belongs to an exited process when no process of that
pid runs (a zombie counts as exited).

``prune`` deletes the files of exited processes, except those of the newest ``keep`` of them
and those written within ``keep_s`` (by the newest modification of any of the process's
files). A live process's files are never deleted: they are bounded by Ray's rotation
(``ray.log_max_mb``, ``ray.log_backups``; ``raystart.local_env``). A pid taken again by a new
process keeps the old files until that one exits too. ``pruner`` gives the driver's scheduler
the pass for the session it started, or nothing: the session of a cluster it joined is the
operator's, and never touched.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rollcall.orchestrator import procfs
from rollcall.orchestrator.config.model import RayConfig

log = logging.getLogger(__name__)

# the files of one process, by folder of the session's logs/ (the pid is the first group)
_OUTPUT = re.compile(r"^worker-[0-9a-f]+-[0-9a-f]+-(\d+)(?:\.\d+)?\.(?:out|err)(?:\.\d+)?$")
_CORE = re.compile(r"^python-core-(?:worker|driver)-[0-9a-f]+_(\d+)(?:\.\d+)?\.log(?:\.\d+)?$")
PER_PROCESS: dict[str, tuple[re.Pattern[str], ...]] = {
    ".": (_OUTPUT, _CORE),
    "old": (_OUTPUT, _CORE),  # where Ray's log monitor moves some exited workers' files
    "events": (re.compile(r"^event_CORE_WORKER_(\d+)\.log(?:\.\d+)?$"),),
    "export_events": (re.compile(r"^event_EXPORT_TASK_(\d+)\.log(?:\.\d+)?$"),),
}


@dataclass(frozen=True)
class Pruned:
    """What one pass deleted."""

    processes: int  # exited processes whose files were deleted
    files: int
    bytes: int


def process_files(logs: Path) -> dict[int, list[Path]]:
    """The session's per-process log files (``logs`` is its ``logs/`` folder), by pid."""
    out: dict[int, list[Path]] = {}
    for sub, patterns in PER_PROCESS.items():
        folder = logs / sub
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            for pattern in patterns:
                if m := pattern.match(path.name):
                    out.setdefault(int(m.group(1)), []).append(path)
                    break
    return out


def _newest_write(files: list[Path]) -> float | None:
    times = []
    for f in files:
        try:
            times.append(f.stat().st_mtime)
        except FileNotFoundError:  # rotated or moved away meanwhile
            continue
    return max(times, default=None)


def prune(
    logs: Path,
    keep: int,
    keep_s: float,
    *,
    now: float | None = None,
    alive: Callable[[int], bool] = procfs.alive,
) -> Pruned:
    """Delete the files of exited processes in ``logs`` (a session's ``logs/`` folder) except
    those of the newest ``keep`` exited processes and those written within ``keep_s``."""
    now = time.time() if now is None else now
    exited: list[tuple[float, int, list[Path]]] = []
    for pid, files in process_files(logs).items():
        if alive(pid):
            continue
        newest = _newest_write(files)
        if newest is not None:
            exited.append((newest, pid, files))
    exited.sort(reverse=True)  # newest first
    processes = count = size = 0
    for newest, _pid, files in exited[keep:]:
        if now - newest <= keep_s:
            continue
        processes += 1
        for f in files:
            try:
                n = f.stat().st_size
                f.unlink()
            except FileNotFoundError:
                continue
            count, size = count + 1, size + n
    return Pruned(processes, count, size)


def session_logs() -> Path:
    """This process's Ray session's ``logs/`` folder (Ray initialized here)."""
    from ray._private import worker

    node = getattr(worker, "_global_node", None)
    assert node is not None, "Ray is not initialized in this process"
    return Path(node.get_logs_dir_path())


def pruner(cfg: RayConfig, started: bool) -> Callable[[], Pruned] | None:
    """The pruning pass of the local Ray this driver ``started`` (its session's folder, read
    now), or None: a cluster it joined, or ``ray.dead_worker_logs`` null."""
    if not started or cfg.dead_worker_logs is None:
        return None
    logs, keep, keep_s = session_logs(), cfg.dead_worker_logs, cfg.dead_worker_logs_s

    def run() -> Pruned:
        p = prune(logs, keep, keep_s)
        if p.files:
            log.info(
                "Ray session %s: deleted %d log files (%d bytes) of %d exited worker processes",
                logs.parent.name,
                p.files,
                p.bytes,
                p.processes,
            )
        return p

    return run
