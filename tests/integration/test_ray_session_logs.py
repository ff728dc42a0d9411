"""A local Ray's session stays bounded (docs/operations.md, "What is bounded over a long job"):
its workers start with the config's log rotation, and the log files of a worker that has exited
are pruned (``orchestrator/runner/sessionlogs.py``) while a live worker's are kept. On the
tests' local Ray (``ray_local``: started with ``raystart.local_env`` of the default config,
as the driver starts its own), so no Ray is started for this file."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from rollcall.orchestrator import procfs
from rollcall.orchestrator.config import RayConfig
from rollcall.orchestrator.runner import sessionlogs
from rollcall.orchestrator.runner.raystart import local_env
from tests.support.waiting import wait_for


def _kinds(files: list[Path]) -> set[str]:
    """Which of Ray's per-process files these are: output, error, core log."""
    kinds = set()
    for f in files:
        if f.name.startswith("worker-"):
            kinds.add(f.name.split(".")[1])  # out, err
        elif f.name.startswith("python-core-worker-"):
            kinds.add("core")
    return kinds


def test_exited_workers_logs_are_pruned_and_live_ones_kept(ray_local: Any) -> None:
    ray = ray_local

    class Chatty:  # defined here: pickled by value, not imported by the worker
        """Writes to its standard output and error, and says who it is."""

        def say(self, text: str) -> int:
            print(text, flush=True)
            print(text, file=sys.stderr, flush=True)
            return os.getpid()

        def argv(self) -> list[str]:
            return list(sys.argv)

    logs = sessionlogs.session_logs()
    assert logs.name == "logs" and logs.parent.name.startswith("session_")
    actor = ray.remote(num_cpus=0)(Chatty)
    live, doomed = actor.remote(), actor.remote()
    live_pid, dead_pid = ray.get([live.say.remote("kept"), doomed.say.remote("pruned")])

    # rotation reaches Ray: the raylet starts every worker with the config's bounds
    argv = ray.get(live.argv.remote())
    env = local_env(RayConfig())
    assert f"--logging-rotate-bytes={env['RAY_ROTATION_MAX_BYTES']}" in argv
    assert f"--logging-rotate-backup-count={env['RAY_ROTATION_BACKUP_COUNT']}" in argv
    assert env["RAY_ROTATION_MAX_BYTES"] == str(RayConfig().log_max_mb * 1_000_000)

    def both_written() -> dict[int, list[Path]] | None:
        found = sessionlogs.process_files(logs)
        ok = all(_kinds(found.get(p, [])) == {"out", "err", "core"} for p in (live_pid, dead_pid))
        return found if ok else None

    before = wait_for("both workers' output, error and core log files", both_written, 60)
    ray.kill(doomed)
    wait_for(f"worker {dead_pid} to exit", lambda: not procfs.alive(dead_pid), 60)

    # within the window an exited worker's files stay (keep none by count)
    kept = sessionlogs.prune(logs, keep=0, keep_s=3_600)
    assert dead_pid in sessionlogs.process_files(logs), kept

    # the driver's pass with a window of a millisecond and none kept by count: the exited
    # worker's files go (all of them: output, error, core log, event files), the live
    # worker's and this driver's stay
    cfg = RayConfig(dead_worker_logs=0, dead_worker_logs_s=0.001)
    prune = sessionlogs.pruner(cfg, started=True)
    assert prune is not None
    done = prune()
    assert done.files >= len(before[dead_pid]), done
    after = sessionlogs.process_files(logs)
    assert dead_pid not in after
    assert not any(f.exists() for f in before[dead_pid])
    assert all(f.exists() for f in before[live_pid])
    assert os.getpid() in after  # this process's (the driver's) core log and events
    assert ray.get(live.say.remote("still here")) == live_pid  # the live worker untouched
    ray.kill(live)
