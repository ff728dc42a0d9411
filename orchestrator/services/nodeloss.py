"""What the ``kill-node`` drill needs of a Ray node: its processes on this host
(``find_ray_node``, ``ray_node_processes``), and when Ray's own node table marks it dead
(``RayNodeWatch``). Linux (``/proc``); Ray is imported only by ``RayNodeWatch``.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollcall.orchestrator import procfs, rayauth

POLL_S = 0.1  # how often Ray's node table is read (as the drills poll the database)


# -- a Ray node's processes on this host ---------------------------------------------------------
#
# What Ray 2.60 starts for a node (ray/_private/node.py, services.py), and how each is found:
#
# - the raylet: ``--node_id=``, with the node's per-node sockets (``--raylet_socket_name=``,
#   ``--store_socket_name=``), its session and logs directories (``--session_dir=``,
#   ``--log_dir=``), the cluster's ``--gcs-address=`` and ``--cluster-id=``;
# - the dashboard agent and the runtime env agent, started by the raylet (its children) with
#   ``--node-id=``, then renamed ``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent``;
# - the worker processes (actors, idle workers, and what they start), the raylet's
#   descendants, renamed ``ray::...`` (before that they name the node's sockets);
# - the log monitor (``ray start`` and a head; ``cluster_utils`` starts none for its worker
#   nodes: "one per physical node"), started by the process that starts the node, before the
#   raylet, with no node id: ``--session-dir=``, ``--logs-dir=``, ``--gcs-address=``,
#   ``--node-ip-address=``. ``ray start`` exits once the node is up, so it is init's child;
# - with ``ray start --block``: that process (the parent of the raylet and the log monitor; it
#   kills the rest when one dies) and its reaper;
# - on the head only: the GCS (``--node-id=``), the autoscaler's monitor (``--logs-dir=``),
#   the dashboard (``--session-dir=``), the client server (``--node-id=``).
#
# The session directory is the cluster's (its name comes from the GCS), so nodes on one host
# share it (``cluster_utils``, or several ``ray start`` on one machine): a process that names
# it but no node id is the node's only where no other node of this host uses that session,
# or, where others do, where it is in the raylet's process group (one ``ray start`` from a
# shell) and no other node's raylet is. Otherwise it is left alone and reported as shared.

NODE_ID_FLAGS = ("--node_id", "--node-id")
AGENT_NAMES = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
SCRIPT_KINDS = (  # scripts Ray starts with python, by the end of their path
    ("/_private/log_monitor.py", "log_monitor"),
    ("/dashboard/agent.py", "agent"),
    ("/runtime_env/agent/main.py", "agent"),
    ("/autoscaler/_private/monitor.py", "monitor"),
    ("/dashboard/dashboard.py", "dashboard"),
    ("/_private/ray_process_reaper.py", "reaper"),
)


@dataclass(frozen=True)
class _Proc:
    pid: int
    ppid: int
    pgid: int
    argv: tuple[str, ...]

    def flag(self, *names: str) -> str | None:
        """The value of ``--name=value`` for the first of ``names`` on the command line."""
        for a in self.argv:
            name, eq, value = a.partition("=")
            if eq and name in names:
                return value
        return None

    def names(self, values: set[str]) -> bool:
        """Whether an argument, or a ``--flag=``'s value, is exactly one of ``values``."""
        return any((a.partition("=")[2] if a.startswith("-") else a) in values for a in self.argv)


def _kind(argv: tuple[str, ...]) -> str:
    head = argv[0] if argv else ""
    if head.startswith("ray::"):  # renamed by Ray (setproctitle)
        return "agent" if head.startswith(AGENT_NAMES) else "worker"
    exe = Path(head).name
    if "gcs_server" in exe:
        return "gcs"
    if "raylet" in exe:
        return "raylet"
    if _is_ray_start(argv):
        return "ray_start"
    for suffix, kind in SCRIPT_KINDS:
        if any(a.endswith(suffix) for a in argv[1:]):
            return kind
    if "ray.util.client.server" in argv:
        return "client_server"
    return "worker"


def _is_ray_start(argv: tuple[str, ...]) -> bool:
    """``ray start ...`` (``python .../bin/ray start``)."""
    return "start" in argv and any(Path(a).name == "ray" for a in argv[: argv.index("start")])


