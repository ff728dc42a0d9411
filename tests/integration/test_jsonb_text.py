"""Any text a model or a tool produces is stored and read back exactly.

PostgreSQL's ``jsonb`` cannot hold the character U+0000 (``unsupported Unicode escape
sequence``), nor can a ``text`` column. A sampled model emits it now and then (the tiny model's
byte tokens do; seen in CI: an agent's journal failed to checkpoint, three times, and the node was
taken for broken). ``orchestrator/db/jsontext.py`` escapes it losslessly in every JSON value the
database stores; these tests write it through the paths that carry model and tool text."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from rollcall.orchestrator.db import jsontext
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.domain import TrajectoryPayload
from tests.integration.buffer_helpers import add_tasks, make_buffer, payload, scalar

NASTY = [
    "a\x00b",
    "\x00",
    "\ue000",  # the escape character itself
    "\ue0000",  # the escape character followed by what an escaped NUL looks like
    "\ue000\x00\ue000\ue000",
    "\\u0000",  # a backslash and 'u0000': no NUL at all
    "plain",
]


def _state() -> dict[str, object]:
    return {
        "journal": [{"k": "chat", "h": "x", "r": {"text": s, "calls": [s]}} for s in NASTY],
        "key\x00with nul": NASTY,
        "\ue000": 1,
    }


@pytest.mark.parametrize("text", NASTY)
def test_the_encoding_round_trips(text: str) -> None:
    value = {text: [text, {"t": text}], "n": 1}
    stored = jsontext.dumps(value)
    assert "\\u0000" not in stored.replace("\\\\", "")
    assert jsontext.loads(stored) == value
    assert jsontext.loads(stored.encode()) == value


def test_a_checkpointed_journal_holding_nul_resumes_exactly(db: Database) -> None:
    add_tasks(db, {"name": "a", "group_size": 1})
    buf = make_buffer(db, batch_groups=1)
    buf.seed()
    c = buf.claim(buf.register_worker("r0").id)
    assert c is not None
    base = payload(0, n_tokens=16, turns=2, seed=1)
    p = TrajectoryPayload.build(
        base.token_ids,
        base.loss_mask,
        base.behaviour_logprobs,
        turn_offsets=base.turn_offsets,
        turn_versions=base.turn_versions,
        prompt_tokens=1,
        env_state=_state(),
    )
    buf.checkpoint(c.lease, 0, p)
    buf.release(c.lease, "engine failed", counted=False)
    other = make_buffer(db, batch_groups=1)
    c2 = other.claim(other.register_worker("r1").id)
    assert c2 is not None and c2.samples[0].checkpoint is not None
    assert c2.samples[0].checkpoint.env_state == _state()
    assert c2.samples[0].checkpoint.same_as(p)


def test_events_with_nul_in_payload_and_message_are_stored(db: Database, engine: sa.Engine) -> None:
    with db.transaction() as tx:
        tx.events.add("tool.error", "test", "tool said a\x00b", payload={"out": "a\x00b"})
    with db.transaction() as tx:
        (ev,) = tx.events.list(kind="tool.error")
    assert ev.payload == {"out": "a\x00b"}
    assert "\x00" not in ev.message and ev.message.startswith("tool said a")
    assert scalar(engine, "SELECT count(*) FROM events WHERE kind = 'tool.error'") == 1
