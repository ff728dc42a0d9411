"""GRPO's mathematics: group advantages, the clipped policy loss with off-policy correction,
loss aggregation weights, KL estimators and the loss metrics. Pure: tensors and plain values in,
tensors and plain values out, no IO.

Tokens are laid out flat (``[N]``): the trainer packs several sequences into one row, so every
per-token tensor here is aligned token by token with the packed row, and a token that is not
trained (prompt, tool output, padding) has aggregation weight 0.

The policy objective is PPO's token-level clip by default; GSPO replaces each token's ratio
with its sequence's geometric-mean ratio (gradient through the token's own log-prob), CISPO
uses the clipped ratio as a weight without gradient on -A log pi_theta (``policy_loss``).

Off-policy terms. pi_behaviour generated the tokens (the rollout's log-probs); pi_old is the
policy the PPO ratio is taken against (with a correction, the trainer's own log-probs at the
start of the step: the proximal policy); pi_theta is the policy being trained. Per token:

    r   = pi_theta / pi_old
    pg  = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)
    w   = correction weight from pi_old / pi_behaviour (1 without a correction), no gradient
    l   = w pg + kl_coef KL_est(pi_theta, pi_ref) - entropy_coef H
    loss = sum_t  a_t l_t          with a_t the aggregation weight of token t

The aggregation weights are computed from the totals of the whole step (all micro-batches,
all ranks), so summing the micro-batch losses gives exactly the step's loss: gradient
accumulation does not change the result.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from rollcall.orchestrator.algorithms import (
    BATCH_NORMALISED,
    AdvantageEstimator,
    Aggregation,
    ConstantNormaliser,
    Correction,
    DecoupledPPO,
    DrGRPOAdvantage,
    GRPOAdvantage,
    LossConfig,
    NoCorrection,
    NoShaping,
    OverlongShaping,
    ReinforcePlusPlus,
    ReinforcePlusPlusBaseline,
    RewardShaping,
    RLOOAdvantage,
    SeqMeanTokenMean,
    TokenMean,
    TruncatedIS,
)

if TYPE_CHECKING:
    import torch

MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: beyond it a ratio is meaningless and overflows in fp16

# --- advantages -------------------------------------------------------------------------------


def _centred(rewards: Sequence[float]) -> list[float]:
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def _grpo(estimator: GRPOAdvantage, rewards: Sequence[float]) -> list[float]:
    centred = _centred(rewards)
    std = math.sqrt(sum(c * c for c in centred) / (len(rewards) - 1))
    return [c / (std + estimator.eps) for c in centred]


def _dr_grpo(estimator: DrGRPOAdvantage, rewards: Sequence[float]) -> list[float]:
    return _centred(rewards)


def _rloo(estimator: RLOOAdvantage, rewards: Sequence[float]) -> list[float]:
    # r_i - sum_{j != i} r_j / (n - 1) = n / (n - 1) (r_i - mean)
    n = len(rewards)
    return [c * n / (n - 1) for c in _centred(rewards)]


_ESTIMATORS: dict[str, Callable[[Any, Sequence[float]], list[float]]] = {
    "grpo": _grpo,
    "dr_grpo": _dr_grpo,
    "rloo": _rloo,
}


def _whitened(
    eps: float, values: Sequence[Sequence[float]], tokens: Sequence[Sequence[int]]
) -> list[list[float]]:
    """REINFORCE++'s global normalisation: every trained token carries its sample's value, and
    the values are whitened over all trained tokens (token-weighted mean, variance with
    Bessel's correction over the token count), as verl's ``masked_whiten``."""
    n = sum(sum(t) for t in tokens)
    if n <= 1:  # one trained token (or none): nothing to normalise against
        return [[0.0] * len(v) for v in values]
    pairs = [
        (v, t) for vs, ts in zip(values, tokens, strict=True) for v, t in zip(vs, ts, strict=True)
    ]
    mean = sum(v * t for v, t in pairs) / n
    var = sum(t * (v - mean) ** 2 for v, t in pairs) / (n - 1)
    scale = 1.0 / math.sqrt(var + eps)
    return [[(v - mean) * scale for v in vs] for vs in values]


def _check_rewards(rewards: Sequence[float]) -> None:
    if not rewards:
        raise ValueError("a group has at least one sample")
    if any(not math.isfinite(r) for r in rewards):
        raise ValueError(f"rewards must be finite, got {list(rewards)}")


def is_degenerate(rewards: Sequence[float]) -> bool:
    """All rewards equal (or a single sample): the group carries no learning signal."""
    return max(rewards) == min(rewards)


def group_advantages(rewards: Sequence[float], estimator: AdvantageEstimator) -> list[float]:
    """Advantages of one group's samples, for the estimators with a group baseline. A
    degenerate group gets exact zeros, never NaN."""
    _check_rewards(rewards)
    if estimator.kind in BATCH_NORMALISED:
        raise ValueError(
            f"the {estimator.kind} advantage is normalised over the whole step: "
            "use batch_advantages"
        )
    if is_degenerate(rewards):
        return [0.0] * len(rewards)
    return _ESTIMATORS[estimator.kind](estimator, rewards)


@dataclass(frozen=True)
class GroupAdvantages:
    """Advantages of a batch's groups, with the degenerate groups counted (and dropped when
    filtering)."""

    advantages: list[list[float]]  # per kept group, per sample
    kept: list[int]  # indices of the kept groups in the input
    degenerate: int  # groups whose rewards were all equal
    filtered: int  # of which dropped (dynamic sampling)


def batch_advantages(
    groups: Sequence[Sequence[float]],
    estimator: AdvantageEstimator,
    *,
    filter_degenerate: bool,
    tokens: Sequence[Sequence[int]] | None = None,
) -> GroupAdvantages:
    """Advantages of a step's groups. ``tokens``: each sample's trained tokens, the weights of
    the step-wide normalisation of REINFORCE++ (1 per sample when not given)."""
    for rewards in groups:
        _check_rewards(rewards)
    degenerate = [is_degenerate(r) for r in groups]
    kept = [i for i, d in enumerate(degenerate) if not (filter_degenerate and d)]
    count = sum(degenerate)
    filtered = count if filter_degenerate else 0
    if estimator.kind not in BATCH_NORMALISED:
        advantages = [group_advantages(groups[i], estimator) for i in kept]
        return GroupAdvantages(advantages, kept, count, filtered)
    assert isinstance(estimator, ReinforcePlusPlus | ReinforcePlusPlusBaseline)
    values = [
        _centred(groups[i]) if isinstance(estimator, ReinforcePlusPlusBaseline) else groups[i]
        for i in kept
    ]
    weights = [tokens[i] if tokens is not None else [1] * len(groups[i]) for i in kept]
    return GroupAdvantages(_whitened(estimator.eps, values, weights), kept, count, filtered)


# --- reward shaping ---------------------------------------------------------------------------


def overlong_penalty(shaping: OverlongShaping, generated: int) -> float:
    """DAPO's soft overlong punishment of a trajectory of ``generated`` trained tokens:
    min(0, -(L - (max - buffer)) / buffer x penalty), as verl's DAPO reward manager."""
    exceed = generated - (shaping.max_tokens - shaping.buffer_tokens)
    return min(-exceed / shaping.buffer_tokens * shaping.penalty, 0.0)


