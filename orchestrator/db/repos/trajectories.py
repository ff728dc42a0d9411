"""Trajectories: per-turn checkpoints, commits, and the samples a resumed claim continues.

Every write is one call of ``rollcall_write_sample`` (its definition: ``orchestrator/db/
schema.sql``), which fences it by the lease epoch, never overwrites a committed sample
(checkpoints and commits only update rows that are still ``in_progress``, which makes a
repeated commit a no-op), and marks the episode done when its group's last sample is committed.
A write carries the payload's tokens from ``start`` on: the tokens before it are already stored
as ``trajectory_segments`` rows, which the write leaves untouched (append-only turns). An agent
sample's record of calls (``env_state["state"]["journal"]``, marked with how many entries its
writer knows are stored) is stored the same way: the entries past the mark as ``agent_journal``
rows, the state without them in ``env_state``. A sample's payload is read back by concatenating
its segments, and its journal entries put back into its state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from rollcall.orchestrator.db import raw
from rollcall.orchestrator.db.models import Trajectory
from rollcall.orchestrator.domain import (
    JOURNAL,
    JOURNAL_STORED,
    SampleState,
    TrajectoryPayload,
    TrajectoryStatus,
)
from rollcall.orchestrator.errors import PayloadMissingError

SampleKey = tuple[int, int, int]  # (task id, episode id, sample index)


class SampleWrite(NamedTuple):
    """One sample's checkpoint (``reward`` None) or commit, with its payload's tokens from
    ``start`` on."""

    episode_id: int
    epoch: int
    sample_index: int
    payload: TrajectoryPayload
    reward: float | None
    reward_info: dict[str, Any] | None
    start: int


# Checkpoint (no reward) or commit one sample, fenced by the lease epoch, in one statement:
# fencing, the write that never overwrites a committed sample, the idempotent re-commit and the
# group's completion are all ``rollcall_write_sample`` (orchestrator/db/schema.sql).
_WRITE_SAMPLE = f"SELECT * FROM rollcall_write_sample({', '.join(['%s'] * 20)})"
# The outcome of a write whose journal mark counts entries that are not stored: nothing was
# written; the write is made again with the whole journal.
_REBASE_JOURNAL = "rebase_journal"


def _split_journal(env_state: dict[str, Any]) -> tuple[dict[str, Any], int, list[Any] | None]:
    """(env_state without the journal, where the entries to write start, those entries) for
    a state with the writer's JOURNAL_STORED mark; (env_state, 0, None) for any other."""
    state = env_state.get("state")
    if not isinstance(state, dict):
        return env_state, 0, None
    journal, stored = state.get(JOURNAL), state.get(JOURNAL_STORED)
    if not isinstance(journal, list) or not isinstance(stored, int) or isinstance(stored, bool):
        return env_state, 0, None
    start = max(0, min(stored, len(journal)))
    rest = {k: v for k, v in state.items() if k not in (JOURNAL, JOURNAL_STORED)}
    return {**env_state, "state": rest}, start, journal[start:]


def _write_params(
    episode_id: int,
    epoch: int,
    sample_index: int,
    payload: TrajectoryPayload,
    reward: float | None,
    reward_info: dict[str, Any] | None,
    start: int,
    journal_rebase: bool = False,
) -> tuple[Any, ...]:
    """The write's arguments; ``journal_rebase``: the whole journal, whatever its mark says."""
    e = payload.encoded(start)
    env_state, journal_start, journal = _split_journal(e["env_state"])
    if journal_rebase and journal is not None:
        journal_start, journal = 0, list(payload.env_state["state"][JOURNAL])
    return (
        episode_id,
        epoch,
        sample_index,
        reward is not None,
        start,
        e["token_ids"],
        e["loss_mask"],
        e["behaviour_logprobs"],
        e["num_tokens"],
        e["prompt_tokens"],
        e["num_turns"],
        e["turn_offsets"],
        e["turn_versions"],
        e["min_policy_version"],
        raw.jsonb(env_state),
        e["finished"],
        reward,
        raw.jsonb(reward_info or {}),
        journal_start,
        None if journal is None else raw.jsonb(journal),
    )


class TrajectoryRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def write_sample(
        self,
        *,
        episode_id: int,
        epoch: int,
        sample_index: int,
        payload: TrajectoryPayload,
        reward: float | None,
        reward_info: dict[str, Any] | None,
        start: int = 0,
    ) -> tuple[str, bool]:
        """Checkpoint (no reward) or commit one sample, fenced, in one statement
        (``rollcall_write_sample``), writing the payload's tokens from ``start`` on (those
        before it must be stored already) and its journal's entries past its mark (written
        again from the first when the stored ones are fewer). Returns (outcome, group_done)
        with outcome ``written``, ``already``, ``stale`` or ``rebase`` (the stored tokens do
        not end at ``start``: nothing written; write again from 0). Run it in autocommit."""
        args = (episode_id, epoch, sample_index, payload, reward, reward_info, start)
        cur = raw.cursor(self.session)
        row = cur.execute(_WRITE_SAMPLE, _write_params(*args)).fetchone()
        assert row is not None
        if row.outcome == _REBASE_JOURNAL:
            row = cur.execute(_WRITE_SAMPLE, _write_params(*args, journal_rebase=True)).fetchone()
            assert row is not None
        return row.outcome, row.group_done

    def write_samples(
        self,
        *,
        episode_id: int,
        epoch: int,
        samples: Sequence[tuple[int, TrajectoryPayload, float | None, dict[str, Any] | None, int]],
    ) -> list[tuple[str, bool]]:
        """``write_batch`` for several samples (index, payload, reward, reward_info, start) of
        one group.

        The first write locks the episode (``FOR UPDATE`` for a commit, ``FOR SHARE`` for a
        checkpoint) until the transaction ends, so the lease cannot move on between them: if any
        sample is ``stale``, none was written."""
        return self.write_batch([SampleWrite(episode_id, epoch, *sample) for sample in samples])

    def write_batch(self, writes: Sequence[SampleWrite]) -> list[tuple[str, bool]]:
        """``write_sample`` for several samples, of any episodes, pipelined in the caller's
        transaction (a node's group commit): one (outcome, group_done) per write, in order.
        Each write is fenced by its own episode's lease and locks that episode until the
        transaction ends; callers write in episode order, so two batches never wait on each
        other in a cycle. A write whose journal mark counts entries that are not stored is
        made again, in the same transaction, with its whole journal."""
        if not writes:
            return []
        if len(writes) == 1:  # one statement, not a pipeline (cheaper for the client)
            return [self.write_sample(**writes[0]._asdict())]
        out = self._write_many([_write_params(*w) for w in writes])
        again = [i for i, (outcome, _) in enumerate(out) if outcome == _REBASE_JOURNAL]
        if again:
            rewritten = self._write_many(
                [_write_params(*writes[i], journal_rebase=True) for i in again]
            )
            for i, result in zip(again, rewritten, strict=True):
                out[i] = result
        return out

    def _write_many(self, params: list[tuple[Any, ...]]) -> list[tuple[str, bool]]:
        cur = raw.cursor(self.session)
        cur.executemany(_WRITE_SAMPLE, params, returning=True)
        out: list[tuple[str, bool]] = []
        while True:
            row = cur.fetchone()
            assert row is not None
            out.append((row.outcome, row.group_done))
            if not cur.nextset():
                break
        return out

    def samples_for_resume(
        self, task_id: int, episode_id: int, group_size: int
    ) -> tuple[SampleState, ...]:
        """Every sample of the group: new, in progress (with its last checkpoint), or ready."""
        rows = self.session.execute(
            select(Trajectory).where(
                Trajectory.task_id == task_id,
                Trajectory.episode_id == episode_id,
                Trajectory.status.in_([TrajectoryStatus.IN_PROGRESS, TrajectoryStatus.READY]),
            )
        ).scalars()
        found: dict[int, SampleState] = {}
        in_progress: list[Trajectory] = []
        for t in rows:
            if t.status == TrajectoryStatus.READY:
                found[t.sample_index] = SampleState(t.sample_index, "ready")
            else:
                in_progress.append(t)
        for t, payload in zip(in_progress, self.payloads(in_progress), strict=True):
            found[t.sample_index] = SampleState(t.sample_index, "in_progress", payload)
        return tuple(found.get(i, SampleState(i, "new")) for i in range(group_size))

    def payloads(
        self, rows: Sequence[Trajectory], *, journal: bool = True
    ) -> list[TrajectoryPayload]:
        """The payloads of ``trajectories`` rows: their segments read in one query and
        concatenated, checked to cover each sample's tokens exactly; with ``journal`` (a
        resume needs it, training does not), a sample's journal entries read in one more and
        put back into its state (``state["journal"]``, in call order), checked to be all
        there."""
        if not rows:
            return []
        parts = self._segments({(t.task_id, t.episode_id, t.sample_index) for t in rows})
        journals = self._journals(
            {
                (t.task_id, t.episode_id, t.sample_index): t.journal_calls
                for t in rows
                if t.journal_calls is not None and journal
            }
        )
        out = []
        for t in rows:
            key = (t.task_id, t.episode_id, t.sample_index)
            tokens, mask, logprobs = parts.get(key, ([], [], []))
            n = sum(len(m) for m in mask)
            if n != t.num_tokens:
                dropped = " (dropped by retention)" if t.payload_dropped_at is not None else ""
                raise PayloadMissingError(
                    f"sample {t.sample_index} of episode {t.episode_id} has {n} of its "
                    f"{t.num_tokens} tokens stored{dropped}"
                )
            payload = TrajectoryPayload.from_columns(
                t, b"".join(tokens), b"".join(mask), b"".join(logprobs)
            )
            if t.journal_calls is not None and journal:
                env = payload.env_state
                state = {**env.get("state", {}), JOURNAL: journals.get(key, [])}
                payload = dataclasses.replace(payload, env_state={**env, "state": state})
            out.append(payload)
        return out

    def _journals(self, calls: dict[SampleKey, int]) -> dict[SampleKey, list[Any]]:
        """Each sample's first ``calls[key]`` journal entries in call order; fewer stored than
        that is an error."""
        if not calls:
            return {}
        rows = self.session.execute(
            text(
                "SELECT task_id, episode_id, sample_index, seq, entry FROM agent_journal "
                "WHERE task_id = ANY(:t) AND episode_id = ANY(:e) "
                "ORDER BY task_id, episode_id, sample_index, seq"
            ),
            {"t": sorted({k[0] for k in calls}), "e": sorted({k[1] for k in calls})},
        )
        out: dict[SampleKey, list[Any]] = {key: [] for key in calls}
        for r in rows:
            key = (r.task_id, r.episode_id, r.sample_index)
            entries = out.get(key)
            if entries is None or r.seq >= calls[key]:
                continue  # another sample, or an entry past the journal (a run started over)
            if r.seq != len(entries):
                break  # a gap: reported below
            entries.append(r.entry)
        for key, n in calls.items():
            if len(out[key]) != n:
                raise PayloadMissingError(
                    f"sample {key[2]} of episode {key[1]} has {len(out[key])} of its {n} "
                    "agent journal entries stored"
                )
        return out

    def _segments(
        self, keys: Iterable[SampleKey]
    ) -> dict[SampleKey, tuple[list[bytes], list[bytes], list[bytes]]]:
        """Each sample's segment bytes (tokens, mask, log-probs) in token order; a segment
        that does not start where the previous one ended is an error."""
        keys = set(keys)
        rows = self.session.execute(
            text(
                "SELECT task_id, episode_id, sample_index, start_token, end_token, token_ids, "
                "loss_mask, behaviour_logprobs FROM trajectory_segments "
                "WHERE task_id = ANY(:t) AND episode_id = ANY(:e) "
                "ORDER BY task_id, episode_id, sample_index, start_token"
            ),
            {"t": sorted({k[0] for k in keys}), "e": sorted({k[1] for k in keys})},
        )
        out: dict[SampleKey, tuple[list[bytes], list[bytes], list[bytes]]] = {}
        ends: dict[SampleKey, int] = {}
        for r in rows:
            key = (r.task_id, r.episode_id, r.sample_index)
            if key not in keys:
                continue
            if r.start_token != ends.get(key, 0):
                raise PayloadMissingError(
                    f"sample {key[2]} of episode {key[1]}: a stored segment starts at token "
                    f"{r.start_token}, not where the previous one ended ({ends.get(key, 0)})"
                )
            ends[key] = r.end_token
            tokens, mask, logprobs = out.setdefault(key, ([], [], []))
            tokens.append(bytes(r.token_ids))
            mask.append(bytes(r.loss_mask))
            logprobs.append(bytes(r.behaviour_logprobs))
        return out

    def retention_step(self, job_id: int, keep_steps: int | None, keep_s: float | None) -> int:
        """The last step whose consumed payloads retention drops: the newest one that is
        ``keep_steps`` steps old, or committed more than ``keep_s`` seconds ago; -1: none."""
        row = self.session.execute(
            text(
                """
                SELECT
                  (SELECT max(step) FROM train_steps WHERE job_id = :j) AS latest,
                  (SELECT max(step) FROM train_steps WHERE job_id = :j
                   AND created_at < now() - make_interval(secs => :s)) AS by_age
                """
            ),
            {"j": job_id, "s": keep_s if keep_s is not None else 0.0},
        ).one()
        cut = -1
        if keep_steps is not None and row.latest is not None:
            cut = row.latest - keep_steps
        if keep_s is not None and row.by_age is not None:
            cut = max(cut, row.by_age)
        return int(cut)

    def drop_payloads(self, job_id: int, after_step: int, through_step: int) -> tuple[int, int]:
        """Retention: delete the segments of the job's trajectories consumed by steps
        ``(after_step, through_step]``, and of its expired groups expired before step
        ``through_step`` was committed, and their journal entries, marking each trajectory
        ``payload_dropped_at`` (its metadata, reward and versions stay). Returns (trajectories,
        payload bytes) dropped."""
        row = self.session.execute(
            text(
                """
                WITH cut AS (
                    SELECT created_at FROM train_steps WHERE job_id = :j AND step = :hi
                ), eps AS (
                    SELECT e.id, e.task_id FROM episodes e
                    WHERE e.job_id = :j AND (
                        (e.consumed_step > :lo AND e.consumed_step <= :hi)
                        OR (e.status = 'expired' AND e.updated_at <= (SELECT created_at FROM cut))
                    )
                ), gone AS (
                    DELETE FROM trajectory_segments s USING eps
                    WHERE s.task_id = eps.task_id AND s.episode_id = eps.id
                    RETURNING s.task_id, s.episode_id, s.sample_index,
                        octet_length(s.token_ids) + octet_length(s.loss_mask)
                        + octet_length(s.behaviour_logprobs) AS nbytes
                ), journal AS (
                    DELETE FROM agent_journal j USING eps
                    WHERE j.task_id = eps.task_id AND j.episode_id = eps.id
                    RETURNING pg_column_size(j.entry) AS nbytes
                ), marked AS (
                    UPDATE trajectories tr SET payload_dropped_at = now()
                    FROM (SELECT DISTINCT task_id, episode_id, sample_index FROM gone) g
                    WHERE tr.task_id = g.task_id AND tr.episode_id = g.episode_id
                      AND tr.sample_index = g.sample_index
                    RETURNING 1
                )
                SELECT (SELECT count(*) FROM marked) AS n,
                       (SELECT coalesce(sum(nbytes), 0) FROM gone)
                       + (SELECT coalesce(sum(nbytes), 0) FROM journal) AS nbytes
                """
            ),
            {"j": job_id, "lo": after_step, "hi": through_step},
        ).one()
        return int(row.n), int(row.nbytes)

    def storage(self, job_id: int) -> dict[str, int]:
        """The job's payload rows and bytes, and its trajectories whose payload retention
        dropped."""
        row = self.session.execute(
            text(
                """
                SELECT
                  (SELECT count(*) FROM trajectory_segments s JOIN tasks t ON t.id = s.task_id
                   WHERE t.job_id = :j) AS segments,
                  (SELECT coalesce(sum(octet_length(s.token_ids) + octet_length(s.loss_mask)
                          + octet_length(s.behaviour_logprobs)), 0)
                   FROM trajectory_segments s JOIN tasks t ON t.id = s.task_id
                   WHERE t.job_id = :j) AS payload_bytes,
                  (SELECT count(*) FROM trajectories tr JOIN tasks t ON t.id = tr.task_id
                   WHERE t.job_id = :j) AS trajectories,
                  (SELECT count(*) FROM trajectories tr JOIN tasks t ON t.id = tr.task_id
                   WHERE t.job_id = :j AND tr.payload_dropped_at IS NOT NULL) AS dropped
                """
            ),
            {"j": job_id},
        ).one()
        return {
            "segments": int(row.segments),
            "payload_bytes": int(row.payload_bytes),
            "trajectories": int(row.trajectories),
            "payloads_dropped": int(row.dropped),
        }


def table_sizes(session: Session) -> dict[str, int]:
    """On-disk bytes of rollcall's tables (with indexes and TOAST; partitions summed into
    their parent), the whole database's last: ``database``."""
    rows = session.execute(
        text(
            """
            SELECT coalesce(p.relname, c.relname) AS name,
                   sum(pg_total_relation_size(c.oid))::bigint AS nbytes
            FROM pg_class c
            JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = current_schema()
            LEFT JOIN pg_inherits i ON i.inhrelid = c.oid
            LEFT JOIN pg_class p ON p.oid = i.inhparent
            WHERE c.relkind = 'r'
            GROUP BY 1 ORDER BY 2 DESC
            """
        )
    ).all()
    out = {r.name: int(r.nbytes) for r in rows}
    out["database"] = int(
        session.execute(text("SELECT pg_database_size(current_database())")).scalar_one()
    )
    return out
