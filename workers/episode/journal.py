"""The record of an agent's calls, and replay from it.

The record (``Trajectory.state["journal"]``) holds one entry per call through ``ctx``, in call
order: its kind (``chat``, ``tool``, ``step``), a fingerprint of what was asked (``h``) and its
result (``r``). ``Recorder`` is the part of ``AgentContext`` that keeps it: each call takes the
next recorded entry while the record lasts (checking that it is the same call: else the run has
diverged), or runs live and appends its entry, and the trajectory is checkpointed at once
(``on_call``) before the result is returned; a deterministic call may instead be checkpointed
with the next one (``Slot.defer``: a built-in plugin's tool call, so a plugin turn is one
checkpoint).

The journal is append-only: the trajectory's state also says how many of its first entries are
stored already (``state["journal_stored"]``: the entries replayed from the checkpoint, and those
of the checkpoints that succeeded), so each checkpoint stores only the entries it added
(``agent_journal`` rows; ``orchestrator/db/repos/trajectories.py``) and the bytes written per
episode grow linearly with its calls. The database checks the mark (a write whose mark counts
entries that are not stored writes the whole journal again), and a resumed sample reads the
whole journal back in order.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rollcall.orchestrator.domain import JOURNAL, JOURNAL_STORED
from rollcall.workers.episode.api import AgentUsageError, ReplayDivergence
from rollcall.workers.episode.threads import in_thread
from rollcall.workers.episode.trajectory import Trajectory


def _stable(value: Any) -> Any:
    """What a fingerprint sees of a value JSON cannot hold: its type, never its address."""
    name = getattr(value, "__qualname__", None) or type(value).__qualname__
    return f"<{name}>"


def fingerprint(*parts: Any) -> str:
    text = json.dumps(parts, sort_keys=True, default=_stable)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def chat_fingerprint(
    train: Any,
    msgs: list[dict[str, str]],
    tools: list[dict[str, Any]],
    max_tokens: Any,
    seen: dict[tuple[str, str], str],
) -> str:
    """``fingerprint("chat", train, msgs, tools, max_tokens)`` (the same text hashed) for
    messages of a role and a text content only, each message's JSON kept in ``seen`` (one run's:
    a call that extends a conversation encodes its new messages only, not all of it again)."""
    texts = []
    for m in msgs:
        text = seen.get((m["role"], m["content"]))
        if text is None:
            text = seen[(m["role"], m["content"])] = json.dumps(m, sort_keys=True)
        texts.append(text)
    rest = [json.dumps(v, sort_keys=True, default=_stable) for v in (train, tools, max_tokens)]
    text = f'["chat", {rest[0]}, [{", ".join(texts)}], {rest[1]}, {rest[2]}]'
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _describe(kind: str, detail: str) -> str:
    return f"{kind} {detail}" if detail else kind


@dataclass
class CallStats:
    replayed: int = 0  # calls answered from the record
    live: int = 0  # calls served now (generated, run)
    generated: int = 0  # of them, chat calls that ran the engine


@dataclass
class Slot:
    """One call in progress: its recorded entry (None: live) and the result to record."""

    entry: dict[str, Any] | None
    result: Any = None
    # checkpoint with the next call instead of at once (a deterministic call: one lost with
    # its process is made again on replay)
    defer: bool = False


class Recorder:
    """The calls of one run of an agent function against its record (``record``: the journal
    of the checkpoint it resumes, empty for a fresh run). ``on_call`` checkpoints the
    trajectory after each live call."""

    def __init__(
        self, record: list[dict[str, Any]], on_call: Callable[[Trajectory], None] | None
    ) -> None:
        self._record = record
        self._pos = 0
        self._journal: list[dict[str, Any]] = []
        self._stored = 0  # the journal's first entries known stored (replayed or checkpointed)
        self.trajectory = Trajectory(state={JOURNAL: self._journal, JOURNAL_STORED: 0})
        self._on_call = on_call
        self._lock = threading.Lock()
        self._busy = False
        self.stats = CallStats()
        self.diverged: str | None = None
        self.failure: BaseException | None = None  # what failed a call served on a thread
        self.closed: str | None = None  # the episode ended (timed out): calls are refused

    def _diverge(self, why: str) -> None:
        self.diverged = why
        raise ReplayDivergence(why)

    def _next(self, kind: str, key: str, detail: str) -> dict[str, Any] | None:
        if self.diverged is not None:
            raise ReplayDivergence(self.diverged)
        if self._pos >= len(self._record):
            return None
        entry = self._record[self._pos]
        if entry.get("k") != kind or entry.get("h") != key:
            self._diverge(
                f"call {self._pos + 1} on replay is {_describe(kind, detail)} but the record "
                f"holds a different {entry.get('k')} call there (the agent is not deterministic "
                "given its recorded results)"
            )
        self._pos += 1
        return entry

    def _mark(self) -> None:
        """The trajectory's state with the journal as it is now (a new list and state each
        time: a checkpoint handed out earlier keeps its own)."""
        self.trajectory.state = {
            **self.trajectory.state,
            JOURNAL: self._journal,
            JOURNAL_STORED: self._stored,
        }

    def _finish_call(
        self, kind: str, key: str, entry: Any, result: Any, checkpoint: bool = True
    ) -> None:
        if entry is None and result is None:  # the live call raised: nothing to record
            return
        self._journal = [*self._journal, entry or {"k": kind, "h": key, "r": result}]
        if entry is not None:  # replayed: the entry was read from the checkpoint
            self._stored = len(self._journal)
            self._mark()
            self.stats.replayed += 1
            return
        self._mark()
        self.stats.live += 1
        if checkpoint and self._on_call is not None:
            try:
                self._on_call(self.trajectory)
            except BaseException as e:  # the checkpoint failed or the lease moved on
                self.failure = e
                raise
            self._stored = len(self._journal)
            self._mark()

    def _enter(self) -> None:
        with self._lock:
            if self.closed is not None:
                raise AgentUsageError(f"this episode is over ({self.closed}): no further calls")
            if self._busy:
                raise AgentUsageError(
                    "ctx calls of one episode must not overlap: await each before the next"
                )
            self._busy = True

    @contextmanager
    def _sync_call(self, kind: str, key: str, detail: str) -> Iterator[Slot]:
        self._enter()
        try:
            slot = Slot(self._next(kind, key, detail))
            yield slot
            self._finish_call(kind, key, slot.entry, slot.result, checkpoint=not slot.defer)
        finally:
            self._busy = False

    def _call(self, kind: str, key: str, detail: str) -> AsyncSlot:
        return AsyncSlot(self, kind, key, detail)


class AsyncSlot:
    """``async with recorder._call(...) as slot``: one call, recorded as it ends (the
    checkpoint on a thread of its own, off the agent's event loop)."""

    def __init__(self, recorder: Recorder, kind: str, key: str, detail: str) -> None:
        self.recorder, self.kind, self.key, self.detail = recorder, kind, key, detail

    async def __aenter__(self) -> Slot:
        self.recorder._enter()
        try:
            self.slot = Slot(self.recorder._next(self.kind, self.key, self.detail))
        except BaseException:
            self.recorder._busy = False
            raise
        return self.slot

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is None and self.slot.defer:  # nothing written now: no thread
                self.recorder._finish_call(
                    self.kind, self.key, self.slot.entry, self.slot.result, checkpoint=False
                )
            elif exc_type is None:
                await in_thread(
                    self.recorder._finish_call,
                    self.kind,
                    self.key,
                    self.slot.entry,
                    self.slot.result,
                )
        finally:
            self.recorder._busy = False
