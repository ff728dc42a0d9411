"""Warm start: supervised fine-tuning on synthetic solved transcripts of the built-in tasks.

An oracle policy per task (it knows the ground truth) plays episodes through the real tools and
the chat format of the agent loop; the model is trained on the generated turns only (the same
loss mask RL uses). A short run leaves the policy non-trivial but far from perfect, which is
where RL has something to learn.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tasks import registry
from tasks.base import TaskPlugin, TaskSpec, ToolError
from workers.rollout.chat import END, Answer, observation_text, parse_turn, prompt_text

Oracle = Callable[[str | None], str]


def _tool(name: str, **arguments: Any) -> str:
    return f"<tool>{json.dumps({'name': name, 'arguments': arguments})}</tool>"


def make_oracle(task: str, prompt: dict[str, Any], spec: TaskSpec) -> Oracle:
    """A function from the last observation (None at the start) to the next turn's text."""
    if task == "echo":
        return lambda obs: f"<answer>{prompt['target']}</answer>"
    if task == "calculator":
        return lambda obs: (
            _tool("calc", expression=prompt["expression"])
            if obs is None
            else f"<answer>{obs}</answer>"
        )
    if task == "guess":
        bounds = {"lo": getattr(spec, "low", 1), "hi": getattr(spec, "high", 100), "last": 0}

        def guess(obs: str | None) -> str:
            if obs is not None and obs.startswith("higher"):
                bounds["lo"] = bounds["last"] + 1
            elif obs is not None and obs.startswith("lower"):
                bounds["hi"] = bounds["last"] - 1
            bounds["last"] = (bounds["lo"] + bounds["hi"]) // 2
            return _tool("guess", number=bounds["last"])

        return guess
    if task == "retrieval":
        steps: list[str] = []

        def look(obs: str | None) -> str:
            if obs is None:
                subject = prompt["subject"]
                steps.append("search")
                return _tool("search", query=subject)
            if steps[-1] == "search":
                steps.append("open")
                return _tool("open", doc_id=obs.splitlines()[0].split(":")[0])
            capital = re.search(r"Its capital is (\w+)", obs)
            if prompt["kind"] == "capital_export" and capital and "capital" not in steps:
                steps.extend(["capital", "search"])
                return _tool("search", query=capital.group(1))
            return f"<answer>{prompt['answer']}</answer>"

        return look
    raise ValueError(f"no oracle for task {task!r}")


@dataclass(frozen=True)
class Transcript:
    token_ids: list[int]
    loss_mask: list[int]


def transcript(
    plugin: TaskPlugin, spec: TaskSpec, prompt: dict[str, Any], tokenizer: Any
) -> Transcript:
    def enc(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    ids = enc(prompt_text(plugin.tools(spec), plugin.instructions(spec, prompt)))
    mask = [0] * len(ids)
    oracle = make_oracle(plugin.name, prompt, spec)
    state = plugin.initial_state(spec, prompt)
    obs: str | None = None
    for _ in range(spec.max_turns):
        text = oracle(obs) + END
        turn = enc(text)
        ids, mask = ids + turn, mask + [1] * len(turn)
        action = parse_turn(text)
        if isinstance(action, Answer):
            break
        assert not isinstance(action, str)
        try:
            result = plugin.call_tool(spec, prompt, state, action.name, action.arguments)  # type: ignore[union-attr]
            obs, state, done = result.text, result.state, result.done
        except ToolError as e:
            obs, done = f"error: {e}", False
        if done:
            break
        seg = enc(observation_text(obs))
        ids, mask = ids + seg, mask + [0] * len(seg)
    return Transcript(ids, mask)


def build_dataset(
    tokenizer: Any, per_task: int, tasks: tuple[str, ...], seed: int
) -> list[Transcript]:
    data = []
    for name in tasks:
        plugin = registry.get(name)
        spec = plugin.Spec()
        data += [
            transcript(plugin, spec, plugin.prompt(spec, i), tokenizer) for i in range(per_task)
        ]
    random.Random(seed).shuffle(data)
    return data


def sft(
    model: Any,
    data: list[Transcript],
    *,
    steps: int,
    batch_size: int = 16,
    lr: float = 3e-3,
    seed: int = 0,
    log: Callable[[int, float], None] | None = None,
) -> float:
    """Train on the generated tokens (loss mask 1); returns the last loss."""
    import torch

    torch.manual_seed(seed)
    rng = random.Random(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    loss_value = math.nan
    for step in range(steps):
        batch = [data[rng.randrange(len(data))] for _ in range(batch_size)]
        width = max(len(t.token_ids) for t in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
        labels = torch.full((len(batch), width), -100, dtype=torch.long)  # [B, T]
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for row, t in enumerate(batch):
            n = len(t.token_ids)
            ids[row, :n] = torch.tensor(t.token_ids)
            attn[row, :n] = 1
            lab = torch.tensor(t.token_ids)
            lab[torch.tensor(t.loss_mask) == 0] = -100
            labels[row, :n] = lab
        for group in opt.param_groups:  # cosine decay
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        out = model(input_ids=ids, attention_mask=attn, labels=labels)
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_value = float(out.loss.detach())
        if log is not None and (step % 50 == 0 or step == steps - 1):
            log(step, loss_value)
    model.eval()
    return loss_value


def evaluate_rewards(
    model_dir: str,
    tasks: tuple[str, ...],
    episodes: int,
    *,
    temperature: float = 1.0,
    max_tokens_per_turn: int = 64,
    seed: int = 0,
) -> dict[str, float]:
    """Mean reward per task on held-out prompts, sampling at ``temperature``; the agent loops
    of all tasks run concurrently against one batching engine."""
    from concurrent.futures import ThreadPoolExecutor

    from workers.rollout.agent import AgentLoop, Limits
    from workers.rollout.engines.batching import BatchingEngine
    from workers.rollout.engines.hf import HFEngine
    from workers.rollout.tools import ToolRunner

    hf = HFEngine(model_dir, seed=seed)
    engine = BatchingEngine(hf, max_batch=16)

    def one(job: tuple[str, int]) -> tuple[str, float]:
        name, i = job
        plugin = registry.get(name)
        spec = plugin.Spec()
        limits = Limits(
            max_turns=spec.max_turns,
            max_tokens_per_turn=max_tokens_per_turn,
            temperature=temperature,
        )
        with ToolRunner() as runner:
            loop = AgentLoop(
                engine, hf.tokenizer, plugin, spec, plugin.eval_prompt(spec, i), runner, limits
            )
            return name, loop.run().reward

    jobs = [(name, i) for name in tasks for i in range(episodes)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        results = list(pool.map(one, jobs))
    engine.close()
    return {name: sum(r for n, r in results if n == name) / episodes for name in tasks}