def shape_rewards(
    shaping: RewardShaping,
    groups: Sequence[Sequence[float]],
    tokens: Sequence[Sequence[int]],
) -> tuple[list[list[float]], dict[str, float]]:
    """The rewards trained on (per group, per sample) and the shaping's metrics."""
    if isinstance(shaping, NoShaping):
        return [list(g) for g in groups], {}
    penalties = [[overlong_penalty(shaping, n) for n in ts] for ts in tokens]
    flat = [p for ps in penalties for p in ps]
    shaped = [
        [r + p for r, p in zip(rs, ps, strict=True)]
        for rs, ps in zip(groups, penalties, strict=True)
    ]
    return shaped, {
        "overlong_frac": sum(1 for p in flat if p < 0) / max(1, len(flat)),
        "overlong_penalty_mean": sum(flat) / max(1, len(flat)),
    }


def token_advantages(advantage: float, loss_mask: torch.Tensor) -> torch.Tensor:
    """The sequence's advantage on its trained tokens (mask 1), 0 elsewhere.  # [T] -> [T]"""
    return loss_mask.to(dtype=_float_dtype(loss_mask)) * advantage


def _float_dtype(t: torch.Tensor) -> torch.dtype:
    import torch

    return t.dtype if t.is_floating_point() else torch.float32


