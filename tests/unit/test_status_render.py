"""``rollcall status``, ``worker list``, ``buffer stats`` and ``events`` stay readable in an
80-column terminal: no line is wider than 80 columns and each table row is one line (a
worker's name and status, a task's name and reward, an event's time and kind share a line).

The documents have the shape of ``rollcall.orchestrator.services.status`` (tests/integration/
test_status.py checks that shape against a real database) with realistic, long-ish values: a
job mid-run with three tasks, rollout nodes and trainer ranks on named hosts, a restart, the
metrics URL and a page of events."""

from __future__ import annotations

import io
from typing import Any

from rich.cells import cell_len
from rich.console import Console

from rollcall.orchestrator.cli import status as cli_status

WIDTH = 80
STATES = ("queued", "leased", "ready", "claimed", "consumed", "expired", "quarantined")
COUNTERS = ("fenced_rejections", "expired_groups", "quarantined_episodes", "requeued_leases")
NODE_ID = "3f9a1c2b7d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4"


def render(renderable: Any) -> list[str]:
    """Lines as the CLI's console (``rollcall.orchestrator.cli.common.console``) prints them."""
    out = Console(file=io.StringIO(), width=WIDTH, record=True, highlight=False, soft_wrap=True)
    out.print(renderable)
    return out.export_text().splitlines()


def check_width(lines: list[str]) -> None:
    wide = [line for line in lines if cell_len(line) > WIDTH]
    assert not wide, "wider than 80 columns:\n" + "\n".join(wide)


def line_with(lines: list[str], *texts: str) -> str:
    """The one line that holds every text: the row was not wrapped."""
    found = [line for line in lines if all(t in line for t in texts)]
    assert found, f"no line holds all of {texts}:\n" + "\n".join(lines)
    return found[0]


def episodes(**n: int) -> dict[str, int]:
    return {s: n.get(s, 0) for s in STATES}


def counters(**n: int) -> dict[str, int]:
    return {c: n.get(c, 0) for c in COUNTERS}


def node(
    name: str, role: str, status: str, host: str, *, restarts: int = 0, version: int | None = 12
) -> dict[str, Any]:
    return {
        "name": name,
        "role": role,
        "status": status,
        "incarnation": restarts,
        "restarts": restarts,
        "host": host,
        "pid": 48213,
        "node_id": NODE_ID,
        "loaded_version": version,
        "heartbeat_age_s": 1.234,
        "progress_age_s": 0.512 if role == "rollout" else 95.0,
        "tokens_generated": 1_234_567,
    }


NODES = [
    node("rollout-0", "rollout", "alive", "gpu-node-17.cluster.internal", restarts=2),
    node("rollout-1", "rollout", "starting", "gpu-node-18.cluster.internal", version=None),
    node("rollout-12", "rollout", "alive", "gpu-node-23.cluster.internal"),
    node("trainer-0", "trainer", "alive", "gpu-node-01.cluster.internal"),
    node("trainer-7", "trainer", "alive", "gpu-node-02.cluster.internal"),
]


def event(i: int, kind: str, actor: str, message: str) -> dict[str, Any]:
    return {
        "id": i,
        "kind": kind,
        "actor": actor,
        "message": message,
        "job_id": 1,
        "task_id": None,
        "payload": {},
        "created_at": f"2026-12-02T15:{i:02d}:07.123456+00:00",
    }


EVENTS = [
    event(
        1,
        "task.registered",
        "operator:alice",
        "task 'calculator' registered with plugin 'calculator'",
    ),
    event(
        2,
        "job.driver_started",
        "driver",
        "driver started (pid 48213 on gpu-node-01.cluster.internal, driver epoch 3, resuming)",
    ),
    event(
        3,
        "metrics.serving",
        "driver",
        "metrics served at http://gpu-node-01.cluster.internal:9464/metrics",
    ),
    event(
        4,
        "worker.restarting",
        "driver",
        "rollout-1 down (ActorDiedError: the actor died unexpectedly); restart 3/5 in 4.0 s",
    ),
    event(5, "task.quota_changed", "operator:alice", "task 'retrieval-multihop' weight 1 -> 2.5"),
]


def task(
    name: str, status: str, weight: float, reward: float | None, **extra: Any
) -> dict[str, Any]:
    return {
        "name": name,
        "plugin": name.split("-")[0],
        "status": status,
        "weight": weight,
        "quota_share": 0.4545,
        "mix_share": 0.5,
        "mix_groups": 40,
        "max_inflight": 128,
        "inflight": 96,
        "max_staleness": 4,
        "ready_staleness": 2,
        "reward": reward,
        "episodes": episodes(queued=1200, leased=96, ready=64, consumed=10240, expired=17),
        "trained_samples": 81920,
        "counters": counters(expired_groups=17, quarantined_episodes=3, fenced_rejections=5),
        **extra,
    }


