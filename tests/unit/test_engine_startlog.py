"""What a failed vLLM start keeps (``workers/rollout/engines/startlog.py``): the error lines of
what its processes wrote since the start began, the root cause first found among them, a
bounded tail, and an error that crosses Ray with them. The lines are vLLM 0.32's own, as the
CPU build wrote them for a KV cache larger than the machine's memory."""

from __future__ import annotations

import os
import pickle
import threading
import time
from pathlib import Path

import pytest

from rollcall.workers.rollout.engines import startlog

ROOT = (
    "ValueError: Available memory on node 0 (22.06/23.54 GiB) on kv cache allocation is less "
    "than requested memory for kv (1024.0 GiB)."
)
STDOUT = f"""(EngineCore pid=7) INFO 12-06 13:00:40 [core.py:100] Initializing a V1 LLM engine
Loading safetensors checkpoint shards:   0% 0/1\rLoading safetensors checkpoint shards: 100% 1/1
(Worker pid=8) ERROR 12-06 13:01:05 [multiproc_executor.py:1063] WorkerProc hit an exception.
(Worker pid=8) ERROR 12-06 13:01:05 [multiproc_executor.py:1063] Traceback (most recent call last):
(Worker pid=8) ERROR 12-06 13:01:05 [multiproc_executor.py:1063]   File "cpu_worker.py", line 219
(Worker pid=8) ERROR 12-06 13:01:05 [multiproc_executor.py:1063]     raise ValueError(
(Worker pid=8) ERROR 12-06 13:01:05 [multiproc_executor.py:1063]     ^^^^^^^^^^^^^^^^^
(Worker pid=8) ERROR 12-06 13:01:05 [multiproc_executor.py:1063] {ROOT}
(Worker pid=8) ERROR 12-06 13:01:05 [multiproc_executor.py:1063] \n(EngineCore pid=7) ERROR 12-06 13:01:05 [core.py:1510] EngineCore failed to start.
(EngineCore pid=7) INFO 12-06 13:01:08 [multiproc_executor.py:486] [shutdown] Executor: all workers exited
"""
STDERR = """Triton is installed, but doesn't include CPU backend. Disabling Triton.
Process EngineCore:
Traceback (most recent call last):
  File "multiprocessing/process.py", line 314, in _bootstrap
    self.run()
    ^^^^^^^^^^
RuntimeError: Worker failed with error 'Available memory on node 0', please check the stack trace
/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: leaked
"""


def test_the_error_lines_and_the_first_exception_as_the_root_cause() -> None:
    lines = startlog.error_lines(STDOUT) + startlog.error_lines(STDERR)
    assert lines == [
        "(Worker pid=8) WorkerProc hit an exception.",
        "(Worker pid=8) Traceback (most recent call last):",
        '(Worker pid=8)   File "cpu_worker.py", line 219',
        "(Worker pid=8)     raise ValueError(",
        f"(Worker pid=8) {ROOT}",
        "(EngineCore pid=7) EngineCore failed to start.",
        "Process EngineCore:",
        "Traceback (most recent call last):",
        '  File "multiprocessing/process.py", line 314, in _bootstrap',
        "    self.run()",
        "RuntimeError: Worker failed with error 'Available memory on node 0', please check the "
        "stack trace",
    ]
    # the worker's error, logged before the EngineCore's and the process's own in turn
    assert startlog.root_cause(lines) == ROOT


def test_the_evidence_is_a_bounded_tail() -> None:
    lines = [f"line {i} " + "x" * 200 for i in range(100)]
    tail = startlog.evidence(lines)
    assert tail[-1] == lines[-1] and sum(len(t) + 1 for t in tail) <= startlog.MAX_BYTES
    # 4,096 bytes hold 19 lines of 208 characters and their newlines (19 x 209 = 3,971)
    assert len(tail) == 19
    assert startlog.evidence(["a", "b"]) == ["a", "b"]


