"""``rollcall.orchestrator.procfs``: one parse of ``/proc/PID/stat`` for the watchdog, orphan checks,
drills and the embedded PostgreSQL."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from rollcall.orchestrator import procfs
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


def test_a_signal_reaches_the_process_recorded_never_the_next_owner_of_its_pid() -> None:
    # a stopped node's pid, signalled after the supervisor killed it, belongs to whoever got
    # it next (pids wrap at 32768 here, within minutes of a busy test run). The next owner is
    # modelled by a live process whose identity has another start time
    import signal
    import subprocess

    first = subprocess.Popen(["sleep", "60"])
    heir = subprocess.Popen(["sleep", "60"])
    try:
        gone = procfs.identity(first.pid)
        assert gone is not None and gone[0] == first.pid
        first.kill()
        first.wait()
        assert procfs.identity(first.pid) is None
        assert not procfs.signal_same(gone, signal.SIGKILL)  # ended: nothing to signal
        ident = procfs.identity(heir.pid)
        assert ident is not None
        # the heir's pid with the ended process's start time: refused, the heir lives on
        assert not procfs.signal_same((heir.pid, ident[1] - 1), signal.SIGKILL)
        assert heir.poll() is None
        assert procfs.signal_same(ident, signal.SIGKILL)  # the same process: signalled
        assert heir.wait(timeout=10) == -signal.SIGKILL
        assert not procfs.signal_same(None, signal.SIGKILL)
    finally:
        for p in (first, heir):
            if p.poll() is None:
                p.kill()
                p.wait()
