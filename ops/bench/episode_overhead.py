"""What the episode runtime itself costs per turn of a built-in plugin's episode, with the engine
and the tools made free: a scripted engine (the same tool call every turn, no model) and the
plugin's tool called in this process. What is left is the runtime's own work per turn: the
record and its replay bookkeeping, rendering and encoding the observation segment, parsing the
turn, the checkpoint hand-off (``on_turn``, here building the payload the node would write).

Usage: python ops/bench/episode_overhead.py [--episodes 300] [--turns 16]
Prints µs per turn (median and p90 over the episodes after 20 warm-up ones) and checkpoints per
turn, then (last line) one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rollcall.tasks.guess import GuessSpec, GuessTask
from rollcall.workers.episode.chat import chat_for
from rollcall.workers.episode.engine import EngineHealth, Generation, GenerationRequest
from rollcall.workers.episode.play import player
from rollcall.workers.episode.tools import ToolResult, ToolRunner
from rollcall.workers.episode.trajectory import Limits, Trajectory
from rollcall.workers.tiny_model import SHIPPED

WARMUP = 20
TURN = '<tool>{"name": "guess", "arguments": {"number": 50}}</tool><|end|>'


class ScriptedEngine:
    """A fake engine (named so): the same guess every turn, made-up log-probs, no model."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.version = 1
        self.ids = list(tokenizer.encode(TURN, add_special_tokens=False))

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        return [Generation(list(self.ids), [-0.1] * len(self.ids), "stop", 1) for _ in requests]

    def load_weights(self, version: int, location: str) -> None:
        self.version = version

    def health(self) -> EngineHealth:
        return EngineHealth(self.version, 0, 0)


class InProcess(ToolRunner):
    """The plugin's tool called in this process: no tool server, no timeout."""

    def __init__(self) -> None:
        self.timeout_s = 5.0

    def call(
        self,
        plugin: Any,
        spec: Any,
        prompt: Any,
        state: Any,
        name: str,
        arguments: Any,
        network: bool = False,
    ) -> ToolResult:
        obs = plugin.call_tool(spec, prompt, state, name, arguments)
        return ToolResult(obs.text, obs.state, obs.done, False)

    def close(self) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=300)
    ap.add_argument("--turns", type=int, default=16, help="1-64 (the game's guesses)")
    args = ap.parse_args()
    if not 1 <= args.turns <= 64 or args.episodes < 2:
        ap.error("--turns must be 1-64 and --episodes at least 2")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SHIPPED)
    chat = chat_for(tokenizer)
    engine, runner = ScriptedEngine(tokenizer), InProcess()
    task = GuessTask()
    spec = GuessSpec(max_turns=args.turns, max_guesses=64)
    limits = Limits(max_turns=args.turns, max_tokens_per_turn=64, max_tokens=1_000_000)
    per_turn: list[float] = []
    checkpoints: list[float] = []
    tokens = 0
    for i in range(WARMUP + args.episodes):
        handed = [0]

        def on_turn(t: Trajectory, handed: list[int] = handed) -> None:
            handed[0] += 1
            t.payload()  # what the node builds to write the checkpoint

        t0 = time.perf_counter()
        out = player(engine, chat, task, spec, {"secret": 10}, runner, limits).run(on_turn=on_turn)
        elapsed = time.perf_counter() - t0
        if i >= WARMUP:
            per_turn.append(elapsed / out.turns * 1e6)
            checkpoints.append(handed[0] / out.turns)
            tokens = len(out.trajectory.token_ids)
    p50 = statistics.median(per_turn)
    p90 = statistics.quantiles(per_turn, n=10)[-1]
    print(
        f"{args.episodes} episodes of {args.turns} turns ({tokens} tokens): {p50:.0f} µs per "
        f"turn (p90 {p90:.0f}), {statistics.mean(checkpoints):.2f} checkpoints per turn"
    )
    figures = {"us_per_turn_p50": round(p50), "us_per_turn_p90": round(p90), "turns": args.turns}
    figures["checkpoints_per_turn"] = round(statistics.mean(checkpoints), 3)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
