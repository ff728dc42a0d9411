"""Reward on held-out prompts: the learning curve's measurements.

``Evaluator`` hosts its own ``hf`` engine (so evaluation never touches the buffer or the rollout
nodes' engines), loads a published version, and plays each task's held-out prompts
(``plugin.eval_prompt``) through the same agent loop as rollout, all loops batched together.
``evaluator_actor()`` makes it a Ray actor.

Evaluation is deterministic: held-out prompt ``i`` of a task is always the same prompt, and its
episode samples with a seed of its own (``episode_seed``: the run's seed, the task, ``i``;
``GenerationRequest.seed``), so the same weights give the same rewards whatever else shares the
batch, and two evaluations of one checkpoint agree.
"""

from __future__ import annotations

import logging
import queue
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rollcall.orchestrator.config import InputLimitsConfig, ToolSandboxConfig
from rollcall.tasks import registry
from rollcall.workers.episode.chat import chat_for
from rollcall.workers.episode.play import player
from rollcall.workers.episode.tools import ToolRunner
from rollcall.workers.episode.trajectory import Limits
from rollcall.workers.episode.usercode import UserCodeError
from rollcall.workers.rollout.engines.batching import BatchingEngine
from rollcall.workers.rollout.engines.hf import HFEngine
from rollcall.workers.weights import wait_published

log = logging.getLogger(__name__)


def episode_seed(seed: int, task: str, index: int, sample: int = 0) -> int:
    """The sampling seed of sample ``sample`` of held-out episode ``index`` of ``task``."""
    base = seed * 1_000_003 + zlib.crc32(task.encode()) * 65_537 + index
    return (base + sample * 0x9E3779B97F4A7C15) % (1 << 62)


@dataclass(frozen=True)
class EvalTask:
    name: str
    plugin: str
    spec: dict[str, Any]


class Evaluator:
    def __init__(
        self,
        model_dir: str,
        *,
        max_tokens_per_turn: int = 64,
        max_tokens: int = 2048,
        temperature: float = 1.0,
        concurrency: int = 16,
        seed: int = 0,
        threads: int = 1,
        tool_format: str = "auto",
        chat_template: str | None = None,
        tool_sandbox: ToolSandboxConfig | None = None,
        input_limits: InputLimitsConfig | None = None,
    ) -> None:
        import torch

        torch.set_num_threads(threads)
        self.hf = HFEngine(model_dir, seed=seed)
        self.engine = BatchingEngine(self.hf, max_batch=concurrency)
        self.concurrency = concurrency
        self.max_tokens_per_turn = max_tokens_per_turn
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.seed = seed

        self.chat = chat_for(self.hf.tokenizer, tool_format, chat_template)
        # One tool process per concurrent episode, reused by the episodes that follow (as a
        # rollout node's agent loops do): a new process per episode costs a process start and
        # its imports, 128 times per evaluation of the quickstart.
        self._runners: queue.SimpleQueue[ToolRunner] = queue.SimpleQueue()
        self.tool_sandbox = tool_sandbox or ToolSandboxConfig()
        self.input_limits = input_limits or InputLimitsConfig()
        observation = self.input_limits.observation_bytes
        self._all_runners = [
            ToolRunner(sandbox=self.tool_sandbox, observation_bytes=observation)
            for _ in range(concurrency)
        ]
        for r in self._all_runners:
            self._runners.put(r)

    def evaluate(
        self,
        tasks: list[EvalTask],
        episodes: int,
        version: int = 0,
        location: str | None = None,
    ) -> dict[str, list[float]]:
        """The reward of each held-out prompt 0..episodes-1 per task, under ``version``."""
        got = self.evaluate_samples(tasks, episodes, 1, version, location)
        return {task: [rs[0] for rs in prompts] for task, prompts in got.items()}

    def evaluate_samples(
        self,
        tasks: list[EvalTask],
        episodes: int,
        samples: int,
        version: int = 0,
        location: str | None = None,
    ) -> dict[str, list[list[float]]]:
        """The rewards of ``samples`` episodes of each held-out prompt 0..episodes-1 per task
        (per prompt, per sample), under ``version``; sample 0 is the episode ``evaluate``
        plays."""
        if location is not None and version != self.engine.version:
            wait_published(location)  # written in the background (collective transport)
            self.engine.load_weights(version, location)

        def one(job: tuple[EvalTask, int, int]) -> float:
            task, i, j = job
            plugin = registry.get(task.plugin)
            spec = plugin.Spec.model_validate(task.spec)
            limits = Limits(
                max_turns=spec.max_turns,
                max_tokens_per_turn=self.max_tokens_per_turn,
                max_tokens=self.max_tokens,
                temperature=self.temperature,
                seed=episode_seed(self.seed, task.name, i, j),
                tool_arguments_bytes=self.input_limits.tool_arguments_bytes,
                observation_bytes=self.input_limits.observation_bytes,
                step_result_bytes=self.input_limits.step_result_bytes,
                request_body_bytes=self.input_limits.request_body_bytes,
                network=task.name in self.tool_sandbox.network_tasks,
            )
            runner = self._runners.get()
            try:
                loop = player(
                    self.engine,
                    self.chat,
                    plugin,
                    spec,
                    plugin.eval_prompt(spec, i),
                    runner,
                    limits,
                )
                return loop.run().reward
            except UserCodeError as e:  # the prompt's fault: it scores 0, the rest go on
                log.warning("held-out episode %s of %s: %s (%s)", i, task.name, e, e.location)
                return 0.0
            finally:
                self._runners.put(runner)

        jobs = [(t, i, j) for t in tasks for i in range(episodes) for j in range(samples)]
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            results = iter(list(pool.map(one, jobs)))
        return {
            t.name: [[next(results) for _ in range(samples)] for _ in range(episodes)]
            for t in tasks
        }

    def close(self) -> None:
        self.engine.close()
        for r in self._all_runners:
            r.close()


def evaluator_actor(num_cpus: float = 0.0) -> Any:
    import ray

    return ray.remote(num_cpus=num_cpus, max_restarts=0)(Evaluator)
