"""The GRPO algorithm's named choices, as typed configs.

Each choice is a class with a ``kind`` tag in a discriminated union, so a config file names the
estimator, the off-policy correction or the loss aggregation, and pydantic rejects anything
else with the list of valid kinds. The mathematics lives in ``workers.trainer.grpo``, which
looks each kind up in a registry; adding one is a class here plus a registration there.
Importable without torch.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from orchestrator import bounds as b


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# --- advantage estimators (per group of samples of one prompt) --------------------------------


class GRPOAdvantage(_Strict):
    """(r - mean) / (std + eps), std with Bessel's correction (n - 1), as TRL and verl."""

    kind: Literal["grpo"] = "grpo"
    eps: Annotated[float, b.EPS.field()] = 1e-6


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
    cap: Annotated[float, b.IS_CAP.field()] = 2.0


class DecoupledPPO(_Strict):
    """Decoupled PPO (Hilton et al., as in AReaL): the clip is taken around the proximal policy
    (the policy at the start of the step) and each token is weighted by
    pi_prox / pi_behaviour. With ``cap`` set, tokens whose weight exceeds it are dropped
    (weight 0) rather than truncated."""

    kind: Literal["decoupled"] = "decoupled"
    cap: Annotated[float, b.IS_CAP.field()] | None = None


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
    max_tokens: Annotated[int, b.tokens(1).field()] = 4096


Aggregation = Annotated[
    TokenMean | SeqMeanTokenMean | ConstantNormaliser, Field(discriminator="kind")
]


class KLPenalty(_Strict):
    """KL(pi_theta || pi_ref) per token, added to the loss with ``coef``; 0: no reference model
    and no reference forward at all."""

    coef: Annotated[float, b.COEF.field()] = 0.0
    estimator: Literal["k1", "k3"] = "k3"


class LossConfig(_Strict):
    """The GRPO loss of a train step."""

    advantage: AdvantageEstimator = Field(default_factory=GRPOAdvantage)
    filter_degenerate_groups: bool = Field(
        default=False,
        description="drop groups whose rewards are all equal (dynamic sampling); counted",
    )
    clip_low: Annotated[float, b.CLIP_LOW.field()] = 0.2
    clip_high: Annotated[float, b.CLIP_HIGH.field()] = 0.28
    correction: Correction = Field(default_factory=TruncatedIS)
    aggregation: Aggregation = Field(default_factory=TokenMean)
    kl: KLPenalty = Field(default_factory=KLPenalty)
    entropy_coef: Annotated[float, b.COEF.field()] = 0.0
    temperature: Annotated[float, b.TEMPERATURE.field()] = Field(
        default=1.0, description="the rollout sampling temperature; log-probs use it too"
    )
