"""Machines come and go under a running job, on a real ``ray start`` cluster on this host
(issue #42's ops run; ``tests/chaos/test_elastic_fleet.py`` is the same story on
``ray.cluster_utils`` in CI).

Everything is a real process: a Ray head (``ray start --head --block``, resource
``trainer: 1``) and rollout "machines", each ``ray start --address=HEAD --resources='{"rollout":
1}' --num-cpus 1 --block`` in its own process group (so a whole machine can be SIGKILLed or
SIGSTOPped), the embedded PostgreSQL in a fresh ``ROLLCALL_HOME``, the job as ``rollcall run
CONFIG ray.address=HEAD ...`` on a pseudo-terminal (what an operator's terminal shows, the live
panel included), and the operators' commands (``rollcall job scale``, ``rollcall node drain``,
``rollcall drill kill-node``, ``rollcall status``, ``rollcall job stop``). Ray's health checks
are Ray's defaults: a machine that stops answering is marked dead only when they fail.
Ray's token authentication for every process, one token for the cluster in a file
(``ops/deploy/ray-start.md``, section 3).

The job is the torch-free timing model (``ops/bench/pipeline.py``: timing engine and trainer,
one ``longtail`` task), so a rollout node starts in about a second and what is measured is the
supervisor, Ray's placement and the buffer. ``rollout.max_restarts: 1``: two counted deaths of
a slot within ``restart_window_s`` (600 s) would fail it, so every machine loss must cost 0.

The scenario (machines A..J; a slot's machine is read from ``rollout_slots``):

0. head, A, B; the job with ``rollout.nodes=2`` (rollout-0, rollout-1 on A, B); spare C joins;
1. ``rollcall job scale --rollout-nodes 3``: rollout-2 starts on C; spare D joins;
2. ``rollcall node drain`` rollout-0's machine: it gives its episodes back and moves to D;
3. three machine losses within 600 s, each with a spare joined before, all three on the
   machine that hosts rollout-1 (so they hit one slot's budget three times): E joins, then
   ``rollcall drill kill-node`` (SIGKILL of every process of the machine); F joins, then the
   machine is frozen (SIGSTOP of every process: it answers nothing; SIGKILLed once Ray has
   declared it dead); G joins, then SIGKILL of every process of the machine (all stopped
   first, then killed: no process of it sees another die, as in a power loss);
4. every rollout machine is SIGKILLed, no spare: every slot waits for capacity and the job
   waits (no ``--resume``); then machine J (``rollout: 3``, 3 CPUs) joins: every slot is placed
   on it and the job goes on;
5. ``rollcall job scale --rollout-nodes 1``: rollout-1 and rollout-2 drain and are removed;

then ``rollcall job stop --wait``. Checks, from PostgreSQL and the commands' own reports: no
counted restart (``rollout_slots.restarts``), no ``worker.restarting`` or ``worker.failed``
event, the invariants (``check_invariants``: nothing trained twice, no lease held by a dead
worker, ...), the drill's lost and duplicated, what the affected nodes held at each fault or
drain (every sample at least as long afterwards, trained, or expired as stale), the driver's
lines (lost, waiting, placed, drained, removed), the job never stopping before ``job stop``.
Figures: per fault, rollcall's detection (the slot leaves ``alive``), its verdict (the
``worker.machine_lost`` event), Ray's detection (its node table marks the machine dead) and the
time until the slot serves again.

Usage: python ops/bench/fleet.py [--scale 0.05] [--keep]
Prints the timeline and a summary, then (last line) one JSON object; exit code 1 when a check
failed. Every process it started is stopped at the end, also on failure. Logs, the driver's
terminal and the JSON stay in the printed directory (removed on success unless --keep).
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import fcntl
import json
import os
import pty
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import sqlalchemy as sa
import yaml

from ops.bench.pipeline import Setup, config_for
from rollcall.orchestrator import rayauth
from rollcall.orchestrator.buffer.invariants import check_invariants
from rollcall.orchestrator.db.engine import Database, open_database
from rollcall.orchestrator.services.nodeloss import RayNodeWatch, find_ray_node
from rollcall.orchestrator.services.nodes import ray_nodes

BIN = Path(sys.executable).parent
JOB = "fleet"
TAG = "ROLLCALL_FLEET_BENCH"  # in the environment of every process this script starts
ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07|\x1b[=>()][0-9A-Za-z]?")
# the live panel's lines (orchestrator/runner/progress.py render): redrawn, kept once each
PANEL = re.compile(
    r"job \S+ \(\w+\)\s+step \d+/|task\s+batch reward|staleness mean |nodes:|waiting for "
    r"|\S+\s+(-|[\d.]+)\s+(-|[\d.]+)\s+\d+$"
)


class Failed(Exception):
    """A check failed or a wait timed out: the run stops and says why."""


class StartFailed(Exception):
    """A `ray start` that exited before its node registered."""


def _start_failure(temp_dir: Path) -> str:
    """Why a Ray node's start failed: the raylet's fatal line, if it wrote one."""
    for err in sorted(temp_dir.glob("session_2*/logs/raylet.err")):
        for line in err.read_text(errors="replace").splitlines():
            if "Check failed" in line or " F " in line or "Unhandled exception" in line:
                return "raylet: " + line.split(") ", 1)[-1].strip()[:200]
    return "no raylet error line"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# -- processes --------------------------------------------------------------------------------


def pgid_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[2])


def all_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def tagged(tag: str) -> list[int]:
    """The processes whose environment carries this run's tag: what this script started and
    everything they started (Ray's workers, PostgreSQL)."""
    needle = f"{TAG}={tag}".encode()
    out = []
    for pid in all_pids():
        if pid == os.getpid():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            out.append(pid)
    return out


def signal_all(pids: set[int], sig: int) -> None:
    """Signal every process. SIGKILL as a power loss does it: every process stopped first,
    then killed, so none of them sees another die and reacts (a raylet whose agent died
    first unregisters from Ray's GCS, which a machine that lost power never does)."""
    if sig == signal.SIGKILL:
        signal_all(pids, signal.SIGSTOP)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


@dataclass
class Machine:
    name: str
    proc: subprocess.Popen[bytes]
    temp_dir: Path
    log: Path
    rollout: int
    started: float
    node_id: str | None = None
    up_s: float | None = None  # from `ray start` until Ray's node table lists it alive
    fate: str = "up"

    def pids(self) -> set[int]:
        """Every process of the machine: its `ray start` group and what Ray counts as its
        node's (workers run in process groups of their own)."""
        out = {pid for pid in all_pids() if pgid_of(pid) == self.proc.pid}
        if self.node_id:
            out |= {pid for pid, _ in find_ray_node(self.node_id).processes}
        return out


@dataclass
class Fault:
    kind: str
    slot: str
    machine: str
    at: float  # wall clock
    spare: str | None = None
    rollcall_detection_s: float | None = None  # the slot left `alive`
    verdict_s: float | None = None  # worker.machine_lost recorded
    ray_detection_s: float | None = None  # Ray's node table: dead
    serving_s: float | None = None  # the slot alive again on another machine
    waited_line: bool = False
    budget: int = 0
    lost: int | None = None
    duplicated: int | None = None
    held_samples: int = 0
    held_tokens: int = 0
    label: str = ""  # its entry in Run.held
    notes: list[str] = field(default_factory=list)


# -- the driver on a terminal -----------------------------------------------------------------


class Terminal:
    """``rollcall run`` on a pseudo-terminal: its raw output, and its lines with the time each
    appeared: every line it printed, and the live panel's lines (redrawn four times a second)
    once each."""

    def __init__(self, cmd: list[str], env: dict[str, str], raw: Path) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 240, 0, 0))
        self.proc = subprocess.Popen(
            cmd, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True
        )
        os.close(slave)
        self.master = master
        self.raw = raw.open("wb")
        self.lines: list[tuple[float, str, bool]] = []  # (time, line, a line of the panel)
        self._panel_seen: set[str] = set()
        self._buf = ""
        self._decode = codecs.getincrementaldecoder("utf-8")("replace")
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                break
            if not data:
                break
            self.raw.write(data)
            self.raw.flush()
            now = time.time()
            with self._lock:
                self._buf += self._decode.decode(data)
                *done, self._buf = re.split(r"[\r\n]", self._buf)
                for raw_line in done:
                    ln = ANSI.sub("", raw_line).rstrip()
                    if not ln.strip():
                        continue
                    panel = bool(PANEL.match(ln.strip()))
                    if panel:
                        if ln in self._panel_seen:
                            continue
                        self._panel_seen.add(ln)
                    self.lines.append((now, ln, panel))
        self.raw.close()

    def since(self, t: float) -> list[str]:
        with self._lock:
            return [ln for at, ln, _ in self.lines if at >= t]

    def text(self) -> str:
        with self._lock:
            return "\n".join(ln for _, ln, _ in self.lines)


