"""The objectives beside GRPO (RLOO, REINFORCE++ and its baseline variant, GSPO, CISPO, DAPO's
overlong shaping) against hand-derived numbers, the derivations in the comments. The formulas
are those of verl's ``core_algos.py`` (and its DAPO reward manager); where rollcall's convention
differs, the test says so."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from rollcall.orchestrator.algorithms import (
    CISPO,
    GSPO,
    DynamicSampling,
    LossConfig,
    NoCorrection,
    NoShaping,
    OverlongShaping,
    PPOClip,
    ReinforcePlusPlus,
    ReinforcePlusPlusBaseline,
    RLOOAdvantage,
)
from rollcall.workers.trainer.grpo import (
    batch_advantages,
    group_advantages,
    overlong_penalty,
    policy_loss,
    shape_rewards,
)

# --- RLOO -------------------------------------------------------------------------------------


def test_rloo_baseline_is_the_mean_of_the_others() -> None:
    # [1, 0, 0, 0]: sample 0's baseline is mean(0, 0, 0) = 0 -> 1; sample 1's is
    # mean(1, 0, 0) = 1/3 -> -1/3. verl: r n / (n - 1) - mean n / (n - 1), the same.
    assert group_advantages([1, 0, 0, 0], RLOOAdvantage()) == pytest.approx(
        [1.0, -1 / 3, -1 / 3, -1 / 3], abs=1e-15
    )
    # [3, 1]: 3 - 1 = 2 and 1 - 3 = -2
    assert group_advantages([3, 1], RLOOAdvantage()) == pytest.approx([2.0, -2.0])
    # convention: a group of one sample (verl: its reward) and an all-equal group get zeros
    assert group_advantages([0.7], RLOOAdvantage()) == [0.0]
    assert group_advantages([1, 1, 1], RLOOAdvantage()) == [0.0, 0.0, 0.0]


# --- REINFORCE++ ------------------------------------------------------------------------------


def test_reinforce_plus_plus_whitens_over_the_steps_trained_tokens() -> None:
    # One group, rewards [1, 0] with 1 and 3 trained tokens: the tokens carry 1, 0, 0, 0.
    # Token mean 1/4; variance with Bessel's correction over 4 tokens:
    # ((3/4)^2 + 3 (1/4)^2) / 3 = 1/4, so the advantages are (r - 1/4) / sqrt(1/4 + eps).
    eps = 1e-8
    got = batch_advantages(
        [[1.0, 0.0]], ReinforcePlusPlus(eps=eps), filter_degenerate=False, tokens=[[1, 3]]
    )
    s = math.sqrt(0.25 + eps)
    assert got.advantages == [pytest.approx([0.75 / s, -0.25 / s], abs=1e-12)]
    # per sample (no token counts given): [1, 0] -> mean 1/2, variance (1/4 + 1/4) / 1
    got = batch_advantages([[1.0, 0.0]], ReinforcePlusPlus(), filter_degenerate=False)
    assert got.advantages[0] == pytest.approx([0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)])


def test_reinforce_plus_plus_learns_from_groups_with_equal_rewards() -> None:
    # No group baseline: [1, 1] and [0, 0] (one token each) against the step's mean 1/2,
    # variance 4 (1/4) / 3 = 1/3: +-(1/2) / sqrt(1/3) = +-0.8660. GRPO gives both groups zeros.
    got = batch_advantages(
        [[1.0, 1.0], [0.0, 0.0]], ReinforcePlusPlus(), filter_degenerate=False, tokens=[[1, 1]] * 2
    )
    a = 0.5 / math.sqrt(1 / 3 + 1e-8)
    assert got.advantages == [pytest.approx([a, a]), pytest.approx([-a, -a])]
    assert got.degenerate == 2 and got.filtered == 0
    # filtering is still the user's choice: both dropped, nothing left
    dropped = batch_advantages(
        [[1.0, 1.0], [0.0, 0.0]], ReinforcePlusPlus(), filter_degenerate=True
    )
    assert dropped.kept == [] and dropped.filtered == 2


def test_reinforce_plus_plus_baseline_subtracts_the_group_mean_first() -> None:
    # [1, 0] -> [1/2, -1/2]; [2, 2] -> [0, 0]; one token each: token mean 0, variance
    # (1/4 + 1/4) / 3 = 1/6: [1/2, -1/2, 0, 0] / sqrt(1/6).
    got = batch_advantages(
        [[1.0, 0.0], [2.0, 2.0]],
        ReinforcePlusPlusBaseline(),
        filter_degenerate=False,
        tokens=[[1, 1], [1, 1]],
    )
    a = 0.5 / math.sqrt(1 / 6 + 1e-8)
    assert got.advantages == [pytest.approx([a, -a]), pytest.approx([0.0, 0.0], abs=1e-12)]
    # the whitening is token-weighted, as verl's masked_whiten: centred [1/2, -1/2] with 3 and 1
    # tokens: mean (3/2 - 1/2) / 4 = 1/4, variance (3 (1/4)^2 + (3/4)^2) / 3 = 1/4
    got = batch_advantages(
        [[1.0, 0.0]], ReinforcePlusPlusBaseline(eps=1e-12), filter_degenerate=False, tokens=[[3, 1]]
    )
    assert got.advantages[0] == pytest.approx([0.25 / 0.5, -0.75 / 0.5], abs=1e-9)


def test_step_normalised_estimators_refuse_a_single_group() -> None:
    with pytest.raises(ValueError, match="whole step"):
        group_advantages([1.0, 0.0], ReinforcePlusPlus())
    with pytest.raises(ValueError, match="finite"):
        batch_advantages([[1.0, float("inf")]], ReinforcePlusPlus(), filter_degenerate=False)


# --- GSPO -------------------------------------------------------------------------------------


def _run(
    config: LossConfig,
    log_ratio: list[float],
    advantages: list[float],
    weights: list[float],
    segments: list[int] | None = None,
) -> tuple[float, list[float], dict[str, float]]:
    """log pi_old = behaviour = 0, log pi_theta = ``log_ratio``: (loss, gradient, stats)."""
    n = len(log_ratio)
    logp = torch.tensor(log_ratio, dtype=torch.float64, requires_grad=True)
    out = policy_loss(
        config,
        logp=logp,
        old_logp=torch.zeros(n, dtype=torch.float64),
        behaviour_logp=torch.zeros(n, dtype=torch.float64),
        advantages=torch.tensor(advantages, dtype=torch.float64),
        weights=torch.tensor(weights, dtype=torch.float64),
        segments=torch.tensor(segments, dtype=torch.long) if segments is not None else None,
    )
    out.loss.backward()
    assert logp.grad is not None
    return float(out.loss.detach()), logp.grad.tolist(), out.stats.summary()


def test_gspo_ratio_is_the_sequences_geometric_mean() -> None:
    # Sequence 0: trained tokens with log-ratios 0.1 and 0.3 (and an untrained one at 5.0,
    # left out of the mean), A = 1: s = exp(0.2) = 1.2214 < 1.28, unclipped. Each token's term
    # is -s A with d/d logp_t = -s; token_mean weights 1/3 over the step's three trained tokens.
    # Sequence 1: one token, log-ratio -0.5, A = -1: s = 0.6065 < 0.8, so the clipped branch
    # -min(sA, 0.8A) = 0.8 binds and its gradient is 0.
    cfg = LossConfig(policy_loss=GSPO(), clip_low=0.2, clip_high=0.28, correction=NoCorrection())
    s = math.exp(0.2)
    loss, grad, stats = _run(
        cfg,
        [0.1, 0.3, 5.0, -0.5],
        [1.0, 1.0, 1.0, -1.0],
        [1 / 3, 1 / 3, 0.0, 1 / 3],
        segments=[0, 0, 0, 1],
    )
    assert loss == pytest.approx((-s - s + 0.8) / 3, abs=1e-12)
    assert grad == pytest.approx([-s / 3, -s / 3, 0.0, 0.0], abs=1e-12)
    assert stats["clip_frac_low"] == pytest.approx(1 / 3) and stats["clip_frac_high"] == 0.0
    # PPO on the same tokens clips token 1 (exp(0.3) = 1.35 > 1.28): GSPO's ratio is not the
    # token's
    _, ppo_grad, _ = _run(
        cfg.model_copy(update={"policy_loss": PPOClip()}),
        [0.1, 0.3, 5.0, -0.5],
        [1.0, 1.0, 1.0, -1.0],
        [1 / 3, 1 / 3, 0.0, 1 / 3],
    )
    assert ppo_grad[0] == pytest.approx(-math.exp(0.1) / 3) and ppo_grad[1] == 0.0


def test_gspo_clips_the_whole_sequence() -> None:
    # log-ratios 0.1 and 0.3 with the paper's clip 3e-4 / 4e-4: s = exp(0.2) > 1.0004, A = 1:
    # both tokens take the clipped constant -1.0004, gradient 0 for the whole sequence.
    cfg = LossConfig(policy_loss=GSPO(), clip_low=3e-4, clip_high=4e-4, correction=NoCorrection())
    loss, grad, stats = _run(cfg, [0.1, 0.3], [1.0, 1.0], [0.5, 0.5], segments=[0, 0])
    assert loss == pytest.approx(-1.0004, abs=1e-12) and grad == [0.0, 0.0]
    assert stats["clip_frac_high"] == 1.0


def test_gspo_needs_the_sequences() -> None:
    with pytest.raises(ValueError, match="segments"):
        _run(LossConfig(policy_loss=GSPO()), [0.0], [1.0], [1.0])


# --- CISPO ------------------------------------------------------------------------------------


def test_cispo_keeps_the_gradient_of_clipped_tokens() -> None:
    # Token 0: r = e > 1.28, A = 1: weight sg[1.28]; loss -1.28 A log pi = -1.28 x 1, gradient
    # -1.28 (PPO: 0). Token 1: r = exp(-1) = 0.368 < 0.8, A = -1: weight 0.8; loss
    # -0.8 x (-1) x (-1) = -0.8, gradient 0.8. Weights 1 each.
    cfg = LossConfig(policy_loss=CISPO(), clip_low=0.2, clip_high=0.28, correction=NoCorrection())
    loss, grad, stats = _run(cfg, [1.0, -1.0], [1.0, -1.0], [1.0, 1.0])
    assert loss == pytest.approx(-1.28 - 0.8, abs=1e-12)
    assert grad == pytest.approx([-1.28, 0.8], abs=1e-12)
    assert stats["clip_frac_high"] == 0.5 and stats["clip_frac_low"] == 0.5
    _, ppo_grad, _ = _run(
        cfg.model_copy(update={"policy_loss": PPOClip()}), [1.0, -1.0], [1.0, -1.0], [1.0, 1.0]
    )
    assert ppo_grad == [0.0, 0.0]
    # inside the clip, CISPO's gradient is PPO's: -r A d log pi
    _, g_in, _ = _run(cfg, [0.1], [2.0], [1.0])
    assert g_in == pytest.approx([-math.exp(0.1) * 2.0], abs=1e-12)


# --- DAPO overlong shaping --------------------------------------------------------------------


def test_overlong_penalty_grows_over_the_buffer() -> None:
    # max 100, buffer 20: free up to 80 tokens, then -(L - 80) / 20 x penalty.
    shaping = OverlongShaping(max_tokens=100, buffer_tokens=20, penalty=0.5)
    assert [overlong_penalty(shaping, n) for n in (10, 80, 90, 100)] == pytest.approx(
        [0.0, 0.0, -0.25, -0.5]
    )
    shaped, metrics = shape_rewards(shaping, [[1.0, 1.0], [0.0]], [[50, 90], [100]])
    assert shaped == [[1.0, 0.75], [-0.5]]
    assert metrics["overlong_frac"] == pytest.approx(2 / 3)
    assert metrics["overlong_penalty_mean"] == pytest.approx(-0.25)
    assert shape_rewards(NoShaping(), [[1.0]], [[500]]) == ([[1.0]], {})


def test_dynamic_sampling_counts_variance_on_the_shaped_rewards() -> None:
    """Dynamic sampling counts the groups whose trained rewards differ: shaped by each sample's
    trained tokens, as ``plan_step`` trains them, not the task's own rewards."""
    import numpy as np

    from rollcall.orchestrator.buffer.types import Batch
    from rollcall.orchestrator.domain import BatchGroup, BatchTrajectory, TrajectoryPayload
    from rollcall.workers.trainer.batch import plan_step, with_variance

    def group(i: int, *samples: tuple[float, int]) -> BatchGroup:
        def traj(k: int, reward: float, trained: int) -> BatchTrajectory:
            n = trained + 2  # two prompt tokens, then the trained ones
            mask = np.ones(n, dtype=np.uint8)
            mask[:2] = 0
            payload = TrajectoryPayload.build(
                np.arange(n), mask, np.full(n, -1.0, dtype=np.float32), turn_offsets=[2],
                turn_versions=[0],
            )  # fmt: skip
            return BatchTrajectory(k, payload, reward)

        return BatchGroup(i, 1, "t", {}, 0, tuple(traj(k, *s) for k, s in enumerate(samples)))

    # max 100, buffer 20: 90 trained tokens cost 0.5, 80 or fewer nothing
    shaping = OverlongShaping(max_tokens=100, buffer_tokens=20)
    groups = [
        group(0, (1.0, 10), (1.0, 90)),  # equal rewards, one too long: 1.0 and 0.5 differ
        group(1, (1.0, 90), (0.5, 10)),  # different rewards, shaped to 0.5 and 0.5: equal
        group(2, (1.0, 10), (0.0, 10)),  # different either way
        group(3, (0.0, 20), (0.0, 30)),  # equal either way
    ]
    assert with_variance(groups, shaping) == [True, False, True, False]
    assert with_variance(groups, NoShaping()) == [False, True, True, False]
    # the step trains the groups it counts: the others are filtered, under dynamic sampling
    loss = LossConfig(reward_shaping=shaping, dynamic_sampling=DynamicSampling(max_claims=2))
    batch = Batch(0, 0, tuple(groups), {"dynamic_claims": 2}, False, {})
    metrics = plan_step(batch, loss, ranks=1, micro_batch_tokens=512).metrics
    assert (metrics["groups_degenerate"], metrics["groups_filtered"]) == (2, 2)
    assert metrics["dynamic_claims"] == 2


# --- configs ----------------------------------------------------------------------------------


def test_bad_objective_parameters_are_one_sentence() -> None:
    with pytest.raises(ValidationError, match=r"buffer_tokens \(100\) must be below"):
        LossConfig.model_validate(
            {"reward_shaping": {"kind": "overlong", "max_tokens": 100, "buffer_tokens": 100}}
        )
    with pytest.raises(ValidationError, match="'ppo', 'gspo', 'cispo'"):
        LossConfig.model_validate({"policy_loss": {"kind": "sapo"}})
    with pytest.raises(ValidationError, match="eps"):
        LossConfig.model_validate({"advantage": {"kind": "reinforce_plus_plus", "eps": 0}})
    with pytest.raises(ValidationError, match="rloo"):
        LossConfig.model_validate({"advantage": {"kind": "vine"}})
    with pytest.raises(ValidationError, match="max_claims"):
        LossConfig.model_validate({"dynamic_sampling": {"max_claims": 0}})
    with pytest.raises(ValidationError, match="penalty"):
        LossConfig.model_validate(
            {
                "reward_shaping": {
                    "kind": "overlong",
                    "max_tokens": 100,
                    "buffer_tokens": 10,
                    "penalty": -1,
                }
            }
        )
