"""The vLLM worker extension's watchdog (``RollcallWorkerExtension.rollcall_watch``) in both
process layouts vLLM uses, as a real process tree (plain Python processes stand in for vLLM's:
the layouts are what matters, and vLLM's CUDA layout cannot run here):

- ``mp`` executor (what the engine always asks vLLM for): owner -> EngineCore -> worker; the
  watch runs in the worker.
- ``uni`` executor (vLLM's default for one GPU, should it run anyway): owner -> EngineCore,
  and the worker, with the watch, runs inside the EngineCore.

In each, the watch must leave the owner alone while it lives and end the EngineCore (and the
worker) once the owner dies."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rollcall.orchestrator.procfs import alive, children_of
from rollcall.workers.rollout.engines.vllm_worker import remove_socket_dir
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]

# argv: layout, owner pid, report file. "uni": this process is the EngineCore and runs the
# watch; "mp": it is the EngineCore and starts a worker (this same script, layout "worker").
CORE = textwrap.dedent(
    """
    import json, subprocess, sys, time
    layout, owner, report = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if layout == "mp":
        subprocess.Popen([sys.executable, __file__, "worker", str(owner), report])
    else:
        from rollcall.workers.rollout.engines.vllm_worker import RollcallWorkerExtension
        watched = RollcallWorkerExtension().rollcall_watch(owner, 0.05)
        with open(report + ".tmp", "w") as f:
            json.dump(list(watched), f)
        import os
        os.rename(report + ".tmp", report)
    time.sleep(120)
    """
)
OWNER = textwrap.dedent(
    """
    import os, subprocess, sys
    core = subprocess.Popen([sys.executable, sys.argv[1], sys.argv[2], str(os.getpid()), sys.argv[3]])
    core.wait()
    """
)


@pytest.mark.parametrize("layout", ["uni", "mp"])
def test_the_watch_spares_a_live_owner_and_ends_the_engine_when_it_dies(
    layout: str, tmp_path: Path
) -> None:
    script = tmp_path / "core.py"
    script.write_text(CORE)
    report = tmp_path / "watched.json"
    # the engine's socket folder (vllm_start.socket_dir), as vLLM's processes inherit it
    sockets = tmp_path / "rollcall-vllm-test" / "123-abc"
    sockets.mkdir(parents=True)
    (sockets / "a-socket").touch()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_RPC_BASE_PATH": str(sockets)}
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(script), layout, str(report)],
        env=env,
        start_new_session=True,  # its own process group: the clean-up reaches every process
    )
    try:
        wait_for("the watch to start", report.exists, 60)
        core, worker = json.loads(report.read_text())
        (started,) = children_of(owner.pid)
        assert core == started, "the EngineCore is the owner's child"
        if layout == "uni":
            assert worker == core, "the worker runs inside the EngineCore"
        else:
            assert children_of(core) == [worker], "the worker is the EngineCore's child"
        # a live owner is left alone (the old watch took the owner for the EngineCore and, its
        # parent not being the owner, killed it within one interval)
        with pytest.raises(subprocess.TimeoutExpired):
            owner.wait(timeout=1.0)
        assert alive(core) and alive(worker) and sockets.exists()
        owner.kill()
        owner.wait()
        wait_for(
            "the EngineCore and the worker to end after the owner died",
            lambda: not alive(core) and not alive(worker),
            30,
        )
        # nobody is left to close the engine: the watch removes its socket folder (a SIGKILLed
        # node's folder stayed until the next engine start on the machine swept it)
        assert not sockets.exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(owner.pid, signal.SIGKILL)
        owner.wait()


def test_only_a_folder_socket_dir_makes_is_removed(tmp_path: Path) -> None:
    """``remove_socket_dir``, shared by the engine's close, its failed start and the watchdog:
    a folder under ``rollcall-vllm-UID`` or the fallback ``rollcall-vllm-*`` goes, anything
    else (vLLM's default, the temp folder) stays."""
    under = tmp_path / "rollcall-vllm-0" / "123-abc"
    alone = tmp_path / "rollcall-vllm-xyz"
    other = tmp_path / "elsewhere"
    for folder in (under, alone, other):
        folder.mkdir(parents=True)
        (folder / "a-socket").touch()
        remove_socket_dir(folder)
    assert not under.exists() and not alone.exists()
    assert (other / "a-socket").exists()
