"""Helpers shared by the buffer tests: a job with tasks, payloads, a simple rollout driver."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import sqlalchemy as sa

from rollcall.orchestrator.buffer.control import ControlPlaneBuffer
from rollcall.orchestrator.buffer.rollout import RolloutBuffer
from rollcall.orchestrator.buffer.trainer import TrainerBuffer
from rollcall.orchestrator.buffer.types import ClaimedEpisode
from rollcall.orchestrator.config import BufferConfig
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.domain import TrajectoryPayload
from rollcall.orchestrator.services.tasks import register_task


def add_tasks(db: Database, *specs: dict[str, Any]) -> dict[str, int]:
    """Register tasks in the default job: each spec has name, and optionally weight,
    max_inflight, max_staleness, group_size. Returns name -> task id."""
    ids = {}
    with db.transaction() as tx:
        for s in specs:
            t = register_task(
                tx,
                job_name="default",
                name=s["name"],
                plugin="echo",
                actor="test",
                weight=s.get("weight", 1.0),
                max_inflight=s.get("max_inflight", 8),
                max_staleness=s.get("max_staleness", 1),
                spec_data={"group_size": s.get("group_size", 2)},
            )
            ids[t.name] = t.id
    return ids


if TYPE_CHECKING:  # every part's methods, with their types

    class _Parts(ControlPlaneBuffer, TrainerBuffer, RolloutBuffer):
        pass

else:
    _Parts = object


class Buffers(_Parts):
    """The default job's buffers as its three callers hold them, for the tests that play all
    three: ``control`` (the control plane's), ``trainer`` (the driver's trainer loop's, beside
    ``control`` as in the driver) and ``rollout`` (a worker's, of a process of its own). An
    attribute of this object is the one of the buffer whose caller has it, the control
    plane's first (the methods all three share: ``event``, ``requeue_worker``, ...)."""

    def __init__(self, db: Database, config: BufferConfig) -> None:
        control = ControlPlaneBuffer(db, 1, config)
        parts = {
            "control": control,
            "trainer": TrainerBuffer(db, 1, config, beside=control),
            "rollout": RolloutBuffer(db, 1, config),
        }
        self.__dict__.update(parts)
        self.__dict__["_parts"] = tuple(parts.values())

    def _owner(self, name: str) -> Any:
        for part in self._parts:
            if hasattr(part, name):
                return part
        raise AttributeError(f"no buffer has {name!r}")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._owner(name), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._owner(name), name, value)


def make_buffer(db: Database, **config: Any) -> Buffers:
    return Buffers(db, BufferConfig(**config))


def payload(version: int, n_tokens: int = 8, turns: int = 1, seed: int = 0) -> TrajectoryPayload:
    rng = np.random.default_rng(seed)
    offsets = [int(i * n_tokens / (turns + 1)) for i in range(turns)]
    mask = np.ones(n_tokens, dtype=np.uint8)
    mask[: max(1, offsets[1] if turns > 1 else 1)] = 0
    return TrajectoryPayload.build(
        rng.integers(0, 50_000, n_tokens),
        mask,
        -rng.random(n_tokens).astype(np.float32),
        turn_offsets=offsets,
        turn_versions=[version] * turns,
        prompt_tokens=1,
        env_state={"turn": turns},
    )


def finish(
    buf: RolloutBuffer | Buffers, claim: ClaimedEpisode, version: int, reward: float = 1.0
) -> None:
    """Commit every sample of a claimed group that is not committed yet."""
    for s in claim.samples:
        if s.status != "ready":
            buf.commit(claim.lease, s.sample_index, payload(version, seed=s.sample_index), reward)


def drain_queue(
    buf: RolloutBuffer | Buffers, worker_id: int, version: int, limit: int = 10_000
) -> list[int]:
    """Claim and finish episodes until none is claimable; returns the episode ids."""
    done = []
    for _ in range(limit):
        c = buf.claim(worker_id)
        if c is None:
            break
        finish(buf, c, version)
        done.append(c.lease.episode_id)
    return done


def rows(engine: sa.Engine, sql: str, **params: Any) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text(sql), params).all())


def scalar(engine: sa.Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar()


def episode_end_states(engine: sa.Engine) -> Iterator[tuple[int, str, int | None]]:
    yield from (
        (r.id, r.status, r.consumed_step)
        for r in rows(engine, "SELECT id, status::text, consumed_step FROM episodes ORDER BY id")
    )
