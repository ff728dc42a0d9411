"""The per-turn and per-beat writes pay for no index that no reader uses (issue 59): a
heartbeat's lease renewal (``EpisodeRepository.renew``: ``SET lease_expires_at``) changes no
column any index of ``episodes`` covers, so PostgreSQL updates the row in place (a HOT update)
instead of adding an entry to each of the table's indexes for every lease at every beat."""

from __future__ import annotations

import re

import sqlalchemy as sa

from rollcall.orchestrator.db.engine import Database
from tests.integration.buffer_helpers import add_tasks, make_buffer


def test_a_lease_renewal_changes_no_indexed_column(db: Database, engine: sa.Engine) -> None:
    with engine.connect() as conn:
        defs = (
            conn.execute(
                sa.text(
                    "SELECT pg_get_indexdef(indexrelid) FROM pg_index "
                    "WHERE indrelid = 'episodes'::regclass"
                )
            )
            .scalars()
            .all()
        )
    assert defs  # the table's indexes were read
    covering = [d for d in defs if re.search(r"\blease_expires_at\b", d)]
    assert covering == [], covering
    # ... and the renewal still works: the leases a worker holds are renewed and listed.
    add_tasks(db, {"name": "a", "group_size": 1})
    buf = make_buffer(db, batch_groups=2)
    buf.seed()
    worker = buf.register_worker("r0").id
    c = buf.claim(worker)
    assert c is not None
    alive, leases = buf.beat(worker)
    assert alive and leases == [(c.lease.episode_id, c.lease.epoch)]