RAY_PACKAGE_DIRS = tuple(f"/ray/{d}/" for d in ("_private", "autoscaler", "core", "dashboard"))


def _runs_ray(argv: tuple[str, ...]) -> bool:
    """A program of Ray's package (``.../ray/_private/log_monitor.py``, ``-m ray.util...``),
    not one that only names Ray's temporary files (``/tmp/ray/session_*``)."""
    return any(a.startswith("ray.") or any(d in a for d in RAY_PACKAGE_DIRS) for a in argv[:3])


def _scan() -> dict[int, _Proc]:
    """Every process with a command line (not kernel threads or zombies), but this one and its
    ancestors: a drill never kills itself or what runs it."""
    procs: dict[int, _Proc] = {}
    for st in procfs.processes():
        try:
            raw = (procfs.PROC / str(st.pid) / "cmdline").read_bytes()
        except OSError:  # ended meanwhile
            continue
        if raw.strip(b"\0"):
            argv = tuple(raw.decode(errors="replace").rstrip("\0").split("\0"))
            procs[st.pid] = _Proc(st.pid, st.ppid, int(st.fields[2]), argv)
    pid = os.getpid()
    while pid > 1:
        p = procs.pop(pid, None)
        pid = p.ppid if p is not None else (procfs.parent_of(pid) or 0)
    return procs


@dataclass(frozen=True)
class RayNodeOnHost:
    """One Ray node's processes on this host (``find_ray_node``)."""

    node_id: str
    processes: list[tuple[int, str]]  # (pid, kind), the drill's to kill
    # processes of the node's Ray session here that other nodes on this host use too (a head's
    # log monitor under cluster_utils): left alone
    shared: list[tuple[int, str]]
    gcs_address: str | None  # the cluster's GCS, as the node's raylet names it
    cluster_id: str | None


def find_ray_node(node_id: str) -> RayNodeOnHost:
    """The processes of Ray node ``node_id`` on this host, with their kind: ``gcs`` (the head),
    ``raylet``, ``agent`` (dashboard and runtime env agents), ``log_monitor``, ``worker``
    (actors, idle workers and what they started), ``ray_start`` and ``reaper`` (``ray start
    --block``), and on a head ``monitor``, ``dashboard``, ``client_server``; never a process of
    another node on this host (see above). Linux (``/proc``)."""
    procs = _scan()
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    owner: dict[int, str] = {}  # pid -> the node it belongs to

    def claim(root: int, nid: str) -> None:
        """``root`` and its descendants that are not another node's."""
        owner.setdefault(root, nid)
        todo = list(children.get(root, []))
        while todo:
            pid = todo.pop()
            if pid not in owner:
                owner[pid] = nid
                todo += children.get(pid, [])

    # the processes that name a node id, each its node's, and then what runs under them
    named = {pid: nid for pid, p in procs.items() if (nid := p.flag(*NODE_ID_FLAGS))}
    owner.update(named)
    for pid, nid in named.items():
        claim(pid, nid)
    raylets = {nid: procs[pid] for pid, nid in named.items() if _kind(procs[pid].argv) == "raylet"}
    shared: list[int] = []
    raylet = raylets.get(node_id)
    if raylet is not None:
        # `ray start --block` stays the parent of what it started (its log monitor, its
        # reaper) and kills the rest when one dies: the node's, as everything on the machine
        parent = procs.get(raylet.ppid)
        if parent is not None and raylet.ppid not in owner and _is_ray_start(parent.argv):
            claim(raylet.ppid, node_id)
        # a worker process that has not renamed itself yet names the node's sockets
        sockets = {raylet.flag("--raylet_socket_name"), raylet.flag("--store_socket_name")}
        for pid, p in procs.items():
            if pid not in owner and p.names({s for s in sockets if s}):
                claim(pid, node_id)
        # the log monitor (and a head's monitor and dashboard) name the session only
        session_dir = raylet.flag("--session_dir")
        dirs = {d for d in (session_dir, raylet.flag("--log_dir")) if d}
        sharing = {
            r.pgid
            for nid, r in raylets.items()
            if nid != node_id and r.flag("--session_dir") == session_dir
        }
        for pid, p in sorted(procs.items()):
            if pid in owner or not p.names(dirs) or not _runs_ray(p.argv):
                continue  # (an operator's `ls` of the logs is no process of the node)
            if not sharing or (p.pgid == raylet.pgid and raylet.pgid not in sharing):
                claim(pid, node_id)
            else:
                shared.append(pid)

    kinds: dict[int, str] = {}

    def kind(pid: int) -> str:
        """A process's kind; what a log monitor, agent or monitor started is of its kind."""
        if pid not in kinds:
            k = _kind(procs[pid].argv)
            parent = procs[pid].ppid
            if k == "worker" and owner.get(parent) == owner[pid] and parent in procs:
                pk = kind(parent)
                k = k if pk in ("raylet", "gcs") else pk
            kinds[pid] = k
        return kinds[pid]

    return RayNodeOnHost(
        node_id,
        sorted((pid, kind(pid)) for pid, nid in owner.items() if nid == node_id),
        [(pid, _kind(procs[pid].argv)) for pid in shared],
        raylet.flag("--gcs-address") if raylet is not None else None,
        raylet.flag("--cluster-id") if raylet is not None else None,
    )


