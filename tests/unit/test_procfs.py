"""``orchestrator.procfs``: one parse of ``/proc/PID/stat`` for the watchdog, orphan checks,
drills and the embedded PostgreSQL."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from orchestrator import procfs
from tests.support.waiting import wait_for


def test_this_process() -> None:
    me = procfs.stat(os.getpid())
    assert me is not None and me.ppid == os.getppid() and me.state in ("R", "S")
    assert procfs.alive(os.getpid()) and procfs.parent_of(os.getpid()) == os.getppid()
    assert os.getpid() in {p.pid for p in procfs.processes()}


def test_a_name_with_spaces_and_parens_keeps_the_fields_after_it(tmp_path: Path) -> None:
    odd = tmp_path / "a b) (c"  # the kernel shows this name in the stat line's parens
    shutil.copy(sys.executable, odd)
    child = subprocess.Popen([str(odd), "-c", "import time; time.sleep(30)"])
    try:
        s = procfs.stat(child.pid)
        assert s is not None and s.name == "a b) (c" and s.ppid == os.getpid()
        assert child.pid in procfs.children_of(os.getpid())
    finally:
        child.kill()
        child.wait()


def test_a_zombie_is_not_alive_and_a_missing_pid_has_no_stat() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])  # not reaped until wait()
    wait_for("the child to be a zombie", lambda: not procfs.alive(child.pid), 30)
    s = procfs.stat(child.pid)
    assert s is not None and s.zombie
    child.wait()
    assert procfs.stat(child.pid) is None and procfs.parent_of(child.pid) is None
