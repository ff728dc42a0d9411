"""A soak: a real job for hours on this machine, faults injected from outside at a steady rate,
resources sampled once a minute, and an audit at the end.

The job (``job_config``): the soak's user agent (``ops/soak_agent.py``: an isolated and an
async tool, an LLM-judge reward, one episode in three through the OpenAI-compatible endpoint)
beside the built-in calculator task, two rollout nodes on the CPU (one vLLM, one hf; or both
vLLM, or both hf: ``--engine``), one trainer rank, the
embedded PostgreSQL, and a Ray cluster of this machine started with ``ray start`` (token
authentication on): a head advertising ``{trainer: 1}`` and three worker nodes advertising
``{rollout: 1}``, one of them spare, so that a lost machine's rollout node has somewhere to go
while the soak brings a replacement machine up (as an operator or an autoscaler would).

Faults (``KINDS``, drawn by weight, one at a time, each waited out; then ``--pause-s``):
EngineCore SIGKILL and SIGSTOP, rollout node SIGKILL and SIGSTOP, a Ray worker node lost
(every process of it SIGKILLed), the trainer's rank SIGKILLed, PostgreSQL restarted in
immediate mode (a crash: no checkpoint), a tool process SIGKILLed mid-call, and the driver
itself SIGKILLed and the job continued with ``rollcall run --resume``, as the operator's
supervisor (systemd, a Kubernetes Job) would.

Budgets: a fault every ~30 s, ~60% of them at one of the two rollout slots, is about 6
restarts of a slot per 10 minutes, so ``rollout.max_restarts`` is 40 per 600 s and the
trainer's 20: the budget exists to stop a job whose nodes cannot start at all (every
restart fails at once), which the soak must still detect, not to ration restarts a healthy
job needs under a fault rate no real cluster has.

Written beside the run (``--home``): ``resources.csv`` (one row per sample and series:
elapsed seconds, series, metric, value), ``faults.jsonl`` (every fault's report),
``soak.png`` (resources against time), ``report.json``, and the drivers' outputs.

Usage (after README command 2, on a machine with the vLLM CPU build):
    python ops/soak.py --hours 3 [--pause-s 5] [--seed 0] [--home /tmp/rollcall-soak]
    python ops/soak.py --hours 1 --each-once --engine hf     # the short form (every kind
                                                              # but the EngineCore's, once)
Prints one line per fault, then the report.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sqlalchemy as sa  # noqa: E402
import yaml  # noqa: E402

from ops.soak_report import report_lines, totals_of, unprovoked  # noqa: E402
from ops.soak_sampling import Sampler, orphans, plot, slopes  # noqa: E402
from rollcall.orchestrator import procfs  # noqa: E402
from rollcall.orchestrator.buffer.invariants import check_invariants  # noqa: E402
from rollcall.orchestrator.db.embedded import EmbeddedPostgres  # noqa: E402
from rollcall.orchestrator.db.engine import Database, open_database  # noqa: E402
from rollcall.orchestrator.rayauth import ensure_token  # noqa: E402
from rollcall.orchestrator.services.drills import DrillReport, Drills  # noqa: E402

JOB = "soak"
KINDS = {
    "kill-engine": 2,
    "hang-engine": 1,
    "kill-rollout": 3,
    "hang-rollout": 2,
    "lose-machine": 1,
    "kill-trainer": 1,
    "crash-db": 1,
    "kill-tool": 3,
    "kill-driver": 1,
}
ROLLOUT_NODES = 2
BIN = Path(sys.executable).parent


VLLM = {
    "kind": "vllm",
    "device": "cpu",
    "dtype": "float32",
    "cpu_kv_cache_gib": 1,
    "cpu_threads_bind": "nobind",
    "max_model_len": 1024,
}
ENGINE_KINDS = ("kill-engine", "hang-engine")  # vLLM's EngineCore: with --engine vllm only


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job_config(run_dir: Path, port: int, engine: str = "vllm") -> dict[str, Any]:
    loss = {"correction": {"kind": "tis", "cap": 2.0}, "aggregation": {"kind": "token_mean"}}
    return {
        "job": {"name": JOB},
        "model": {"path": None},
        "ray": {"address": f"127.0.0.1:{port}"},
        "buffer": {"batch_groups": 4, "lease_s": 60},
        "rollout": {
            "nodes": ROLLOUT_NODES,
            "concurrency": 8,
            "cpus_per_node": 1,
            "resources": {"rollout": 1},
            "max_tokens_per_turn": 48,
            "max_tokens": 1024,
            "start_timeout_s": 300,
            "max_restarts": 40,
            # mixed: rollout-0 runs vLLM, rollout-1 hf
            "engine": VLLM if engine == "vllm" else {"kind": "hf"},
            "node_engines": [VLLM] if engine == "mixed" else [],
        },
        "trainer": {
            "ranks": 1,
            "cpus_per_rank": 1,
            "resources": {"trainer": 1},
            "lr": 1.0e-4,
            "micro_batch_tokens": 1024,
            "checkpoint_every": 1,
            "max_restarts": 20,
            "loss": loss,
        },
        "run": {
            "mode": "async",
            "total_steps": 1_000_000,  # the soak stops the job (rollcall job stop) at its end
            "dir": str(run_dir),
            "eval": {"every": 100, "episodes": 16},
        },
        "tasks": [
            {
                "name": "calculator",
                "plugin": "calculator",
                "max_inflight": 8,
                "max_staleness": 4,
                "spec": {"group_size": 4, "max_turns": 4},
            },
            {
                "name": "agent",
                "agent": f"{ROOT / 'ops' / 'soak_agent.py'}:rollout",
                "prompts": {
                    "path": str(ROOT / "examples" / "arithmetic.jsonl"),
                    "key": "question",
                    "held_out_per_mille": 100,
                },
                "max_inflight": 8,
                "max_staleness": 4,
                "spec": {"group_size": 4, "max_turns": 6},
            },
        ],
    }


class Cluster:
    """A Ray cluster of this machine started with ``ray start``: the head and worker nodes.
    Stopped by killing its own processes (those naming its session, and what they started),
    not with ``ray stop``, which would stop every Ray on the machine."""

    def __init__(self, home: Path, port: int, env: dict[str, str]) -> None:
        self.home, self.port, self.env = home, port, env
        self.session = ""

    def _ray(self, *args: str) -> None:
        subprocess.run(
            [str(BIN / "ray"), *args], env=self.env, check=True, capture_output=True, timeout=180
        )

    def start(self, workers: int) -> None:
        # every port of the head chosen free: another Ray on this machine keeps its defaults
        self._ray("start", "--head", f"--port={self.port}", "--node-ip-address=127.0.0.1",
                  "--num-cpus=3", '--resources={"trainer": 1}', "--include-dashboard=false",
                  f"--dashboard-port={free_port()}", f"--ray-client-server-port={free_port()}",
                  "--disable-usage-stats")  # fmt: skip
        for s in procfs.processes():
            line = procfs.cmdline(s.pid)
            if "gcs_server" in line and f"--gcs_server_port={self.port} " in f"{line} ":
                self.session = line.split("--session-name=")[1].split()[0]
        if not self.session:
            raise SystemExit(f"the Ray head on port {self.port} did not start its GCS")
        for _ in range(workers):
            self.add_machine()

    def add_machine(self) -> None:
        address = f"--address=127.0.0.1:{self.port}"
        self._ray("start", address, "--node-ip-address=127.0.0.1", "--num-cpus=1",
                  '--resources={"rollout": 1}', "--disable-usage-stats")  # fmt: skip

    def processes(self) -> list[int]:
        if not self.session:
            return []
        roots = [s.pid for s in procfs.processes() if self.session in procfs.cmdline(s.pid)]
        found = set(roots)
        for pid in roots:
            found.update(procfs.descendants_of(pid))
        found.discard(os.getpid())
        return sorted(found)

    def stop(self) -> None:
        for _ in range(3):
            for pid in self.processes():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(1)


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.home: Path = args.home
        self.run_dir = self.home / "run"
        self.rng = random.Random(args.seed)
        self.env = dict(os.environ)
        token = ensure_token(self.home / "ray_token")
        # RAY_TMPDIR: the cluster's files (sessions, and ray_current_cluster, which a later
        # ray.init() on this machine would otherwise try to join after the soak) in the home
        self.env.update(ROLLCALL_HOME=str(self.home), RAY_AUTH_MODE="token",
                        RAY_AUTH_TOKEN_PATH=str(token), RAY_TMPDIR=str(self.home))  # fmt: skip
        os.environ.update(ROLLCALL_HOME=self.env["ROLLCALL_HOME"], RAY_AUTH_MODE="token",
                          RAY_AUTH_TOKEN_PATH=str(token), RAY_TMPDIR=str(self.home))  # fmt: skip
        self.cluster = Cluster(self.home, args.port or free_port(), self.env)
        self.server = EmbeddedPostgres(self.home)
        self.config = self.home / "soak.yaml"
        self.driver: subprocess.Popen[bytes] | None = None
        self.drivers = 0
        self.driver_exits: list[str] = []  # drivers that ended on their own (not killed)
        self.reports: list[DrillReport] = []
        self.faults_log = self.home / "faults.jsonl"
        self.db: Database | None = None
        self.drills: Drills | None = None

    # -- the job ----------------------------------------------------------------------------

    def start_driver(self, resume: bool) -> None:
        self.drivers += 1
        out = open(self.home / f"driver-{self.drivers}.out", "wb")  # noqa: SIM115
        cmd = [str(BIN / "rollcall"), "run", str(self.config)] + (["--resume"] if resume else [])
        self.driver = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                       cwd=self.home)  # fmt: skip
        out.close()

    def check_driver(self) -> None:
        """A driver that ended on its own is continued as a supervisor would (and noted)."""
        if self.driver is not None and self.driver.poll() is not None:
            rc = self.driver.returncode
            tail = (self.home / f"driver-{self.drivers}.out").read_text(errors="replace")[-600:]
            self.driver_exits.append(f"driver {self.drivers} exited {rc}: {tail.strip()}")
            print(f"     driver {self.drivers} exited {rc}; continuing with --resume", flush=True)
            self.start_driver(resume=True)

    def version(self) -> int:
        assert self.db is not None
        with self.db.transaction() as tx:
            return int(tx.batches.job_state(self.drills.job.id).policy_version)  # type: ignore[union-attr]

    def wait(self, what: str, cond: Callable[[], Any], timeout_s: float) -> float | None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            with contextlib.suppress(Exception):
                if cond():
                    return time.monotonic()
            time.sleep(0.2)
        return None

    # -- faults of the soak's own (the others are rollcall's drills) ---------------------------

    def kill_driver(self) -> DrillReport:
        assert self.driver is not None
        step0 = self.version()
        at_fault = self._in_flight()
        r = DrillReport("kill-driver", JOB, f"driver pid {self.driver.pid}", time.time())
        t0 = time.monotonic()
        self.driver.send_signal(signal.SIGKILL)
        self.driver.wait()
        r.detection_s = 0.0  # its supervisor sees the exit at once
        self.start_driver(resume=True)
        up = self.wait("a step after the resume", lambda: self.version() > step0, 900)
        r.recovery_s = None if up is None else up - t0
        self._audit(r, at_fault)
        return r

    def kill_tool(self) -> DrillReport:
        """SIGKILL a tool process mid-call (the call's own process in the sandbox, else the
        tool server); recovered when a tool call runs again under a node."""
        r = DrillReport("kill-tool", JOB, "", time.time())
        victim = None
        deadline = time.monotonic() + 60
        while victim is None and time.monotonic() < deadline:
            victim = _tool_process(self._node_pids())
            if victim is None:
                time.sleep(0.02)
        if victim is None:
            r.notes.append("no tool process ran within 60 s")
            self._audit(r, [])
            return r
        before = set(_tool_processes(self._node_pids()))
        at_fault = self._in_flight()
        r.target = f"tool pid {victim}"
        t0 = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
        gone = self.wait("gone", lambda: not procfs.alive(victim), 30)
        r.detection_s = None if gone is None else gone - t0
        up = self.wait(
            "a tool call again",
            lambda: set(_tool_processes(self._node_pids())) - before - {victim},
            self.args.timeout,
        )
        r.recovery_s = None if up is None else up - t0
        self._audit(r, at_fault)
        return r

    def crash_db(self) -> DrillReport:
        assert self.drills is not None

        def crash() -> None:
            self.server.stop(mode="immediate")
            self.server.ensure_running()

        r = self.drills.restart_db(crash)
        r.drill = "crash-db"
        return r

    def lose_machine(self) -> DrillReport:
        """A Ray worker node lost; a replacement machine joins once it is declared lost, so the
        next loss has a spare again (the spare took the lost node's rollout node)."""
        assert self.drills is not None
        replaced = threading.Event()

        def replace() -> None:
            time.sleep(5)  # the machine reboots
            with contextlib.suppress(Exception):
                self.cluster.add_machine()
            replaced.set()

        threading.Thread(target=replace, daemon=True).start()
        r = self.drills.kill_node()
        replaced.wait(300)
        return r

    def _node_pids(self) -> set[int]:
        assert self.drills is not None
        return {int(w["pid"]) for w in self.drills._workers("rollout") if w.get("pid")}

    def _in_flight(self) -> list[dict[str, Any]]:
        """The samples every live rollout node holds (and their checkpointed progress)."""
        assert self.db is not None and self.drills is not None
        with self.db.transaction() as tx:
            return [
                s
                for w in self.drills._workers("rollout")
                for s in tx.invariants.samples_of_worker(w["id"])
            ]

    def _audit(self, r: DrillReport, at_fault: list[dict[str, Any]]) -> None:
        """The drills' accounting: what was in flight at the fault and is lost now (progress
        gone, not expired or quarantined), resumed turns, and the invariant checker."""
        assert self.drills is not None
        self.drills.account(r, at_fault)

    def inject(self, kind: str) -> DrillReport:
        d = self.drills
        assert d is not None
        if kind in ("kill-engine", "hang-engine"):
            return d.kill_engine(1, "KILL" if kind == "kill-engine" else "STOP")[0]
        if kind in ("kill-rollout", "hang-rollout"):
            return d.kill_rollout(1, "KILL" if kind == "kill-rollout" else "STOP")[0]
        return {
            "lose-machine": self.lose_machine,
            "kill-trainer": d.kill_trainer,
            "crash-db": self.crash_db,
            "kill-tool": self.kill_tool,
            "kill-driver": self.kill_driver,
        }[kind]()

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        a = self.args
        self.home.mkdir(parents=True, exist_ok=True)
        self.server.ensure_running()
        subprocess.run([str(BIN / "rollcall"), "db", "upgrade"], env=self.env, check=True,
                       capture_output=True, timeout=300)  # fmt: skip
        config = job_config(self.run_dir, self.cluster.port, a.engine)
        self.config.write_text(yaml.safe_dump(config, sort_keys=False))
        self.cluster.start(ROLLOUT_NODES + 1)
        self.start_driver(resume=False)
        self.db = self._open_database()
        up = self.wait("the job", lambda: self._job_started(), 900)
        if up is None:
            raise SystemExit(f"the job did not train a step within 900 s (see {self.home})")
        assert self.drills is not None
        sampler = Sampler(self.db, self.drills.job.id, self.home, lambda: self.driver,
                          a.sample_s)  # fmt: skip
        sampler.start()
        t_start = time.monotonic()
        end = t_start + a.hours * 3600
        kinds = {k: w for k, w in KINDS.items() if k not in a.without}
        if a.engine == "hf":
            kinds = {k: w for k, w in kinds.items() if k not in ENGINE_KINDS}
        sequence = list(kinds) if a.each_once else None  # each kind once, in this order
        print(f"soak: job {JOB!r} training; faults for {a.hours:g} h from {sorted(kinds)}",
              flush=True)  # fmt: skip
        i = 0
        while time.monotonic() < end and (a.faults is None or i < a.faults):
            if sequence is not None and i >= len(sequence):
                break
            i += 1
            kind = (
                sequence[i - 1]
                if sequence is not None
                else self.rng.choices(list(kinds), weights=list(kinds.values()))[0]
            )
            self.check_driver()
            try:
                r = self.inject(kind)
            except Exception as e:  # a fault that could not be injected: said, not counted
                print(f"{i:>5} {kind:<14} not injected: {e}", flush=True)
                i -= 1
                time.sleep(5)
                continue
            self.reports.append(r)
            with self.faults_log.open("a") as f:
                f.write(json.dumps({"kind": kind, "at_s": round(time.monotonic() - t_start, 1),
                                    **r.to_json()}) + "\n")  # fmt: skip
            rec = "-" if r.recovery_s is None else f"{r.recovery_s:6.1f}"
            det = "-" if r.detection_s is None else f"{r.detection_s:6.1f}"
            print(f"{i:>5} {kind:<14} {r.target[:34]:<34} detect {det} s recover {rec} s "
                  f"in flight {r.in_flight_samples} resumed turns {r.resumed_turns} "
                  f"lost {r.lost} dup {r.duplicated} {'ok' if r.passed else 'FAILED'}",
                  flush=True)  # fmt: skip
            for note in r.notes if not r.passed else []:
                print(f"      {note}", flush=True)
            time.sleep(a.pause_s)
        return self.finish(sampler, time.monotonic() - t_start)

    def _open_database(self) -> Database:
        """The job's database, once its driver has it up (it may restart the embedded server
        with the job's settings as it starts)."""
        deadline = time.monotonic() + 300
        while True:
            try:
                return open_database(None)
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(2)

    def _job_started(self) -> bool:
        assert self.db is not None
        if self.drills is None:
            self.drills = Drills(self.db, JOB, timeout_s=self.args.timeout)
        self.check_driver()
        return self.version() >= 1

    def finish(self, sampler: Sampler, wall_s: float) -> dict[str, Any]:
        assert self.db is not None and self.drills is not None
        subprocess.run([str(BIN / "rollcall"), "job", "stop", JOB], env=self.env, timeout=120,
                       capture_output=True)  # fmt: skip
        driver = self.driver
        ended = driver is not None and self.wait(
            "the driver's end", lambda: driver.poll() is not None, 900
        )
        sampler.stop()
        final = check_invariants(self.db, self.drills.job.id)
        with self.db.transaction() as tx:
            steps = int(tx.batches.job_state(self.drills.job.id).policy_version)
            events: dict[str, int] = dict(tx.session.execute(sa.text(
                "SELECT kind, count(*) FROM events WHERE job_id = :j GROUP BY kind"),
                {"j": self.drills.job.id}).all())  # fmt: skip
            downs = [
                (at.timestamp(), str(slot), str(reason))
                for at, slot, reason in tx.session.execute(sa.text(
                    "SELECT created_at, payload->>'slot', payload->>'reason' FROM events "
                    "WHERE job_id = :j AND kind IN ('worker.restarting', 'worker.machine_lost', "
                    "'worker.failed') ORDER BY id"),
                    {"j": self.drills.job.id}).all()
            ]  # fmt: skip
            # each failed start with the last lines of its evidence (the root cause last)
            failed_starts = [
                {"message": m, "evidence": list(e or [])[-6:]}
                for m, e in tx.session.execute(sa.text(
                    "SELECT message, payload->'evidence' FROM events WHERE job_id = :j "
                    "AND kind = 'worker.start_failed' ORDER BY id"),
                    {"j": self.drills.job.id}).all()
            ]  # fmt: skip
        # the job ended: none of its engines or tool processes may be left (Ray ends a
        # finished job's actors within seconds)
        clean = self.wait("no orphan", lambda: not orphans(set(), self.home), 120)
        left = [] if clean is not None else orphans(set(), self.home)
        self.cluster.stop()
        totals = totals_of(self.reports)
        totals.update(
            wall_s=round(wall_s, 1),
            steps=steps,
            driver_ended=bool(ended),
            driver_rc=None if self.driver is None else self.driver.returncode,
            drivers=self.drivers,
            driver_exits=self.driver_exits,
            final_invariants=final.summary(),
            final_invariants_ok=final.ok,
            duplicated_at_end=len(final.violations.get("trained_once", [])),
            orphans_at_end=left,
            events=events,
            failed_starts=failed_starts,
            downs=len(downs),
            unprovoked=unprovoked(downs, self.reports, self.args.timeout),
            slopes=slopes(sampler.path),
        )
        plot(sampler.path, self.home / "soak.png", f"soak: {totals['faults']} faults")
        (self.home / "report.json").write_text(json.dumps(totals, indent=1))
        return totals


def _tool_processes(node_pids: set[int]) -> list[int]:
    """Tool processes of these rollout nodes: what their forkservers started (tool servers
    and, in the sandbox, each call's own process; a forked child keeps its forkserver's
    command line), newest first."""
    found: list[tuple[int, int]] = []
    for pid in node_pids:
        for fs in procfs.descendants_of(pid):
            if not procfs.forked(fs) or procfs.forked(procfs.parent_of(fs) or 1):
                continue  # not a forkserver (one forked from a forkserver is a tool)
            for p in procfs.descendants_of(fs):
                s = procfs.stat(p)
                if s is not None and not s.zombie:
                    found.append((s.start_ticks, p))
    return [p for _, p in sorted(found, reverse=True)]


def _tool_process(node_pids: set[int]) -> int | None:
    """A call in flight: a process under a tool server (not the server itself), else None."""
    for p in _tool_processes(node_pids):
        parent = procfs.parent_of(p) or 1
        if procfs.forked(parent) and procfs.forked(procfs.parent_of(parent) or 1):
            return p
    return None


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--hours", type=float, required=True)
    ap.add_argument("--faults", type=int, default=None, help="stop after this many faults")
    ap.add_argument("--pause-s", type=float, default=5.0, help="between one fault's recovery "
                    "and the next fault")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--home", type=Path, default=Path(f"/tmp/rollcall-soak-{int(time.time())}"))
    ap.add_argument("--port", type=int, default=None, help="the Ray head's (default: a free one)")
    ap.add_argument("--timeout", type=float, default=300.0, help="a fault's recovery wait")
    ap.add_argument("--sample-s", type=float, default=60.0)
    ap.add_argument("--engine", choices=("mixed", "vllm", "hf"), default="mixed",
                    help="mixed: one vLLM node and one hf node")  # fmt: skip
    ap.add_argument("--each-once", action="store_true", help="each fault kind once, in order, "
                    "then the end (the short form CI runs)")  # fmt: skip
    ap.add_argument("--without", nargs="*", default=[], choices=sorted(KINDS))
    args = ap.parse_args()
    if shutil.which("ray", path=str(BIN)) is None:
        sys.exit(f"no ray next to {sys.executable}: install rollcall (README command 2) first")
    soak = Soak(args)
    try:
        totals = soak.run()
    finally:
        if soak.driver is not None and soak.driver.poll() is None:
            soak.driver.kill()
        soak.cluster.stop()
        if soak.db is not None:
            soak.db.dispose()
        soak.server.stop()  # `rollcall --home HOME db start` brings it back to look around
    for line in report_lines(totals):
        print(line)
    print(f"everything: {args.home / 'report.json'}, {args.home / 'soak.png'}")


if __name__ == "__main__":
    main()
