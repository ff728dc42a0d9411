"""The ``trainer`` section: the FSDP2 trainer (or its timing model) and how weights reach the
engines (``trainer.weights``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from rollcall.orchestrator import bounds as b
from rollcall.orchestrator.algorithms import LossConfig
from rollcall.orchestrator.config.base import (
    RayAmount,
    Resources,
    Seconds,
    SecondsOrZero,
    Steps,
    StrictModel,
    TimeScale,
)


class TimingTrainerConfig(StrictModel):
    """A benchmark trainer, not a trainer: one Ray actor that takes each step's planned batch
    and sleeps ``step_s + s_per_token x tokens`` simulated seconds (``time_scale`` real seconds
    each), then goes through the normal checkpoint, publish and commit path, writing small
    files (``publish_bytes`` of weights per version) and sleeping the modelled ``checkpoint_s``
    and ``publish_s``. Never for training: the weights do not change (``ops/bench/pipeline.py``)."""

    time_scale: TimeScale = Field(default=0.02, description="real seconds per simulated second")
    step_s: SecondsOrZero = Field(default=1.0, description="fixed simulated time per step")
    s_per_token: Annotated[float, b.SECONDS_PER_TOKEN.field()] = Field(
        default=3e-4, description="simulated seconds per token"
    )
    checkpoint_s: SecondsOrZero = Field(default=0.5, description="simulated checkpoint time")
    publish_s: SecondsOrZero = Field(default=0.5, description="simulated weight-publish time")
    publish_bytes: Annotated[int, b.BYTES.field()] = Field(
        default=1_000_000, description="bytes of the weights file written per version"
    )


class WeightsConfig(StrictModel):
    """How published weights reach the rollout engines (docs/architecture.md, "Weights over
    collectives"). ``files``: each node loads a published version's safetensors file.
    ``collective``: the trainer's rank 0 broadcasts each version to the live nodes over
    ``torch.distributed`` (gloo on CPU, NCCL on GPU) right after its step commits; the file is
    still written, off the trainer's critical path, as the durable copy that a node which missed
    the broadcast (restarted, late, or in a failed group) loads instead."""

    transport: Literal["files", "collective"] = Field(
        default="files", description="files or collective (a broadcast from rank 0)"
    )
    timeout_s: Seconds = Field(
        default=30.0,
        description="collective: each step of a broadcast (forming the group, each bucket); a "
        "member that does not keep up is dropped from it",
    )
    bucket_mb: Annotated[float, b.BUCKET_MB.field()] = Field(
        default=256.0, description="collective: tensors are sent in buckets of this many MB"
    )
    grace_s: Seconds = Field(
        default=120.0,
        description="collective: a node that has not received a version this long after it "
        "saw it published loads it from its file",
    )


# every linear layer of a Llama/Qwen2/Mistral decoder block
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAConfig(StrictModel):
    """LoRA (peft): the trainer trains low-rank adapters on ``target_modules`` with the base
    weights frozen (optimizer state for the adapters only) and publishes only the adapter by
    version; engines apply it to their base model (docs/algorithms.md#lora)."""

    rank: Annotated[int, b.LORA_RANK.field()] = Field(description="the adapters' rank r")
    alpha: Annotated[int, b.LORA_ALPHA.field()] = Field(
        default=16, description="the adapters' scale is alpha / rank"
    )
    dropout: Annotated[float, b.LORA_DROPOUT.field()] = Field(
        default=0.0, description="dropout on the adapters' input (training only)"
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS),
        min_length=1,
        description="names of the linear modules that get adapters (each must exist in the model)",
    )


class TrainerConfig(StrictModel):
    """The FSDP2 trainer: ``ranks`` Ray actors, gloo on CPU, NCCL on CUDA. With
    ``timing_model`` set, the benchmark's timing model stands in for it instead."""

    ranks: Annotated[int, b.NODES.field()] = Field(
        default=1, description="FSDP2 ranks (Ray actors)"
    )
    cpus_per_rank: RayAmount = Field(default=1.0, gt=0, description="Ray CPUs each rank asks for")
    resources: Resources = Field(
        default_factory=dict, description="custom Ray resources each rank needs (placement)"
    )
    device: Literal["cpu", "cuda"] = Field(
        default="cpu", description="cpu (gloo) or cuda (NCCL, one GPU per rank)"
    )
    lr: Annotated[float, b.LR.field()] = Field(default=1e-5, description="AdamW learning rate")
    weight_decay: Annotated[float, b.WEIGHT_DECAY.field()] = Field(
        default=0.0, description="AdamW weight decay"
    )
    betas: tuple[Annotated[float, b.BETA.field()], Annotated[float, b.BETA.field()]] = Field(
        default=(0.9, 0.999), description="AdamW betas"
    )
    warmup_steps: Annotated[int, b.STEPS_OR_ZERO.field()] = Field(
        default=0, description="steps of linear learning-rate warm-up"
    )
    schedule: Literal["constant", "cosine"] = Field(
        default="constant", description="after warm-up: constant, or cosine down to min_lr_ratio"
    )
    min_lr_ratio: Annotated[float, b.FRACTION.field()] = Field(
        default=0.1, description="the cosine schedule's final learning rate, as a share of lr"
    )
    grad_clip: Annotated[float, b.GRAD_CLIP.field()] = Field(
        default=1.0, description="gradient norm clip"
    )
    micro_batch_tokens: Annotated[int, b.tokens(16).field()] = Field(
        default=8192, description="packing budget: tokens per micro-batch"
    )
    mini_batches: Annotated[int, b.MINI_BATCHES.field()] = Field(
        default=1, description="optimizer updates per step (PPO mini-batches)"
    )
    logprob_chunk_tokens: Annotated[int, b.tokens(0).field()] = Field(
        default=1024,
        description="positions whose full-vocabulary logits exist at once (recomputed in "
        "backward); 0: a whole micro-batch at once",
    )
    precision: Literal["float32", "bf16"] = Field(
        default="float32",
        description="bf16: forward and backward in bfloat16 (FSDP2 mixed precision), with "
        "float32 weights, optimizer state, gradient reduction and log-prob math",
    )
    activation_checkpointing: bool = Field(
        default=False, description="recompute each decoder layer in backward (less memory)"
    )
    checkpoint_every: Steps = Field(
        default=1, description="steps between checkpoints (a multiple or divisor of sync_every)"
    )
    keep_checkpoints: Annotated[int, b.KEEP.field()] = Field(
        default=2, description="checkpoints kept in the run directory"
    )
    sync_every: Steps = Field(default=1, description="steps between weight publications")
    keep_weights: Annotated[int, b.KEEP.field()] = Field(
        default=3, description="published weight versions kept in the run directory"
    )
    max_restarts: Annotated[int, b.RESTARTS.field()] = Field(
        default=3, description="trainer restarts within restart_window_s before giving up"
    )
    restart_window_s: Seconds = Field(
        default=600.0, description="the window max_restarts counts restarts in"
    )
    start_timeout_s: Seconds = Field(
        default=600.0,
        description="a (re)started trainer whose placed ranks have not finished their set-up "
        "(model load, process group) by then is a failed start",
    )
    call_timeout_s: Seconds = Field(
        default=1800.0,
        description="a trainer call (set-up, step, checkpoint, publish) that has not returned "
        "by then is a failed trainer: killed and restarted from the last checkpoint",
    )
    loss: LossConfig = Field(
        default_factory=LossConfig, description="the GRPO loss (docs/algorithms.md)"
    )
    is_weight_tolerance: Annotated[float, b.FRACTION.field()] = Field(
        default=0.05,
        description="warn when the on-policy tokens' importance weight (geometric mean of "
        "pi_old / pi_behaviour over tokens 0 versions behind) strays further from 1",
    )
    is_weight_warn_every: Steps = Field(
        default=100, description="steps between repeated warnings while the weight stays out"
    )
    weights: WeightsConfig = Field(
        default_factory=WeightsConfig, description="how published weights reach the engines"
    )
    timing_model: TimingTrainerConfig | None = Field(
        default=None, description="benchmarks only: a timing model instead of the FSDP2 ranks"
    )
    lora: LoRAConfig | None = Field(
        default=None, description="train LoRA adapters instead of every weight (unset: full)"
    )

    @model_validator(mode="after")
    def _checkpoints_aligned_with_publications(self) -> TrainerConfig:
        # A restarted trainer resumes from its last checkpoint. With one interval a multiple of
        # the other the two schedules stay aligned: every checkpoint is taken at a publication
        # (a restart goes back to weights the rollout nodes were given), or every publication
        # at a checkpoint (a restart never goes back behind a published version). Drifting
        # schedules (e.g. 2 and 3) put checkpoints between publications and publications
        # after checkpoints, which a restart cannot reconcile with the versions published.
        if self.timing_model is not None and self.weights.transport == "collective":
            raise ValueError(
                "trainer.weights.transport: collective needs real weights to broadcast; the "
                "timing-model trainer publishes none: use files"
            )
        if self.lora is not None and self.timing_model is not None:
            raise ValueError("trainer.lora needs the FSDP2 trainer, not the timing model")
        c, s = self.checkpoint_every, self.sync_every
        if c % s and s % c:
            raise ValueError(
                f"trainer.checkpoint_every ({c}) and trainer.sync_every ({s}) must be multiples "
                "of one another, so that checkpoints and weight publications stay aligned; "
                f"set checkpoint_every to {s} or a multiple of it"
            )
        return self
