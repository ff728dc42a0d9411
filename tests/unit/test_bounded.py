"""What grows over a long job has a bound (docs/operations.md, "What is bounded over a long
job"): the driver's log rotates by size, the local Ray rotates its own logs, and the log files of
its exited workers are pruned."""

from __future__ import annotations

import io
import logging
import logging.handlers
import os
from pathlib import Path
from typing import Any

import pytest

from rollcall.orchestrator.runner.rundir import RunDir


def test_driver_log_rotates_by_size_and_errors_name_the_current_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = RunDir(tmp_path)
    release = run.capture_logs(max_bytes=10_000, backups=2)
    log = logging.getLogger("rollcall.test.bounded")
    try:
        for i in range(2_000):  # about 200 kB of records: twenty times the file's bound
            log.warning("record %05d %s", i, "x" * 40)
        log.error("the last one")
    finally:
        release()
    files = sorted(p.name for p in tmp_path.glob("driver.log*"))
    assert files == ["driver.log", "driver.log.1", "driver.log.2"]  # two backups, no more
    assert all(p.stat().st_size <= 10_000 for p in tmp_path.glob("driver.log*"))
    # the error's line points at driver.log, and its record is there (not in a backup)
    assert f"(details in {run.log_path})" in capsys.readouterr().err
    assert "the last one" in run.log_path.read_text()
    assert "record 01999" in run.log_path.read_text() + (tmp_path / "driver.log.1").read_text()


def test_driver_log_is_bounded_by_default(tmp_path: Path) -> None:
    from rollcall.orchestrator.config import RollcallConfig

    run = RollcallConfig.model_validate({"job": {"name": "bounded"}}).run
    assert (run.log_max_mb, run.log_backups) == (20, 5)  # 120 MB of driver.log at most
    release = RunDir(tmp_path.resolve()).capture_logs()
    try:
        (handler,) = [
            h
            for h in logging.getLogger().handlers
            if getattr(h, "baseFilename", None) == str(tmp_path.resolve() / "driver.log")
        ]
        assert isinstance(handler, logging.handlers.RotatingFileHandler)
        assert (handler.maxBytes, handler.backupCount) == (20_000_000, 5)
    finally:
        release()


def test_a_local_ray_rotates_its_logs_at_a_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray
    from rich.console import Console

    from rollcall.orchestrator import rayauth
    from rollcall.orchestrator.config import RollcallConfig
    from rollcall.orchestrator.runner import raystart

    seen: dict[str, Any] = {}
    for name in ("RAY_ROTATION_MAX_BYTES", "RAY_ROTATION_BACKUP_COUNT", "RAY_worker_niceness"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(rayauth, "configure_local", lambda home: None)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(os.environ))
    cfg = RollcallConfig.model_validate({"job": {"name": "bounded"}})
    assert (cfg.ray.log_max_mb, cfg.ray.log_backups) == (50, 5)
    assert raystart.init_ray(cfg, tmp_path, Console(file=io.StringIO()))
    # Ray reads these when it starts the local cluster (ray/_private/node.py)
    assert seen["RAY_ROTATION_MAX_BYTES"] == "50000000"
    assert seen["RAY_ROTATION_BACKUP_COUNT"] == "5"
    # ... only while it starts: a later local Ray in this process reads its own config's
    assert "RAY_ROTATION_MAX_BYTES" not in os.environ
    seen.clear()
    small = RollcallConfig.model_validate(
        {"job": {"name": "bounded"}, "ray": {"log_max_mb": 7, "log_backups": 2}}
    )
    raystart.init_ray(small, tmp_path, Console(file=io.StringIO()))
    assert (seen["RAY_ROTATION_MAX_BYTES"], seen["RAY_ROTATION_BACKUP_COUNT"]) == ("7000000", "2")
    # an operator's own choice stays
    seen.clear()
    monkeypatch.setenv("RAY_ROTATION_MAX_BYTES", "1000")
    raystart.init_ray(cfg, tmp_path, Console(file=io.StringIO()))
    assert seen["RAY_ROTATION_MAX_BYTES"] == "1000"
    assert os.environ["RAY_ROTATION_MAX_BYTES"] == "1000"