def test_a_start_error_reads_back_only_what_was_written_since_the_mark(tmp_path: Path) -> None:
    out = tmp_path / "worker.out"
    saved = os.dup(1)
    with out.open("wb") as f:
        f.write(b"(Worker pid=1) ERROR 12-06 13:00:00 [x.py:1] OSError: an older start's\n")
        f.flush()
        os.dup2(f.fileno(), 1)
    try:
        mark = startlog.OutputMark()
        os.write(1, f"(Worker pid=8) ERROR 12-06 13:01:05 [x.py:1] {ROOT}\n".encode())
        error = startlog.start_error(RuntimeError("Engine core initialization failed."), mark)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    assert "stdout" in [s.name for s in mark.streams]
    assert str(error).splitlines()[-1] == (
        f"{ROOT} (vLLM did not start: RuntimeError: Engine core initialization failed.)"
    )
    assert error.cause == ROOT and f"(Worker pid=8) {ROOT}" in error.output
    assert "older start" not in str(error)
    copy = pickle.loads(pickle.dumps(error))  # as Ray sends it to the supervisor
    assert (str(copy), copy.cause, copy.output) == (str(error), error.cause, error.output)


def test_through_rays_pipe_it_reads_the_log_file_once_the_copy_has_caught_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under log rotation (the driver's local Ray) a worker's stdout is a pipe and Ray's logger
    copies it into worker-*.out: a copier of our own stands in for Ray's (a fake at that seam;
    tests/vllm/test_vllm_start_failure.py has the real one), late by 0.3 s, and rotates the
    file before it writes the error line."""
    log = tmp_path / "worker.out"
    log.write_bytes(b"(Worker pid=1) ERROR 12-06 13:00:00 [x.py:1] OSError: an older start's\n")
    monkeypatch.setattr(startlog, "ray_worker_logs", lambda: {"stdout": str(log)})
    read_end, write_end = os.pipe()
    saved = os.dup(1)
    os.dup2(write_end, 1)
    os.close(write_end)

    def copy() -> None:
        with os.fdopen(read_end, "rb") as pipe:
            data = pipe.read()  # until the writer's end closes
        time.sleep(0.3)
        log.rename(tmp_path / "worker.1.out")  # rotated: a new file takes the name
        log.write_bytes(data)

    copier = threading.Thread(target=copy)
    copier.start()
    try:
        mark = startlog.OutputMark()
        os.write(1, f"(Worker pid=8) ERROR 12-06 13:01:05 [x.py:1] {ROOT}\n".encode())
    finally:
        os.dup2(saved, 1)  # the pipe's last writer closes: the copier goes on
        os.close(saved)
    error = startlog.start_error(RuntimeError("Engine core initialization failed."), mark)
    copier.join()
    assert (mark.streams[0].where, mark.streams[0].piped) == (str(log), True)  # stdout's
    assert error.cause == ROOT and "older start" not in str(error), str(error)
    assert f"stdout: {log}" in str(error)


def test_the_supervisor_keeps_the_tail_of_a_constructors_error() -> None:
    from ray.exceptions import ActorDiedError, RayTaskError

    from rollcall.orchestrator.runner.slots import _death_reason, _evidence

    error = startlog.EngineStartError(
        "vLLM's processes wrote, while it started (stdout: /tmp/w.out):\n"
        f"  | (Worker pid=8) {ROOT}\n{ROOT} (vLLM did not start: RuntimeError: Engine core "
        "initialization failed.)",
        ROOT,
        (f"(Worker pid=8) {ROOT}",),
    )
    frames = '  File "x.py", line 1, in f\n' * 60
    tb = (
        "ray::RolloutNode.__init__() (pid=4242, ip=127.0.0.1)\n"
        f"Traceback (most recent call last):\n{frames}"
        f"rollcall.workers.rollout.engines.startlog.EngineStartError: {error}"
    )
    e = ActorDiedError(RayTaskError("RolloutNode.__init__", tb, error, actor_id="01" * 16))
    assert _death_reason(e).startswith(f"constructor raised {ROOT[:60]}")
    kept = _evidence(e)
    assert len(kept) == 40 and kept[-1].startswith(ROOT)
    assert any(line.endswith(f"(Worker pid=8) {ROOT}") for line in kept)


@pytest.mark.parametrize("text", ["", "INFO 12-06 13:00:00 [x.py:1] all well\n"])
def test_no_error_line_no_cause(text: str) -> None:
    assert startlog.root_cause(startlog.error_lines(text)) is None
