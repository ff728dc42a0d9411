"""A vLLM engine that fails inside its EngineCore's start keeps its root cause (issue #46): vLLM's
frontend says only "Engine core initialization failed. See root cause above"; the cause is what
the EngineCore and its worker wrote. The failure here is real and only the core's worker sees
it: a KV cache of 1,024 GiB (``cpu_kv_cache_gib``, valid config) is more than the machine's free
memory, which the CPU worker checks after loading the model (vLLM's ``determine_available_memory``:
"Available memory on node 0 (...) on kv cache allocation is less than requested memory for kv
(1024.0 GiB)"), the same check a restart meets when the killed node's EngineCore still holds
its memory (docs/fault-tolerance.md). About 35 s each on two cores.

The node's case (a Ray actor under the supervisor) runs on every push and asserts what the
engine's own case does of the exception's last line (the root cause first, then vLLM's
"Engine core initialization failed"), through the event's evidence (its last line) and reason
(that line, cut at 300 characters); the engine started in this process (its exception's
``cause`` and ``output``, read from this process's own stdout and stderr) is in the long tier."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from rollcall.orchestrator.config import BufferConfig, VLLMEngineConfig
from rollcall.orchestrator.db.engine import Database
from tests.integration.buffer_helpers import rows
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(600)

# the worker's own words: in none of the exceptions the node's process sees without its
# processes' output
ROOT_CAUSE = "less than requested memory for kv (1024.0 GiB)"


def _too_big() -> VLLMEngineConfig:
    return VLLMEngineConfig(device="cpu", dtype="float32", cpu_kv_cache_gib=1024)


@pytest.mark.long
def test_an_engine_core_that_fails_to_start_raises_its_root_cause(
    vllm_tiny_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from rollcall.workers.rollout.engines.vllm import VLLMEngine

    # capfd: this process's stdout and stderr are files, as a Ray worker's are (its
    # worker-*.out / .err), whatever pytest's -s says
    with pytest.raises(Exception) as info:
        VLLMEngine(vllm_tiny_dir, _too_big())
    message = str(info.value)
    last = message.splitlines()[-1]
    # the last line (what the supervisor's restart line takes) names the root cause first
    assert last.startswith("ValueError: Available memory on node"), message
    assert ROOT_CAUSE in last and "Engine core initialization failed" in last, message
    cause, output = info.value.cause, info.value.output  # type: ignore[attr-defined]
    assert ROOT_CAUSE in cause
    assert 0 < len(output) <= 40 and sum(len(line) + 1 for line in output) <= 4096
    assert any(ROOT_CAUSE in line for line in output), output


def test_a_node_whose_engine_fails_to_start_leaves_its_cause_in_the_event(
    ray_local: Any, vllm_tiny_dir: Path, db: Database, db_url: str, engine: sa.Engine
) -> None:
    from rollcall.orchestrator.buffer.control import ControlPlaneBuffer
    from rollcall.orchestrator.runner.supervisor import Supervisor
    from rollcall.orchestrator.services.tasks import register_task
    from rollcall.workers.rollout.node import NodeConfig, rollout_actor

    with db.transaction() as tx:
        register_task(
            tx, job_name="default", name="calc", plugin="calculator", actor="test",
            max_staleness=50, max_inflight=4, spec_data={"group_size": 2, "max_turns": 1},
        )  # fmt: skip
    buffer = ControlPlaneBuffer(db, 1, BufferConfig())
    lines: list[str] = []

    def start_node(index: int) -> Any:
        config = NodeConfig(
            name=f"rollout-{index}", model_dir=str(vllm_tiny_dir), heartbeat_interval_s=0.5,
            engine=_too_big(),
        )  # fmt: skip
        return rollout_actor(num_cpus=1).remote(db_url, 1, config)

    # a real Ray worker under the driver's log rotation (tests/conftest.py): its stdout and
    # stderr are Ray's pipes to worker-*.out / .err, which the engine reads back
    supervisor = Supervisor(buffer, start_node, nodes=1, max_restarts=0, say=lines.append)

    def failed() -> bool:
        supervisor.check()
        return supervisor.slots[0].failed

    try:
        wait_for("the slot failed", failed, 300)
    finally:
        supervisor.stop()
    events = rows(engine, "SELECT kind, payload FROM events WHERE kind LIKE 'worker.%' ORDER BY id")
    kinds = [k for k, _ in events]
    assert kinds.count("worker.start_failed") == 1 and kinds.count("worker.failed") == 1, events
    assert kinds.index("worker.start_failed") < kinds.index("worker.failed"), events
    started, ended = (p for k, p in events if k in ("worker.start_failed", "worker.failed"))
    # countable, with a cause: the reason names the root cause, the evidence shows it
    assert ROOT_CAUSE in started["reason"] and ROOT_CAUSE in ended["reason"], events
    assert started["reason"].startswith("failed to start: constructor raised ValueError")
    # the exception's last line, the evidence's last, names the root cause first, then what
    # vLLM's frontend said; the reason (what the supervisor's restart line takes) is that line,
    # cut at 300 characters
    last = started["evidence"][-1].strip()
    assert last.startswith("ValueError: Available memory on node"), started
    assert ROOT_CAUSE in last and "Engine core initialization failed" in last, started
    assert started["reason"] == f"failed to start: constructor raised {last[:300]}", started
    evidence = started["evidence"]
    assert 0 < len(evidence) <= 40 and any(ROOT_CAUSE in line for line in evidence), evidence
    assert sum(len(line) + 1 for line in evidence) <= 4096, evidence
    # the supervisor's line in driver.log names it
    assert any(ROOT_CAUSE in line for line in lines if "FAILED" in line), lines
