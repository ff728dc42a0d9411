"""A trajectory under construction, the limits an episode plays within, and what playing one
gives back.

Guarantees of every episode (``rollcall.workers.episode.runtime``, which plays a built-in
plugin through ``rollcall.workers.episode.plugin`` and a user's agent function alike):

- The trajectory's tokens are exactly what the engine consumed and produced: every segment is
  encoded once and appended; earlier turns are never re-encoded from text. Each generation
  request's context is the trajectory so far, in the model's own chat template and tool-call
  format (``rollcall.workers.episode.chat.Chat``).
- Generated tokens carry loss mask 1 and their behaviour log-probs; prompt, observation and
  other message tokens carry mask 0 and log-prob 0. Every turn records the policy version that
  generated it.
- The trajectory is checkpointed (``on_turn``) as the episode goes; given a checkpoint, a run
  resumes with the earlier turns unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollcall.orchestrator.domain import TrajectoryPayload


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
