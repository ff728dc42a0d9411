"""The tool sandbox's kernel-side protections (issue #58): an IPC namespace per call (SysV shared
memory a call makes dies with it), a seccomp filter (the usual container deny-list; Python's
threads, subprocesses and forks still work), and a cgroup per call (memory across the call's
processes, its process count; removed after the call). Through ``ToolRunner.call_function``
with functions of this module, each run in a real sandboxed call."""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rollcall.orchestrator.config import ToolSandboxConfig
from rollcall.workers.episode import sandbox
from rollcall.workers.episode.tools import ToolRunner

PROTECTIONS = sandbox.probe()

IPC_CREAT = 0o1000
IPC_RMID = 0


def _requires(ok: bool, why: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Fails (never skips) without the protection: this machine must give it."""

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            assert ok, why
            return fn(*args, **kwargs)

        return checked

    return mark


needs_ipcns = _requires(PROTECTIONS.ipc, f"no IPC namespace here: {PROTECTIONS.problems}")
needs_seccomp = _requires(PROTECTIONS.seccomp, f"no seccomp filter here: {PROTECTIONS.problems}")
needs_cgroup = _requires(
    PROTECTIONS.cgroup != "none", f"no cgroup per call here: {PROTECTIONS.problems}"
)


@pytest.fixture(scope="module")
def runner() -> Any:
    r = ToolRunner(timeout_s=30, sandbox=ToolSandboxConfig(processes=32, memory_mb=1024))
    yield r
    r.close()


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    libc.shmdt.argtypes = [ctypes.c_void_p]
    return libc


def _host_shm_keys() -> set[int]:
    lines = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    return {int(line.split()[0]) for line in lines}


# -- run in the calls ----------------------------------------------------------------------


def shm_leave(key: int, text: str) -> int:
    """A SysV segment of 4 MiB under ``key``, with ``text`` in it, left attached to nobody."""
    libc = _libc()
    shmid = libc.shmget(key, 4 << 20, IPC_CREAT | 0o666)
    if shmid < 0:
        raise OSError(ctypes.get_errno(), "shmget")
    addr = libc.shmat(shmid, None, 0)
    ctypes.memmove(addr, text.encode(), len(text))
    libc.shmdt(ctypes.c_void_p(addr))
    return int(shmid)


def shm_find(key: int) -> str:
    """What a segment under ``key`` holds, or the errno of looking it up."""
    libc = _libc()
    shmid = libc.shmget(key, 0, 0)
    if shmid < 0:
        return errno.errorcode[ctypes.get_errno()]
    addr = libc.shmat(shmid, None, 0o10000)  # SHM_RDONLY
    return ctypes.string_at(addr, 64).split(b"\0")[0].decode()


def denied() -> dict[str, str]:
    """What the deny-list's calls answer in a call: each one's errno ("ok" if it worked)."""
    import socket

    libc = ctypes.CDLL(None, use_errno=True)

    def rc(value: int) -> str:
        return "ok" if value >= 0 else errno.errorcode[ctypes.get_errno()]

    out = {
        "unshare(CLONE_NEWUSER)": rc(libc.unshare(0x10000000)),
        "unshare(CLONE_NEWNS)": rc(libc.unshare(0x00020000)),
        "io_uring_setup": rc(libc.syscall(425, 4, ctypes.create_string_buffer(120))),
        "keyctl": rc(libc.syscall(250, 0, -3, 0, 0, 0)),  # KEYCTL_GET_KEYRING_ID, session
        "bpf": rc(libc.syscall(321, 0, ctypes.create_string_buffer(128), 128)),
        "ptrace(PTRACE_TRACEME)": rc(libc.ptrace(0, 0, None, None)),
        "clone3": rc(libc.syscall(435, ctypes.create_string_buffer(88), 88)),
    }
    try:
        socket.socket(40, socket.SOCK_STREAM).close()  # AF_VSOCK
        out["socket(AF_VSOCK)"] = "ok"
    except OSError as e:
        out["socket(AF_VSOCK)"] = errno.errorcode[e.errno or 0]
    return out


def python_works() -> dict[str, Any]:
    """A thread, a subprocess, a fork: each one's result."""
    import subprocess
    import threading

    ran: list[str] = []
    t = threading.Thread(target=lambda: ran.append("thread"))
    t.start()
    t.join()
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    forked = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    true = subprocess.run(["/bin/true"], check=False).returncode
    echo = subprocess.run(["sh", "-c", "echo hi"], capture_output=True, text=True).stdout
    return {"thread": ran, "fork": forked, "true": true, "echo": echo}


def hog(mib: int, others: int, each_mib: int) -> list[int]:
    """Touch ``mib`` MiB here, then start ``others`` fresh interpreters that touch ``each_mib``
    MiB each and hold it a while: their exit codes."""
    import subprocess
    import sys

    held = b"\1" * (mib << 20)
    code = f"import time; b = b'\\1' * ({each_mib} << 20); time.sleep(3)"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(others)]
    codes = [p.wait() for p in procs]
    return [*codes, len(held) >> 20]


