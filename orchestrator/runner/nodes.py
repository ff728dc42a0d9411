"""The job driver's rollout nodes as it starts them and hears from them: a slot's
``NodeConfig`` and actor, from the job's config, their supervisor, and the nodes' reports
that go into each step's record (``NodeReports``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollcall.orchestrator.buffer.control import ControlPlaneBuffer
from rollcall.orchestrator.config import BufferConfig, RollcallConfig
from rollcall.orchestrator.runner.supervisor import Supervisor
from rollcall.workers.episode.trajectory import Limits
from rollcall.workers.rollout.node import NodeConfig, rollout_actor

if TYPE_CHECKING:
    from rollcall.workers.rollout.node import NodeConfig

# How long a step's bookkeeping waits for the rollout nodes' reports (NodeReports.collect).
NODE_REPORT_WAIT_S = 10.0


def node_config(
    cfg: RollcallConfig,
    index: int,
    *,
    model_dir: Path,
    chat_template: Any,
    engine_hook: str | None = None,
) -> NodeConfig:
    """The ``NodeConfig`` of rollout slot ``index``, from the job's config."""
    r = cfg.rollout
    return NodeConfig(
        name=f"rollout-{index}",
        model_dir=str(model_dir),
        concurrency=r.concurrency,
        heartbeat_interval_s=r.heartbeat_interval_s,
        tool_timeout_s=r.tool_timeout_s,
        limits=Limits(
            max_tokens_per_turn=r.max_tokens_per_turn,
            max_tokens=r.max_tokens,
            temperature=r.temperature,
        ),
        engine=r.engine_of(index),
        seed=cfg.run.seed * 1000 + index,
        threads=max(1, int(r.cpus_per_node)),
        lora_rank=cfg.trainer.lora.rank if cfg.trainer.lora is not None else None,
        breaker_failures=r.breaker_failures,
        retry_backoff_s=cfg.buffer.retry_backoff_s,
        failing_task_window=r.failing_task_window,
        failing_task_min_episodes=r.failing_task_min_episodes,
        tool_format=cfg.model.tool_format,
        chat_template=chat_template,
        engine_hook=engine_hook,
        endpoint_host=r.agent_endpoint_host,
        weights_transport=cfg.trainer.weights.transport,
        weights_grace_s=cfg.trainer.weights.grace_s,
        db_connections=r.db_connections,
        db_idle_tx_timeout_s=cfg.control_plane.heartbeat_timeout_s,
        tool_sandbox=r.tool_sandbox,
        input_limits=r.input_limits,
    )


def make_node(
    cfg: RollcallConfig,
    database_url: str,
    job_id: int,
    config: NodeConfig,
    buffer: BufferConfig,
    strategy: Any = None,
) -> Any:
    """A rollout slot's actor, in its placement group's bundle (``strategy``)."""
    r = cfg.rollout
    actor = rollout_actor(
        num_cpus=r.cpus_per_node,
        num_gpus=r.gpus_per_node,
        resources=r.resources,
        scheduling_strategy=strategy,
    )
    return actor.remote(database_url, job_id, config, buffer)


class NodeReports:
    """The rollout nodes' own reports (weight-load latency, progress), asked for after each
    step. A node that has not answered the last step's request (frozen, or swamped) is not
    asked nor waited for again until it has: a hung node holds up one step's bookkeeping, not
    every step's until it is declared dead."""

    def __init__(self) -> None:
        self.unanswered: dict[str, Any] = {}  # node actor id -> its report request still owed

    def collect(self, actors: list[Any], metrics: Any = None) -> dict[str, float]:
        """Ask the nodes and wait up to ``NODE_REPORT_WAIT_S``; the figures are of the nodes
        that answered (none: no figures), handed to the exporter (``metrics``) too; the
        others show in their heartbeats."""
        import ray

        asked: dict[str, Any] = {}
        owing: dict[str, Any] = {}
        for actor in actors:
            key = actor._actor_id.hex()
            last = self.unanswered.get(key)
            if last is not None and not ray.wait([last], timeout=0)[0]:
                owing[key] = last
            else:
                asked[key] = actor.report.remote()
        refs = list(asked.values())
        ready = ray.wait(refs, num_returns=len(refs), timeout=NODE_REPORT_WAIT_S)[0] if refs else []
        answered = {ref.hex() for ref in ready}
        self.unanswered = owing | {k: r for k, r in asked.items() if r.hex() not in answered}
        reports = []
        for ref in ready:
            with contextlib.suppress(Exception):  # a node that died: its heartbeat shows it
                reports.append(ray.get(ref, timeout=0))
        if (refs or owing) and not reports:
            return {}
        if metrics is not None:
            metrics.take_reports(reports)
        loads = [r["weight_load_s_last"] for r in reports if r["weight_loads"]]
        return {
            "weight_load_s_max": max(loads) if loads else 0.0,
            "node_versions_min": float(min(r["version"] for r in reports)) if reports else 0.0,
            "tokens_generated": float(sum(r["tokens_generated"] for r in reports)),
        }


def make_supervisor(
    cfg: RollcallConfig,
    buffer: ControlPlaneBuffer,
    start_node: Callable[..., Any],
    placement: Any,
    say: Callable[[str], None],
) -> Any:
    """The rollout nodes' supervisor (``supervisor.py``), with the config's fleet and budgets;
    ``start_node(index, strategy)`` starts a slot's actor."""
    r = cfg.rollout
    return Supervisor(
        buffer,
        start_node,
        nodes=r.nodes,
        max_restarts=r.max_restarts,
        restart_window_s=r.restart_window_s,
        backoff_base_s=r.restart_backoff_s,
        start_timeout_s=r.start_timeout_s,
        engine_start_timeout_s=r.engine_start_timeout_s,
        machine_verdict_s=r.machine_verdict_s,
        drain_timeout_s=r.drain_timeout_s,
        placement=placement,
        say=say,
    )