# --- aggregation ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepTotals:
    """Counts over the whole train step (every micro-batch on every rank)."""

    sequences: int  # sequences with at least one trained token
    tokens: int  # trained tokens

    @classmethod
    def of(cls, trained_tokens: Sequence[int]) -> StepTotals:
        return cls(sum(1 for n in trained_tokens if n > 0), sum(trained_tokens))


def _token_mean(agg: TokenMean, n: int, totals: StepTotals) -> float:
    return 1.0 / totals.tokens


def _seq_mean_token_mean(agg: SeqMeanTokenMean, n: int, totals: StepTotals) -> float:
    return 1.0 / (n * totals.sequences)


def _constant(agg: ConstantNormaliser, n: int, totals: StepTotals) -> float:
    return 1.0 / (agg.max_tokens * totals.sequences)


_AGGREGATIONS: dict[str, Callable[[Any, int, StepTotals], float]] = {
    "token_mean": _token_mean,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "constant": _constant,
}


def sequence_scale(aggregation: Aggregation, trained_tokens: int, totals: StepTotals) -> float:
    """The weight of each trained token of a sequence with ``trained_tokens`` trained tokens."""
    if trained_tokens <= 0:
        return 0.0
    return _AGGREGATIONS[aggregation.kind](aggregation, trained_tokens, totals)


def token_weights(
    loss_mask: torch.Tensor, aggregation: Aggregation, totals: StepTotals
) -> torch.Tensor:
    """Aggregation weights of one sequence's tokens.  # [T] -> [T]"""
    n = int(loss_mask.sum())
    return loss_mask.to(dtype=_float_dtype(loss_mask)) * sequence_scale(aggregation, n, totals)


# --- off-policy correction --------------------------------------------------------------------


