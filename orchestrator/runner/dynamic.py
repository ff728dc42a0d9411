"""Dynamic sampling (DAPO): a step trains ``buffer.batch_groups`` groups whose rewards differ.

A group whose trained rewards (shaped, as the step trains them) are all equal carries no
learning signal: under a group baseline its advantages are exact zeros. With
``trainer.loss.dynamic_sampling`` on, once the step's batch is claimed the driver counts the
groups with variance; while there are fewer than ``buffer.batch_groups``, it reserves as many
more finished groups as it lacks into the same step (``TrainerBuffer.extend_batch``, one extra
claim), waiting for rollout to finish them the way the trainer loop waits for a batch, up to
``max_claims`` extra claims. The groups without variance stay reserved and are consumed by the
step's commit without being trained (``groups_filtered``), so every group ends trained, expired
or quarantined as before; the reservation is the step's, so a restarted driver replays all of
it and goes on from the claims it counts. At the limit the step trains the groups with variance
it has, saying so, and naming each task that produced none; a step with none at all stops the
job (``JobFailedError``): there is nothing to train.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from rollcall.orchestrator.algorithms import DynamicSampling, LossConfig
from rollcall.orchestrator.buffer.trainer import TrainerBuffer
from rollcall.orchestrator.buffer.types import DYNAMIC_CLAIMS, Batch
from rollcall.orchestrator.domain import BatchGroup
from rollcall.orchestrator.errors import JobFailedError
from rollcall.workers.trainer.batch import trained_rewards, with_variance

log = logging.getLogger(__name__)

EVENT = "trainer.dynamic_sampling"  # the limit was reached; the step trains what it has
FAILED_EVENT = "job.no_variance"  # the limit was reached with nothing to train


class DynamicSampler:
    """Fills a claimed batch with groups that have variance (``fill``)."""

    def __init__(
        self,
        loss: LossConfig,
        batch_groups: int,
        buffer: TrainerBuffer,
        *,
        job: str,
        say: Callable[[str], None],
    ) -> None:
        assert loss.dynamic_sampling is not None
        self.settings: DynamicSampling = loss.dynamic_sampling
        self.shaping = loss.reward_shaping
        self.batch_groups = batch_groups  # groups with variance a step trains
        self.buffer = buffer
        self.job = job
        self.say = say

    def fill(
        self,
        batch: Batch,
        *,
        wait: Callable[[int], None],
        stopped: Callable[[], bool],
    ) -> Batch | None:
        """``batch`` (the step's, claimed or replayed) with as many groups with variance as
        ``buffer.batch_groups``, or as many as ``max_claims`` extra claims found. ``wait(n)``
        waits for rollout to finish up to ``n`` groups (and checks that something still can);
        None when a stop was requested meanwhile: the step's reservation stays, replayed by
        ``--resume``."""
        shaping = self.shaping
        wanted = self.batch_groups
        groups = list(batch.groups)
        varied = with_variance(groups, shaping)
        mix, expired, prefetched = batch.task_mix, dict(batch.expired_groups), 0
        while (have := sum(varied)) < wanted and _claims(mix) < self.settings.max_claims:
            if stopped():
                return None
            extra = self.buffer.extend_batch(
                batch.step,
                wanted - have,
                have=[g.episode_id for g in groups],
                degenerate=_degenerate(groups, varied),
            )
            mix = extra.task_mix
            for name, n in extra.expired_groups.items():
                expired[name] = expired.get(name, 0) + n
            if not extra.groups:
                wait(extra.shortfall)
                continue
            groups += extra.groups
            varied += with_variance(extra.groups, shaping)
            prefetched += extra.prefetched_groups
        if _recorded(mix) != (degenerate := _degenerate(groups, varied)):
            # the step's task mix says how many of each task's groups are not trained
            mix = self.buffer.extend_batch(
                batch.step, 0, have=[g.episode_id for g in groups], degenerate=degenerate
            ).task_mix
        if have < wanted:
            self._limit(batch.step, groups, _claims(mix))
        order = sorted(range(len(groups)), key=lambda i: groups[i].episode_id)
        return dataclasses.replace(
            batch,
            groups=tuple(groups[i] for i in order),  # as a replay of the reservation loads them
            task_mix=mix,
            expired_groups=expired,
            prefetched_groups=batch.prefetched_groups + prefetched,
        )

    def _limit(self, step: int, groups: Sequence[BatchGroup], claims: int) -> None:
        """``max_claims`` reached short of a full batch: say so, naming each task that produced
        no group with variance; with nothing to train, stop the job."""
        shaped, _, _ = trained_rewards(groups, self.shaping)
        by_task: dict[str, list[list[float]]] = {}
        for g, rewards in zip(groups, shaped, strict=True):
            by_task.setdefault(g.task_name, []).append(rewards)
        have = sum(1 for rs in by_task.values() for r in rs if max(r) != min(r))
        limit = self.settings.max_claims
        silent = [
            no_variance_sentence(name, step, rs, claims)
            for name, rs in sorted(by_task.items())
            if all(max(r) == min(r) for r in rs)
        ]
        payload: dict[str, Any] = {
            "step": step,
            "claims": claims,
            "groups": len(groups),
            "with_variance": have,
            "tasks": {
                name: {
                    "groups": len(rs),
                    "with_variance": sum(1 for r in rs if max(r) != min(r)),
                }
                for name, rs in sorted(by_task.items())
            },
        }
        if have == 0:
            message = (
                f"job {self.job!r} stopped at step {step}, which has nothing to train: "
                + "; ".join(silent)
                + "; continue with --resume"
            )
            self.buffer.event(FAILED_EVENT, message, payload)
            raise JobFailedError(message)
        message = (
            f"step {step} trains {_count(have, 'group')} with different rewards, fewer than "
            f"buffer.batch_groups ({self.batch_groups}): dynamic sampling stopped after "
            f"{_count(claims, 'extra claim')} (trainer.loss.dynamic_sampling.max_claims "
            f"{limit}); {_count(len(groups) - have, 'group')} with equal rewards are dropped"
        )
        self.buffer.event(EVENT, "; ".join([message, *silent]), payload)
        for line in [message, *silent]:
            log.warning("%s", line)
            self.say(line)


def no_variance_sentence(
    task: str, step: int, rewards: Sequence[Sequence[float]], claims: int
) -> str:
    """A task none of whose groups in the step had different rewards, in one sentence."""
    values = sorted({r[0] for r in rewards})
    shown = ", ".join(str(round(v, 4)) for v in values[:4]) + (", ..." if len(values) > 4 else "")
    what = f"all rewards {shown}" if len(values) == 1 else f"each group's all {shown}"
    return (
        f"task {task}: 0 of {_count(len(rewards), 'group')} claimed for step {step} had "
        f"different rewards ({what}); dynamic sampling stopped after "
        f"{_count(claims, 'extra claim')}: check its reward or raise "
        "trainer.loss.dynamic_sampling.max_claims"
    )


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}" + ("" if n == 1 else "s")


def _claims(mix: dict[str, Any]) -> int:
    return int(mix.get(DYNAMIC_CLAIMS, 0))


def _recorded(mix: dict[str, Any]) -> dict[int, int]:
    """Per task id, the groups without variance as the step's task mix records them."""
    return {
        int(k): int(v["degenerate"])
        for k, v in mix.items()
        if isinstance(v, dict) and v.get("degenerate")
    }


def _degenerate(groups: Sequence[BatchGroup], varied: Sequence[bool]) -> dict[int, int]:
    """Per task id, the groups without variance."""
    return dict(Counter(g.task_id for g, v in zip(groups, varied, strict=True) if not v))
