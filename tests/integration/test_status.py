"""``rollcall status``, ``worker list``, ``buffer stats`` and ``events`` against a buffer in a
known state (built with the buffer's own operations), and the drills' ``--yes`` guard.

``STATUS_SCHEMA`` is the contract of ``status --json``: exact keys and types. Its values are
checked against the state the test built and against direct SQL."""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa

from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.domain import WorkerRole, WorkerStatus
from tests.integration.buffer_helpers import add_tasks, finish, make_buffer, rows, scalar

NUM = (int, float)
OPT_NUM = (int, float, type(None))
OPT_INT = (int, type(None))
OPT_STR = (str, type(None))
STATES = ("queued", "leased", "ready", "claimed", "consumed", "expired", "quarantined")
COUNTERS = ("fenced_rejections", "expired_groups", "quarantined_episodes", "requeued_leases")

STATUS_SCHEMA: dict[str, Any] = {
    "job": {
        "id": int,
        "name": str,
        "status": str,
        "running": bool,
        "driver": {
            "alive": bool,
            "epoch": int,
            "pid": OPT_INT,
            "host": OPT_STR,
            "started_at": OPT_STR,
        },
        "mode": OPT_STR,
        "policy_version": int,
        "weights_version": OPT_INT,
        "steps": int,
        "total_steps": OPT_INT,
        "pending_step": OPT_INT,
        "last_step_age_s": OPT_NUM,
        "metrics_url": OPT_STR,
    },
    "trainer": {"busy_ratio": OPT_NUM, "last_step_seconds": OPT_NUM, "last_step_samples": OPT_INT},
    "tasks": [
        {
            "name": str,
            "plugin": str,
            "status": str,
            "weight": NUM,
            "quota_share": NUM,
            "mix_share": OPT_NUM,
            "mix_groups": int,
            "max_inflight": int,
            "inflight": int,
            "max_staleness": int,
            "ready_staleness": int,
            "reward": OPT_NUM,
            "episodes": dict.fromkeys(STATES, int),
            "trained_samples": int,
            "counters": dict.fromkeys(COUNTERS, int),
            "status_reason": OPT_STR,
            "paused": OPT_STR,
        }
    ],
    "user_errors": [
        {
            "count": int,
            "tasks": [str],
            "error": str,
            "location": str,
            "last": str,
            "last_at": OPT_STR,
        }
    ],
    "nodes": [
        {
            "name": str,
            "role": str,
            "status": str,
            "incarnation": int,
            "restarts": int,
            "host": OPT_STR,
            "pid": OPT_INT,
            "node_id": OPT_STR,
            "loaded_version": OPT_INT,
            # None for a rollout slot that has no incarnation yet (waiting for a machine)
            "heartbeat_age_s": (int, float, type(None)),
            "progress_age_s": (int, float, type(None)),
            "tokens_generated": int,
            # a rollout slot as the supervisor sees it (None for a trainer rank, or a rollout
            # node no supervisor ran)
            "slot": OPT_STR,
            "slot_reason": OPT_STR,
            "slot_age_s": (float, int, type(None)),
            "budget_restarts": OPT_INT,
            "max_restarts": OPT_INT,
            "machine_losses": OPT_INT,
        }
    ],
    "buffer": dict.fromkeys(STATES, int),
    "recent_events": [
        {
            "id": int,
            "kind": str,
            "actor": str,
            "message": str,
            "job_id": OPT_INT,
            "task_id": OPT_INT,
            "payload": dict,
            "created_at": str,
        }
    ],
}


def check_shape(value: Any, schema: Any, path: str = "$") -> None:
    """``value`` has exactly the keys of ``schema`` (recursively) with values of its types."""
    if isinstance(schema, dict):
        assert isinstance(value, dict), path
        assert set(value) == set(schema), f"{path}: {sorted(set(value) ^ set(schema))}"
        for k, sub in schema.items():
            check_shape(value[k], sub, f"{path}.{k}")
    elif isinstance(schema, list):
        assert isinstance(value, list), path
        for i, item in enumerate(value):
            check_shape(item, schema[0], f"{path}[{i}]")
    else:
        types = schema if isinstance(schema, tuple) else (schema,)
        assert isinstance(value, types) and not (isinstance(value, bool) and bool not in types), (
            f"{path}: {value!r} is not {types}"
        )


