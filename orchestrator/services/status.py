"""What an operator sees of a job: ``rollcall status``, ``worker list``, ``buffer stats``,
``events``, and the numbers behind the Prometheus exporter.

``snapshot()`` reads one consistent picture of a job from the database (inside the caller's
transaction): the job's progress, every non-retired task with its quota, live mix, work by
state, staleness and counters, the latest incarnation of every worker slot with its heartbeat
age on the database clock, and the trainer's recent steps. ``status_document()`` turns it into
the JSON of ``rollcall status --json`` (its shape is checked by a test); the exporter turns the
same snapshot into metrics, so the CLI and the dashboards never disagree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from rollcall.orchestrator import bounds
from rollcall.orchestrator.db.engine import Tx
from rollcall.orchestrator.db.repos.monitoring import DrillCount, JobProgress, StepSummary
from rollcall.orchestrator.db.repos.trajectories import table_sizes
from rollcall.orchestrator.domain import JobView, paused_sentence
from rollcall.orchestrator.errors import NotFoundError, UserError
from rollcall.orchestrator.services.jobs import driver_json, require_job

# Episode states as operators see them: ``done`` split by where it is in training.
EPISODE_STATES = ("queued", "leased", "ready", "claimed", "consumed", "expired", "quarantined")
# Steps over which the live task mix and the trainer's busy fraction are measured.
MIX_WINDOW_STEPS = 10
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0
COUNTERS = ("fenced_rejections", "expired_groups", "quarantined_episodes", "requeued_leases")
# seconds the trainer spends on a step once its batch is planned: what "busy" means (the same
# sum as the driver's trainer-busy figure)
BUSY_PHASES = ("train_s", "checkpoint_s", "publish_s")


@dataclass
class TaskSnapshot:
    id: int
    name: str
    plugin: str
    status: str
    weight: float
    max_inflight: int
    max_staleness: int
    quota_share: float  # weight / total weight of the job's non-retired tasks
    mix_share: float | None  # share of the groups trained over the last MIX_WINDOW_STEPS
    mix_groups: int
    episodes: dict[str, int]  # state -> episodes (every state of EPISODE_STATES)
    samples: dict[str, int]  # state -> samples (episodes x group size)
    trained_staleness: dict[int, int]  # staleness in versions -> trained groups
    ready_staleness: int  # oldest finished, untrained group: versions behind the policy
    ready_age_s: float  # and seconds since it finished
    reward: float | None  # mean reward of the task's samples in the last step
    counters: dict[str, int]
    status_reason: str | None = None  # why the user-code guard paused it

    @property
    def inflight(self) -> int:
        return self.episodes["leased"]


@dataclass
class JobSnapshot:
    job: JobProgress
    mode: str | None
    total_steps: int | None
    heartbeat_timeout_s: float
    tasks: list[TaskSnapshot]
    nodes: list[dict[str, Any]]
    steps: list[StepSummary]  # the last MIX_WINDOW_STEPS + 1, oldest first
    events: dict[str, int] = field(default_factory=dict)  # kind -> count
    drills: list[DrillCount] = field(default_factory=list)
    slots: list[dict[str, Any]] = field(default_factory=list)  # rollout slots (supervisor's)

    @property
    def busy_ratio(self) -> float | None:
        return busy_ratio(self.steps)

    @property
    def running(self) -> bool:
        """Some worker is alive and beat within the heartbeat timeout (the job's processes are
        up; the job's status and whether its driver is alive are the job row's and the driver
        lock's)."""
        return any(
            n["status"] in ("starting", "alive") and n["heartbeat_age_s"] < self.heartbeat_timeout_s
            for n in self.nodes
        )

    def depth(self) -> dict[str, int]:
        return {s: sum(t.episodes[s] for t in self.tasks) for s in EPISODE_STATES}


def step_busy_s(step: StepSummary) -> float:
    return sum(float(step.metrics.get(k, 0.0) or 0.0) for k in BUSY_PHASES)


def step_seconds(step: StepSummary) -> float:
    """The trainer's time for a step from its claimed batch to its commit."""
    return step_busy_s(step) + float(step.metrics.get("plan_s", 0.0) or 0.0)


def busy_ratio(steps: list[StepSummary]) -> float | None:
    """The trainer's busy time over the wall time between the first and the last step of the
    window (needs two steps); a live figure, unlike the since-start one of ``rollcall run``."""
    if len(steps) < 2:
        return None
    span = steps[-1].at - steps[0].at
    if span <= 0:
        return None
    return min(1.0, sum(step_busy_s(s) for s in steps[1:]) / span)


def resolve_job(tx: Tx, name: str | None) -> JobView:
    """The named job, or (no name) the job with the most recent activity."""
    if name is None:
        name = tx.monitoring.latest_job_name()
        if name is None:
            raise NotFoundError("there are no jobs; run `rollcall db upgrade` first")
    return require_job(tx, name)


def snapshot(tx: Tx, job_id: int) -> JobSnapshot:
    progress = tx.monitoring.job_progress(job_id)
    job = tx.jobs.get(job_id)
    config = job.config if job is not None else {}
    tasks = tx.tasks.list(job_id, include_retired=False)
    states = tx.monitoring.episode_states(job_id)
    trained = tx.monitoring.trained_staleness(job_id)
    ready = tx.monitoring.ready_staleness(job_id)
    steps = tx.monitoring.recent_steps(job_id, MIX_WINDOW_STEPS + 1)
    window = steps[-MIX_WINDOW_STEPS:]
    mix: dict[int, int] = {}
    for s in window:
        for key, v in s.task_mix.items():
            if isinstance(v, dict):
                mix[int(key)] = mix.get(int(key), 0) + int(v.get("groups", 0))
    mix_total = sum(mix.values())
    total_weight = sum(t.weight for t in tasks)
    last_metrics = steps[-1].metrics if steps else {}
    out = []
    for t in tasks:
        lag, age = ready.get(t.id, (0, 0.0))
        reward = last_metrics.get(f"reward/{t.name}")
        out.append(
            TaskSnapshot(
                id=t.id,
                name=t.name,
                plugin=t.plugin,
                status=t.status.value,
                weight=t.weight,
                max_inflight=t.max_inflight,
                max_staleness=t.max_staleness,
                quota_share=t.weight / total_weight if total_weight > 0 else 0.0,
                mix_share=mix.get(t.id, 0) / mix_total if mix_total else None,
                mix_groups=mix.get(t.id, 0),
                episodes={s: states.get((t.id, s), (0, 0))[0] for s in EPISODE_STATES},
                samples={s: states.get((t.id, s), (0, 0))[1] for s in EPISODE_STATES},
                trained_staleness=trained.get(t.id, {}),
                ready_staleness=lag,
                ready_age_s=age,
                reward=float(reward) if isinstance(reward, int | float) else None,
                counters={k: int(t.counters.get(k, 0)) for k in COUNTERS},
                status_reason=t.status_reason,
            )
        )
    cp = config.get("control_plane") or {}
    run = config.get("run") or {}
    return JobSnapshot(
        job=progress,
        mode=run.get("mode"),
        total_steps=run.get("total_steps"),
        heartbeat_timeout_s=float(cp.get("heartbeat_timeout_s", DEFAULT_HEARTBEAT_TIMEOUT_S)),
        tasks=out,
        nodes=tx.workers.health(job_id),
        steps=steps,
        events=tx.monitoring.event_counts(job_id),
        drills=tx.monitoring.drill_counts(job_id),
        slots=tx.fleet.slots(job_id),
    )


SLOT_WORDS = {
    "waiting_capacity": "waits for a machine with room",
    "awaiting_ray": "waits for Ray's word on its machine",
    "restarting": "restarts",
    "draining": "drains",
}


def with_slots(nodes: list[dict[str, Any]], slots: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The workers' rows with each rollout slot's state as the supervisor sees it (``slot``,
    its counted ``budget_restarts`` of ``max_restarts``, ``machine_losses``), and a row for a
    slot that has no incarnation yet (added, waiting for a machine)."""
    by_name = {s["name"]: s for s in slots}
    out = []
    for n in nodes:
        s = by_name.pop(n["name"], None)
        out.append({**n, **_slot_fields(s)} if s is not None else {**n, "slot": None})
    for s in by_name.values():
        if s["state"] == "removed":
            continue
        out.append(
            {
                "id": None, "name": s["name"], "role": "rollout", "status": s["state"],
                "incarnation": None, "restarts": 0, "host": None, "pid": None,
                "node_id": s["ray_node_id"], "loaded_version": None, "heartbeat_age_s": None,
                "progress_age_s": None, "tokens_generated": 0, **_slot_fields(s),
            }
        )  # fmt: skip
    return out


def _slot_fields(s: dict[str, Any]) -> dict[str, Any]:
    return {
        "slot": s["state"],
        "slot_reason": s["reason"],
        "slot_age_s": round(s["state_age_s"], 3),
        "budget_restarts": s["restarts"],
        "max_restarts": s["max_restarts"],
        "machine_losses": s["machine_losses"],
    }


def slot_lines(nodes: list[dict[str, Any]]) -> list[str]:
    """One sentence per rollout slot that is not serving (waiting for capacity, for Ray's word,
    restarting, draining)."""
    lines = []
    for n in nodes:
        words = SLOT_WORDS.get(n.get("slot") or "")
        if words:
            why = f": {n['slot_reason']}" if n.get("slot_reason") else ""
            lines.append(f"{n['name']} {words} (for {n['slot_age_s']:.0f} s){why}")
    return lines


def node_json(n: dict[str, Any]) -> dict[str, Any]:
    slot = {
        k: n.get(k)
        for k in ("slot", "slot_reason", "slot_age_s", "budget_restarts", "max_restarts",
                  "machine_losses")
    }  # fmt: skip
    return {
        **slot,
        "name": n["name"],
        "role": n["role"],
        "status": n["status"],
        "incarnation": n["incarnation"],
        "restarts": n["restarts"],
        "host": n["host"],
        "pid": n["pid"],
        "node_id": n["node_id"],
        "loaded_version": n["loaded_version"],
        "heartbeat_age_s": None if n["heartbeat_age_s"] is None else round(n["heartbeat_age_s"], 3),
        "progress_age_s": None if n["progress_age_s"] is None else round(n["progress_age_s"], 3),
        "tokens_generated": n["tokens_generated"],
    }


def status_document(tx: Tx, job_name: str | None, *, events: int = 10) -> dict[str, Any]:
    """The JSON of ``rollcall status``."""
    job = resolve_job(tx, job_name)
    snap = snapshot(tx, job.id)
    driver = driver_json(job, tx.jobs.driver_alive(job.id))
    recent = tx.events.list(job_id=job.id, limit=events) if events > 0 else []
    served = tx.events.list(job_id=job.id, kind="metrics.serving", limit=1)
    p = snap.job
    last = snap.steps[-1] if snap.steps else None
    return {
        "job": {
            "id": p.id,
            "name": p.name,
            "status": p.status,
            "running": snap.running,
            "driver": driver,
            "mode": snap.mode,
            "policy_version": p.policy_version,
            "weights_version": p.weights_version,
            "steps": p.steps,
            "total_steps": snap.total_steps,
            "pending_step": p.pending_step,
            "last_step_age_s": None if p.last_step_age_s is None else round(p.last_step_age_s, 3),
            "metrics_url": served[-1].payload.get("url") if served and snap.running else None,
        },
        "trainer": {
            "busy_ratio": None if snap.busy_ratio is None else round(snap.busy_ratio, 4),
            "last_step_seconds": None if last is None else round(step_seconds(last), 4),
            "last_step_samples": None if last is None else last.num_trajectories,
        },
        "tasks": [
            {
                "name": t.name,
                "plugin": t.plugin,
                "status": t.status,
                "weight": t.weight,
                "quota_share": round(t.quota_share, 4),
                "mix_share": None if t.mix_share is None else round(t.mix_share, 4),
                "mix_groups": t.mix_groups,
                "max_inflight": t.max_inflight,
                "inflight": t.inflight,
                "max_staleness": t.max_staleness,
                "ready_staleness": t.ready_staleness,
                "reward": t.reward,
                "episodes": t.episodes,
                "trained_samples": t.samples["consumed"],
                "counters": t.counters,
                "status_reason": t.status_reason,
                "paused": (
                    paused_sentence(t.name, p.name, t.status_reason)
                    if t.status_reason and t.status == "paused"
                    else None
                ),
            }
            for t in snap.tasks
        ],
        "user_errors": [
            {
                "count": u.count,
                "tasks": u.tasks,
                "error": u.head,
                "location": u.location,
                "last": u.last_message,
                "last_at": u.last_at.isoformat() if u.last_at else None,
            }
            for u in tx.monitoring.user_errors(job.id)
        ],
        "nodes": [node_json(n) for n in with_slots(snap.nodes, snap.slots)],
        "buffer": snap.depth(),
        "recent_events": [e.to_json() for e in recent],
    }


def workers(tx: Tx, job_name: str | None, *, all_incarnations: bool = False) -> dict[str, Any]:
    job = resolve_job(tx, job_name)
    if all_incarnations:
        rows = tx.monitoring.incarnations(job.id)
    else:
        rows = with_slots(tx.workers.health(job.id), tx.fleet.slots(job.id))
    out = []
    for r in rows:
        d = node_json(r)
        if all_incarnations:
            d["id"] = r["id"]
            d["started_at"] = r["started_at"].isoformat()
            d["stopped_at"] = r["stopped_at"].isoformat() if r["stopped_at"] else None
        out.append(d)
    return {"job": job.name, "workers": out}


def buffer_stats(tx: Tx, job_name: str | None) -> dict[str, Any]:
    job = resolve_job(tx, job_name)
    snap = snapshot(tx, job.id)
    tasks = []
    for t in snap.tasks:
        trained_groups = sum(t.trained_staleness.values())
        lag_sum = sum(k * v for k, v in t.trained_staleness.items())
        tasks.append(
            {
                "name": t.name,
                "status": t.status,
                "episodes": t.episodes,
                "samples": t.samples,
                "inflight": t.inflight,
                "max_inflight": t.max_inflight,
                "ready_staleness": t.ready_staleness,
                "ready_age_s": round(t.ready_age_s, 3),
                "max_staleness": t.max_staleness,
                "trained_staleness": {str(k): v for k, v in sorted(t.trained_staleness.items())},
                "trained_staleness_mean": (
                    round(lag_sum / trained_groups, 4) if trained_groups else None
                ),
                "counters": t.counters,
            }
        )
    steps = snap.job.policy_version
    storage = tx.trajectories.storage(job.id)
    compacted = tx.history.totals(job.id)
    storage |= {
        "compacted_through_step": compacted.through_step,
        "compacted_episodes": compacted.episodes,
        "compacted_trajectories": compacted.trajectories,
    }
    sizes = table_sizes(tx.session)
    return {
        "job": job.name,
        "policy_version": snap.job.policy_version,
        "total": snap.depth(),
        "tasks": tasks,
        "storage": {
            **storage,
            "tables": sizes,
            "database_bytes_per_step": round(sizes["database"] / steps) if steps else None,
        },
    }


_DURATION_RE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(value: str, now: datetime) -> datetime:
    """``--since``: a duration back from ``now`` (``90s``, ``15m``, ``2h``, ``1d``) or an ISO
    8601 time (``2026-01-31T12:00:00+00:00``; without a zone, UTC)."""
    m = _DURATION_RE.match(value.strip())
    if m:
        back = float(m[1]) * _UNIT_S[m[2]]
        if back > bounds.SINCE_MAX_S:
            raise UserError(f"--since {value!r} reaches back more than a century; pass e.g. 2h")
        return now - timedelta(seconds=back)
    try:
        at = datetime.fromisoformat(value.strip())
    except ValueError:
        raise UserError(
            f"--since {value!r} is neither a duration nor a time; pass e.g. --since 15m, "
            "--since 2h or --since 2026-01-31T12:00:00"
        ) from None
    return at if at.tzinfo is not None else at.replace(tzinfo=now.tzinfo)


def list_events(
    tx: Tx,
    job_name: str | None,
    *,
    since: str | None = None,
    kind: str | None = None,
    limit: int = 100,
) -> list[dict[str, Any]]:
    """Events, oldest first: of one job (or every job), from ``since``, of one ``kind`` (or
    every kind under a prefix ending in a dot, e.g. ``task.``)."""
    bounds.EVENTS_LIMIT.check("--limit", limit)
    at = parse_since(since, tx.workers.db_now()) if since else None
    job_id = require_job(tx, job_name).id if job_name is not None else None
    return [e.to_json() for e in tx.events.list(job_id=job_id, kind=kind, since=at, limit=limit)]
