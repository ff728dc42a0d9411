"""The tool sandbox (``rollout.tool_sandbox``, ``rollcall.workers.episode.sandbox``): a tool call gets
no network unless its task is granted it, none of the node's environment, a fresh empty working
directory, and limits on processes, file size, CPU and its observation's size; a call that
breaks one is an error observation, and the next call works. Level ``process`` still works.
Through ``ToolRunner`` directly, with a fake plugin and functions of this module."""

from __future__ import annotations

import ctypes
import functools
import json
import multiprocessing.forkserver
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest

from rollcall.orchestrator.config import ToolSandboxConfig
from rollcall.tasks.base import BaseTask, Observation, TaskSpec, Tool
from rollcall.workers.episode import sandbox, tools
from rollcall.workers.episode.tools import ToolRunner

# Secrets of the node's, in its environment: the tool servers' forkserver inherits what the
# process has when it starts (set by the fixture below, before this test process starts one if
# it did not already; conftest.py sets RAY_AUTH_TOKEN_PATH before anything)
SECRETS = {
    "ROLLCALL_DATABASE_URL": "postgresql://rc:s3cr3t-sandbox@db.example:5432/rc",
    "PGPASSWORD": "s3cr3t-pg",
}

PROTECTIONS = sandbox.probe()


def _requires(ok: bool, why: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A test that needs a protection this kernel must give: it fails (never skips) without
    it, naming why: CI's machines and these allow namespaces, and a skip would hide their loss."""

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            assert ok, why
            return fn(*args, **kwargs)

        return checked

    return mark


needs_netns = _requires(
    PROTECTIONS.network, f"no network namespace here: {PROTECTIONS.network_error}"
)
needs_nproc = _requires(
    PROTECTIONS.processes == "per call",
    f"the process limit is {PROTECTIONS.processes} here: {PROTECTIONS.problems}",
)


class MeanTask(BaseTask):
    """A fake plugin whose tools try what a tool must not get away with (named a fake: it
    exists for this test)."""

    name: ClassVar[str] = "mean"
    description: ClassVar[str] = "tools that try to escape"
    Spec: ClassVar[type[TaskSpec]] = TaskSpec

    def prompt(self, spec: TaskSpec, index: int) -> dict[str, Any]:
        return {}

    def eval_prompt(self, spec: TaskSpec, index: int) -> dict[str, Any]:
        return {}

    def instructions(self, spec: TaskSpec, prompt: dict[str, Any]) -> str:
        return ""

    def reward(
        self,
        spec: TaskSpec,
        prompt: dict[str, Any],
        answer: str | None,
        state: dict[str, Any],
        turns: int,
    ) -> float:
        return 0.0

    def tools(self, spec: TaskSpec) -> list[Tool]:
        return []

    def call_tool(
        self,
        spec: TaskSpec,
        prompt: dict[str, Any],
        state: dict[str, Any],
        name: str,
        arguments: dict[str, Any],
    ) -> Observation:
        value = TOOLS[name](**arguments)
        return Observation(value if isinstance(value, str) else json.dumps(value), state)


def connect(host: str, port: int) -> str:
    with socket.socket() as s:
        s.settimeout(3)
        s.connect((host, port))
        return "connected"


def environment() -> dict[str, Any]:
    return {
        "environ": dict(os.environ),
        "block": Path("/proc/self/environ").read_bytes().decode(errors="replace"),
    }


def fork_bomb(n: int, marker: str) -> str:
    """Fork ``n`` children that sleep (a shell-less fork bomb), and a ``sleep`` marked."""
    import subprocess

    subprocess.Popen(["sleep", marker], start_new_session=True)  # left behind on purpose
    for _ in range(n):
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
    return f"forked {n}"


def write(mib: int, file: str) -> str:
    chunk = b"x" * (1024 * 1024)
    with (Path(tempfile.gettempdir()) / file).open("wb") as f:
        for _ in range(mib):
            f.write(chunk)
    return f"wrote {mib} MiB"


def spin() -> str:
    while True:
        pass


def hang(marker: str) -> str:
    import subprocess

    subprocess.Popen(["sleep", marker])
    time.sleep(3600)
    return "woke"


def where() -> dict[str, Any]:
    listing = sorted(p.name for p in Path.cwd().iterdir())
    return {"cwd": str(Path.cwd()), "listing": listing, "home": os.environ.get("HOME")}


def huge(mib: int) -> str:
    return "x" * (mib * 1024 * 1024)


def read(path: str) -> str:
    return Path(path).read_text()


def scratch(socket_path: str, marker: str) -> dict[str, Any]:
    """What a tool finds of the node's in /tmp and /dev/shm; leaves ``marker`` in each."""
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(3)
            s.connect(socket_path)
            reached = "connected"
    except OSError as e:
        reached = f"{type(e).__name__}: {e}"
    seen = {d: sorted(p.name for p in Path(d).iterdir()) for d in ("/tmp", "/dev/shm")}
    for d in ("/tmp", "/dev/shm"):
        (Path(d) / marker).write_text("left behind")
    return {"socket": reached, "seen": seen, "cwd": str(Path.cwd())}


def flood(mib: int) -> str:
    """An answer frame of ``mib`` MiB written straight to the answer pipe (fd 3), valid JSON."""
    body = b'["ok", "' + b"x" * (mib << 20) + b'", {}, false]'
    os.write(3, len(body).to_bytes(8, "big"))
    view = memoryview(body)
    while view:
        view = view[os.write(3, view) :]
    return "flooded"


def unmount(paths: list[str]) -> dict[str, Any]:
    """Try to uncover ``paths`` (umount2, MNT_DETACH) and to mount a tmpfs: the errnos."""
    libc = ctypes.CDLL(None, use_errno=True)
    out: dict[str, Any] = {}
    for p in paths:
        rc = libc.umount2(p.encode(), 2)
        out[p] = 0 if rc == 0 else errno_name(ctypes.get_errno())
    rc = libc.mount(b"none", b".", b"tmpfs", 0, None)
    out["mount"] = 0 if rc == 0 else errno_name(ctypes.get_errno())
    return out


def errno_name(e: int) -> str:
    import errno

    return errno.errorcode.get(e, str(e))


TOOLS: dict[str, Any] = {
    "connect": connect, "environment": environment, "fork_bomb": fork_bomb, "write": write,
    "spin": spin, "hang": hang, "where": where, "huge": huge, "read": read, "scratch": scratch,
    "flood": flood, "unmount": unmount,
}  # fmt: skip


def _call(runner: ToolRunner, name: str, network: bool = False, **arguments: Any) -> Any:
    return runner.call(MeanTask(), TaskSpec(), {}, {"n": 1}, name, arguments, network=network)


def _forkserver_environ() -> bytes:
    pid = multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    return Path(f"/proc/{pid}/environ").read_bytes() if pid else b""


@pytest.fixture(scope="module", autouse=True)
def secrets() -> Any:
    before = {k: os.environ.get(k) for k in SECRETS}
    os.environ.update(SECRETS)
    if b"s3cr3t" not in _forkserver_environ():  # started before: its servers lack the secrets
        multiprocessing.forkserver._forkserver._stop()  # type: ignore[attr-defined]
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def runner(secrets: None) -> Any:
    r = ToolRunner(
        timeout_s=20,
        sandbox=ToolSandboxConfig(cpu_s=2, processes=32, file_mb=16, memory_mb=512),
    )
    yield r
    r.close()


@pytest.fixture
def listening() -> Any:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _processes_with(marker: str) -> list[int]:
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if marker.encode() in (p / "cmdline").read_bytes():
                    found.append(int(p.name))
            except OSError:
                continue
    return found


@needs_netns
def test_no_network_unless_the_task_is_granted_it(runner: ToolRunner, listening: int) -> None:
    r = _call(runner, "connect", host="127.0.0.1", port=listening)
    assert r.error and "Network is unreachable" in r.observation, r.observation
    r = _call(runner, "connect", host="192.0.2.1", port=80)  # TEST-NET-1: not loopback
    assert r.error and "Network is unreachable" in r.observation, r.observation
    # the task granted the network: the node's own loopback is there
    r = _call(runner, "connect", network=True, host="127.0.0.1", port=listening)
    assert (r.observation, r.error) == ("connected", False)
    # and an agent's function likewise
    ok, why = runner.call_function(connect, ("127.0.0.1", listening), {}, timeout_s=20)
    assert not ok and "Network is unreachable" in why
    assert runner.call_function(
        connect, ("127.0.0.1", listening), {}, timeout_s=20, network=True
    ) == (True, "connected")


def test_the_environment_has_no_secret_of_the_nodes(runner: ToolRunner) -> None:
    assert os.environ.get("RAY_AUTH_TOKEN_PATH")  # the node has secrets (conftest.py)
    r = _call(runner, "environment")
    # the servers' forkserver has them (else this test proves nothing)
    assert b"s3cr3t-sandbox" in _forkserver_environ()
    assert not r.error, r.observation
    seen = json.loads(r.observation)
    assert set(seen["environ"]) <= {"PATH", "LANG", "HOME", "TMPDIR"}, seen["environ"]
    for secret in ("RAY_", "ROLLCALL", "PGPASSWORD", "s3cr3t"):
        assert secret not in seen["block"]  # /proc/self/environ: the block it started with
    # an agent's function: the same
    ok, seen = runner.call_function(environment, (), {}, timeout_s=20)
    assert ok and set(seen["environ"]) <= {"PATH", "LANG", "HOME", "TMPDIR"}
    if PROTECTIONS.mounts or PROTECTIONS.drop_uid:  # covered, or 0600 and not the tool's
        token = Path(os.environ["RAY_AUTH_TOKEN_PATH"]).read_text()
        r = _call(runner, "read", path=os.environ["RAY_AUTH_TOKEN_PATH"])
        assert token not in r.observation


@needs_nproc
def test_a_fork_bomb_is_stopped_by_the_process_limit_and_the_next_call_works(
    runner: ToolRunner,
) -> None:
    marker = f"1{uuid.uuid4().int % 10**8}.5"  # a unique number of seconds for sleep
    r = _call(runner, "fork_bomb", n=1000, marker=marker)
    assert r.error and "Resource temporarily unavailable" in r.observation, r.observation
    # nothing of the call is left: its children, and the sleep that left its session (killed
    # with its pid namespace once the call's first process is gone: soon after the answer)
    deadline = time.monotonic() + 10
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_with(marker) == []
    r = _call(runner, "where")
    assert not r.error, r.observation


def test_a_file_past_the_file_limit_fails_and_nothing_is_left_on_disk(runner: ToolRunner) -> None:
    name = f"big-{uuid.uuid4().hex}.bin"
    try:
        r = _call(runner, "write", mib=1024, file=name)
        assert r.error and r.observation == "error: the tool wrote past its 16 MiB file limit"
        assert not list(Path(tempfile.gettempdir()).glob(f"*/{name}"))  # its directory: gone
    finally:  # (the old code wrote it in the node's own temporary directory)
        (Path(tempfile.gettempdir()) / name).unlink(missing_ok=True)


def test_a_tool_that_spins_is_stopped_by_its_cpu_limit(runner: ToolRunner) -> None:
    r = _call(runner, "spin")
    assert r.error and r.observation == "error: the tool used its 2 s of CPU", r.observation


def test_a_hung_tool_is_killed_with_what_it_started() -> None:
    marker = f"2{uuid.uuid4().int % 10**8}.5"
    short = ToolRunner(timeout_s=3.0, sandbox=ToolSandboxConfig())
    try:
        calls = _in_thread(lambda: _call(short, "hang", marker=marker))
        assert _wait_for(lambda: _processes_with(marker)), "its sleep never started"
        calls.join()
        r = calls.result
        assert r.error and "did not answer within 3 s" in r.observation
        assert _wait_for(lambda: not _processes_with(marker))  # its sleep died with it
        assert not _call(short, "where").error  # the same server serves the next call
    finally:
        short.close()


def test_the_working_directory_is_fresh_and_empty(runner: ToolRunner) -> None:
    first = json.loads(_call(runner, "where").observation)
    second = json.loads(_call(runner, "where").observation)
    assert first["listing"] == [] and first["cwd"] != str(Path.cwd())
    assert first["home"] == first["cwd"] != second["cwd"]
    assert not Path(first["cwd"]).exists()  # removed after the call


def test_an_observation_over_its_limit_is_refused_in_the_tool_process() -> None:
    with ToolRunner(timeout_s=20, sandbox=ToolSandboxConfig(), observation_bytes=1000) as r:
        result = _call(r, "huge", mib=10)
        assert result.error and result.observation == (
            "error: the tool's observation is 10,485,760 bytes, over "
            "rollout.input_limits.observation_bytes (1,000)"
        )
        assert result.state == {"n": 1}
        ok, why = r.call_function(huge, (10,), {}, timeout_s=20)
        assert not ok and why.startswith("the tool's observation is 10,485,760 bytes")


def test_level_process_still_runs_tools_in_one_process() -> None:
    with ToolRunner(timeout_s=20, sandbox=ToolSandboxConfig(level="process")) as r:
        a = json.loads(_call(r, "where").observation)
        b = json.loads(_call(r, "where").observation)
        assert a["cwd"] == b["cwd"] == str(Path.cwd())  # today's behaviour: the node's directory
        ok, pid = r.call_function(os.getpid, (), {}, timeout_s=20)
        assert ok and pid == r.call_function(os.getpid, (), {}, timeout_s=20)[1] != os.getpid()
        result = _call(r, "huge", mib=1)
        assert result.error and "over rollout.input_limits.observation_bytes" in result.observation


def test_the_node_says_what_the_sandbox_does_here() -> None:
    line = tools.describe(ToolSandboxConfig(network_tasks=["web"]))
    assert line.startswith("tool sandbox: ")
    if PROTECTIONS.network:
        assert "no network (a network namespace of the call's own); the network for web" in line
    else:
        assert f"no network namespace ({PROTECTIONS.network_error}); tools can reach" in line
    assert tools.describe(ToolSandboxConfig(level="process")).startswith(
        "tool sandbox: level process"
    )


class _Call(threading.Thread):
    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.result: Any = None

    def run(self) -> None:
        self.result = self.fn()


def _in_thread(fn: Callable[[], Any]) -> _Call:
    call = _Call(fn)
    call.start()
    return call


def _wait_for(check: Callable[[], Any], within_s: float = 30.0) -> Any:
    """``check()`` once true (polled), else its last false value."""
    deadline = time.monotonic() + within_s
    while not (value := check()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def test_tmp_and_dev_shm_are_the_calls_own(runner: ToolRunner) -> None:
    _call(runner, "where")  # the forkserver runs (it started the server)
    address = multiprocessing.forkserver._forkserver._forkserver_address  # type: ignore[attr-defined]
    assert address and Path(address).exists()
    marker = f"left-{uuid.uuid4().hex}"
    try:
        r = _call(runner, "scratch", socket_path=address, marker=marker)
        assert not r.error, r.observation
        seen = json.loads(r.observation)
        assert seen["socket"].startswith(("FileNotFoundError", "PermissionError")), seen
        # empty, but for the call's own working directory (and the interpreter's paths, if any
        # are under /tmp: bound back read-only)
        kept = {Path(k).parts[2] for k in sandbox.layout().keep if sandbox._under(k, "/tmp")}
        assert set(seen["seen"]["/tmp"]) <= {Path(seen["cwd"]).name, *kept}, seen
        assert Path(seen["cwd"]).name in seen["seen"]["/tmp"] and seen["seen"]["/dev/shm"] == []
        # what it wrote there went with the call
        assert not (Path("/tmp") / marker).exists() and not (Path("/dev/shm") / marker).exists()
        again = json.loads(_call(runner, "scratch", socket_path=address, marker=marker).observation)
        assert marker not in again["seen"]["/tmp"] and again["seen"]["/dev/shm"] == []
    finally:
        for d in ("/tmp", "/dev/shm"):
            (Path(d) / marker).unlink(missing_ok=True)


def test_an_answer_frame_over_its_limit_is_a_crash_and_the_next_call_works(
    runner: ToolRunner,
) -> None:
    r = _call(runner, "flood", mib=50)
    assert r.error and "the tool's answer is over its limit" in r.observation, r.observation[:200]
    assert r.state == {"n": 1}
    assert not _call(runner, "where").error


def test_as_root_a_tool_can_neither_unmount_nor_mount(runner: ToolRunner) -> None:
    home = os.environ["HOME"]
    assert home in PROTECTIONS.hidden, PROTECTIONS
    r = _call(runner, "unmount", paths=[home, "/tmp", "/proc"])
    assert not r.error, r.observation
    assert json.loads(r.observation) == {home: "EPERM", "/tmp": "EPERM", "/proc": "EPERM",
                                         "mount": "EPERM"}  # fmt: skip


def test_a_tool_outlives_neither_its_server_nor_its_working_directory() -> None:
    marker = f"3{uuid.uuid4().int % 10**8}.5"
    doomed = ToolRunner(timeout_s=60.0, sandbox=ToolSandboxConfig())
    calls = _in_thread(lambda: _call(doomed, "hang", marker=marker))
    try:
        (sleeper,) = _wait_for(lambda: _processes_with(marker))
        workdir = Path(f"/proc/{sleeper}/cwd").readlink()
        assert workdir.name.startswith("rollcall-tool-") and workdir.is_dir()
        doomed.close()  # the server killed (as the node does a hung one)
        calls.join()
        assert _wait_for(lambda: not _processes_with(marker)), "the tool outlived its server"
        # a new server sweeps what the killed one left
        with ToolRunner(timeout_s=20, sandbox=ToolSandboxConfig()) as fresh:
            assert not _call(fresh, "where").error
        assert not workdir.exists()
    finally:
        doomed.close()


def test_the_line_says_when_tools_see_the_nodes_processes() -> None:
    limits = sandbox.Limits()
    netpid = sandbox.CLONE_NEWNET | sandbox.CLONE_NEWPID
    line = sandbox.Protections(True, "root", netpid, True).describe(limits)
    assert "tools see the node's processes in /proc" in line
    full = netpid | sandbox.CLONE_NEWNS
    assert "node's processes" not in sandbox.Protections(True, "root", full, True).describe(limits)


def test_what_is_hidden_from_the_drivers_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run from ``$HOME`` (Ray puts the driver's cwd on workers' ``sys.path``), with
    ``ROLLCALL_HOME`` inside ``HOME``: both hidden, neither bound back."""
    home = tmp_path / "home"
    (home / ".rollcall").mkdir(parents=True)
    env = {"HOME": str(home), "ROLLCALL_HOME": str(home / ".rollcall")}
    monkeypatch.chdir(home)
    monkeypatch.setattr(sys, "path", ["", str(home), *sys.path])
    lay = sandbox.layout(env)
    assert {str(home), str(home / ".rollcall")} <= set(lay.hide), lay
    for kept in lay.keep:
        assert not any(sandbox._under(h, kept) for h in lay.hide), (kept, lay)
    assert str(home) not in lay.needed
    assert lay == sandbox.layout(env, cwd=str(home), path=sys.path)  # (the same, said)


# a call run by ``sandbox`` alone (a bare interpreter: as root, or as a user of no account's)
SCRIPT = """
import ctypes, json, os, sys
sys.path.insert(0, os.getcwd())  # as Ray does: the driver's working directory
import sandbox

home = os.environ["HOME"]
lay = sandbox.layout()
plan = sandbox.probe_here(lay)
limits = sandbox.Limits(cpu_s=5, memory_mb=512, processes=16, file_mb=4)


def work():
    libc = ctypes.CDLL(None, use_errno=True)
    out = {"uid": os.getuid()}
    for p in (home + "/.rollcall", home, "/tmp", "/proc"):
        out[p] = 0 if libc.umount2(p.encode(), 2) == 0 else ctypes.get_errno()
    rc = libc.mount(b"none", b".", b"tmpfs", 0, None)
    out["mount"] = 0 if rc == 0 else ctypes.get_errno()
    for f in (home + "/secret", home + "/.rollcall/secret"):
        try:
            out[f] = open(f).read()
        except OSError as e:
            out[f] = e.errno
    return json.dumps(out).encode()


box = sandbox.Sandbox(limits, plan, lay, lambda _request: work())
o = box.run(b"", network=False, timeout_s=20, started=lambda: 0)
box.close()
print(json.dumps({"mode": plan.mode, "mounts": plan.mounts, "hidden": plan.hidden,
                  "drop_uid": plan.drop_uid, "problems": plan.problems,
                  "answer": o.answer.decode() if o.answer else None, "failure": o.failure,
                  "detail": o.detail}))
"""


def _interpreter(uid: int) -> str:
    """An interpreter ``uid`` may run: this one, else the system's."""
    for python in (sys.executable, "/usr/bin/python3"):
        ok = subprocess.run(
            [*_as(uid), python, "-c", "import ctypes"], capture_output=True, check=False
        )
        if ok.returncode == 0:
            return python
    raise AssertionError(f"no interpreter that uid {uid} may run")


def _as(uid: int | None) -> list[str]:
    if uid is None:
        return []
    if uid == -1:
        return [shutil.which("unshare") or "unshare", "--user", "--map-root-user"]
    return [shutil.which("setpriv") or "setpriv", f"--reuid={uid}", f"--regid={uid}",
            "--clear-groups"]  # fmt: skip


@pytest.mark.parametrize(
    "uid", [None, 40000 + uuid.uuid4().int % 20000, -1], ids=["root", "user", "userns-root"]
)
def test_a_tool_cannot_uncover_what_is_hidden(uid: int | None) -> None:
    """Not as root the tool process is root in a user namespace of its own: it must have no
    capability left there (else it unmounts the covers). From a ``HOME`` that is the cwd and
    in ``sys.path``, with ``ROLLCALL_HOME`` inside it: neither bound back. ``userns-root``:
    root in a user namespace (a container's), where a uid of the tool's own is unmapped."""
    assert os.geteuid() == 0  # CI runs as root: the test becomes another user itself
    base = Path(tempfile.mkdtemp(prefix="rollcall-sandbox-test-", dir="/run"))
    try:
        base.chmod(0o755)
        code = base / "bin"  # (not above HOME: the script's directory is bound back)
        code.mkdir(mode=0o755)
        shutil.copytree(  # the package, imported by its folder's name (as its probe does)
            Path(sandbox.__file__).parent, code / "sandbox",
            ignore=shutil.ignore_patterns("__pycache__"),
        )  # fmt: skip
        (code / "script.py").write_text(SCRIPT)
        home = base / "home"
        (home / ".rollcall").mkdir(parents=True)
        (home / "secret").write_text("home-secret")
        (home / ".rollcall" / "secret").write_text("rollcall-secret")
        for p in (code / "script.py", *(code / "sandbox").glob("*.py"), home / "secret",
                  home / ".rollcall" / "secret"):  # fmt: skip
            p.chmod(0o644)
        for d in (home, home / ".rollcall", code / "sandbox"):
            d.chmod(0o755)
        python = _interpreter(uid) if uid not in (None, -1) else "/usr/bin/python3"
        env = {"HOME": str(home), "ROLLCALL_HOME": str(home / ".rollcall")}
        env["PATH"] = "/usr/bin:/bin"
        done = subprocess.run(
            [*_as(uid), python, "-s", str(code / "script.py")], cwd=home, env=env,
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
        assert seen["mounts"] and seen["mode"] == ("userns" if uid and uid > 0 else "root"), seen
        if uid == -1:  # said, and the tools run as (this namespace's) root
            assert not seen["drop_uid"] and "no uid of their own" in str(seen["problems"]), seen
        assert seen["answer"], (seen["failure"], seen["detail"], done.stderr)
        answer = json.loads(seen["answer"])
        assert "home-secret" not in answer.values() and "rollcall-secret" not in answer.values()
        for what in (str(home), str(home / ".rollcall"), "/tmp", "/proc", "mount"):
            assert answer[what] != 0, answer  # refused (EPERM; ENOENT/EINVAL: not there)
        assert answer["mount"] == 1 and answer["/tmp"] == 1, answer  # EPERM
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_removing_a_working_directory_never_changes_the_folder_it_is_in(tmp_path: Path) -> None:
    # a working directory already gone made the removal open up its parent with chmod 0700:
    # as the parent is /tmp, every non-root process (the test suite's PostgreSQL) lost its
    # files there (CI: "could not stat data directory ...: Permission denied")
    from rollcall.workers.episode.sandbox.server import _remove

    parent = tmp_path / "tmp"
    parent.mkdir()
    parent.chmod(0o1777)
    _remove(str(parent / "rollcall-tool-1-gone"))
    assert stat.S_IMODE(parent.stat().st_mode) == 0o1777
    # what the tool made unreadable inside its own directory is still removed
    work = parent / "rollcall-tool-2-x"
    (work / "locked" / "deep").mkdir(parents=True)
    (work / "locked" / "deep" / "f").write_text("x")
    (work / "locked").chmod(0)
    work.chmod(0o500)
    _remove(str(work))
    assert not work.exists()
    assert stat.S_IMODE(parent.stat().st_mode) == 0o1777


def test_closing_a_runner_under_a_waiting_call_ends_that_call_as_a_crash() -> None:
    """``close`` from another thread (the node ending a hung call) races the call's own
    clean-up: each pipe is closed once, the call returns a crash and raises nothing. (Threads
    switch often here to widen the race CI once met: a pipe closed twice, ``EBADF``.)"""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        _close_under_calls()
    finally:
        sys.setswitchinterval(interval)


def _close_under_calls() -> None:
    for attempt in range(8):
        marker = f"4{uuid.uuid4().int % 10**8}.5"
        runner = ToolRunner(timeout_s=60.0, sandbox=ToolSandboxConfig())
        calls = _in_thread(lambda: _call(runner, "hang", marker=marker))  # noqa: B023
        try:
            assert _wait_for(lambda: _processes_with(marker)), "its sleep never started"  # noqa: B023
            runner.close()
            calls.join(timeout=30)
            assert not calls.is_alive(), f"attempt {attempt}: the call still waits"
            assert calls.result is not None, f"attempt {attempt}: the call raised"
            assert calls.result.error and "crashed" in calls.result.observation
        finally:
            runner.close()
