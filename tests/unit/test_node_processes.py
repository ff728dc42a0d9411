"""Which processes ``rollcall drill kill-node`` kills (``rollcall.orchestrator.services.drills``): every
process of one Ray node on this host, and never one of another node. Each test lays out a fake
``/proc`` (``procfs.PROC``) as Ray 2.60 leaves it, from command lines seen on real clusters:
``ray start`` on its own machine, two ``ray start`` nodes sharing one host, and
``ray.cluster_utils.Cluster`` (tests/integration/test_node_processes.py runs a real one)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rollcall.orchestrator import procfs
from rollcall.orchestrator.cli.drill import drill_table
from rollcall.orchestrator.services.drills import DrillReport
from rollcall.orchestrator.services.nodeloss import RayNodeWatch, find_ray_node
from tests.unit.test_status_render import check_width, line_with, render

RAY = "/venv/lib/python3.11/site-packages/ray"
PY = "/venv/bin/python"
SESSION = "/tmp/ray/session_2026-12-05_17-38-42_568252_7962"
LOGS = f"{SESSION}/logs"
GCS = "10.0.0.1:6379"
CLUSTER = "fbd24845b08a3923c3691b3c198d8885024694152ec782338f9c7c7e"
HEAD = "5b2c5d8bb16ad988aa8969561f80c80d52085fc19125025498c0a372"
WORKER = "363d8713c8412c459f0106323359211a6d921d9064924e6c18659f92"
OTHER = "9f1c0de2a8b4c6e0f1a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4"


class FakeProc:
    def __init__(self, root: Path) -> None:
        self.root = root

    def add(self, pid: int, ppid: int, pgid: int, *argv: str) -> int:
        d = self.root / str(pid)
        d.mkdir()
        name = Path(argv[0]).name[:15] if argv else "kworker"
        (d / "stat").write_text(f"{pid} ({name}) S {ppid} {pgid} {pgid} 0 -1 4194560 0 0\n")
        (d / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in argv))
        return pid

    def raylet(self, pid: int, ppid: int, pgid: int, node: str, sock: str, head: bool) -> int:
        return self.add(
            pid,
            ppid,
            pgid,
            f"{RAY}/core/src/ray/raylet/raylet",
            f"--raylet_socket_name={SESSION}/sockets/{sock}",
            f"--store_socket_name={SESSION}/sockets/plasma_store{sock[6:]}",
            f"--node_id={node}",
            "--node_ip_address=10.0.0.1",
            f"--python_worker_command={PY} setup_worker.py default_worker.py "
            f"--raylet-name={SESSION}/sockets/{sock} --temp-dir=/tmp/ray",
            "--temp_dir=/tmp/ray",
            f"--session_dir={SESSION}",
            f"--log_dir={LOGS}",
            f"--gcs-address={GCS}",
            f"--cluster-id={CLUSTER}",
            f"--dashboard_agent_command={PY} {RAY}/dashboard/agent.py --node-id={node} "
            f"--session-dir={SESSION} --log-dir={LOGS}",
            *(["--head"] if head else []),
        )

    def log_monitor(self, pid: int, ppid: int, pgid: int) -> int:
        return self.add(
            pid,
            ppid,
            pgid,
            PY,
            "-u",
            f"{RAY}/_private/log_monitor.py",
            f"--session-dir={SESSION}",
            f"--logs-dir={LOGS}",
            f"--gcs-address={GCS}",
            "--node-ip-address=10.0.0.1",
            f"--stdout-filepath={LOGS}/log_monitor.out",
        )

    def head_processes(self, ppid: int, pgid: int, base: int) -> dict[str, int]:
        """What a head starts before its raylet, as `ray start --head` (or cluster_utils)."""
        gcs = self.add(
            base,
            ppid,
            pgid,
            f"{RAY}/core/src/ray/gcs/gcs_server",
            f"--log_dir={LOGS}",
            "--gcs_server_port=6379",
            f"--session-dir={SESSION}",
            f"--node-id={HEAD}",
        )
        monitor = self.add(
            base + 1, ppid, pgid, PY, "-u", f"{RAY}/autoscaler/_private/monitor.py",
            f"--logs-dir={LOGS}", f"--gcs-address={GCS}",
        )  # fmt: skip
        client = self.add(
            base + 2, ppid, pgid, PY, "-m", "ray.util.client.server", f"--address={GCS}",
            f"--node-id={HEAD}",
        )  # fmt: skip
        dashboard = self.add(
            base + 3, ppid, pgid, PY, f"{RAY}/dashboard/dashboard.py", "--temp-dir=/tmp/ray",
            f"--log-dir={LOGS}", f"--session-dir={SESSION}", f"--gcs-address={GCS}",
        )  # fmt: skip
        return {"gcs": gcs, "monitor": monitor, "client": client, "dashboard": dashboard}


@pytest.fixture
def proc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeProc:
    monkeypatch.setattr(procfs, "PROC", tmp_path)
    fake = FakeProc(tmp_path)
    fake.add(1, 0, 1, "/sbin/init")
    return fake


def test_ray_start_on_its_own_machine(proc: FakeProc) -> None:
    """The reported case: `ray start --address=...` on a worker machine. `ray start` has exited:
    its log monitor and raylet are init's children; the log monitor names no node id and must
    be killed too."""
    lm = proc.log_monitor(300, 1, 290)
    raylet = proc.raylet(301, 1, 290, WORKER, "raylet", head=False)
    proc.add(310, raylet, 290, "ray::DashboardAgent")
    proc.add(311, raylet, 290, "ray::RuntimeEnvAgent")
    rollout = proc.add(320, raylet, 320, "ray::RolloutNode.run")
    proc.add(321, rollout, 320, "VLLM::EngineCore")
    proc.add(322, raylet, 322, "ray::IDLE")
    # a worker process just started, not renamed yet (it names the node's sockets), whose
    # parent the raylet is no more
    proc.add(323, 1, 323, PY, "default_worker.py", f"--raylet-name={SESSION}/sockets/raylet")
    proc.add(400, 1, 400, "/usr/sbin/sshd", "-D")  # not Ray's
    proc.add(401, 1, 401, "/usr/bin/less", f"{LOGS}")  # an operator's, naming the logs
    node = find_ray_node(WORKER)
    assert node.processes == [
        (lm, "log_monitor"),
        (raylet, "raylet"),
        (310, "agent"),
        (311, "agent"),
        (rollout, "worker"),
        (321, "worker"),
        (322, "worker"),
        (323, "worker"),
    ]
    assert node.shared == []
    assert (node.gcs_address, node.cluster_id) == (GCS, CLUSTER)


def test_two_ray_start_nodes_on_one_host(proc: FakeProc) -> None:
    """`ray start --head` and `ray start --address` on one machine, each from its own shell
    (its own process group), sharing the session directory: each node's log monitor is its
    own, and killing the worker node leaves the head's processes alone."""
    head = proc.head_processes(1, 7962, 7984)
    head_lm = proc.log_monitor(8059, 1, 7962)
    head_raylet = proc.raylet(8060, 1, 7962, HEAD, "raylet", head=True)
    proc.add(8085, head_raylet, 7962, "ray::DashboardAgent")
    proc.add(8087, head_raylet, 7962, "ray::RuntimeEnvAgent")
    worker_lm = proc.log_monitor(8276, 1, 8261)
    worker_raylet = proc.raylet(8277, 1, 8261, WORKER, "raylet.1", head=False)
    proc.add(8300, worker_raylet, 8261, "ray::DashboardAgent")
    proc.add(8302, worker_raylet, 8261, "ray::RuntimeEnvAgent")
    proc.add(8400, worker_raylet, 8400, "ray::RolloutNode")

    worker = find_ray_node(WORKER)
    assert worker.processes == [
        (worker_lm, "log_monitor"),
        (worker_raylet, "raylet"),
        (8300, "agent"),
        (8302, "agent"),
        (8400, "worker"),
    ]
    assert {pid for pid, _ in worker.shared} == {head["monitor"], head["dashboard"], head_lm}

    head_node = find_ray_node(HEAD)
    assert dict(head_node.processes) == {
        head["gcs"]: "gcs",
        head["monitor"]: "monitor",
        head["client"]: "client_server",
        head["dashboard"]: "dashboard",
        head_lm: "log_monitor",
        head_raylet: "raylet",
        8085: "agent",
        8087: "agent",
    }
    assert {pid for pid, _ in head_node.shared} == {worker_lm}


