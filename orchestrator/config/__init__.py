"""Job configuration: pydantic models, YAML loading and dotted overrides.

Every model forbids unknown keys, so a typo in a YAML file is an error that names the key.
This package imports neither torch nor ray nor SQLAlchemy. Configs are data: there is no
interpolation or code evaluation of any kind.

One module per section of a config file: ``base`` (the strict model, names, bounded numbers),
``tasks`` (``job``, ``tasks``), ``buffer``, ``model`` (``database``, ``model``, ``ray``),
``rollout`` (with its engines, tool sandbox and input limits), ``trainer``, ``control_plane``,
``run`` (``run``, ``metrics``), ``root`` (``RollcallConfig``, the checks across sections) and
``loading`` (YAML files, overrides, errors). Import the names from here.
"""

from __future__ import annotations

from rollcall.orchestrator.config.base import (
    NAME_PATTERN,
    RayAmount,
    Resources,
    Seconds,
    SecondsOrZero,
    Steps,
    StrictModel,
    Temperature,
    TimeScale,
    check_name,
)
from rollcall.orchestrator.config.buffer import BufferConfig
from rollcall.orchestrator.config.control_plane import ControlPlaneConfig
from rollcall.orchestrator.config.loading import (
    apply_overrides,
    format_validation_error,
    load_config,
    read_chat_template,
    read_yaml_mapping,
)
from rollcall.orchestrator.config.model import (
    BUILTIN_MODELS,
    BuiltinModel,
    DatabaseConfig,
    ModelConfig,
    RayConfig,
)
from rollcall.orchestrator.config.rollout import (
    EngineConfig,
    HFEngineConfig,
    InputLimitsConfig,
    RolloutConfig,
    TimingEngineConfig,
    ToolSandboxConfig,
    VLLMEngineConfig,
)
from rollcall.orchestrator.config.root import RollcallConfig
from rollcall.orchestrator.config.run import (
    EvalConfig,
    MetricsConfig,
    RunConfig,
    TrackerName,
    TrackingConfig,
)
from rollcall.orchestrator.config.tasks import JobSection, TaskConfig
from rollcall.orchestrator.config.trainer import (
    LoRAConfig,
    TimingTrainerConfig,
    TrainerConfig,
    WeightsConfig,
)

__all__ = [
    "BUILTIN_MODELS",
    "NAME_PATTERN",
    "BufferConfig",
    "BuiltinModel",
    "ControlPlaneConfig",
    "DatabaseConfig",
    "EngineConfig",
    "EvalConfig",
    "HFEngineConfig",
    "InputLimitsConfig",
    "JobSection",
    "LoRAConfig",
    "MetricsConfig",
    "ModelConfig",
    "RayAmount",
    "RayConfig",
    "Resources",
    "RollcallConfig",
    "RolloutConfig",
    "RunConfig",
    "Seconds",
    "SecondsOrZero",
    "Steps",
    "StrictModel",
    "TaskConfig",
    "Temperature",
    "TimeScale",
    "TimingEngineConfig",
    "TimingTrainerConfig",
    "ToolSandboxConfig",
    "TrackerName",
    "TrackingConfig",
    "TrainerConfig",
    "VLLMEngineConfig",
    "WeightsConfig",
    "apply_overrides",
    "check_name",
    "format_validation_error",
    "load_config",
    "read_chat_template",
    "read_yaml_mapping",
]
