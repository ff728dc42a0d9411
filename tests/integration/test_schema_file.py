"""The schema file (orchestrator/db/schema.sql) is the schema the migrations produce.

One fresh database is migrated to head (the template's copy), another gets the schema file,
and their catalogs are compared: tables and their columns (in order, with types, defaults,
nullability and storage), constraints, indexes, sequences, enum types, the partition key, and
the definition of every function. A migration that changes any of them (adds a function, say)
without the same change in the schema file fails here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa

from rollcall.orchestrator.db.migrate import SCHEMA_FILE

# Alembic's bookkeeping, and the partitions registration creates.
_LEFT_OUT = r"^(alembic_version(_pkc)?|trajectories_t[0-9]+.*)$"

_RELATIONS = """
SELECT c.relname, c.relkind::text, coalesce(pg_get_partkeydef(c.oid), ''),
       coalesce(array_to_string(c.reloptions, ','), '')
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f')
  AND c.relname !~ :left_out
ORDER BY 1
"""

# Columns in their order (attnum has gaps where a migration dropped one: the rank is compared).
_COLUMNS = """
SELECT c.relname,
       rank() OVER (PARTITION BY c.relname ORDER BY a.attnum) AS position,
       a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
       coalesce(pg_get_expr(d.adbin, d.adrelid), ''), a.attstorage::text, a.attidentity::text,
       a.attgenerated::text, coalesce(co.collname, '')
FROM pg_attribute a
JOIN pg_class c ON c.oid = a.attrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
LEFT JOIN pg_collation co ON co.oid = a.attcollation AND a.attcollation <> 0
WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p', 'v', 'm', 'f') AND a.attnum > 0
  AND NOT a.attisdropped AND c.relname !~ :left_out
ORDER BY 1, 2
"""

_CONSTRAINTS = """
SELECT c.relname, k.conname, k.contype::text, pg_get_constraintdef(k.oid)
FROM pg_constraint k
JOIN pg_class c ON c.oid = k.conrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = 'public' AND c.relname !~ :left_out
ORDER BY 1, 2
"""

_INDEXES = """
SELECT tablename, indexname, indexdef FROM pg_indexes
WHERE schemaname = 'public' AND tablename !~ :left_out
ORDER BY 1, 2
"""

_SEQUENCES = """
SELECT s.sequencename, s.data_type::text, s.start_value, s.increment_by, s.min_value,
       s.max_value, s.cache_size, s.cycle,
       coalesce((SELECT t.relname || '.' || a.attname FROM pg_depend dep
                 JOIN pg_class t ON t.oid = dep.refobjid
                 JOIN pg_attribute a ON a.attrelid = dep.refobjid AND a.attnum = dep.refobjsubid
                 WHERE dep.objid = (quote_ident(s.sequencename))::regclass
                   AND dep.deptype IN ('a', 'i')), '')
FROM pg_sequences s WHERE s.schemaname = 'public'
ORDER BY 1
"""

_TYPES = """
SELECT t.typname, t.typtype::text,
       coalesce((SELECT string_agg(e.enumlabel, ',' ORDER BY e.enumsortorder)
                 FROM pg_enum e WHERE e.enumtypid = t.oid), '')
FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
WHERE n.nspname = 'public' AND t.typtype IN ('e', 'd', 'c')
  AND NOT EXISTS (SELECT 1 FROM pg_class c WHERE c.reltype = t.oid)
ORDER BY 1
"""

_FUNCTIONS = """
SELECT p.proname, pg_get_function_identity_arguments(p.oid), pg_get_functiondef(p.oid)
FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = 'public'
ORDER BY 1, 2
"""

_TRIGGERS = """
SELECT c.relname, t.tgname, pg_get_triggerdef(t.oid)
FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = 'public' AND NOT t.tgisinternal
ORDER BY 1, 2
"""

_QUERIES = {
    "relations": _RELATIONS,
    "columns": _COLUMNS,
    "constraints": _CONSTRAINTS,
    "indexes": _INDEXES,
    "sequences": _SEQUENCES,
    "types": _TYPES,
    "functions": _FUNCTIONS,
    "triggers": _TRIGGERS,
    "jobs": "SELECT id, name, status::text FROM jobs ORDER BY id",
}


def catalog(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """The database's schema as rows of plain values, per kind of object."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return {
                kind: [tuple(r) for r in conn.execute(sa.text(sql), {"left_out": _LEFT_OUT})]
                for kind, sql in _QUERIES.items()
            }
    finally:
        engine.dispose()


def differences(a: dict[str, list[Any]], b: dict[str, list[Any]]) -> list[str]:
    out = []
    for kind in a:
        for row in sorted(set(a[kind]) - set(b[kind]), key=str):
            out.append(f"{kind}: only in the migrated database: {row}")
        for row in sorted(set(b[kind]) - set(a[kind]), key=str):
            out.append(f"{kind}: only in the schema file's database: {row}")
        if not out and a[kind] != b[kind]:
            out.append(f"{kind}: the same rows in another order")
    return out


def _apply_schema_file(url: str) -> None:
    dsn = sa.engine.make_url(url).set(drivername="postgresql")
    with psycopg.connect(dsn.render_as_string(hide_password=False), autocommit=True) as conn:
        conn.execute(Path(SCHEMA_FILE).read_text())


def test_the_schema_file_is_what_the_migrations_produce(db_url: str, empty_db_url: str) -> None:
    _apply_schema_file(empty_db_url)
    migrated, from_file = catalog(db_url), catalog(empty_db_url)
    assert all(migrated[k] for k in ("relations", "columns", "functions", "types")), migrated
    diffs = differences(migrated, from_file)
    assert diffs == [], "orchestrator/db/schema.sql differs from the migrations:\n" + "\n".join(
        diffs
    )
    names = {f[0] for f in from_file["functions"]}
    assert names == {
        "rollcall_attach_task_partition",
        "rollcall_detach_task_partition",
        "rollcall_claim",
        "rollcall_write_sample",
        "rollcall_drop_old_events",
        "rollcall_compact_steps",
    }


def test_a_function_the_schema_file_lacks_is_a_difference(db_url: str, empty_db_url: str) -> None:
    """What a migration that adds a function without the schema file looks like here."""
    _apply_schema_file(empty_db_url)
    engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.execute(
            sa.text("CREATE FUNCTION rollcall_new() RETURNS integer AS 'SELECT 1' LANGUAGE sql")
        )
        conn.execute(sa.text("ALTER TABLE jobs ALTER COLUMN name TYPE character varying(64)"))
    engine.dispose()
    diffs = differences(catalog(db_url), catalog(empty_db_url))
    assert any("functions" in d and "rollcall_new" in d for d in diffs), diffs
    assert any("columns" in d and "character varying(64)" in d for d in diffs), diffs
