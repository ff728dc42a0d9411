"""GRPO mathematics against hand-derived numbers (the derivations are in the comments)."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import TypeAdapter, ValidationError

from rollcall.orchestrator.algorithms import (
    ConstantNormaliser,
    Correction,
    DecoupledPPO,
    DrGRPOAdvantage,
    GRPOAdvantage,
    KLPenalty,
    LossConfig,
    NoCorrection,
    SeqMeanTokenMean,
    TokenMean,
    TruncatedIS,
)
from rollcall.workers.trainer.grpo import (
    LossStats,
    StepTotals,
    advantage_stats,
    batch_advantages,
    group_advantages,
    kl_k1,
    kl_k3,
    needs_proximal,
    policy_loss,
    sequence_scale,
    staleness,
    token_advantages,
    token_weights,
)

# --- advantages -------------------------------------------------------------------------------


def test_grpo_advantages_one_success_in_four() -> None:
    # rewards [1,0,0,0]: mean 1/4, centred [3/4, -1/4, -1/4, -1/4];
    # sample variance (n-1 = 3): (9/16 + 3 * 1/16) / 3 = 1/4, std 1/2;
    # advantages = centred / (1/2 + eps) = [1.5, -0.5, -0.5, -0.5] (to eps).
    adv = group_advantages([1, 0, 0, 0], GRPOAdvantage(eps=1e-6))
    assert adv == pytest.approx(
        [0.75 / 0.500001, -0.25 / 0.500001, -0.25 / 0.500001, -0.25 / 0.500001], abs=1e-12
    )
    assert adv[0] == pytest.approx(1.5, abs=1e-5) and adv[1] == pytest.approx(-0.5, abs=1e-5)


def test_grpo_two_samples() -> None:
    # rewards [2, 0]: mean 1, centred [1, -1], variance (1 + 1) / 1 = 2, std sqrt 2.
    adv = group_advantages([2.0, 0.0], GRPOAdvantage(eps=1e-6))
    assert adv == pytest.approx([1 / (math.sqrt(2) + 1e-6), -1 / (math.sqrt(2) + 1e-6)], abs=1e-12)


def test_dr_grpo_only_centres() -> None:
    # Dr. GRPO: r - mean, mean of [1,0,0,0] is 1/4.
    assert group_advantages([1, 0, 0, 0], DrGRPOAdvantage()) == [0.75, -0.25, -0.25, -0.25]
    # scale is kept: rewards [3, 1] -> mean 2 -> [1, -1]
    assert group_advantages([3, 1], DrGRPOAdvantage()) == [1.0, -1.0]


@pytest.mark.parametrize("estimator", [GRPOAdvantage(), DrGRPOAdvantage()])
def test_degenerate_groups_are_exact_zeros(estimator: GRPOAdvantage | DrGRPOAdvantage) -> None:
    for rewards in ([1.0, 1.0, 1.0, 1.0], [0.0, 0.0], [0.7]):
        adv = group_advantages(rewards, estimator)
        assert adv == [0.0] * len(rewards)
        assert all(not math.isnan(a) for a in adv)


def test_bad_rewards_are_refused() -> None:
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, float("nan")], GRPOAdvantage())
    with pytest.raises(ValueError, match="at least one"):
        group_advantages([], GRPOAdvantage())


def test_dynamic_sampling_filters_and_counts() -> None:
    groups = [[1, 0], [1, 1], [0, 0, 0], [0, 2]]
    kept = batch_advantages(groups, DrGRPOAdvantage(), filter_degenerate=True)
    assert kept.kept == [0, 3] and kept.degenerate == 2 and kept.filtered == 2
    assert kept.advantages == [[0.5, -0.5], [-1.0, 1.0]]
    allg = batch_advantages(groups, DrGRPOAdvantage(), filter_degenerate=False)
    assert allg.kept == [0, 1, 2, 3] and allg.degenerate == 2 and allg.filtered == 0
    assert allg.advantages[1] == [0.0, 0.0] and allg.advantages[2] == [0.0, 0.0, 0.0]


def test_advantage_broadcast_to_trained_tokens() -> None:
    mask = torch.tensor([0, 0, 1, 1, 0, 1])
    assert token_advantages(-0.5, mask).tolist() == [0, 0, -0.5, -0.5, 0, -0.5]


def test_advantage_stats_per_task() -> None:
    # [1.5, -0.5, -0.5, -0.5] and [0, 0]: mean 0 over six samples, population std
    # sqrt((2.25 + 3 * 0.25) / 6) = sqrt(0.5), zero fraction 2/6.
    s = advantage_stats("calc", [[1.5, -0.5, -0.5, -0.5], [0.0, 0.0]])
    assert s["adv_mean/calc"] == pytest.approx(0.0)
    assert s["adv_std/calc"] == pytest.approx(math.sqrt(0.5))
    assert s["adv_zero_frac/calc"] == pytest.approx(1 / 3)


# --- clipped objective ------------------------------------------------------------------------


def _loss(
    config: LossConfig,
    log_ratio: float,
    advantage: float,
    *,
    behaviour_shift: float = 0.0,
) -> tuple[float, float, LossStats]:
    """One token: log pi_old = 0, log pi_theta = log_ratio, log pi_behaviour = -shift.
    Returns (loss, d loss / d log pi_theta, stats)."""
    logp = torch.tensor([log_ratio], dtype=torch.float64, requires_grad=True)
    out = policy_loss(
        config,
        logp=logp,
        old_logp=torch.tensor([0.0], dtype=torch.float64),
        behaviour_logp=torch.tensor([-behaviour_shift], dtype=torch.float64),
        advantages=torch.tensor([advantage], dtype=torch.float64),
        weights=torch.tensor([1.0], dtype=torch.float64),
    )
    out.loss.backward()
    assert logp.grad is not None
    return float(out.loss.detach()), float(logp.grad[0]), out.stats


PPO = LossConfig(clip_low=0.2, clip_high=0.2, correction=NoCorrection())


def test_ratio_e_positive_advantage_is_clipped_high() -> None:
    # r = e ~ 2.718 > 1 + 0.2 with A = 1: min(e * 1, 1.2 * 1) = 1.2, loss -1.2, and the
    # clipped branch is constant in theta: gradient 0.
    loss, grad, stats = _loss(PPO, 1.0, 1.0)
    assert loss == pytest.approx(-1.2, abs=1e-12) and grad == 0.0
    assert stats.clipped_high == 1 and stats.clipped_low == 0


def test_ratio_e_negative_advantage_is_not_clipped() -> None:
    # r = e with A = -1: min(-e, -1.2) = -e (the pessimistic bound), loss e;
    # d(-r A)/d log pi = -A r = e.
    loss, grad, stats = _loss(PPO, 1.0, -1.0)
    assert loss == pytest.approx(math.e, abs=1e-12) and grad == pytest.approx(math.e, abs=1e-12)
    assert stats.clipped_high == 0 and stats.clipped_low == 0


def test_ratio_below_one_minus_clip_negative_advantage_is_clipped_low() -> None:
    # r = 1/e ~ 0.368 < 0.8 with A = -1: min(-0.368, -0.8) = -0.8, loss 0.8, gradient 0.
    loss, grad, stats = _loss(PPO, -1.0, -1.0)
    assert loss == pytest.approx(0.8, abs=1e-12) and grad == 0.0
    assert stats.clipped_low == 1


def test_clip_higher_is_asymmetric() -> None:
    # clip_high 0.28: r = e -> min(e, 1.28) = 1.28 with A = 1; r = 1.25 stays unclipped:
    # loss -1.25, gradient -A r = -1.25.
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, correction=NoCorrection())
    assert _loss(cfg, 1.0, 1.0)[0] == pytest.approx(-1.28, abs=1e-12)
    loss, grad, _ = _loss(cfg, math.log(1.25), 1.0)
    assert loss == pytest.approx(-1.25, abs=1e-12) and grad == pytest.approx(-1.25, abs=1e-12)


def test_truncated_is_caps_the_weight() -> None:
    # pi_old / pi_behaviour = e^log5 = 5 > cap 2: the weight is 2; at r = 1, A = 1 the PPO
    # term is -1, so the loss is -2 and the gradient -2 (d(-w r A)/d log pi = -w r A).
    cfg = LossConfig(correction=TruncatedIS(cap=2.0))
    loss, grad, stats = _loss(cfg, 0.0, 1.0, behaviour_shift=math.log(5))
    assert loss == pytest.approx(-2.0, abs=1e-12) and grad == pytest.approx(-2.0, abs=1e-12)
    assert stats.is_capped == 1 and stats.is_weight_max == pytest.approx(5.0)
    # under the cap the weight is the ratio itself: 1.5
    loss, _, stats = _loss(cfg, 0.0, 1.0, behaviour_shift=math.log(1.5))
    assert loss == pytest.approx(-1.5, abs=1e-12) and stats.is_capped == 0


def test_decoupled_weights_by_proximal_over_behaviour() -> None:
    # Uncapped: weight 5, loss -5. Capped at 2: the token is dropped (weight 0), not truncated.
    loss, grad, _ = _loss(
        LossConfig(correction=DecoupledPPO()), 0.0, 1.0, behaviour_shift=math.log(5)
    )
    assert loss == pytest.approx(-5.0, abs=1e-12) and grad == pytest.approx(-5.0, abs=1e-12)
    loss, grad, stats = _loss(
        LossConfig(correction=DecoupledPPO(cap=2.0)), 0.0, 1.0, behaviour_shift=math.log(5)
    )
    assert loss == 0.0 and grad == 0.0 and stats.is_capped == 1


@pytest.mark.parametrize(
    "correction", [TruncatedIS(cap=2.0), DecoupledPPO(), DecoupledPPO(cap=1.5)]
)
def test_every_correction_is_plain_ppo_when_behaviour_is_old(correction: Correction) -> None:
    g = torch.Generator().manual_seed(0)
    n = 64
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    logp0 = old + torch.randn(n, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    weights = torch.rand(n, generator=g, dtype=torch.float64) * (torch.rand(n, generator=g) > 0.3)

    def run(c: Correction) -> tuple[torch.Tensor, torch.Tensor]:
        logp = logp0.clone().requires_grad_(True)
        out = policy_loss(
            LossConfig(correction=c),
            logp=logp,
            old_logp=old,
            behaviour_logp=old,
            advantages=adv,
            weights=weights,
        )
        out.loss.backward()
        assert logp.grad is not None
        return out.loss.detach(), logp.grad

    ref_loss, ref_grad = run(NoCorrection())
    loss, grad = run(correction)
    assert ref_grad.abs().sum() > 0.1  # the comparison is not between zeros
    assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad)
    assert needs_proximal(correction) and not needs_proximal(NoCorrection())


def test_correction_is_chosen_by_a_named_config() -> None:
    adapter: TypeAdapter[Correction] = TypeAdapter(Correction)
    assert adapter.validate_python({"kind": "tis", "cap": 3}) == TruncatedIS(cap=3.0)
    with pytest.raises(ValidationError, match="'none', 'tis', 'decoupled'"):
        adapter.validate_python({"kind": "vtrace"})
    with pytest.raises(ValidationError, match="cap"):
        adapter.validate_python({"kind": "tis", "cap": 0.5})


def test_untrained_tokens_do_not_matter() -> None:
    # A token with weight 0 contributes nothing even where its ratio overflows.
    logp = torch.tensor([0.0, 500.0], requires_grad=True)
    out = policy_loss(
        LossConfig(),
        logp=logp,
        old_logp=torch.zeros(2),
        behaviour_logp=torch.tensor([0.0, -900.0]),
        advantages=torch.tensor([1.0, 1.0]),
        weights=torch.tensor([1.0, 0.0]),
    )
    out.loss.backward()
    assert logp.grad is not None
    assert float(out.loss.detach()) == -1.0 and logp.grad.tolist() == [-1.0, 0.0]
    assert out.stats.tokens == 1 and out.stats.is_weight_max == 1.0


# --- aggregation ------------------------------------------------------------------------------


def test_aggregation_weights_on_sequences_of_different_lengths() -> None:
    # Two sequences with 1 and 3 trained tokens (4 tokens, 2 sequences in the step):
    #  token_mean           each token 1/4           -> sequence shares 1/4, 3/4
    #  seq_mean_token_mean  1/(1*2) = 1/2, 1/(3*2)   -> sequence shares 1/2, 1/2
    #  constant(8)          each token 1/(8*2)       -> sequence shares 1/16, 3/16
    totals = StepTotals.of([1, 3])
    assert totals == StepTotals(sequences=2, tokens=4)
    cases: dict[TokenMean | SeqMeanTokenMean | ConstantNormaliser, tuple[list[float], ...]] = {
        TokenMean(): ([1 / 4, 1 / 4], [1 / 4, 3 / 4]),
        SeqMeanTokenMean(): ([1 / 2, 1 / 6], [1 / 2, 1 / 2]),
        ConstantNormaliser(max_tokens=8): ([1 / 16, 1 / 16], [1 / 16, 3 / 16]),
    }
    for agg, (per_token, shares) in cases.items():
        got = [sequence_scale(agg, n, totals) for n in (1, 3)]
        assert got == pytest.approx(per_token, abs=1e-15), agg
        assert [g * n for g, n in zip(got, (1, 3), strict=True)] == pytest.approx(shares), agg
    # token weights follow the mask; a sequence with nothing to train weighs nothing
    w = token_weights(torch.tensor([0, 1, 0, 1, 1]), SeqMeanTokenMean(), totals)
    assert w.tolist() == pytest.approx([0, 1 / 6, 0, 1 / 6, 1 / 6])
    assert sequence_scale(TokenMean(), 0, totals) == 0.0
    assert StepTotals.of([0, 2, 5]) == StepTotals(sequences=2, tokens=7)


def test_aggregated_loss_of_unit_token_losses() -> None:
    # With every per-token term equal to 1, the loss is the sum of the weights:
    # token_mean 1, seq_mean_token_mean 1, constant(8) (1 + 3) / 16 = 1/4.
    totals = StepTotals.of([1, 3])
    masks = [torch.tensor([0, 1]), torch.tensor([0, 1, 1, 1])]
    for agg, expected in (
        (TokenMean(), 1.0),
        (SeqMeanTokenMean(), 1.0),
        (ConstantNormaliser(max_tokens=8), 0.25),
    ):
        weights = torch.cat([token_weights(m, agg, totals) for m in masks])
        # r = 1 everywhere, A = -1, no correction: each trained token's term is -min(-1, -1) = 1
        out = policy_loss(
            LossConfig(correction=NoCorrection()),
            logp=torch.zeros(6),
            old_logp=torch.zeros(6),
            behaviour_logp=torch.zeros(6),
            advantages=-torch.ones(6),
            weights=weights,
        )
        assert float(out.loss) == pytest.approx(expected, abs=1e-7), agg


# --- KL and entropy ---------------------------------------------------------------------------


def test_kl_estimators() -> None:
    # pi_theta = 1/2, pi_ref = 1/4 for the sampled token:
    # k1 = log(1/2) - log(1/4) = log 2;
    # k3 with rho = pi_ref / pi_theta = 1/2: (rho - 1) - log rho = -1/2 + log 2.
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert float(kl_k1(logp, ref)) == pytest.approx(math.log(2), abs=1e-7)
    assert float(kl_k3(logp, ref)) == pytest.approx(math.log(2) - 0.5, abs=1e-7)
    assert float(kl_k3(ref, ref)) == 0.0


def test_kl_and_entropy_terms_in_the_loss() -> None:
    # r = 1, A = 0: the PPO term is 0, so the loss is coef * k3 - entropy_coef * H
    # = 0.1 * (log 2 - 1/2) - 0.01 * 2.
    cfg = LossConfig(kl=KLPenalty(coef=0.1, estimator="k3"), entropy_coef=0.01)
    logp = torch.tensor([math.log(0.5)])
    out = policy_loss(
        cfg,
        logp=logp,
        old_logp=logp,
        behaviour_logp=logp,
        advantages=torch.zeros(1),
        weights=torch.ones(1),
        ref_logp=torch.tensor([math.log(0.25)]),
        entropy=torch.tensor([2.0]),
    )
    assert float(out.loss) == pytest.approx(0.1 * (math.log(2) - 0.5) - 0.02, abs=1e-7)
    s = out.stats.summary()
    assert s["kl"] == pytest.approx(math.log(2) - 0.5, abs=1e-7) and s["entropy"] == 2.0
    with pytest.raises(ValueError, match="reference"):
        policy_loss(
            cfg,
            logp=logp,
            old_logp=logp,
            behaviour_logp=logp,
            advantages=torch.zeros(1),
            weights=torch.ones(1),
        )


def test_stats_add_up_across_micro_batches() -> None:
    a = LossStats(tokens=3, clipped_low=1, is_weight_sum=3.0, is_weight_max=1.5)
    b = LossStats(tokens=1, clipped_high=1, is_weight_sum=2.0, is_weight_max=2.0)
    s = (a + b).summary()
    assert s["tokens"] == 4 and s["clip_frac_low"] == 0.25 and s["clip_frac_high"] == 0.25
    assert s["is_weight_mean"] == 1.25 and s["is_weight_max"] == 2.0


def test_staleness_of_a_batch() -> None:
    # version 5; trajectories whose turns ran under [3, 4], [5], [1, 5]: behind 2, 0, 4.
    assert staleness(5, [[3, 4], [5], [1, 5]]) == {"staleness_mean": 2.0, "staleness_max": 4.0}


def test_agreement_stats_count_only_onpolicy_tokens() -> None:
    from rollcall.workers.trainer.grpo import agreement_stats

    start = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    beh = torch.tensor([-1.0, -2.1, -0.1, -3.0])
    on = torch.tensor([True, True, False, False])  # the last two: stale or not trained
    s = agreement_stats(start, beh, on).summary()
    assert s["onpolicy_tokens"] == 2
    assert s["is_log_weight_onpolicy_mean"] == pytest.approx(0.05)
    assert s["is_weight_onpolicy_mean"] == pytest.approx((1 + math.exp(0.1)) / 2)
    assert "is_weight_onpolicy_mean" not in agreement_stats(start, beh, on & False).summary()


def test_plan_step_marks_trajectories_of_the_trained_version_on_policy() -> None:
    import numpy as np

    from rollcall.orchestrator.algorithms import LossConfig
    from rollcall.orchestrator.buffer.types import Batch
    from rollcall.orchestrator.domain import BatchGroup, BatchTrajectory, TrajectoryPayload
    from rollcall.workers.trainer.batch import plan_step

    def traj(i: int, versions: list[int]) -> BatchTrajectory:
        n = 4 * len(versions)
        payload = TrajectoryPayload.build(
            np.arange(n),
            np.ones(n, dtype=np.uint8),
            np.full(n, -1.0, dtype=np.float32),
            turn_offsets=list(range(0, n, 4)),
            turn_versions=versions,
        )
        return BatchTrajectory(i, payload, float(i))

    group = BatchGroup(0, 1, "t", {}, 3, (traj(0, [5]), traj(1, [4]), traj(2, [4, 5])))
    plan = plan_step(
        Batch(5, 5, (group,), {}, False, {}), LossConfig(), ranks=1, micro_batch_tokens=64
    )
    seqs = [s for mini in plan.mini_batches for rank in mini for mb in rank for s in mb]
    # rewards 0, 1, 2: advantages negative, zero, positive identify the three samples
    by_sign = {int(math.copysign(1, s.advantage)) if s.advantage else 0: s.on_policy for s in seqs}
    assert by_sign == {-1: True, 0: False, 1: False}  # [5] on-policy; [4] and [4, 5] stale
