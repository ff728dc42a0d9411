"""The collective weight transport into real vLLM (the CPU build): the trainer's rank 0
broadcasts each committed version over gloo to vLLM's worker process, which receives it whole
into staging memory and loads it in place through the worker extension
(``rollcall_receive_weights``: the same layer-wise reload and checks as a file), and the node
generates with it. The loss of a member mid-broadcast is tested with hf nodes
(``tests/integration/test_weight_broadcast.py``): the receive is the same code.

In the long tier (``pytest -m long``: a job of its own, one vLLM start, about 95 s under CI's
load). Held on every push by: test_weight_broadcast_script.py (the trainer's ``collective.send``
of full weights over gloo into vLLM's worker through ``VLLMEngine.receive_weights``, the node's
receive, in several buckets; each version then samples exactly as its file loaded), test_vllm_lora.py
(a vLLM node in a job with ``transport: collective``: each version broadcast, loaded by the node
and generated with) and tests/integration/test_weight_broadcast.py (a job's membership, every
version to every node, on hf)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from rollcall.orchestrator.db.engine import Database
from tests.integration.buffer_helpers import rows, scalar
from tests.integration.test_weight_broadcast import broadcasts, config, nothing_lost, run_job

pytestmark = pytest.mark.timeout(900)


@pytest.mark.long
def test_versions_are_broadcast_into_vllm_and_generated_with(
    ray_local: Any, vllm_tiny_dir: Path, db: Database, engine: sa.Engine, tmp_path: Path
) -> None:
    cfg = config(
        tmp_path,
        vllm_tiny_dir,
        4,
        nodes=1,
        engine={"kind": "vllm", "device": "cpu", "dtype": "float32"},
        start_timeout_s=300.0,
    )
    result = run_job(cfg, db, vllm_tiny_dir, tmp_path, None)
    assert result.steps == 4
    events = broadcasts(engine)
    assert [e["version"] for e in events] == [1, 2, 3, 4]
    assert all(e["loaded"] == e["members"] and not e["errors"] for e in events), events
    reached = [e for e in events if e["loaded"] == ["rollout-0"]]
    assert len(reached) >= 3, events  # the node is a member once up (first: from the file)
    # turns generated under broadcast versions
    turns = {v[0] for v in rows(engine, "SELECT DISTINCT unnest(turn_versions) FROM trajectories")}
    assert turns & {e["version"] for e in reached[:-1]}, (turns, events)
    assert scalar(engine, "SELECT max(loaded_version) FROM workers WHERE role = 'rollout'") == 4
    nothing_lost(db, engine, 4)