def _touch(path: Path, mtime: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("x" * 10)
    os.utime(path, (mtime, mtime))
    return path


def _process(logs: Path, pid: int, mtime: float, *, old: bool = False) -> list[Path]:
    """The files Ray writes for one worker process (rotated copies included)."""
    wid = f"{pid:056x}"
    out = logs / "old" if old else logs
    return [
        _touch(out / f"worker-{wid}-01000000-{pid}.out", mtime),
        _touch(out / f"worker-{wid}-01000000-{pid}.err", mtime - 5),
        _touch(out / f"worker-{wid}-01000000-{pid}.out.1", mtime - 50),
        _touch(out / f"python-core-worker-{wid}_{pid}.log", mtime),
        _touch(out / f"python-core-worker-{wid}_{pid}.1.log", mtime - 50),
        _touch(logs / "events" / f"event_CORE_WORKER_{pid}.log", mtime),
        _touch(logs / "export_events" / f"event_EXPORT_TASK_{pid}.log", mtime),
    ]


def test_exited_workers_log_files_are_pruned_beyond_the_newest_and_the_window(
    tmp_path: Path,
) -> None:
    from rollcall.orchestrator.runner.sessionlogs import process_files, prune

    now = 1_000_000.0
    logs = tmp_path / "logs"
    live = {100}  # pid 100 runs; its files are old, and kept whatever their age
    # exited processes, newest last write first: 201 (10 s ago), 202 (2 h), 203 (3 h, in
    # old/, where Ray's log monitor moves some), 204 (4 h)
    files = {
        100: _process(logs, 100, now - 9_000),
        201: _process(logs, 201, now - 10),
        202: _process(logs, 202, now - 7_200),
        203: _process(logs, 203, now - 10_800, old=True),
        204: _process(logs, 204, now - 14_400),
    }
    # the session's other files: never touched
    others = [
        _touch(logs / name, now - 20_000)
        for name in ("raylet.out", "raylet.err", "gcs_server.out", "monitor.log", "raylet.1.out")
    ] + [_touch(logs / "events" / "event_RAYLET.log", now - 20_000)]
    assert {pid: sorted(fs) for pid, fs in process_files(logs).items()} == {
        pid: sorted(fs) for pid, fs in files.items()
    }

    # keep the newest 2 exited (201, 202) and anything written within the hour (201 again)
    got = prune(logs, keep=2, keep_s=3_600, now=now, alive=live.__contains__)
    assert (got.processes, got.files, got.bytes) == (2, 14, 140)  # 203 and 204, 7 files each
    left = process_files(logs)
    assert sorted(left) == [100, 201, 202]
    assert all(f.exists() for pid in (100, 201, 202) for f in files[pid])
    assert all(f.exists() for f in others)

    # none kept by count: the window alone keeps 201 (10 s old)
    prune(logs, keep=0, keep_s=3_600, now=now, alive=live.__contains__)
    assert sorted(process_files(logs)) == [100, 201]
    # a process that exits: its files go once the window has passed
    prune(logs, keep=0, keep_s=3_600, now=now + 3_600, alive=set().__contains__)
    assert process_files(logs) == {}
    assert all(f.exists() for f in others)


def test_only_a_ray_the_driver_started_has_its_logs_pruned() -> None:
    from rollcall.orchestrator.config import RollcallConfig
    from rollcall.orchestrator.runner.scheduler import control_plane_jobs
    from rollcall.orchestrator.runner.sessionlogs import pruner

    cfg = RollcallConfig.model_validate({"job": {"name": "bounded"}})
    assert (cfg.ray.dead_worker_logs, cfg.ray.dead_worker_logs_s) == (20, 3_600)
    # a joined cluster: its session is the operator's (the session is not even looked up)
    assert pruner(cfg.ray, started=False) is None
    off = RollcallConfig.model_validate(
        {"job": {"name": "bounded"}, "ray": {"dead_worker_logs": None}}
    )
    assert pruner(off.ray, started=True) is None

    class Control:  # the jobs are only listed, not run
        def __getattr__(self, name: str) -> Any:
            return lambda: None

    def jobs(ray_logs: Any) -> dict[str, float]:
        listed = control_plane_jobs(
            cfg,
            Control(),  # type: ignore[arg-type]
            supervisor=lambda: None,
            user_errors=lambda: None,
            say=print,
            ray_logs=ray_logs,
        )
        return {name: every for _, every, name in listed}

    assert "ray-log-prune" not in jobs(None)
    assert jobs(lambda: None)["ray-log-prune"] == cfg.control_plane.retention_interval_s


def test_the_retention_pass_drops_old_events_with_the_configured_bounds(tmp_path: Path) -> None:
    from rollcall.orchestrator.config import RollcallConfig
    from rollcall.orchestrator.runner.scheduler import control_plane_jobs

    calls: list[tuple[Any, ...]] = []

    class Control:  # a fake control-plane buffer: the retention pass's two calls, recorded
        def __getattr__(self, name: str) -> Any:  # the other jobs' functions: not run here
            return lambda: None

        def drop_old_payloads(self) -> tuple[int, int]:
            calls.append(("payloads",))
            return 0, 0

        def drop_old_events(self, keep_s: float | None, keep_count: int | None) -> int:
            calls.append(("events", keep_s, keep_count))
            return 0

    cfg = RollcallConfig.model_validate(
        {"job": {"name": "bounded"}, "control_plane": {"event_retention_count": None}}
    )
    assert cfg.control_plane.event_retention_s == 7 * 86_400  # a week by default
    jobs = control_plane_jobs(
        cfg,
        Control(),  # type: ignore[arg-type]
        supervisor=lambda: None,
        user_errors=lambda: None,
        say=print,
    )
    [retention] = [fn for fn, _, name in jobs if name == "payload-retention"]
    retention()
    assert calls == [("payloads",), ("events", 7 * 86_400, None)]
