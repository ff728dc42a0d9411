"""The tool sandbox through a real rollout node (in-process, real PostgreSQL, the tiny model):
the node says at start what a tool call gets on this machine, and an agent's isolated tool
reaches the network only for a task in ``rollout.tool_sandbox.network_tasks``, without the
node's environment. ``tests/unit/test_tool_sandbox.py`` covers each protection."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from rollcall.orchestrator.config import BufferConfig, ToolSandboxConfig
from rollcall.orchestrator.db.engine import Database
from rollcall.workers.episode import sandbox
from rollcall.workers.episode.trajectory import Limits
from rollcall.workers.rollout.node import NodeConfig, RolloutNode
from tests.integration.buffer_helpers import rows

AGENT = """
import os, socket

from rollcall.workers.episode import Outcome, ToolCall


def probe(port: int) -> dict:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=3).close()
        net = "connected"
    except OSError as e:
        net = str(e)
    return {"net": net, "env": sorted(os.environ)}


async def agent(ctx, prompt):
    await ctx.chat([{"role": "user", "content": "Hi."}])
    call = ToolCall("c1", "probe", {"port": prompt["port"]})
    message = await ctx.tool(probe, call, isolate=True)
    return Outcome(reward=0.0, info={"probe": message["content"]})
"""


def test_an_isolated_tool_has_the_network_only_when_its_task_is_granted_it(
    tiny_dir: Path, db: Database, db_url: str, engine: sa.Engine, tmp_path: Path
) -> None:
    from rollcall.orchestrator.buffer.control import ControlPlaneBuffer
    from rollcall.orchestrator.services.tasks import register_task

    agent = tmp_path / "sandboxed.py"
    agent.write_text(AGENT)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(8)
        port = listening.getsockname()[1]
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"port": port, "i": i}) + "\n" for i in range(4)))
        with db.transaction() as tx:
            for name in ("open", "closed"):
                register_task(
                    tx, job_name="default", name=name, plugin="agent", actor="test",
                    max_inflight=1, max_staleness=4,
                    spec_data={
                        "agent": f"{agent}:agent", "group_size": 1, "max_turns": 1,
                        "prompts": {"path": str(prompts), "held_out_per_mille": 0},
                    },
                )  # fmt: skip
        buffer = BufferConfig(batch_groups=2)
        ControlPlaneBuffer(db, 1, buffer).seed()
        node = RolloutNode(
            db_url,
            1,
            NodeConfig(
                name="r0", model_dir=str(tiny_dir), concurrency=2, heartbeat_interval_s=0.5,
                limits=Limits(max_tokens_per_turn=8, max_tokens=256),
                tool_sandbox=ToolSandboxConfig(network_tasks=["open"]),
            ),
            buffer,
        )  # fmt: skip
        try:
            line = node.tool_sandbox_line
            assert line == sandbox.probe().describe(sandbox.Limits(), ["open"])
            assert line.startswith("tool sandbox: ")
            node.run(max_episodes=4)  # the two tasks take turns (equal weights)
        finally:
            node.stop()
    (said,) = rows(engine, "SELECT info->>'tool_sandbox' FROM workers")[0]
    assert said == line
    seen: dict[str, list[dict[str, Any]]] = {}
    for name, info in rows(
        engine,
        "SELECT t.name, tr.reward_info FROM trajectories tr JOIN tasks t ON t.id = tr.task_id",
    ):
        seen.setdefault(name, []).append(json.loads(info["info"]["probe"]))
    assert set(seen) == {"open", "closed"}, seen
    assert sandbox.probe().network, sandbox.probe().network_error  # CI's machines have it
    for name, probes in seen.items():
        for probe in probes:
            if name == "open":
                assert probe["net"] == "connected", probe
            else:
                assert "Network is unreachable" in probe["net"], probe
            assert set(probe["env"]) <= {"PATH", "LANG", "HOME", "TMPDIR"}, probe["env"]