TASKS = [
    task("calculator", "active", 1.0, 0.8125),
    task("retrieval-multihop", "draining", 2.5, -0.25),
    task("guess", "paused", 0.5, None),
]


def status_doc() -> dict[str, Any]:
    return {
        "job": {
            "id": 1,
            "name": "smollm2-vllm",
            "status": "running",
            "running": True,
            "driver": {
                "alive": False,
                "epoch": 3,
                "pid": 48213,
                "host": "gpu-node-01.cluster.internal",
                "started_at": "2026-12-02T15:00:00+00:00",
            },
            "mode": "ray-cluster",
            "policy_version": 1234,
            "weights_version": 1233,
            "steps": 1234,
            "total_steps": 10000,
            "pending_step": 1234,
            "last_step_age_s": 3456.0,
            "metrics_url": "http://gpu-node-01.cluster.internal:9464/metrics",
        },
        "trainer": {"busy_ratio": 0.8432, "last_step_seconds": 12.5, "last_step_samples": 512},
        "tasks": TASKS,
        "nodes": NODES,
        "buffer": episodes(queued=3600, leased=288, ready=192, consumed=30720, expired=51),
        "recent_events": EVENTS,
    }


def test_status_fits_80_columns_one_line_per_row() -> None:
    lines = render(cli_status.render_status(status_doc()))
    check_width(lines)
    line_with(lines, "smollm2-vllm", "running")
    line_with(lines, "1234/10000")
    for t in TASKS:
        reward = "-" if t["reward"] is None else f"{t['reward']:.3f}"
        # a name too long for its column is cut with an ellipsis, on the row's line
        line_with(lines, t["name"][:14], t["status"], reward, "96/128")
    for n in NODES:
        line_with(lines, n["name"], n["status"])
    for e in EVENTS:
        line_with(lines, e["created_at"][11:19], e["kind"], e["message"][:20])
    line_with(lines, "queued 3600", "leased 288")
    line_with(lines, "quarantined 0")


def test_worker_list_fits_80_columns_one_line_per_row() -> None:
    for incarnations in (False, True):
        rows = [
            {
                **n,
                "id": 100 + i,
                "started_at": "2026-12-02T15:00:00.123456+00:00",
                "stopped_at": None,
            }
            for i, n in enumerate(NODES)
        ]
        doc = {"job": "smollm2-vllm", "workers": rows}
        lines = render(cli_status.render_workers(doc, incarnations=incarnations))
        check_width(lines)
        for n in rows:
            row = line_with(lines, n["name"], n["status"], n["host"][:8])
            if incarnations:
                assert str(n["id"]) in row


def test_buffer_stats_fit_80_columns_one_line_per_row() -> None:
    doc: dict[str, Any] = {
        "job": "smollm2-vllm",
        "policy_version": 1234,
        "total": episodes(queued=3600, leased=288, ready=192, consumed=30720, expired=51),
        "tasks": [
            {
                "name": t["name"],
                "status": t["status"],
                "episodes": t["episodes"],
                "samples": {s: 8 * v for s, v in t["episodes"].items()},
                "inflight": t["inflight"],
                "max_inflight": t["max_inflight"],
                "ready_staleness": 2,
                "ready_age_s": 3456.0,
                "max_staleness": 4,
                "trained_staleness": {"0": 900, "1": 300, "2": 80},
                "trained_staleness_mean": 0.3594,
                "counters": t["counters"],
            }
            for t in TASKS
        ],
        "storage": {
            "segments": 9_876_543,
            "payload_bytes": 123_456_789_012,
            "trajectories": 245_760,
            "payloads_dropped": 233_472,
            "tables": {
                "trajectory_segments": 130_000_000_000,
                "trajectories": 400_000_000,
                "episodes": 20_000_000,
                "database": 131_000_000_000,
            },
            "database_bytes_per_step": 106_158_833,
        },
    }
    lines = render(cli_status.render_buffer(doc))
    check_width(lines)
    line_with(lines, "245760 trajectories", "233472 payloads dropped")
    line_with(lines, "9876543 segments", "123.5 GB", "database 131.0 GB", "106.2 MB per step")
    line_with(lines, "trajectory_segments", "130.0 GB")
    for t in doc["tasks"]:  # episodes by state, then in flight, staleness and counters
        line_with(lines, t["name"][:14], "1200", "96", "64", "10240", "17")
        line_with(lines, t["name"][:14], "96/128", "2 versions, 58m", "0.36 (bound 4)")
    line_with(lines, "total", "3600", "30720")


def test_events_fit_80_columns_one_line_per_row() -> None:
    lines = render(cli_status.render_events(EVENTS))
    check_width(lines)
    for e in EVENTS:
        line_with(lines, e["created_at"][11:19], e["kind"], e["actor"], e["message"][:15])