def _no_correction(c: NoCorrection, log_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    return torch.ones_like(log_w), torch.zeros_like(log_w, dtype=torch.bool)


def _truncated_is(c: TruncatedIS, log_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = log_w.exp()
    return w.clamp(max=c.cap), w > c.cap


def _decoupled(c: DecoupledPPO, log_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    w = log_w.exp()
    if c.cap is None:
        return w, torch.zeros_like(w, dtype=torch.bool)
    capped = w > c.cap
    return w.masked_fill(capped, 0.0), capped


_CORRECTIONS: dict[str, Callable[[Any, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {
    "none": _no_correction,
    "tis": _truncated_is,
    "decoupled": _decoupled,
}


def needs_proximal(correction: Correction) -> bool:
    """Whether the trainer must compute pi_old itself (a no-grad forward at the step start);
    otherwise the behaviour log-probs are pi_old."""
    return not isinstance(correction, NoCorrection)


def correction_weights(
    correction: Correction, old_logp: torch.Tensor, behaviour_logp: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight applied, raw pi_old / pi_behaviour, capped?) per token, all without gradient."""
    log_w = (old_logp - behaviour_logp).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    weight, capped = _CORRECTIONS[correction.kind](correction, log_w)
    return weight, log_w.exp(), capped


# --- KL ---------------------------------------------------------------------------------------


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log pi_theta - log pi_ref: unbiased for KL(pi_theta || pi_ref), high variance."""
    return logp - ref_logp


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = (rho - 1) - log rho with rho = pi_ref / pi_theta: unbiased and never negative."""
    log_rho = (ref_logp - logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return log_rho.exp() - 1.0 - log_rho


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1,
    "k3": kl_k3,
}


# --- the loss ---------------------------------------------------------------------------------


@dataclass
class LossStats:
    """Sums over trained tokens, so micro-batches add up; ``summary`` turns them into means."""

    tokens: int = 0
    clipped_low: int = 0
    clipped_high: int = 0
    is_weight_sum: float = 0.0
    is_weight_max: float = 0.0
    is_log_weight_sum: float = 0.0
    is_capped: int = 0
    # the rollout/trainer agreement on on-policy tokens (``agreement_stats``)
    onpolicy_tokens: int = 0
    onpolicy_weight_sum: float = 0.0
    onpolicy_log_weight_sum: float = 0.0
    kl_sum: float = 0.0
    entropy_sum: float = 0.0
    ratio_sum: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def __add__(self, other: LossStats) -> LossStats:
        out = LossStats()
        for f in fields(self):
            if f.name == "extra":
                continue
            a, b = getattr(self, f.name), getattr(other, f.name)
            setattr(out, f.name, max(a, b) if f.name.endswith("_max") else a + b)
        out.extra = {**self.extra, **other.extra}
        return out

    def summary(self) -> dict[str, float]:
        n = max(self.tokens, 1)
        onpolicy: dict[str, float] = {"onpolicy_tokens": float(self.onpolicy_tokens)}
        if self.onpolicy_tokens:
            m = self.onpolicy_tokens
            onpolicy["is_weight_onpolicy_mean"] = self.onpolicy_weight_sum / m
            onpolicy["is_log_weight_onpolicy_mean"] = self.onpolicy_log_weight_sum / m
        return {
            "tokens": float(self.tokens),
            "clip_frac_low": self.clipped_low / n,
            "clip_frac_high": self.clipped_high / n,
            "is_weight_mean": self.is_weight_sum / n,
            "is_weight_max": self.is_weight_max,
            "is_log_weight_mean": self.is_log_weight_sum / n,
            **onpolicy,
            "is_capped_frac": self.is_capped / n,
            "kl": self.kl_sum / n,
            "entropy": self.entropy_sum / n,
            "ratio_mean": self.ratio_sum / n,
            **self.extra,
        }


@dataclass(frozen=True)
class LossOutput:
    loss: torch.Tensor  # scalar, this micro-batch's share of the step loss
    per_token: torch.Tensor  # [N] l_t before aggregation weights (0 where untrained)
    stats: LossStats


def _sequence_log_ratio(
    log_ratio: torch.Tensor, trained: torch.Tensor, segments: torch.Tensor
) -> torch.Tensor:
    """Each token's sequence mean of ``log_ratio`` over the sequence's trained tokens, without
    gradient (GSPO's log s_i).  # [N] -> [N]"""
    import torch

    count = int(segments.max()) + 1 if segments.numel() else 0
    lr = torch.where(trained, log_ratio.detach(), torch.zeros_like(log_ratio))
    sums = torch.zeros(count, dtype=lr.dtype, device=lr.device).index_add_(0, segments, lr)
    ns = torch.zeros(count, dtype=lr.dtype, device=lr.device).index_add_(
        0, segments, trained.to(lr.dtype)
    )
    return (sums / ns.clamp(min=1))[segments]


def policy_loss(
    config: LossConfig,
    *,
    logp: torch.Tensor,  # [N] log pi_theta of each token (with gradient)
    old_logp: torch.Tensor,  # [N] log pi_old: proximal, or the behaviour log-probs
    behaviour_logp: torch.Tensor,  # [N] log pi_behaviour from the rollout
    advantages: torch.Tensor,  # [N] per-token advantage
    weights: torch.Tensor,  # [N] aggregation weights; 0 on tokens not trained
    ref_logp: torch.Tensor | None = None,  # [N] log pi_ref, required when kl.coef > 0
    entropy: torch.Tensor | None = None,  # [N] policy entropy per position
    segments: torch.Tensor | None = None,  # [N] int64: which sequence each token belongs to
) -> LossOutput:
    import torch

    trained = weights != 0  # [N]
    old_logp = old_logp.detach()
    log_ratio = (logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    lo, hi = 1.0 - config.clip_low, 1.0 + config.clip_high
    kind = config.policy_loss.kind
    if kind == "gspo":
        if segments is None:
            raise ValueError("the gspo policy loss needs each token's sequence (segments)")
        # s_i,t = sg[s_i] pi_theta / sg[pi_theta]: the sequence's ratio, each token's gradient
        seq = _sequence_log_ratio(log_ratio, trained, segments)
        log_ratio = (logp - logp.detach() + seq).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    if kind == "cispo":
        pg = -ratio.clamp(lo, hi).detach() * advantages * logp
    else:
        pg = -torch.minimum(ratio * advantages, ratio.clamp(lo, hi) * advantages)
    is_weight, raw_weight, capped = correction_weights(config.correction, old_logp, behaviour_logp)
    per_token = is_weight * pg
    kl = None
    if config.kl.coef > 0:
        if ref_logp is None:
            raise ValueError("kl.coef > 0 needs the reference policy's log-probs")
        kl = KL_ESTIMATORS[config.kl.estimator](logp, ref_logp.detach())
        per_token = per_token + config.kl.coef * kl
    if config.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the policy entropy")
        per_token = per_token - config.entropy_coef * entropy
    per_token = torch.where(trained, per_token, torch.zeros_like(per_token))
    loss = (per_token * weights).sum()

    with torch.no_grad():
        r = ratio.detach()
        # PPO and GSPO clip a side only where it binds for the advantage's sign; CISPO's clip
        # bounds the weight whatever the sign
        low = (r < lo) if kind == "cispo" else (advantages < 0) & (r < lo)
        high = (r > hi) if kind == "cispo" else (advantages > 0) & (r > hi)
        stats = LossStats(
            tokens=int(trained.sum()),
            clipped_low=int((trained & low).sum()),
            clipped_high=int((trained & high).sum()),
            is_weight_sum=float(raw_weight[trained].sum()),
            is_weight_max=float(raw_weight[trained].max()) if trained.any() else 0.0,
            is_log_weight_sum=float(raw_weight[trained].log().sum()),
            is_capped=int((capped & trained).sum()),
            kl_sum=float(kl.detach()[trained].sum()) if kl is not None else 0.0,
            entropy_sum=float(entropy.detach()[trained].sum()) if entropy is not None else 0.0,
            ratio_sum=float(r[trained].sum()),
        )
    return LossOutput(loss, per_token, stats)


def agreement_stats(
    start_logp: torch.Tensor,  # [N] the trainer's log-probs under the step's starting weights
    behaviour_logp: torch.Tensor,  # [N] the rollout's
    on_policy: torch.Tensor,  # [N] bool: trained tokens generated by those same weights
) -> LossStats:
    """How far the trainer's log-probs are from the rollout's on tokens the trainer's current
    weights generated (a trajectory 0 versions behind): there pi_old / pi_behaviour is 1 but
    for numerics (a dtype, a kernel, a temperature or a weight-loading mismatch). Whatever the
    correction, so also without one (where the loss's pi_old is pi_behaviour itself).

    Both the mean weight and the mean log-weight are kept: the mean weight is 1 in expectation
    under any mismatch (E_beh[pi / beh] = 1 over the sampled tokens), so it only shows noise;
    the mean log-weight is -KL(beh || pi) <= 0 in expectation, 0 only when the two agree.
    Stale tokens are left out: their weight moves for a legitimate reason."""
    import torch

    with torch.no_grad():
        log_w = (start_logp - behaviour_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)[on_policy]
        return LossStats(
            onpolicy_tokens=int(log_w.numel()),
            onpolicy_weight_sum=float(log_w.exp().sum()),
            onpolicy_log_weight_sum=float(log_w.sum()),
        )


# --- batch metrics ----------------------------------------------------------------------------


def staleness(policy_version: int, turn_versions: Sequence[Sequence[int]]) -> dict[str, float]:
    """Versions behind of each trajectory (current version minus the oldest version that
    generated one of its turns): mean and max over the batch."""
    behind = [policy_version - min(v) for v in turn_versions if v]
    if not behind:
        return {"staleness_mean": 0.0, "staleness_max": 0.0}
    return {"staleness_mean": sum(behind) / len(behind), "staleness_max": float(max(behind))}


def advantage_stats(task: str, advantages: Sequence[Sequence[float]]) -> dict[str, float]:
    """Mean, std and the fraction of zero advantages over a task's samples."""
    flat = [a for group in advantages for a in group]
    if not flat:
        return {}
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((a - mean) ** 2 for a in flat) / len(flat))
    zero = sum(1 for a in flat if a == 0.0) / len(flat)
    return {
        f"adv_mean/{task}": mean,
        f"adv_std/{task}": std,
        f"adv_zero_frac/{task}": zero,
    }