# -- the database, watched ---------------------------------------------------------------------


class Watch(threading.Thread):
    """Polls the job's rollout slots and steps every 0.25 s: each slot's (state, Ray node)
    transitions with the time they were seen."""

    def __init__(self, db: Database, job_id: int) -> None:
        super().__init__(daemon=True)
        self.db, self.job_id = db, job_id
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.slots: dict[str, dict[str, Any]] = {}
        self.steps = 0
        self.transitions: list[tuple[float, str, str, str | None]] = []
        self.poll()

    def poll(self) -> None:
        with self.db.engine.connect() as c:
            rows = c.execute(
                sa.text(
                    "SELECT name, state, ray_node_id, restarts, machine_losses, reason "
                    "FROM rollout_slots WHERE job_id = :j"
                ),
                {"j": self.job_id},
            ).all()
            steps = c.execute(
                sa.text("SELECT count(*) FROM train_steps WHERE job_id = :j"), {"j": self.job_id}
            ).scalar_one()
        now = time.time()
        with self.lock:
            self.steps = int(steps)
            for name, state, node, restarts, losses, reason in rows:
                old = self.slots.get(name)
                if old is None or (old["state"], old["node"]) != (state, node):
                    self.transitions.append((now, name, state, node))
                self.slots[name] = {
                    "state": state, "node": node, "restarts": restarts, "losses": losses,
                    "reason": reason,
                }  # fmt: skip

    def run(self) -> None:
        while not self.stop.wait(0.25):
            with contextlib.suppress(Exception):  # a moment without the database: next poll
                self.poll()

    def slot(self, name: str) -> dict[str, Any]:
        with self.lock:
            return dict(self.slots.get(name) or {"state": None, "node": None})

    def first(self, name: str, after: float, pred: Callable[[str, str | None], bool]) -> float:
        with self.lock:
            for t, n, state, node in self.transitions:
                if n == name and t >= after and pred(state, node):
                    return t
        return float("nan")


# -- the run ----------------------------------------------------------------------------------


