"""The GRPO algorithm's named choices, as typed configs.

Each choice is a class with a ``kind`` tag in a discriminated union, so a config file names the
estimator, the off-policy correction or the loss aggregation, and pydantic rejects anything
else with the list of valid kinds. The mathematics lives in ``rollcall.workers.trainer.grpo``, which
looks each kind up in a registry; adding one is a class here plus a registration there.
Importable without torch.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollcall.orchestrator import bounds as b


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# --- advantage estimators (per group of samples of one prompt) --------------------------------


class GRPOAdvantage(_Strict):
    """(r - mean) / (std + eps), std with Bessel's correction (n - 1), as TRL and verl."""

    kind: Literal["grpo"] = "grpo"
    eps: Annotated[float, b.EPS.field()] = Field(
        default=1e-6, description="added to the group's standard deviation"
    )


class DrGRPOAdvantage(_Strict):
    """Dr. GRPO: r - mean, no division by the standard deviation."""

    kind: Literal["dr_grpo"] = "dr_grpo"


class RLOOAdvantage(_Strict):
    """RLOO (Ahmadian et al. 2024): each sample's baseline is the mean reward of the other
    samples of its group, r_i - mean_{j != i} r_j = n / (n - 1) (r_i - mean)."""

    kind: Literal["rloo"] = "rloo"


class ReinforcePlusPlus(_Strict):
    """REINFORCE++ (Hu 2025), outcome reward, gamma 1: every trained token's return is its
    sample's reward, whitened over all trained tokens of the step (token-weighted mean,
    variance with Bessel's correction): (r - mean) / sqrt(var + eps). No group baseline, so a
    group whose rewards are all equal still learns (against the step's mean)."""

    kind: Literal["reinforce_plus_plus"] = "reinforce_plus_plus"
    eps: Annotated[float, b.EPS.field()] = Field(
        default=1e-8, description="added to the step's variance before its square root"
    )


class ReinforcePlusPlusBaseline(_Strict):
    """REINFORCE++-baseline: the group mean subtracted first (r - mean of the group), then
    whitened over all trained tokens of the step as ``reinforce_plus_plus``."""

    kind: Literal["reinforce_plus_plus_baseline"] = "reinforce_plus_plus_baseline"
    eps: Annotated[float, b.EPS.field()] = Field(
        default=1e-8, description="added to the step's variance before its square root"
    )


AdvantageEstimator = Annotated[
    GRPOAdvantage | DrGRPOAdvantage | RLOOAdvantage | ReinforcePlusPlus | ReinforcePlusPlusBaseline,
    Field(discriminator="kind"),
]

# estimators whose advantages depend on the whole step, not on each group alone
BATCH_NORMALISED = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")


# --- policy losses (the ratio and how it is clipped) -------------------------------------------


class PPOClip(_Strict):
    """PPO's token-level clipped ratio: -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A),
    r = pi_theta / pi_old per token."""

    kind: Literal["ppo"] = "ppo"


class GSPO(_Strict):
    """GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of its tokens'
    ratios s = exp(mean_t log(pi_theta / pi_old)) over the sequence's trained tokens, clipped
    as PPO's with ``loss.clip_low`` / ``loss.clip_high`` (the paper uses 3e-4 / 4e-4); each
    token carries s with the gradient of its own log-prob, sg[s] pi_theta / sg[pi_theta]."""

    kind: Literal["gspo"] = "gspo"


class CISPO(_Strict):
    """CISPO (MiniMax-M1): -sg[clip(r, 1 - clip_low, 1 + clip_high)] A log pi_theta. The
    clipped ratio is a weight without gradient, so no token's gradient is dropped by the
    clip (PPO's clip zeroes it)."""

    kind: Literal["cispo"] = "cispo"


PolicyLoss = Annotated[PPOClip | GSPO | CISPO, Field(discriminator="kind")]


# --- reward shaping ---------------------------------------------------------------------------


class NoShaping(_Strict):
    """Rewards are trained as the task gave them."""

    kind: Literal["none"] = "none"


class OverlongShaping(_Strict):
    """DAPO's soft overlong punishment: a trajectory whose generated (trained) tokens L pass
    ``max_tokens - buffer_tokens`` gets min(0, -(L - (max_tokens - buffer_tokens)) /
    buffer_tokens x penalty) added to its reward for training (the stored reward, evaluation
    and the reward metrics are unchanged)."""

    kind: Literal["overlong"] = "overlong"
    max_tokens: Annotated[int, b.tokens(2).field()] = Field(
        description="the generated-token length the penalty is measured against (DAPO's "
        "max response length): what a trajectory may generate at most"
    )
    buffer_tokens: Annotated[int, b.tokens(1).field()] = Field(
        description="the penalty grows over the last buffer_tokens before max_tokens"
    )
    penalty: Annotated[float, b.COEF.field()] = Field(
        default=1.0, description="the penalty at max_tokens (DAPO's penalty_factor)"
    )

    @model_validator(mode="after")
    def _buffer(self) -> OverlongShaping:
        if self.buffer_tokens >= self.max_tokens:
            raise ValueError(
                f"reward_shaping.buffer_tokens ({self.buffer_tokens}) must be below "
                f"reward_shaping.max_tokens ({self.max_tokens})"
            )
        return self


RewardShaping = Annotated[NoShaping | OverlongShaping, Field(discriminator="kind")]


# --- off-policy corrections -------------------------------------------------------------------


class NoCorrection(_Strict):
    """Plain PPO: the rollout's behaviour log-probs serve as pi_old; no proximal forward."""

    kind: Literal["none"] = "none"


