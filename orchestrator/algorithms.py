"""The GRPO algorithm's named choices, as typed configs.

Each choice is a class with a ``kind`` tag in a discriminated union, so a config file names the
estimator, the off-policy correction or the loss aggregation, and pydantic rejects anything
else with the list of valid kinds. The mathematics lives in ``rollcall.workers.trainer.grpo``, which
looks each kind up in a registry; adding one is a class here plus a registration there.
Importable without torch.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

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


AdvantageEstimator = Annotated[GRPOAdvantage | DrGRPOAdvantage, Field(discriminator="kind")]


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


class LossConfig(_Strict):
    """The GRPO loss of a train step."""

    advantage: AdvantageEstimator = Field(
        default_factory=GRPOAdvantage, description="the advantage estimator, by kind"
    )
    filter_degenerate_groups: bool = Field(
        default=False,
        description="drop groups whose rewards are all equal (dynamic sampling); counted",
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
