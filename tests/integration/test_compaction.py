"""Metadata retention (``buffer.metadata_retention_steps``, ``rollcall_compact_steps``): the
rows of old steps are compacted into totals, and what operators and the checker read is
unchanged: ``rollcall status``, the Prometheus metrics, the buffer's depth and the invariant
checker give the same answers before and after; a row an invariant flags is never compacted.
(The runtime role's use of the function, and its lack of DELETE on the tables, are in
test_db_roles.py.)"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rollcall.orchestrator.buffer.invariants import check_invariants
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.runner.metrics import MetricsExporter
from rollcall.orchestrator.services.status import status_document
from tests.integration.buffer_helpers import (
    Buffers,
    add_tasks,
    drain_queue,
    make_buffer,
    scalar,
)

# what moves with the clock, not with the job: left out of the comparison
_CLOCK = ("age_s", "age_seconds", "timestamp", "at")


def _steady(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _steady(x) for k, x in v.items() if not k.endswith(_CLOCK)}
    if isinstance(v, list):
        return [_steady(x) for x in v]
    return v


def picture(db: Database, job_id: int = 1, job_name: str = "default") -> dict[str, Any]:
    """What operators and the checker see of a job: ``rollcall status --json``, every metric
    sample, the buffer's depth and the invariant report, without the clock's values."""
    with db.transaction() as tx:
        status = status_document(tx, job_name)
        depth = tx.episodes.depth(job_id)
    exporter = MetricsExporter(db, job_id, job_name)
    exporter.refresh()
    samples = sorted(
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for fam in text_string_to_metric_families(generate_latest(exporter.registry).decode())
        for s in fam.samples
        if not s.name.endswith(_CLOCK) and "collect" not in s.name
    )
    report = check_invariants(db, job_id)
    return {
        "status": _steady(status),
        "metrics": samples,
        "depth": depth,
        "invariants": report.violations,
    }


def _history(db: Database, steps: int) -> Buffers:
    """A job of two tasks trained ``steps`` steps: a tight one whose groups generated a version
    behind expire (their prompts queued again), a loose one, and an episode quarantined."""
    add_tasks(
        db,
        {"name": "tight", "max_staleness": 0, "group_size": 1},
        {"name": "loose", "max_staleness": 2, "group_size": 2},
    )
    buf = make_buffer(db, batch_groups=2, max_attempts=1, metadata_retention_steps=2)
    w = buf.register_worker("rollout-0")
    buf.seed()
    c = buf.claim(w.id)
    assert c is not None
    buf.release(c.lease, "the rollout failed")  # one attempt allowed: quarantined
    for step in range(steps):
        buf.seed()
        drain_queue(buf, w.id, version=max(0, step - 1))  # some data a version behind
        buf.expire_stale()
        if not buf.claim_batch(step).groups:
            drain_queue(buf, w.id, version=step)
            assert buf.claim_batch(step).groups
        buf.commit_step(step, metrics={"reward/tight": 1.0, "train_s": 0.5})
    return buf


def test_a_compacted_job_reads_the_same_and_keeps_its_totals(
    db: Database, engine: sa.Engine
) -> None:
    buf = _history(db, steps=8)
    assert scalar(engine, "SELECT count(*) FROM episodes WHERE status = 'expired'") > 0
    assert scalar(engine, "SELECT count(*) FROM episodes WHERE status = 'quarantined'") == 1
    before = picture(db)
    assert not any(before["invariants"].values())
    rows_before = scalar(engine, "SELECT count(*) FROM episodes")
    # the hour's guard holds everything back; without it, steps 0..5 go (2 kept)
    assert buf.compact_metadata() == 0
    gone = buf.compact_metadata(min_age_s=0)
    assert gone > 0 and scalar(engine, "SELECT count(*) FROM episodes") == rows_before - gone
    assert scalar(engine, "SELECT through_step FROM compacted_steps") == 5
    assert scalar(engine, "SELECT count(*) FROM episodes WHERE consumed_step <= 5") == 0
    # quarantined episodes stay, for inspection
    assert scalar(engine, "SELECT count(*) FROM episodes WHERE status = 'quarantined'") == 1
    assert (
        scalar(
            engine,
            "SELECT count(*) FROM trajectories tr LEFT JOIN episodes e ON e.id = tr.episode_id "
            "WHERE e.id IS NULL",
        )
        == 0
    )
    assert picture(db) == before
    assert buf.compact_metadata(min_age_s=0) == 0  # nothing new to compact
    # the job goes on: new steps, compacted as they age, and the checker still agrees
    w = buf.register_worker("rollout-1")
    for step in range(8, 12):
        buf.seed()
        drain_queue(buf, w.id, version=step)
        assert buf.claim_batch(step).groups
        buf.commit_step(step)
        buf.compact_metadata(min_age_s=0)
    assert scalar(engine, "SELECT through_step FROM compacted_steps") == 9
    later = picture(db)
    assert not any(later["invariants"].values())
    assert later["status"]["job"]["steps"] == 12


def test_a_row_an_invariant_flags_is_never_compacted(db: Database, engine: sa.Engine) -> None:
    buf = _history(db, steps=6)
    # step 1 trained a group one of whose samples reads as not consumed: the episode_state and
    # trained_once checks flag it
    bad = scalar(engine, "SELECT min(id) FROM episodes WHERE consumed_step = 1")
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE trajectories SET status = 'claimed' WHERE episode_id = :e "
                "AND sample_index = 0"
            ),
            {"e": bad},
        )
    flagged = check_invariants(db, 1).violations
    assert flagged["episode_state"] and flagged["trained_once"]
    assert buf.compact_metadata(min_age_s=0) > 0
    assert scalar(engine, "SELECT count(*) FROM episodes WHERE consumed_step <= 3") == 1
    assert check_invariants(db, 1).violations == flagged
