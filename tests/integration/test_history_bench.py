"""A smoke run of ``ops/bench/history.py``: a day-long job synthesized as metadata retention
leaves it (at 60 steps an hour) and a fresh one, the retention passes over the older full
hour, and every timed operation run on both. It checks that the synthetic history is
consistent (status counts every step and trained sample, compacted ones included, and every
invariant holds: ``Ops.invariants`` asserts it); it asserts no timings."""

from __future__ import annotations

import os

from ops.bench.history import OPERATIONS, Ops, Shape, compare, synthesize
from rollcall.orchestrator.services.status import status_document
from tests.conftest import TEMPLATE_DB, PgServer


def test_a_synthetic_aged_job_reads_whole_and_every_operation_runs(
    pg: PgServer, db_url: str
) -> None:
    fresh_name = f"t_hist_fresh_{os.getpid()}"
    fresh_url = pg.create_database(fresh_name, template=TEMPLATE_DB)
    shape = Shape(steps_per_hour=60, samples_per_step=16, group_size=8)
    ops: list[Ops] = []
    try:
        aged = synthesize(db_url, 24, shape, compacted=True, keep_steps=30)
        fresh = synthesize(fresh_url, 1, shape, compacted=False)
        # 1,440 steps: all but the last 2 hours as totals, of those the older hour compacted
        # by the function (the hour's guard keeps the last, 60 steps, more than the 30 the
        # window keeps), in passes of at most 50 steps
        assert aged["steps"] == 1440 and aged["compaction"]["passes"] >= 2
        assert aged["compaction"]["episodes"] >= 60 * shape.groups
        assert aged["live_episodes"] < 2 * 60 * shape.groups + 200
        ops = [Ops(db_url, aged["job_id"]), Ops(fresh_url, fresh["job_id"])]
        with ops[0].db.transaction() as tx:
            doc = status_document(tx, "history")
        assert doc["job"]["steps"] == 1440
        assert sum(t["trained_samples"] for t in doc["tasks"]) == 1440 * 16
        assert doc["buffer"]["consumed"] == 1440 * shape.groups
        result = compare(ops[0], ops[1], 3, tuple(o for o in OPERATIONS if o != "upgrade"))
        assert set(result) == set(OPERATIONS) - {"upgrade"}
        assert all(r["aged_ms"] > 0 and r["ratio"] > 0 for r in result.values())
    finally:
        for o in ops:
            o.close()
        pg.drop_database(fresh_name)