def _state(db: Database) -> dict[str, int]:
    """Tasks a (weight 2) and b (weight 1), groups of 2; one step trained on 2 groups; one
    episode of a left in flight; a second incarnation of rollout-0; a trainer rank."""
    ids = add_tasks(
        db,
        {"name": "a", "weight": 2, "max_inflight": 4, "max_staleness": 1},
        {"name": "b", "weight": 1, "max_inflight": 2, "max_staleness": 1},
    )
    buf = make_buffer(db, batch_groups=2)
    buf.seed()
    old = buf.register_worker("rollout-0", host="h1", pid=10, node_id="n" * 20)
    buf.requeue_worker(old.id, WorkerStatus.DEAD)
    buf.event("worker.restarting", "rollout-0 down (test); restart 1/5", {"slot": "rollout-0"})
    w = buf.register_worker("rollout-0", host="h1", pid=11, node_id="n" * 20)
    buf.register_worker("trainer-0", role=WorkerRole.TRAINER)
    for _ in range(3):  # three groups finished (whichever tasks the fair claim picks)
        c = buf.claim(w.id)
        assert c is not None
        finish(buf, c, version=0)
    assert len(buf.claim_batch(0, min_groups=2).groups) == 2
    buf.commit_step(
        0, metrics={"plan_s": 0.5, "train_s": 2.0, "checkpoint_s": 0.25, "publish_s": 0.25}
    )
    inflight = buf.claim(w.id)  # left in flight
    assert inflight is not None
    buf.beat(w.id, tokens_generated=40, loaded_version=1)
    return ids