def test_cluster_utils_nodes_share_the_driver(proc: FakeProc) -> None:
    """`ray.cluster_utils.Cluster`: every node's processes are children of the test process,
    in its process group; only the head has a log monitor ("one per physical node"). Killing
    the worker node takes its raylet and what runs under it, never the head's processes, nor
    the test process (the drill runs in it) and its parents."""
    me = os.getpid()
    pytest_pid = proc.add(me, 50, 50, PY, "-m", "pytest", f"--basetemp={SESSION}")
    proc.add(50, 1, 50, "/bin/bash", f"--rcfile={LOGS}")  # its parent names the session too
    head = proc.head_processes(me, 50, 600)
    head_lm = proc.log_monitor(610, me, 50)
    head_raylet = proc.raylet(611, me, 50, HEAD, "raylet", head=True)
    proc.add(620, head_raylet, 50, "ray::DashboardAgent")
    proc.add(621, head_raylet, 50, "ray::RuntimeEnvAgent")
    proc.add(622, head_raylet, 622, "ray::TrainerRank")
    proc.add(700, me, 50, PY, "-u", f"{RAY}/_private/ray_process_reaper.py")  # each node's
    worker_raylet = proc.raylet(701, me, 50, WORKER, "raylet.1", head=False)
    proc.add(710, worker_raylet, 50, "ray::DashboardAgent")
    proc.add(711, worker_raylet, 50, "ray::RuntimeEnvAgent")
    proc.add(720, worker_raylet, 720, "ray::RolloutNode")
    # another cluster's node on this host (another session): nothing of it either
    proc.add(900, 1, 900, f"{RAY}/core/src/ray/raylet/raylet", f"--node_id={OTHER}",
             "--session_dir=/tmp/ray/session_other", "--log_dir=/tmp/ray/session_other/logs")  # fmt: skip

    worker = find_ray_node(WORKER)
    assert worker.processes == [
        (worker_raylet, "raylet"),
        (710, "agent"),
        (711, "agent"),
        (720, "worker"),
    ]
    # the head's log monitor, monitor and dashboard name the session the nodes share, in the
    # same process group: nobody's to kill
    assert dict(worker.shared) == {
        head["monitor"]: "monitor",
        head["dashboard"]: "dashboard",
        head_lm: "log_monitor",
    }
    head_node = find_ray_node(HEAD)
    assert ("gcs" in dict(head_node.processes).values()) and head["gcs"] in dict(
        head_node.processes
    )
    assert {pytest_pid, 50} & {pid for pid, _ in head_node.processes + head_node.shared} == set()
    assert find_ray_node(OTHER).processes == [(900, "raylet")]