class Run:
    def __init__(self, root: Path, scale: float) -> None:
        self.root = root
        self.scale = scale
        self.home = root / "home"
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        token = rayauth.ensure_token(root / "ray_token")
        env.update(
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN_PATH=str(token),
            RAY_worker_niceness="0",  # as ops/deploy/ray-start.md section 4
            ROLLCALL_HOME=str(self.home),
            TERM="xterm-256color",
            COLUMNS="240",
            LINES="60",
            **{TAG: str(root)},
        )
        env.pop("ROLLCALL_DATABASE_URL", None)
        env.pop("ROLLCALL_JOB", None)
        self.env = env
        # this process's GCS client (node table)
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
        rayauth.configure_client()
        self.head: Machine | None = None
        self.machines: dict[str, Machine] = {}
        self.started: list[Machine] = []  # every `ray start`, failed ones included
        self.start_failures: list[str] = []
        self.driver: Terminal | None = None
        self.db: Database | None = None
        self.watch: Watch | None = None
        self.job_id: int | None = None
        self.faults: list[Fault] = []
        self.moves: list[dict[str, Any]] = []  # scale-up, drain, join, scale-down
        self.holdings: list[tuple[str, list[dict[str, Any]]]] = []
        self.failures: list[str] = []
        self.timeline: list[str] = []
        self.t0 = time.time()
        self.drill: dict[str, Any] | None = None
        self.captures: dict[str, str] = {}

    # -- saying and waiting -------------------------------------------------------------------

    def say(self, msg: str) -> None:
        line = f"[{time.time() - self.t0:7.1f} s] {msg}"
        self.timeline.append(line)
        print(line, flush=True)

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(what)
            self.say(f"CHECK FAILED: {what}")

    def wait_for(self, what: str, pred: Callable[[], bool], timeout: float) -> float:
        end = time.time() + timeout
        while time.time() < end:
            if pred():
                return time.time()
            self.alive_or_fail()
            time.sleep(0.25)
        raise Failed(f"timed out after {timeout:.0f} s waiting for {what}")

    def alive_or_fail(self) -> None:
        if self.driver is not None and self.driver.proc.poll() is not None:
            raise Failed(f"the driver exited with code {self.driver.proc.returncode}")

    def cmd(self, *args: str, timeout: float = 120, check: bool = True) -> str:
        p = subprocess.run(
            [str(BIN / "rollcall"), *args], env=self.env, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip
        if check and p.returncode != 0:
            raise Failed(f"rollcall {' '.join(args)}: exit {p.returncode}: {p.stderr or p.stdout}")
        return p.stdout

    # -- Ray's machines -----------------------------------------------------------------------

    def start_head(self) -> None:
        def args() -> list[str]:
            return [
                "--head", f"--port={self.port}", f"--ray-client-server-port={free_port()}",
                f"--dashboard-port={free_port()}", "--include-dashboard=false",
                '--resources={"trainer": 1}', "--num-cpus=1", "--object-store-memory=200000000",
            ]  # fmt: skip

        self.head = self._ray_start("head", args, 0)

    def start_machine(self, name: str, rollout: int = 1) -> Machine:
        def args() -> list[str]:
            return [
                f"--address={self.address}", f'--resources={{"rollout": {rollout}}}',
                f"--num-cpus={rollout}", "--object-store-memory=200000000",
            ]  # fmt: skip

        m = self._ray_start(name, args, rollout)
        self.machines[name] = m
        return m

    def _ray_start(self, name: str, args: Callable[[], list[str]], rollout: int) -> Machine:
        """One machine: `ray start --block` in a process group of its own, with a temp dir of
        its own; returns once Ray's node table lists it alive. A start that fails before it
        registers (Ray's own start-up on a loaded host) is said, cleaned up and tried again
        once."""
        for attempt in (1, 2):
            tag = name if attempt == 1 else f"{name}.{attempt}"
            d, log = self.root / tag, self.root / f"{tag}.log"
            before = self._alive_ids() if self.head is not None else set()
            cmd = [str(BIN / "ray"), "start", *args(), f"--temp-dir={d}", "--block",
                   "--disable-usage-stats"]  # fmt: skip
            t = time.time()
            proc = subprocess.Popen(
                cmd, env=self.env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
            m = Machine(name, proc, d, log, rollout, t)
            self.started.append(m)

            def registered(m: Machine = m, before: set[str] = before) -> bool:
                if m.proc.poll() is not None:
                    raise StartFailed(f"ray start exited {m.proc.returncode}")
                new = self._alive_ids() - before
                if new:
                    m.node_id = sorted(new)[0]
                    return True
                return False

            try:
                self.wait_for(f"machine {name} registered with Ray", registered, 180)
            except StartFailed as e:
                why = _start_failure(d)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                self.start_failures.append(f"{name}: {e}: {why} (log {log})")
                self.say(f"machine {name}: {e} before it registered: {why}")
                if attempt == 2:
                    raise Failed(f"machine {name} did not start twice: {why}") from None
                continue
            m.up_s = time.time() - t
            node = (m.node_id or "")[:8]
            self.say(f"machine {name} up: Ray node {node} ({m.up_s:.1f} s after ray start)")
            return m
        raise AssertionError("unreachable")

    def _nodes(self) -> list[Any]:
        try:
            return ray_nodes(self.address)
        except Exception:
            return []

    def _alive_ids(self) -> set[str]:
        return {n.node_id for n in self._nodes() if n.alive}

    def ray_alive(self, node_id: str) -> bool | None:
        for n in self._nodes():
            if n.node_id == node_id:
                return bool(n.alive)
        return None

    def machine_of(self, slot: str) -> Machine:
        assert self.watch is not None
        node = self.watch.slot(slot)["node"]
        for m in self.machines.values():
            if m.node_id == node:
                return m
        raise Failed(f"{slot} is on Ray node {node}, none of this run's machines")

    # -- the job ------------------------------------------------------------------------------

    def write_config(self) -> Path:
        setup = Setup(
            nodes=2, concurrency=2, tasks=1, batch_groups=1, group_size=2, max_staleness=8,
            scale=self.scale, steps=1_000_000,
            trainer={"s_per_token": 1e-4, "publish_bytes": 10_000},
        )  # fmt: skip
        data = config_for(setup, JOB, "", self.home / "runs" / JOB).model_dump(mode="json")
        data.pop("database")  # the embedded PostgreSQL in ROLLCALL_HOME
        data["ray"]["num_cpus"] = None  # (a local Ray's; the job joins the cluster)
        path = self.root / "job.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    def start_job(self, config: Path) -> None:
        cmd = [
            str(BIN / "rollcall"), "run", str(config), f"ray.address={self.address}",
            "rollout.nodes=2", "rollout.resources={rollout: 1}", "trainer.resources={trainer: 1}",
            "rollout.max_restarts=1", "rollout.restart_window_s=600", "--live",
        ]  # fmt: skip
        self.say("$ " + " ".join(cmd[1:]))
        self.driver = Terminal(cmd, self.env, self.root / "driver.tty")
        db = self.db
        assert db is not None

        def running() -> bool:
            with db.engine.connect() as c:
                row = c.execute(
                    sa.text("SELECT id, status::text FROM jobs WHERE name = :n"), {"n": JOB}
                ).first()
            if row is not None and row[1] == "running":
                self.job_id = int(row[0])
                return True
            return False

        self.wait_for("the job running", running, 240)
        assert self.job_id is not None
        self.watch = Watch(db, self.job_id)
        self.watch.start()

    def serving(self, slot: str, machine: Machine) -> bool:
        assert self.watch is not None
        s = self.watch.slot(slot)
        return s["state"] == "alive" and s["node"] == machine.node_id

    def steps(self) -> int:
        assert self.watch is not None
        return self.watch.steps

    def steps_go_on(self, timeout: float = 180) -> None:
        at = self.steps()
        self.wait_for(f"a step after {at}", lambda: self.steps() > at, timeout)

    def held(self, slots: list[str], label: str) -> list[dict[str, Any]]:
        """The samples the slots' live incarnations hold now (their leased episodes)."""
        assert self.db is not None and self.job_id is not None
        with self.db.engine.connect() as c:
            ids = [
                int(wid)
                for wid, name in c.execute(
                    sa.text(
                        "SELECT id, name FROM workers WHERE job_id = :j AND role = 'rollout' "
                        "AND status = 'alive'"
                    ),
                    {"j": self.job_id},
                ).all()
                if name in slots
            ]
        out: list[dict[str, Any]] = []
        with self.db.transaction() as tx:
            for wid in ids:
                out += [
                    s for s in tx.invariants.samples_of_worker(wid) if s["sample_index"] is not None
                ]
        self.holdings.append((label, out))
        return out

    def lost(self, held: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Samples held at a fault that are shorter now (or gone), unless their episode expired
        as stale or was quarantined (counted on the task, its prompt requeued)."""
        assert self.db is not None
        episodes = sorted({s["episode_id"] for s in held})
        if not episodes:
            return []
        with self.db.transaction() as tx:
            now = {
                (s["episode_id"], s["sample_index"]): s
                for s in tx.invariants.samples_of_episodes(episodes)
            }
        out = []
        for s in held:
            cur = now.get((s["episode_id"], s["sample_index"]))
            if cur is not None and (
                cur["episode_status"] in ("expired", "quarantined") or cur["status"] == "expired"
            ):
                continue
            if cur is None or (cur["num_tokens"] or 0) < (s["num_tokens"] or 0):
                out.append({"before": s, "now": cur})
        return out

    def trained_twice(self) -> int:
        assert self.db is not None and self.job_id is not None
        report = check_invariants(self.db, self.job_id)
        return len(report.violations.get("trained_once", []))

    def events(self, kinds: tuple[str, ...] = ("worker.", "drill.", "job.")) -> list[dict]:
        assert self.db is not None and self.job_id is not None
        with self.db.engine.connect() as c:
            rows = c.execute(
                sa.text(
                    "SELECT extract(epoch FROM created_at), kind, message FROM events "
                    "WHERE job_id = :j ORDER BY id"
                ),
                {"j": self.job_id},
            ).all()
        return [
            {"at": float(t), "kind": k, "message": m}
            for t, k, m in rows
            if any(k.startswith(p) for p in kinds)
        ]

    def machine_lost_at(self, slot: str, after: float) -> float | None:
        for e in self.events(("worker.machine_lost",)):
            if e["at"] >= after and e["message"].startswith(f"{slot} "):
                return e["at"]
        return None

    # -- the faults ---------------------------------------------------------------------------

    def lose(self, kind: str, slot: str, spare: Machine, sig: int) -> Fault:
        """Lose the machine hosting ``slot`` (every process of it, ``sig``); with a spare, wait
        until the slot serves there."""
        assert self.watch is not None
        m = self.machine_of(slot)
        label = f"{kind} on {m.name}"
        held = self.held([slot], label)
        node = find_ray_node(m.node_id or "")
        watch = RayNodeWatch(m.node_id or "", node.gcs_address, node.cluster_id)
        pids = m.pids()
        t0, mono = time.time(), time.monotonic()
        signal_all(pids, sig)
        watch.start(mono, mono + 180)
        m.fate = "frozen" if sig == signal.SIGSTOP else "killed"
        f = Fault(kind, slot, m.name, t0, spare.name, label=label)
        f.held_samples = len(held)
        f.held_tokens = sum(s["num_tokens"] or 0 for s in held)
        f.notes.append(f"{len(pids)} processes signalled")
        self.say(
            f"{kind}: machine {m.name} (Ray node {(m.node_id or '')[:8]}, {slot}, "
            f"{len(held)} samples in flight) {signal.Signals(sig).name}, {len(pids)} processes"
        )
        self.wait_for(f"{slot} serving on {spare.name}", lambda: self.serving(slot, spare), 240)
        self._measure(f, m, watch)
        self.faults.append(f)
        return f

    def _measure(self, f: Fault, m: Machine, watch: RayNodeWatch) -> None:
        assert self.watch is not None
        t0 = f.at
        left = self.watch.first(f.slot, t0, lambda s, n: s != "alive")
        back = self.watch.first(f.slot, t0, lambda s, n: s == "alive" and n != m.node_id)
        f.rollcall_detection_s = _num(left - t0)
        f.serving_s = _num(back - t0)
        lost_at = self.machine_lost_at(f.slot, t0 - 1)
        f.verdict_s = None if lost_at is None else lost_at - t0
        f.ray_detection_s = watch.result()
        if f.ray_detection_s is None:
            f.notes.append(f"Ray's detection: {watch.why_not()}")
        f.budget = self.watch.slot(f.slot)["restarts"]
        f.waited_line = any(f"{f.slot}: waiting for capacity" in ln for ln in self.driver_lines(t0))
        self.say(
            f"  {f.slot}: left alive after {f.rollcall_detection_s:.1f} s, machine_lost after "
            f"{_s(f.verdict_s)}, Ray's node table dead after {_s(f.ray_detection_s)}, serving "
            f"again after {_s(f.serving_s)}; counted restarts {f.budget}"
        )

    def driver_lines(self, since: float) -> list[str]:
        return self.driver.since(since) if self.driver is not None else []

    # -- cleanup ------------------------------------------------------------------------------

    def cleanup(self) -> list[str]:
        notes = []
        if self.watch is not None:
            self.watch.stop.set()
        if self.driver is not None and self.driver.proc.poll() is None:
            notes.append("the driver was still running: SIGTERM, then SIGKILL")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.driver.proc.pid, signal.SIGTERM)
            try:
                self.driver.proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.driver.proc.pid, signal.SIGKILL)
        for m in self.started:
            with contextlib.suppress(Exception):
                pids = m.pids()
                signal_all(pids, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(m.proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                m.proc.wait(10)
        if self.db is not None:
            with contextlib.suppress(Exception):
                self.db.dispose()
        with contextlib.suppress(Exception):
            subprocess.run(
                [str(BIN / "rollcall"), "db", "stop", "--yes"], env=self.env, timeout=60,
                capture_output=True,
            )  # fmt: skip
        time.sleep(1)
        left = tagged(str(self.root))
        if left:
            notes.append(f"{len(left)} more processes of this run killed: {sorted(left)}")
            signal_all(set(left), signal.SIGKILL)
            time.sleep(1)
        still = tagged(str(self.root))
        if still:
            notes.append(f"processes of this run still there: {still}")
        return notes


def _num(x: float) -> float | None:
    return None if x != x else x


def _s(x: float | None) -> str:
    return "-" if x is None or x != x else f"{x:.1f} s"


def scenario(r: Run) -> None:
    r.say(f"host: {os.cpu_count()} CPUs, load {load()}; root {r.root}")
    r.start_head()
    a = r.start_machine("A")
    b = r.start_machine("B")
    r.cmd("db", "upgrade")  # the embedded PostgreSQL, started and migrated
    r.db = open_database(home=str(r.home))
    r.start_job(r.write_config())
    assert r.watch is not None
    w = r.watch

    def both_serving() -> bool:
        s0, s1 = w.slot("rollout-0"), w.slot("rollout-1")
        return {s0["node"], s1["node"]} == {a.node_id, b.node_id} and (
            s0["state"] == s1["state"] == "alive"
        )

    t = r.wait_for("rollout-0 and rollout-1 serving on A and B", both_serving, 300)
    r.say(f"job {JOB} (id {r.job_id}): rollout-0, rollout-1 serving ({t - r.t0:.0f} s)")
    r.steps_go_on(240)
    r.say(f"first steps: {r.steps()}")

    # 1. scale up with a spare: rollout-2 on C
    c = r.start_machine("C")
    t0 = time.time()
    r.cmd("job", "scale", JOB, "--rollout-nodes", "3")
    r.say("$ rollcall job scale fleet --rollout-nodes 3")
    t = r.wait_for("rollout-2 serving on C", lambda: r.serving("rollout-2", c), 180)
    r.moves.append({"what": "job scale 2 -> 3", "slot": "rollout-2", "to": "C",
                    "serving_s": t - t0})  # fmt: skip
    r.say(f"  rollout-2 serving on C after {t - t0:.1f} s")
    r.steps_go_on()
    d = r.start_machine("D")

    # 2. drain rollout-0's machine: it moves to the spare D
    src = r.machine_of("rollout-0")
    held = r.held(["rollout-0"], f"drain {src.name}")
    node = find_ray_node(src.node_id or "")
    gone = RayNodeWatch(src.node_id or "", node.gcs_address, node.cluster_id)
    t0, mono = time.time(), time.monotonic()
    gone.start(mono, mono + 120)  # when Ray's node table has the drained machine's raylet ended
    r.cmd("node", "drain", (src.node_id or "")[:12], "--job", JOB)
    r.say(f"$ rollcall node drain {(src.node_id or '')[:12]} --job fleet   (machine {src.name}, "
          f"rollout-0, {len(held)} samples in flight)")  # fmt: skip
    t = r.wait_for("rollout-0 serving on D", lambda: r.serving("rollout-0", d), 240)
    draining = r.watch.first("rollout-0", t0, lambda s, n: s == "draining") - t0
    lines = r.driver_lines(t0)
    drained = [ln for ln in lines if "rollout-0: drained" in ln]
    r.moves.append({
        "what": f"node drain {src.name}", "slot": "rollout-0", "to": "D", "draining_s": draining,
        "serving_s": t - t0, "held_samples": len(held),
        "held_tokens": sum(s["num_tokens"] or 0 for s in held), "drained_line": drained,
    })  # fmt: skip
    r.say(f"  rollout-0 draining after {draining:.1f} s, serving on D after {t - t0:.1f} s")
    r.check(bool(drained) and "not done within" not in drained[0],
            f"the drain of {src.name} ended in time (line: {drained})")  # fmt: skip
    ended = gone.result()  # Ray ends a drained machine's raylet once it is idle
    r.moves[-1]["raylet_ended_s"] = ended
    src.fate = "drained" + (f", its raylet ended {ended:.1f} s after the drain" if ended else "")
    r.say(f"  machine {src.name}: {src.fate}")
    r.steps_go_on()

    # 3. three machine losses within 600 s, each with a spare, all on rollout-1's machine
    e = r.start_machine("E")
    victim = r.machine_of("rollout-1")
    held = r.held(["rollout-1"], f"kill-node on {victim.name}")
    t0 = time.time()
    budget0 = r.watch.slot("rollout-1")["restarts"]
    r.say(f"loss 1: $ rollcall drill kill-node --job fleet --node {victim.node_id} --yes --json"
          f"   (machine {victim.name}, rollout-1)")  # fmt: skip
    out = r.cmd("drill", "kill-node", "--job", JOB, "--node", victim.node_id or "", "--yes",
                "--json", "--timeout", "240", timeout=400, check=False)  # fmt: skip
    victim.fate = "killed (drill)"
    try:
        r.drill = json.JSONDecoder().raw_decode(out[out.index("{") :])[0]
    except ValueError:
        raise Failed(f"the drill printed no report: {out!r}") from None
    keys = ("detection_s", "ray_detection_s", "recovery_s", "lost", "duplicated", "passed")
    r.say(f"  drill: {json.dumps({k: r.drill.get(k) for k in keys})}")
    f = Fault(
        "SIGKILL (rollcall drill kill-node)",
        "rollout-1",
        victim.name,
        r.drill["fault_at"],
        "E",
        label=f"kill-node on {victim.name}",
    )
    r.wait_for("rollout-1 serving on E", lambda: r.serving("rollout-1", e), 240)
    left = r.watch.first("rollout-1", t0, lambda s, n: s != "alive")
    back = r.watch.first("rollout-1", t0, lambda s, n: s == "alive" and n == e.node_id)
    f.rollcall_detection_s = _num(left - f.at)
    f.serving_s = _num(back - f.at)
    lost_at = r.machine_lost_at("rollout-1", t0)
    f.verdict_s = None if lost_at is None else lost_at - f.at
    f.ray_detection_s = r.drill.get("ray_detection_s")
    f.budget = r.watch.slot("rollout-1")["restarts"] - budget0
    f.lost, f.duplicated = r.drill.get("lost"), r.drill.get("duplicated")
    f.held_samples = r.drill.get("in_flight_samples", 0)
    f.held_tokens = sum(s["num_tokens"] or 0 for s in held)
    f.notes += [
        f"drill detection_s {r.drill.get('detection_s')}, recovery_s "
        f"{r.drill.get('recovery_s')}, passed {r.drill.get('passed')}",
        *(r.drill.get("notes") or []),
    ]
    f.waited_line = any("rollout-1: waiting for capacity" in ln for ln in r.driver_lines(t0))
    r.faults.append(f)
    r.check(bool(r.drill.get("passed")), f"the kill-node drill passed ({r.drill})")
    r.say(f"  rollout-1 serving on E after {_s(f.serving_s)} (from the drill's fault time)")

    f_machine = r.start_machine("F")
    frozen = r.lose("SIGSTOP (frozen machine)", "rollout-1", f_machine, signal.SIGSTOP)
    frozen_m = r.machines[frozen.machine]
    r.wait_for(f"Ray's node table marking {frozen_m.name} dead",
               lambda: r.ray_alive(frozen_m.node_id or "") is False, 120)  # fmt: skip
    signal_all(frozen_m.pids(), signal.SIGKILL)  # the frozen machine, cleaned up
    with contextlib.suppress(ProcessLookupError):
        os.killpg(frozen_m.proc.pid, signal.SIGKILL)
    r.say(f"  frozen machine {frozen_m.name} SIGKILLed (cleanup, after Ray declared it dead)")

    g = r.start_machine("G")
    r.lose("SIGKILL (power loss)", "rollout-1", g, signal.SIGKILL)
    r.steps_go_on()
    span = r.faults[-1].at - r.faults[-3].at
    r.say(f"three losses within {span:.0f} s")
    r.check(span < 600, f"the three losses within 600 s ({span:.0f} s)")

    # 4. every rollout machine lost, no spare: every slot waits, the job waits, J joins
    slots = ["rollout-0", "rollout-1", "rollout-2"]
    victims = {s: r.machine_of(s) for s in slots}
    held_by = {s: r.held([s], f"every machine: {s}") for s in slots}
    held = [x for h in held_by.values() for x in h]
    watches = {}
    pids: set[int] = set()
    for s, m in victims.items():
        node = find_ray_node(m.node_id or "")
        watches[s] = RayNodeWatch(m.node_id or "", node.gcs_address, node.cluster_id)
        pids |= m.pids()
    steps_at = r.steps()
    t0, mono = time.time(), time.monotonic()
    signal_all(pids, signal.SIGKILL)
    for rw in watches.values():
        rw.start(mono, mono + 180)
    for m in victims.values():
        m.fate = "killed"
    names = ", ".join(sorted({m.name for m in victims.values()}))
    r.say(f"loss 4: every rollout machine ({names}) SIGKILL, {len(pids)} processes; no spare; "
          f"{len(held)} samples in flight")  # fmt: skip
    t_wait = r.wait_for(
        "every slot waiting for capacity",
        lambda: all(w.slot(s)["state"] == "waiting_capacity" for s in slots),
        180,
    )
    r.say(f"  every slot waiting_capacity after {t_wait - t0:.1f} s")
    time.sleep(3)
    r.captures["status while waiting"] = r.cmd("status", "--job", JOB, "--events", "6")
    r.captures["worker list while waiting"] = r.cmd("worker", "list", "--job", JOB)
    r.captures["node list while waiting"] = r.cmd("node", "list", "--job", JOB)
    time.sleep(20)  # the job waits
    r.alive_or_fail()
    assert r.db is not None
    with r.db.engine.connect() as conn:
        status = conn.execute(sa.text("SELECT status::text FROM jobs WHERE id = :j"),
                              {"j": r.job_id}).scalar_one()  # fmt: skip
    r.check(status == "running", f"the job still running while it waits (status {status})")
    waiting_panel = [ln for ln in r.driver_lines(t0) if "no rollout node can run" in ln]
    r.say(f"  the job waits: status {status}, steps {steps_at} -> {r.steps()}, driver panel: "
          f"{waiting_panel[-1].strip() if waiting_panel else '(no waiting line)'}")  # fmt: skip
    r.check(bool(waiting_panel), "the driver's terminal says the job waits for capacity")
    j = r.start_machine("J", rollout=3)
    t_join = time.time()
    t = r.wait_for("every slot serving on J", lambda: all(r.serving(s, j) for s in slots), 240)
    r.steps_go_on()
    for s, m in victims.items():
        f = Fault(
            "SIGKILL, every machine, no spare", s, m.name, t0, None, label=f"every machine: {s}"
        )
        left = r.watch.first(s, t0, lambda st, n: st != "alive")
        f.rollcall_detection_s = _num(left - t0)
        lost_at = r.machine_lost_at(s, t0 - 1)
        f.verdict_s = None if lost_at is None else lost_at - t0
        f.ray_detection_s = watches[s].result()
        back = r.watch.first(s, t0, lambda st, n: st == "alive" and n == j.node_id)
        f.serving_s = _num(back - t0)
        f.budget = r.watch.slot(s)["restarts"]
        f.waited_line = any(f"{s}: waiting for capacity" in ln for ln in r.driver_lines(t0))
        f.held_samples = len(held_by[s])
        f.held_tokens = sum(x["num_tokens"] or 0 for x in held_by[s])
        f.notes.append(f"J joined {t_join - t0:.1f} s after the loss; serving "
                       f"{back - t_join:.1f} s after J registered")  # fmt: skip
        r.faults.append(f)
    r.moves.append({"what": "machine J joins (rollout: 3)", "slot": ",".join(slots), "to": "J",
                    "serving_s": t - t_join, "waited_s": t_join - t_wait})  # fmt: skip
    r.say(f"  every slot serving on J {t - t_join:.1f} s after J registered; steps go on")

    # 5. scale down to one: rollout-1 and rollout-2 drain and are removed
    held = r.held(["rollout-1", "rollout-2"], "scale 3 -> 1")
    t0 = time.time()
    r.cmd("job", "scale", JOB, "--rollout-nodes", "1")
    r.say(f"$ rollcall job scale fleet --rollout-nodes 1   ({len(held)} samples in flight on "
          "the two)")  # fmt: skip
    t = r.wait_for(
        "rollout-1 and rollout-2 removed",
        lambda: all(w.slot(s)["state"] == "removed" for s in ("rollout-1", "rollout-2")),
        240,
    )
    drained = [ln for ln in r.driver_lines(t0) if ": drained" in ln]
    r.moves.append({"what": "job scale 3 -> 1", "slot": "rollout-1,rollout-2", "removed_s": t - t0,
                    "held_samples": len(held), "drained_line": drained})  # fmt: skip
    r.check(len(drained) == 2 and not any("not done within" in ln for ln in drained),
            f"both removed slots drained in time ({drained})")  # fmt: skip
    r.say(f"  removed after {t - t0:.1f} s")
    r.steps_go_on()
    r.captures["worker list at the end"] = r.cmd("worker", "list", "--job", JOB)

    # the end
    r.say(f"$ rollcall job stop fleet --wait   (steps {r.steps()})")
    r.cmd("job", "stop", JOB, "--wait", "--timeout", "300", timeout=360)
    assert r.driver is not None
    rc = r.driver.proc.wait(120)
    r.driver.thread.join(10)
    r.say(f"the driver exited with code {rc}")
    r.check(rc == 0, f"the driver's exit code 0 (got {rc})")


def verdict(r: Run) -> dict[str, Any]:
    """The checks on the database at the end, and the summary."""
    assert r.db is not None and r.job_id is not None and r.watch is not None
    r.watch.poll()
    with r.db.engine.connect() as c:
        slots = [
            dict(x._mapping)
            for x in c.execute(
                sa.text(
                    "SELECT name, state, restarts, machine_losses FROM rollout_slots "
                    "WHERE job_id = :j ORDER BY name"
                ),
                {"j": r.job_id},
            ).all()
        ]
        steps = c.execute(
            sa.text("SELECT count(*), coalesce(sum(num_trajectories), 0) FROM train_steps "
                    "WHERE job_id = :j"), {"j": r.job_id},
        ).one()  # fmt: skip
    events = r.events()
    kinds = [e["kind"] for e in events]
    r.check(all(s["restarts"] == 0 for s in slots), f"no counted restart: {slots}")
    r.check(not any(s["state"] == "failed" for s in slots), "no failed slot")
    r.check("worker.restarting" not in kinds and "worker.failed" not in kinds,
            "no worker.restarting / worker.failed event")  # fmt: skip
    report = check_invariants(r.db, r.job_id)
    r.check(report.ok, f"invariants: {report.summary()}")
    dup = len(report.violations.get("trained_once", []))
    for f in r.faults:
        if f.duplicated is None:
            f.duplicated = dup
    lost_by: dict[str, dict[str, Any]] = {}
    for label, held in r.holdings:
        lost = r.lost(held)
        lost_by[label] = {"held": len(held), "lost": len(lost), "examples": lost[:3]}
        r.check(not lost, f"nothing checkpointed lost at {label}: {lost[:3]}")
    for f in r.faults:
        if f.lost is None and f.label in lost_by:
            f.lost = int(lost_by[f.label]["lost"])
        r.check(f.budget == 0, f"{f.kind} on {f.machine} cost no budget ({f.budget})")
        r.check(f.serving_s is not None, f"{f.slot} served again after {f.kind}")
    text = r.driver.text() if r.driver else ""
    for needle in ("is lost", "waiting for capacity", "after waiting", "drained", "removing it",
                   "added"):  # fmt: skip
        r.check(needle in text, f"the driver printed a line with {needle!r}")
    # what the driver printed (each line, with when), and the panel's waiting line, first and last
    said: list[tuple[float, str]] = []
    waits: list[tuple[float, str]] = []
    for t, ln, panel in r.driver.lines if r.driver else []:
        if panel and "no rollout node can run" in ln:
            waits.append((t, f"(live panel) {ln.strip()}"))
        elif not panel and re.match(r"\s*(rollout-\d+:|placed:|job |database)", ln):
            said.append((t, ln.strip()))
    said += waits[:1] + waits[-1:] if len(waits) > 1 else waits
    lines = [f"[{t - r.t0:6.1f} s] {ln}" for t, ln in sorted(said)]
    return {
        "host": {"cpus": os.cpu_count(), "load_end": load()},
        "slots": slots,
        "steps": int(steps[0]),
        "trajectories_trained": int(steps[1]),
        "events": [
            {**e, "t": round(e["at"] - r.t0, 1)} for e in events if e["kind"] != "job.heartbeat"
        ],
        "invariants_ok": report.ok,
        "trained_twice": dup,
        "held_and_lost": lost_by,
        "faults": [f.__dict__ for f in r.faults],
        "moves": r.moves,
        "machines": {
            m.name: {"node": m.node_id, "up_s": m.up_s, "fate": m.fate, "rollout": m.rollout}
            for m in r.machines.values()
        },
        "drill": r.drill,
        "ray_start_failures": r.start_failures,
        "driver_lines": lines,
        "captures": r.captures,
        "failures": r.failures,
    }


def print_summary(r: Run, out: dict[str, Any]) -> None:
    print("\n== driver lines (rollcall run's terminal) ==")
    for ln in out["driver_lines"]:
        print("  " + ln.strip())
    for k, v in out["captures"].items():
        print(f"\n== {k} ==\n{v.rstrip()}")
    print("\n== slots ==")
    for s in out["slots"]:
        print(f"  {s['name']}: {s['state']}, counted restarts {s['restarts']}, machine losses "
              f"{s['machine_losses']}")  # fmt: skip
    print("\n== faults ==")
    print(
        "  kind | slot | machine | rollcall detection | machine_lost | Ray's detection | "
        "serving again | budget | lost | duplicated"
    )
    for f in r.faults:
        print(f"  {f.kind} | {f.slot} | {f.machine} | {_s(f.rollcall_detection_s)} | "
              f"{_s(f.verdict_s)} | {_s(f.ray_detection_s)} | {_s(f.serving_s)} | {f.budget} | "
              f"{f.lost} | {f.duplicated}")  # fmt: skip
    print("\n== moves ==")
    for m in out["moves"]:
        print("  " + json.dumps(m))
    for x in out["ray_start_failures"]:
        print(f"ray start failed (tried again): {x}")
    print(f"\nsteps {out['steps']}, trajectories trained {out['trajectories_trained']}, "
          f"invariants ok {out['invariants_ok']}, load {out['host']['load_end']}")  # fmt: skip
    print("FAILED: " + "; ".join(out["failures"]) if out["failures"] else "all checks passed")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=0.05, help="real seconds per simulated one")
    ap.add_argument("--keep", action="store_true", help="keep the run's directory on success")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rf42.", dir="/tmp"))  # short: Ray's socket paths
    r = Run(root, args.scale)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out: dict[str, Any] = {}
    try:
        scenario(r)
    except (Failed, subprocess.TimeoutExpired) as e:
        r.failures.append(f"{type(e).__name__}: {e}")
        r.say(f"STOPPED: {e}")
    except BaseException as e:
        r.failures.append(f"{type(e).__name__}: {e}")
        r.say(f"STOPPED: {e!r}")
        if not isinstance(e, Exception):
            raise
    finally:
        try:
            if r.db is not None and r.job_id is not None and r.watch is not None:
                out = verdict(r)
        except Exception as e:
            r.failures.append(f"the verdict failed: {e!r}")
        notes = r.cleanup()
        for n in notes:
            r.say(f"cleanup: {n}")
    out["failures"] = r.failures
    out["timeline"] = r.timeline
    out["root"] = str(root)
    (root / "fleet.json").write_text(json.dumps(out, indent=1, default=str))
    if "slots" in out:
        print_summary(r, out)
    else:
        print("FAILED: " + "; ".join(r.failures))
    print(f"logs: {root}")
    if not r.failures and not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({k: out.get(k) for k in ("faults", "moves", "slots", "steps", "failures")},
                     default=str))  # fmt: skip
    return 1 if r.failures else 0


if __name__ == "__main__":
    sys.exit(main())