class TruncatedIS(_Strict):
    """Token-level truncated importance sampling: pi_old is recomputed by the trainer at the start
    of the step; each token's PPO term is weighted by min(pi_old / pi_behaviour, cap)."""

    kind: Literal["tis"] = "tis"
    cap: Annotated[float, b.IS_CAP.field()] = Field(
        default=2.0, description="largest importance weight (larger ones are truncated to it)"
    )


class DecoupledPPO(_Strict):
    """Decoupled PPO (Hilton et al., as in AReaL): the clip is taken around the proximal policy
    (the policy at the start of the step) and each token is weighted by
    pi_prox / pi_behaviour. With ``cap`` set, tokens whose weight exceeds it are dropped
    (weight 0) rather than truncated."""

    kind: Literal["decoupled"] = "decoupled"
    cap: Annotated[float, b.IS_CAP.field()] | None = Field(
        default=None, description="tokens whose weight exceeds it are dropped; unset: none"
    )


Correction = Annotated[NoCorrection | TruncatedIS | DecoupledPPO, Field(discriminator="kind")]


# --- loss aggregation -------------------------------------------------------------------------


class TokenMean(_Strict):
    """Every trained token of the step weighs the same: 1 / (trained tokens in the step)."""

    kind: Literal["token_mean"] = "token_mean"


class SeqMeanTokenMean(_Strict):
    """Mean over sequences of each sequence's token mean: a token of sequence i weighs
    1 / (n_i x sequences in the step)."""

    kind: Literal["seq_mean_token_mean"] = "seq_mean_token_mean"


class ConstantNormaliser(_Strict):
    """Dr. GRPO: every token weighs 1 / (max_tokens x sequences in the step), whatever the
    sequence's length."""

    kind: Literal["constant"] = "constant"
    max_tokens: Annotated[int, b.tokens(1).field()] = Field(
        default=4096, description="the constant token count every sequence is normalised by"
    )


Aggregation = Annotated[
    TokenMean | SeqMeanTokenMean | ConstantNormaliser, Field(discriminator="kind")
]


class KLPenalty(_Strict):
    """KL(pi_theta || pi_ref) per token, added to the loss with ``coef``; 0: no reference model
    and no reference forward at all."""

    coef: Annotated[float, b.COEF.field()] = Field(
        default=0.0, description="KL coefficient; 0: no reference forward at all"
    )
    estimator: Literal["k1", "k3"] = Field(
        default="k3",
        description="k1: log pi_theta - log pi_ref; k3: (rho - 1) - log rho, "
        "rho = pi_ref / pi_theta (unbiased, never negative)",
    )


class DynamicSampling(_Strict):
    """DAPO's dynamic sampling: a step whose claimed batch has fewer than
    ``buffer.batch_groups`` groups whose trained (shaped) rewards differ keeps reserving finished
    groups into the same step, as many as it lacks, up to ``max_claims`` extra claims; the groups
    whose rewards are all equal are consumed without being trained (``groups_filtered``). At the
    limit the step trains the groups with variance it has, and says which task produced none;
    a step with none at all stops the job."""

    max_claims: Annotated[int, b.EXTRA_CLAIMS.field()] = Field(
        default=8,
        description="extra claims a step makes at most while it lacks groups with different "
        "rewards",
    )


class LossConfig(_Strict):
    """The GRPO loss of a train step."""

    advantage: AdvantageEstimator = Field(
        default_factory=GRPOAdvantage, description="the advantage estimator, by kind"
    )
    policy_loss: PolicyLoss = Field(
        default_factory=PPOClip,
        description="the policy objective, by kind: ppo (token ratio), gspo (sequence ratio), "
        "cispo (clipped ratio as a weight)",
    )
    reward_shaping: RewardShaping = Field(
        default_factory=NoShaping,
        description="how rewards are shaped before advantages, by kind: none or overlong",
    )
    filter_degenerate_groups: bool = Field(
        default=False,
        description="drop groups whose rewards are all equal from the claimed batch; counted",
    )
    dynamic_sampling: DynamicSampling | None = Field(
        default=None,
        description="keep claiming finished groups into the step until buffer.batch_groups of "
        "them have different rewards (DAPO's dynamic sampling; groups with equal rewards are "
        "dropped, as filter_degenerate_groups); null: off",
    )
    clip_low: Annotated[float, b.CLIP_LOW.field()] = Field(
        default=0.2, description="the PPO ratio clip below 1 (1 - clip_low)"
    )
    clip_high: Annotated[float, b.CLIP_HIGH.field()] = Field(
        default=0.28, description="the PPO ratio clip above 1 (1 + clip_high; clip-higher)"
    )
    correction: Correction = Field(
        default_factory=TruncatedIS, description="the off-policy correction, by kind"
    )
    aggregation: Aggregation = Field(
        default_factory=TokenMean, description="how token losses are weighed, by kind"
    )
    kl: KLPenalty = Field(default_factory=KLPenalty, description="KL penalty to the reference")
    entropy_coef: Annotated[float, b.COEF.field()] = Field(
        default=0.0, description="entropy bonus coefficient"
    )
    temperature: Annotated[float, b.TEMPERATURE.field()] = Field(
        default=1.0, description="the rollout sampling temperature; log-probs use it too"
    )

    @property
    def filters_degenerate(self) -> bool:
        """Groups whose rewards are all equal are dropped from the step (by the filter, or by
        dynamic sampling, which implies it)."""
        return self.filter_degenerate_groups or self.dynamic_sampling is not None