def test_status_json_schema_and_values(cli: Any, db: Database, engine: sa.Engine) -> None:
    _state(db)
    r = cli("job", "create", "idle")  # created before any activity below: not the default pick
    assert r.code == 0
    with engine.begin() as conn:  # activity of job default after idle's creation
        conn.execute(sa.text("UPDATE workers SET last_heartbeat_at = now()"))
    r = cli("status", "--json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    check_shape(doc, STATUS_SCHEMA)
    assert doc["job"]["name"] == "default"  # the most recently active job
    assert doc["job"]["policy_version"] == doc["job"]["steps"] == 1
    assert doc["job"]["running"] is True  # rollout-0 beat just now
    assert doc["trainer"]["last_step_seconds"] == 3.0  # plan + train + checkpoint + publish
    assert doc["trainer"]["last_step_samples"] == 4
    tasks = {t["name"]: t for t in doc["tasks"]}
    assert set(tasks) == {"a", "b"}
    assert (tasks["a"]["quota_share"], tasks["b"]["quota_share"]) == (0.6667, 0.3333)
    # the step's task mix, as recorded by the batch claim
    mix = rows(engine, "SELECT task_mix FROM train_steps")[0][0]
    groups = {v["name"]: v["groups"] for v in mix.values()}
    assert sum(groups.values()) == 2
    for name in ("a", "b"):
        assert tasks[name]["mix_groups"] == groups[name]
        assert tasks[name]["mix_share"] == round(groups[name] / 2, 4)
        assert tasks[name]["trained_samples"] == 2 * groups[name]
    # buffer depth and in-flight counts equal the database's own counts
    by_sql = dict(
        rows(
            engine,
            """SELECT CASE WHEN status = 'done' AND consumed_step IS NOT NULL THEN 'consumed'
                           WHEN status = 'done' THEN 'ready' ELSE status::text END, count(*)
               FROM episodes GROUP BY 1""",
        )
    )
    assert doc["buffer"] == {s: by_sql.get(s, 0) for s in STATES}
    assert doc["buffer"]["leased"] == 1 and doc["buffer"]["consumed"] == 2
    assert sum(t["inflight"] for t in doc["tasks"]) == 1
    for t in doc["tasks"]:
        assert sum(t["episodes"].values()) == scalar(
            engine,
            "SELECT count(*) FROM episodes e JOIN tasks t ON t.id = e.task_id WHERE t.name = :n",
            n=t["name"],
        )
    nodes = {n["name"]: n for n in doc["nodes"]}
    assert set(nodes) == {"rollout-0", "trainer-0"}
    r0 = nodes["rollout-0"]
    assert (r0["incarnation"], r0["restarts"], r0["pid"], r0["status"]) == (1, 1, 11, "alive")
    assert (r0["loaded_version"], r0["tokens_generated"]) == (1, 40)
    assert 0 <= r0["heartbeat_age_s"] < 5
    last_ids = [i for (i,) in rows(engine, "SELECT id FROM events WHERE job_id = 1 ORDER BY id")]
    assert [e["id"] for e in doc["recent_events"]] == last_ids[-10:]
    assert "worker.restarting" in [e["kind"] for e in doc["recent_events"]]

    # the same, for people
    r = cli("status", "--job", "default")
    assert r.code == 0, r.err
    for text in ("job default", "rollout-0", "trainer-0", "67%", "leased 1"):
        assert text in r.out, text
    # --watch: one JSON object per refresh
    r = cli("status", "--job", "default", "--watch", "--json", "--interval", "0.1", "--count", "2")
    lines = r.out.strip().splitlines()
    assert r.code == 0 and len(lines) == 2
    check_shape(json.loads(lines[1]), STATUS_SCHEMA)
    # an unknown job: one line, exit 3
    r = cli("status", "--job", "nope")
    assert r.code == 3 and "job 'nope' does not exist" in r.err


def test_worker_list_and_buffer_stats(cli: Any, db: Database, engine: sa.Engine) -> None:
    _state(db)
    r = cli("worker", "list", "--job", "default", "--json")
    assert r.code == 0, r.err
    workers = json.loads(r.out)["workers"]
    assert [(w["name"], w["incarnation"]) for w in workers] == [("rollout-0", 1), ("trainer-0", 0)]
    r = cli("worker", "list", "--job", "default", "--all", "--json")
    every = json.loads(r.out)["workers"]
    assert [(w["name"], w["incarnation"], w["status"]) for w in every] == [
        ("rollout-0", 0, "dead"),
        ("rollout-0", 1, "alive"),
        ("trainer-0", 0, "alive"),
    ]
    assert every[0]["stopped_at"] is not None and every[1]["stopped_at"] is None
    r = cli("worker", "list", "--job", "default")
    assert r.code == 0 and "rollout-0" in r.out and "h1" in r.out

    r = cli("buffer", "stats", "--job", "default", "--json")
    assert r.code == 0, r.err
    stats = json.loads(r.out)
    assert stats["policy_version"] == 1
    assert stats["total"]["consumed"] == 2 and stats["total"]["leased"] == 1
    trained = {t["name"]: t["trained_staleness"] for t in stats["tasks"]}
    # both trained groups were generated by version 0 and consumed by step 0: staleness 0
    assert sum(sum(h.values()) for h in trained.values()) == 2
    assert all(set(h) <= {"0"} for h in trained.values())
    ready = [t for t in stats["tasks"] if t["episodes"]["ready"]]
    assert len(ready) == 1  # the third finished group waits, one version behind now
    assert ready[0]["ready_staleness"] == 1 and ready[0]["ready_age_s"] >= 0
    for t in stats["tasks"]:
        samples = scalar(
            engine,
            "SELECT coalesce(sum(group_size), 0) FROM episodes e JOIN tasks t "
            "ON t.id = e.task_id WHERE t.name = :n",
            n=t["name"],
        )
        assert sum(t["samples"].values()) == samples
    r = cli("buffer", "stats", "--job", "default")
    assert r.code == 0 and "total" in r.out


def test_events_filters(cli: Any, db: Database) -> None:
    _state(db)
    r = cli("events", "--job", "default", "--kind", "task.registered", "--json")
    assert r.code == 0, r.err
    assert [e["kind"] for e in json.loads(r.out)] == ["task.registered", "task.registered"]
    r = cli("events", "--kind", "worker.", "--json")
    kinds = {e["kind"] for e in json.loads(r.out)}
    assert kinds == {"worker.restarting"}
    everything = json.loads(cli("events", "--json").out)
    assert [e["kind"] for e in everything] == [
        "task.registered",
        "task.registered",
        "worker.restarting",
    ]
    assert json.loads(cli("events", "--since", "1h", "--json").out) == everything
    assert json.loads(cli("events", "--since", "2999-01-01T00:00:00", "--json").out) == []
    assert len(json.loads(cli("events", "--limit", "1", "--json").out)) == 1
    r = cli("events")
    assert r.code == 0 and "task.registered" in r.out
    r = cli("events", "--since", "yesterday")
    assert r.code == 2 and "--since 'yesterday'" in r.err
