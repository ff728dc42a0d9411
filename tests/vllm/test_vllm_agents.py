"""Agent functions on a vLLM node (CPU build): the job of ``tests/integration/test_agents.py``
(an agent through ``ctx.chat`` and the OpenAI endpoint, and a non-deterministic one), its node
SIGKILLed in the middle of the agent's third call. Its first two calls come back from
PostgreSQL, none is generated again, the divergent replay is reported, nothing is lost.

Each job costs two vLLM starts (the node's and its restart's), about 270 s under CI's load: the
node killed in an endpoint call runs on every push; the EngineCore killed in a ``ctx.chat`` call
is in the long tier (``pytest -m long``). What it adds is held per push by: the agent's replay
from PostgreSQL after a vLLM node's death (the endpoint test here; ``ctx.chat`` calls, the
same replay, in tests/integration/test_agents.py on hf), a dead EngineCore found by the node,
its episodes given back uncounted and resumed without regenerating a checkpointed turn, in a
job (test_vllm_job.py's ``kill-engine`` drill: ``resumed_turns == checkpointed_turns``, nothing
lost) and at the node (test_vllm_node.py: every lease back at once, its attempt not counted)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from rollcall.orchestrator.config import VLLMEngineConfig
from rollcall.orchestrator.db.engine import Database
from tests.integration.test_agents import kill_mid_call_and_replay

pytestmark = pytest.mark.timeout(900)


VLLM = {
    "engine": VLLMEngineConfig(kind="vllm", device="cpu", dtype="float32"),
    "start_timeout_s": 300.0,
}


def test_an_openai_client_agent_on_vllm_killed_mid_call_resumes_without_regenerating(
    ray_local: Any, vllm_tiny_dir: Path, db: Database, engine: sa.Engine, tmp_path: Path
) -> None:
    """The node SIGKILLed while the agent's third call, an HTTP request to the node's endpoint,
    generates."""
    got = kill_mid_call_and_replay(vllm_tiny_dir, db, engine, tmp_path, VLLM, endpoint_turns=(0, 2))
    print("vLLM, node killed in an endpoint call:", got)


@pytest.mark.long
def test_an_agent_on_vllm_whose_engine_core_dies_mid_call_resumes_without_regenerating(
    ray_local: Any, vllm_tiny_dir: Path, db: Database, engine: sa.Engine, tmp_path: Path
) -> None:
    """vLLM's EngineCore SIGKILLed in the agent's third call (a ``ctx.chat``): the actor lives,
    learns of the death, gives its episodes back uncounted and is restarted."""
    got = kill_mid_call_and_replay(
        vllm_tiny_dir, db, engine, tmp_path, VLLM, hook="kill_engine_third"
    )
    print("vLLM, EngineCore killed in a ctx.chat call:", got)
