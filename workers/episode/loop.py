"""The agent loop: one trajectory, turn by turn, token-in/token-out.

Guarantees:

- The trajectory's tokens are exactly what the engine consumed and produced: every segment is
  encoded once and appended; earlier turns are never re-encoded from text. Each generation
  request's context is the trajectory so far. The conversation is in the model's own chat
  template and tool-call format (``rollcall.workers.episode.chat.Chat``): the prompt and each
  observation segment are rendered by the template; generated turns are kept as generated.
- A final answer is read by the task (``read_answer``) before the reward sees it.
- Generated tokens carry loss mask 1 and their behaviour log-probs; prompt and tool-observation
  tokens carry mask 0 and log-prob 0. Every turn records the policy version that generated it.
- After every turn the trajectory is handed to ``on_turn`` (the rollout node checkpoints it
  through the buffer, fenced by its lease). Given such a checkpoint, ``run`` resumes
  mid-trajectory with the earlier turns unchanged.
- Malformed turns, unknown tools, bad arguments, tool errors and timeouts become error
  observations for the model; limits (turns, tokens per turn, tokens per trajectory) end the
  trajectory without an answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollcall.orchestrator.domain import TrajectoryPayload
from rollcall.orchestrator.inputs import json_bytes, too_big
from rollcall.tasks.base import TaskPlugin, TaskSpec
from rollcall.workers.episode.chat import Chat, chat_for
from rollcall.workers.episode.engine import Engine, GenerationRequest
from rollcall.workers.episode.toolcalls import Answer, Malformed, ParsedCall
from rollcall.workers.episode.tools import ToolRunner
from rollcall.workers.episode.usercode import check_json, check_reward, user_call


@dataclass(frozen=True)
class Limits:
    max_turns: int = 8
    max_tokens_per_turn: int = 96
    max_tokens: int = 2048
    temperature: float = 1.0
    seed: int | None = None  # seeded sampling (``GenerationRequest.seed``): evaluation only
    # the most bytes of each untrusted input an episode meets (rollout.input_limits)
    tool_arguments_bytes: int = 64 * 1024
    observation_bytes: int = 64 * 1024
    step_result_bytes: int = 1024 * 1024
    request_body_bytes: int = 8 * 1024 * 1024
    # the task's tools may use the network (rollout.tool_sandbox.network_tasks)
    network: bool = False


@dataclass
class Trajectory:
    """A trajectory under construction (and what a checkpoint restores)."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_offsets: list[int] = field(default_factory=list)
    turn_versions: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    state: dict[str, Any] = field(default_factory=dict)
    answer: str | None = None
    finished: bool = False
    stop_reason: str = ""

    def append(
        self, ids: list[int], *, generated: bool, logprobs: list[float] | None = None
    ) -> None:
        self.token_ids += ids
        self.loss_mask += [1 if generated else 0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def payload(self) -> TrajectoryPayload:
        return TrajectoryPayload.build(
            self.token_ids,
            self.loss_mask,
            self.logprobs,
            turn_offsets=self.turn_offsets,
            turn_versions=self.turn_versions,
            prompt_tokens=self.prompt_tokens,
            env_state={
                "state": self.state,
                "answer": self.answer,
                "stop_reason": self.stop_reason,
            },
            finished=self.finished,
        )

    @classmethod
    def from_payload(cls, p: TrajectoryPayload) -> Trajectory:
        return cls(
            token_ids=[int(x) for x in p.token_ids],
            loss_mask=[int(x) for x in p.loss_mask],
            logprobs=[float(x) for x in p.behaviour_logprobs],
            turn_offsets=list(p.turn_offsets),
            turn_versions=list(p.turn_versions),
            prompt_tokens=p.prompt_tokens,
            state=dict(p.env_state.get("state", {})),
            answer=p.env_state.get("answer"),
            finished=p.finished,
            stop_reason=str(p.env_state.get("stop_reason", "")),
        )


@dataclass(frozen=True)
class Played:
    trajectory: Trajectory
    reward: float
    turns: int


class AgentLoop:
    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        plugin: TaskPlugin,
        spec: TaskSpec,
        prompt: dict[str, Any],
        tools: ToolRunner,
        limits: Limits | None = None,
        chat: Chat | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.plugin = plugin
        self.spec = spec
        self.prompt = prompt
        self.tools = tools
        self.limits = limits or Limits(max_turns=spec.max_turns)
        self.chat = chat or chat_for(tokenizer)
        # the plugin's code is the task's (the user's): what it raises fails the episode as its
        # input's fault (UserCodeError), never the node
        self._tools = user_call("the task's tools", plugin.tools, spec)
        self._instructions = user_call("the task's instructions", plugin.instructions, spec, prompt)

    def start(self) -> Trajectory:
        state = user_call("the task's initial state", self.plugin.initial_state, self.spec,
                          self.prompt)  # fmt: skip
        check_json(state, "the task's initial state", self.plugin.initial_state)
        t = Trajectory(state=state)
        ids = self.chat.prompt_ids(self._tools, self._instructions)
        t.append(ids, generated=False)
        t.prompt_tokens = len(ids)
        return t

    def run(
        self,
        resume: TrajectoryPayload | None = None,
        on_turn: Callable[[Trajectory], None] | None = None,
    ) -> Played:
        t = Trajectory.from_payload(resume) if resume is not None else self.start()
        while not t.finished:
            self.step(t)
            if on_turn is not None:
                on_turn(t)
        reward = user_call(
            "the task's reward",
            self.plugin.reward,
            self.spec, self.prompt, t.answer, t.state, len(t.turn_offsets),
        )  # fmt: skip
        reward = check_reward(reward, "the task's reward", self.plugin.reward)
        return Played(t, reward, len(t.turn_offsets))

    def step(self, t: Trajectory) -> None:
        """One turn: generate, then apply the tool call or take the answer."""
        budget = min(self.limits.max_tokens_per_turn, self.limits.max_tokens - len(t.token_ids))
        if len(t.turn_offsets) >= self.limits.max_turns or budget <= 0:
            t.finished, t.stop_reason = True, "turn limit" if budget > 0 else "token limit"
            return
        gen = self.engine.generate(
            [
                GenerationRequest(
                    list(t.token_ids), budget, self.limits.temperature, self.limits.seed
                )
            ]
        )[0]
        t.turn_offsets.append(len(t.token_ids))
        t.turn_versions.append(gen.version)
        t.append(gen.token_ids, generated=True, logprobs=gen.logprobs)
        if gen.finish_reason != "stop":
            observation = "error: the turn was cut off; end each turn with a tool call or an answer"
            done = False
        else:
            action = self.chat.parse(gen.token_ids)
            done = False
            if isinstance(action, Answer):
                t.answer, t.finished, t.stop_reason = self._read(action.text), True, "answer"
                return
            if isinstance(action, Malformed):
                observation = f"error: {action.reason}"
            else:
                assert isinstance(action, ParsedCall)
                refused = _arguments_problem(action, self.limits.tool_arguments_bytes)
                if refused is not None:
                    observation = refused
                else:
                    result = self.tools.call(
                        self.plugin, self.spec, self.prompt, t.state, action.name,
                        action.arguments, network=self.limits.network,
                    )  # fmt: skip
                    observation, t.state, done = result.observation, result.state, result.done
                    check_json(t.state, "the task's state after a tool call", self.plugin.call_tool)
        if done:  # the environment ended the episode (e.g. the game was won)
            t.finished, t.stop_reason = True, "environment"
            return
        ended = gen.finish_reason == "stop"
        ids = self.chat.observation_ids(self._tools, self._instructions, observation, ended=ended)
        t.append(ids, generated=False)

    def _read(self, text: str) -> str | None:
        """The final answer as the task reads it (``read_answer``; plugins without one take
        the text as written)."""
        read = getattr(self.plugin, "read_answer", None)
        return text if read is None else user_call("the task's read_answer", read, self.spec, text)


def _arguments_problem(call: ParsedCall, limit: int) -> str | None:
    """The error observation for tool-call arguments over ``limit`` bytes (the tool is not
    called), or None."""
    size = json_bytes(call.arguments)
    if size <= limit:
        return None
    return "error: " + too_big(
        f"the arguments of the call to {call.name[:64]!r}", size, "tool_arguments_bytes", limit
    )
