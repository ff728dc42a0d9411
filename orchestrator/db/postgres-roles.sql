-- rollcall on an external PostgreSQL (14 or newer): one database, two login roles.
--
--   rollcall_migrator  owns the database and the schema; runs `rollcall db upgrade` (the only
--                      DDL) and nothing else.
--   rollcall_runtime   what jobs, rollout nodes, trainer ranks and the operator CLI use:
--                      SELECT/INSERT/UPDATE on the tables, the sequences, EXECUTE on
--                      rollcall's functions, and no DDL at all (no CREATE in the schema or the
--                      database, no temporary tables, owns nothing, so it cannot ALTER, DROP or
--                      TRUNCATE). Registering a task creates its trajectory partition through
--                      the SECURITY DEFINER function rollcall_attach_task_partition, which runs
--                      as its owner, the migrator; retiring one detaches it the same way.
--
-- Run it as a superuser (or a role with CREATEROLE and CREATEDB that is a member of
-- rollcall_migrator, e.g. the master user of a managed service), for a fresh database, BEFORE
-- the first `rollcall db upgrade`: the default privileges below are what give the runtime role
-- the tables, sequences and functions that the migrations create. Running it again is safe (it
-- creates only what is missing and resets the two passwords).
--
--   psql "postgresql://ADMIN@HOST:5432/postgres" -v ON_ERROR_STOP=1 \
--        -v database=rollcall \
--        -v migrator_password="$MIGRATOR_PASSWORD" -v runtime_password="$RUNTIME_PASSWORD" \
--        -f ops/deploy/postgres-roles.sql
--
-- then, with the migrator's URL, `rollcall db upgrade`, and give jobs the runtime role's URL
-- (ROLLCALL_DATABASE_URL). Passwords come from the environment or a secret store, never from a
-- file in the repository; rollcall prints every URL as USER:***@HOST.
-- tests/integration/test_db_roles.py runs this very file, and so does the embedded PostgreSQL
-- (orchestrator/db/embedded.py; ops/deploy/postgres-roles.sql links here) for its own roles,
-- with random passwords that nobody uses: it admits its owner by peer credentials only.

\set ON_ERROR_STOP on

-- the roles (created when missing; passwords set on every run)
SELECT 'CREATE ROLE rollcall_migrator LOGIN'
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'rollcall_migrator') \gexec
SELECT 'CREATE ROLE rollcall_runtime LOGIN'
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'rollcall_runtime') \gexec
ALTER ROLE rollcall_migrator NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD :'migrator_password';
ALTER ROLE rollcall_runtime NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT
    PASSWORD :'runtime_password';

-- the database, owned by the migrator
SELECT format('CREATE DATABASE %I OWNER rollcall_migrator', :'database')
WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = :'database') \gexec
REVOKE ALL ON DATABASE :"database" FROM PUBLIC;  -- CONNECT and TEMPORARY for everyone
GRANT CONNECT ON DATABASE :"database" TO rollcall_runtime;

\connect :"database"

-- the schema: the migrator creates in it; the runtime role may only use it
ALTER SCHEMA public OWNER TO rollcall_migrator;
REVOKE ALL ON SCHEMA public FROM PUBLIC;
GRANT USAGE ON SCHEMA public TO rollcall_runtime;

-- what the migrations create (as the migrator) is usable by the runtime role: data, not DDL.
-- No DELETE: rollcall never deletes rows (ended work keeps its end state), except payload
-- segments (a replaced checkpoint, retention) and recorded calls (replaced entries, from
-- migration 0012, and retention), which migrations 0005 and 0008 grant on those two tables. Old events (retention) are deleted by
-- rollcall_drop_old_events, a SECURITY DEFINER function (migration 0010), not by the role.
ALTER DEFAULT PRIVILEGES FOR ROLE rollcall_migrator IN SCHEMA public
    GRANT SELECT, INSERT, UPDATE ON TABLES TO rollcall_runtime;
ALTER DEFAULT PRIVILEGES FOR ROLE rollcall_migrator IN SCHEMA public
    GRANT USAGE, SELECT ON SEQUENCES TO rollcall_runtime;
-- functions (among them the two SECURITY DEFINER partition functions): the runtime role only,
-- not PUBLIC
ALTER DEFAULT PRIVILEGES FOR ROLE rollcall_migrator REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC;
ALTER DEFAULT PRIVILEGES FOR ROLE rollcall_migrator IN SCHEMA public
    GRANT EXECUTE ON FUNCTIONS TO rollcall_runtime;