def fork_loop() -> dict[str, Any]:
    """Fork until refused: how many; and the call's cgroup (its directories, pids.max and the
    memory limit as the tool sees them)."""
    import time

    own = dict(
        line.split(":", 2)[1:] for line in Path("/proc/self/cgroup").read_text().splitlines()
    )
    dirs = {c: f"/sys/fs/cgroup/{c}{own.get(c, '/')}" for c in ("memory", "pids")}

    def read(path: str) -> str:
        try:
            return Path(path).read_text().strip()
        except OSError as e:
            return errno.errorcode[e.errno or 0]

    n, refused = 0, ""
    while n < 10_000:
        try:
            if os.fork() == 0:
                time.sleep(30)
                os._exit(0)
        except OSError as e:
            refused = errno.errorcode[e.errno or 0]
            break
        n += 1
    return {
        "forked": n, "refused": refused, "dirs": dirs,
        "pids.max": read(dirs["pids"] + "/pids.max"),
        "memory": read(dirs["memory"] + "/memory.limit_in_bytes"),
    }  # fmt: skip


# -- the tests -----------------------------------------------------------------------------


@needs_ipcns
def test_sysv_shared_memory_dies_with_its_call(runner: ToolRunner) -> None:
    key = random.randrange(1 << 20, 1 << 30)
    try:
        ok, shmid = runner.call_function(shm_leave, (key, "the first call's"), {}, timeout_s=30)
        assert ok, shmid
        assert key not in _host_shm_keys()  # not the host's
        ok, found = runner.call_function(shm_find, (key,), {}, timeout_s=30)
        assert (ok, found) == (True, "ENOENT")  # nor the next call's
    finally:  # (the old code left it on the host)
        libc = _libc()
        shmid = libc.shmget(key, 0, 0)
        if shmid >= 0:
            libc.shmctl(shmid, IPC_RMID, None)


@needs_seccomp
def test_the_deny_list_is_denied_in_a_call_and_python_still_works(runner: ToolRunner) -> None:
    ok, seen = runner.call_function(denied, (), {}, timeout_s=30)
    assert ok, seen
    assert seen == {
        "unshare(CLONE_NEWUSER)": "EPERM", "unshare(CLONE_NEWNS)": "EPERM",
        "io_uring_setup": "EPERM", "keyctl": "EPERM", "bpf": "EPERM",
        "ptrace(PTRACE_TRACEME)": "EPERM", "clone3": "ENOSYS", "socket(AF_VSOCK)": "EPERM",
    }  # fmt: skip
    ok, seen = runner.call_function(python_works, (), {}, timeout_s=30)
    assert (ok, seen) == (True, {"thread": ["thread"], "fork": 7, "true": 0, "echo": "hi\n"})


@needs_cgroup
def test_the_calls_processes_share_its_memory_limit_and_the_node_is_unharmed(
    runner: ToolRunner,
) -> None:
    # six processes of 700 and 600 MiB under 1024 MiB: the old code let them reach 3.7 GB
    ok, why = runner.call_function(hog, (700, 5, 600), {}, timeout_s=30)
    assert (ok, why) == (
        False, "the tool's processes used more than their 1024 MiB of memory"
    ), why  # fmt: skip
    ok, codes = runner.call_function(hog, (100, 2, 100), {}, timeout_s=30)  # the next works
    assert (ok, codes) == (True, [0, 0, 100])


@needs_cgroup
def test_a_fork_loop_stops_at_the_calls_process_limit_and_its_group_goes(
    runner: ToolRunner,
) -> None:
    ok, seen = runner.call_function(fork_loop, (), {}, timeout_s=30)
    assert ok, seen
    assert (seen["pids.max"], seen["memory"]) == ("32", str(1024 << 20)), seen
    assert seen["refused"] == "EAGAIN" and seen["forked"] < 32, seen
    for d in seen["dirs"].values():  # its group goes (and so its processes), soon after
        assert "rollcall-tools" in d, d
        deadline = time.monotonic() + 10  # (the zygote reaps the keeper after the answer)
        while Path(d).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not Path(d).exists(), d


@needs_cgroup
def test_the_groups_a_dead_server_left_are_swept_with_their_processes() -> None:
    import subprocess

    from rollcall.workers.episode.sandbox import cgroups

    gone = subprocess.Popen(["true"])  # a server pid no longer running
    gone.wait()
    name = cgroups.call_name(gone.pid, 1)
    dirs = cgroups.create(PROTECTIONS, name, sandbox.Limits())
    left = subprocess.Popen(["sleep", "60"])  # a process the dead server's call left there
    try:
        for d in dirs:
            Path(d, "cgroup.procs").write_text(str(left.pid))
        mine = cgroups.call_name(os.getpid(), 2)  # a running server's: kept
        kept = cgroups.create(PROTECTIONS, mine, sandbox.Limits())
        sandbox.sweep_groups(PROTECTIONS)  # (other dead servers' groups go too, or went
        assert left.wait(timeout=10) == -9  # in another test process's sweep: either way)
        assert not any(Path(d).exists() for d in dirs)
        assert all(Path(d).exists() for d in kept)
    finally:
        left.kill()
        cgroups.remove(PROTECTIONS, name)
        cgroups.remove(PROTECTIONS, mine)


def test_the_node_says_what_the_kernel_gives(runner: ToolRunner) -> None:
    line = PROTECTIONS.describe(sandbox.Limits())
    if PROTECTIONS.ipc:
        assert "an IPC namespace of the call's own" in line
    if PROTECTIONS.seccomp:
        assert "a seccomp filter (no new namespaces" in line
    if PROTECTIONS.cgroup != "none":
        assert (
            f"a cgroup of the call's own ({PROTECTIONS.cgroup}: 1024 MiB of memory across its "
            "processes, 64 processes" in line
        ), line
    assert os.uname().sysname == "Linux"