def ray_node_processes(node_id: str) -> list[tuple[int, str]]:
    """The processes of Ray node ``node_id`` on this host with their kind (``find_ray_node``)."""
    return find_ray_node(node_id).processes


class RayNodeWatch:
    """When Ray's own node table (the GCS) marks a node dead, timed from the fault. The drill
    is no Ray driver (``rollcall drill`` does not join the cluster), so this is a GCS client of
    its own on the address the node's raylet names, polled from a thread. Whatever fails here
    leaves the figure unknown (``why_not``), never the drill."""

    def __init__(
        self,
        node_id: str,
        gcs_address: str | None,
        cluster_id: str | None,
        home: Path | None = None,
    ) -> None:
        self.node_id = node_id
        self._client: Any = None
        self._why = ""
        self._dead_at: float | None = None
        self._t0 = self._deadline = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if not gcs_address:
            self._why = "the node's raylet names no GCS address"
            return
        try:
            from ray._raylet import GcsClient  # type: ignore[attr-defined]
            from ray.core.generated.gcs_service_pb2 import (  # type: ignore[attr-defined]
                GetAllNodeInfoRequest,
            )

            self._selector = GetAllNodeInfoRequest.NodeSelector(node_id=bytes.fromhex(node_id))
            rayauth.configure_client(home)
            self._client = GcsClient(address=gcs_address, cluster_id=cluster_id)
            state = self._state()
        except Exception as e:
            self._client = None
            self._why = f"Ray's node table at {gcs_address} could not be read: {e!r}"
            return
        if state != "alive":
            self._client = None
            self._why = f"Ray's node table at {gcs_address} " + (
                "had the node dead before the fault" if state else "does not list the node"
            )

    def _state(self) -> str | None:
        """``alive``, ``dead``, or None when the table does not list the node."""
        from ray.core.generated.gcs_pb2 import GcsNodeInfo  # type: ignore[attr-defined]

        infos = self._client.get_all_node_info(timeout=2.0, node_selectors=[self._selector])
        for nid, info in infos.items():
            if nid.hex() == self.node_id:
                return "dead" if info.state == GcsNodeInfo.DEAD else "alive"
        return None

    def start(self, t0: float, deadline: float) -> None:
        """Poll from now (the fault was at ``t0``, monotonic) until ``deadline``."""
        self._t0, self._deadline = t0, deadline
        if self._client is not None:
            self._thread = threading.Thread(target=self._poll, name="ray-node-watch", daemon=True)
            self._thread.start()

    def _poll(self) -> None:
        error = ""
        while not self._stop.is_set() and time.monotonic() < self._deadline:
            try:
                if self._state() == "dead":
                    self._dead_at = time.monotonic()
                    return
            except Exception as e:  # the GCS away for a moment: try again
                error = f" (the last read failed: {e!r})"
            self._stop.wait(POLL_S)
        self._why = (
            f"Ray's node table did not mark the node dead within "
            f"{self._deadline - self._t0:g} s{error}"
        )

    def result(self) -> float | None:
        """Seconds from the fault until Ray marked the node dead (waiting for it up to the
        deadline), None when that was not seen."""
        if self._thread is not None:
            self._thread.join(max(0.0, self._deadline - time.monotonic()) + 5.0)
            self._stop.set()
        return None if self._dead_at is None else self._dead_at - self._t0

    def why_not(self) -> str:
        return self._why or "not observed"