def test_nodes_started_from_one_process_group_leave_the_log_monitors(proc: FakeProc) -> None:
    """Two `ray start` from one script (one process group) on one host: which log monitor is
    whose cannot be told; both are left alone and reported (the drill's notes say so)."""
    proc.head_processes(1, 77, 100)
    head_lm = proc.log_monitor(110, 1, 77)
    proc.raylet(111, 1, 77, HEAD, "raylet", head=True)
    worker_lm = proc.log_monitor(120, 1, 77)
    worker_raylet = proc.raylet(121, 1, 77, WORKER, "raylet.1", head=False)
    worker = find_ray_node(WORKER)
    assert worker.processes == [(worker_raylet, "raylet")]
    assert {head_lm, worker_lm} <= {pid for pid, _ in worker.shared}


def test_ray_start_block_is_the_nodes(proc: FakeProc) -> None:
    """`ray start --block` stays the parent of the log monitor and the raylet (and kills the
    rest when one dies): it is the node's, and so is its log monitor even where the session
    and the process group are shared with the head's."""
    proc.head_processes(1, 77, 100)
    head_lm = proc.log_monitor(110, 1, 77)
    proc.raylet(111, 1, 77, HEAD, "raylet", head=True)
    block = proc.add(
        200, 1, 77, PY, "/venv/bin/ray", "start", f"--address={GCS}", "--num-cpus=1", "--block"
    )
    worker_lm = proc.log_monitor(201, block, 77)
    worker_raylet = proc.raylet(202, block, 77, WORKER, "raylet.1", head=False)
    proc.add(203, worker_raylet, 77, "ray::DashboardAgent")
    worker = find_ray_node(WORKER)
    assert worker.processes == [
        (block, "ray_start"),
        (worker_lm, "log_monitor"),
        (worker_raylet, "raylet"),
        (203, "agent"),
    ]
    assert head_lm in dict(worker.shared)


def test_a_node_not_on_this_host(proc: FakeProc) -> None:
    proc.log_monitor(300, 1, 290)
    proc.raylet(301, 1, 290, WORKER, "raylet", head=False)
    node = find_ray_node(OTHER)
    assert node.processes == [] and node.shared == [] and node.gcs_address is None


def test_ray_detection_unknown_without_a_gcs_address() -> None:
    watch = RayNodeWatch(WORKER, None, None)
    watch.start(0.0, 0.0)
    assert watch.result() is None
    assert "no GCS address" in watch.why_not()


def test_kill_node_report_shows_both_detections() -> None:
    """Rollcall's detection and Ray's side by side, in 80 columns; --json has both by name."""
    r = DrillReport(
        drill="kill-node",
        job="quickstart",
        target=f"node {WORKER[:12]} (rollout-0, rollout-1)",
        fault_at=0.0,
        detection_s=2.31,
        ray_detection_s=14.87,
        recovery_s=18.5,
        in_flight_episodes=16,
        in_flight_samples=128,
        resumed_turns=37,
    )
    unseen = DrillReport("kill-node", "quickstart", "node 363d8713c841 (rollout-0)", 0.0)
    lines = render(drill_table([r, unseen]))
    check_width(lines)
    header = line_with(lines, "detect s", "ray s", "recover s")
    assert header.index("detect s") < header.index("ray s") < header.index("recover s")
    line_with(lines, "kill-node", "2.31", "14.87", "18.50", "16/128", "37", "ok")
    line_with(lines, "kill-node", "-", "timed out")
    assert r.to_json()["ray_detection_s"] == 14.87 and r.to_json()["detection_s"] == 2.31
    # the other drills' tables stay as they were
    other = DrillReport("kill-rollout", "quickstart", "rollout-0", 0.0, detection_s=1.0)
    assert "ray s" not in "\n".join(render(drill_table([other])))
