"""Cheaper per-turn writes: a checkpoint's journal entries are inserted after deleting the
stored ones they replace (no speculative insertion, and its confirmation record, per entry), and a
trajectory segment stays in its heap page up to 8 KB (``toast_tuple_target``; its columns keep
``STORAGE EXTERNAL``: no compression), so a turn's tokens no longer cost TOAST rows and TOAST
index entries. The function's current definition: orchestrator/db/schema.sql.

And a heartbeat's lease renewal no longer writes every index of ``episodes``: the partial index
on ``lease_expires_at`` goes (its one reader, the sweep of expired leases, compares
``GREATEST(lease_expires_at, ...)``, which no index on the column serves; it finds the leased
episodes by ``ix_episodes_job_id_status``), so the renewal changes no indexed column and is a
HOT update. In the 4 x 64 pipeline, renewals were 11,000 of 11,500 updates of ``episodes``, none
of them HOT, each adding an entry to the table's nine indexes.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-08
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_JOURNAL = """
            INSERT INTO agent_journal AS j (
                task_id, episode_id, sample_index, seq, lease_epoch, entry
            )
            SELECT ep.task_id, p_episode, p_sample, p_journal_start + c.i::integer - 1, p_epoch,
                   c.entry
            FROM jsonb_array_elements(p_journal) WITH ORDINALITY AS c(entry, i)
            ON CONFLICT (task_id, episode_id, sample_index, seq) DO UPDATE SET
                lease_epoch = excluded.lease_epoch, entry = excluded.entry;
"""
NEW_JOURNAL = """
            DELETE FROM agent_journal j
            WHERE j.task_id = ep.task_id AND j.episode_id = p_episode
              AND j.sample_index = p_sample AND j.seq >= p_journal_start;
            INSERT INTO agent_journal (task_id, episode_id, sample_index, seq, lease_epoch, entry)
            SELECT ep.task_id, p_episode, p_sample, p_journal_start + c.i::integer - 1, p_epoch,
                   c.entry
            FROM jsonb_array_elements(p_journal) WITH ORDINALITY AS c(entry, i);
"""


def _migration(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(name))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_fn(journal: str) -> str:
    old: str = _migration("0008_agent_journal.py").WRITE_FN
    assert OLD_JOURNAL in old
    return old.replace(OLD_JOURNAL, journal).replace(
        "CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1
    )


def upgrade() -> None:
    op.execute(_write_fn(NEW_JOURNAL))
    op.execute("ALTER TABLE trajectory_segments SET (toast_tuple_target = 8160)")
    op.execute("DROP INDEX ix_episodes_lease_expires_at")
    op.execute("ALTER TABLE episodes SET (fillfactor = 80)")  # room for those updates


def downgrade() -> None:
    op.execute("ALTER TABLE episodes RESET (fillfactor)")
    op.execute(
        "CREATE INDEX ix_episodes_lease_expires_at ON episodes (lease_expires_at) "
        "WHERE status = 'leased'"
    )
    op.execute("ALTER TABLE trajectory_segments RESET (toast_tuple_target)")
    op.execute(_write_fn(OLD_JOURNAL))
