"""Migrations on a real PostgreSQL: upgrade, drift check, round trip, head verification."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from rollcall.orchestrator.db import migrate
from rollcall.orchestrator.db.engine import open_database
from rollcall.orchestrator.errors import SchemaError

TABLES = {"jobs", "tasks", "workers", "episodes", "trajectories", "train_steps", "events"}


def _tables(conn: sa.Connection) -> set[str]:
    return set(sa.inspect(conn).get_table_names())


def test_upgrade_drift_downgrade_upgrade(empty_db_url: str) -> None:
    engine = sa.create_engine(empty_db_url, poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        assert migrate.current_revision(conn) is None
        migrate.upgrade(conn)
        conn.commit()
        assert migrate.schema_state(conn).at_head
        assert _tables(conn) >= TABLES
        assert migrate.drift(conn) == []
        kind = conn.scalar(sa.text("SELECT relkind FROM pg_class WHERE relname = 'trajectories'"))
        assert kind == "p"  # partitioned table
        assert conn.scalar(sa.text("SELECT name FROM jobs")) == "default"

        # A task partition (and a detached one) must not break the round trip.
        conn.execute(
            sa.text(
                "INSERT INTO tasks (job_id, name, plugin, weight, max_inflight, max_staleness) VALUES (1, 'a', 'echo', 1, 1, 0), (1, 'b', 'echo', 1, 1, 0)"
            )
        )
        conn.execute(
            sa.text("SELECT rollcall_attach_task_partition(1), rollcall_attach_task_partition(2)")
        )
        conn.execute(sa.text("SELECT rollcall_detach_task_partition(2)"))
        conn.commit()
        assert migrate.drift(conn) == []

        migrate.downgrade(conn, "base")
        conn.commit()
        assert migrate.current_revision(conn) is None
        assert _tables(conn) & (TABLES | {"trajectories_t1", "trajectories_t2"}) == set()
        types = conn.scalars(
            sa.text(
                "SELECT t.typname FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace "
                "WHERE n.nspname = 'public' AND t.typtype = 'e'"
            )
        ).all()
        assert types == []
        fns = conn.scalars(
            sa.text("SELECT proname FROM pg_proc WHERE proname LIKE 'rollcall_%'")
        ).all()
        assert fns == []

        migrate.upgrade(conn)
        conn.commit()
        assert migrate.schema_state(conn).at_head
        assert migrate.drift(conn) == []
    engine.dispose()


def test_drift_is_detected(db_url: str) -> None:
    engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        conn.execute(sa.text("ALTER TABLE events DROP COLUMN message"))
        conn.execute(sa.text("ALTER TABLE jobs ADD COLUMN extra integer"))
        conn.commit()
        diffs = migrate.drift(conn)
    engine.dispose()
    assert any("message" in d for d in diffs), diffs
    assert any("extra" in d for d in diffs), diffs


def test_open_database_refuses_empty_schema(empty_db_url: str) -> None:
    with pytest.raises(SchemaError, match="run `rollcall db upgrade` first"):
        open_database(empty_db_url)


def test_open_database_refuses_unknown_revision(db_url: str) -> None:
    engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = 'ffff9999'"))
    engine.dispose()
    with pytest.raises(SchemaError, match="does not know"):
        open_database(db_url)


def test_open_database_refuses_older_revision(db_url: str) -> None:
    engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        migrate.downgrade(conn, "0001")
        conn.commit()
    engine.dispose()
    head = migrate.head_revision()
    assert head != "0001"
    with pytest.raises(
        SchemaError,
        match=rf"at revision 0001 but this rollcall needs {head}; run `rollcall db upgrade`",
    ):
        open_database(db_url)


def test_migration_files_are_one_linear_history() -> None:
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(migrate.alembic_config())
    assert len(script.get_heads()) == 1
    revs = list(script.walk_revisions())
    assert revs[-1].down_revision is None


def test_0005_moves_stored_payloads_into_segments_and_back(empty_db_url: str) -> None:
    """A database with payloads written before append-only turns keeps them across the
    upgrade (one segment each, detached partitions too) and the downgrade."""
    engine = sa.create_engine(empty_db_url, poolclass=sa.pool.NullPool)
    tokens, mask, logprobs = bytes(range(16)), bytes([0, 1, 1, 1]), bytes(range(100, 116))
    with engine.connect() as conn:
        migrate.upgrade(conn, "0004")
        conn.execute(
            sa.text(
                "INSERT INTO tasks (job_id, name, plugin, weight, max_inflight, max_staleness) "
                "VALUES (1, 'a', 'echo', 1, 1, 0), (1, 'b', 'echo', 1, 1, 0)"
            )
        )
        conn.execute(
            sa.text("SELECT rollcall_attach_task_partition(1), rollcall_attach_task_partition(2)")
        )
        conn.execute(
            sa.text(
                "INSERT INTO episodes (job_id, task_id, prompt_index, prompt, group_size) "
                "VALUES (1, 1, 0, '{}', 1), (1, 2, 0, '{}', 1)"
            )
        )
        for task in (1, 2):
            conn.execute(
                sa.text(
                    "INSERT INTO trajectories (task_id, episode_id, sample_index, lease_epoch, "
                    "token_ids, loss_mask, behaviour_logprobs, num_tokens) "
                    "VALUES (:t, :t, 0, 1, :a, :b, :c, 4)"
                ),
                {"t": task, "a": tokens, "b": mask, "c": logprobs},
            )
        conn.execute(sa.text("SELECT rollcall_detach_task_partition(2)"))
        conn.commit()

        migrate.upgrade(conn)
        conn.commit()
        assert migrate.drift(conn) == []
        segs = conn.execute(
            sa.text(
                "SELECT task_id, start_token, end_token, token_ids, loss_mask, "
                "behaviour_logprobs FROM trajectory_segments ORDER BY task_id"
            )
        ).all()
        assert [tuple(s[:3]) for s in segs] == [(1, 0, 4), (2, 0, 4)]
        assert all(
            (bytes(s[3]), bytes(s[4]), bytes(s[5])) == (tokens, mask, logprobs) for s in segs
        )
        detached = {
            r[0]
            for r in conn.execute(
                sa.text(
                    "SELECT column_name FROM information_schema.columns "
                    "WHERE table_name = 'trajectories_t2'"
                )
            )
        }
        assert "token_ids" not in detached and "payload_dropped_at" in detached

        migrate.downgrade(conn, "0004")
        conn.commit()
        back = conn.execute(
            sa.text("SELECT token_ids, loss_mask, behaviour_logprobs FROM trajectories")
        ).one()
        assert (bytes(back[0]), bytes(back[1]), bytes(back[2])) == (tokens, mask, logprobs)
        back2 = conn.execute(
            sa.text("SELECT token_ids, loss_mask, behaviour_logprobs FROM trajectories_t2")
        ).one()
        assert (bytes(back2[0]), bytes(back2[1]), bytes(back2[2])) == (tokens, mask, logprobs)
    engine.dispose()
