"""The trainer the config names: the FSDP2 ranks, or a benchmark's timing model."""

from __future__ import annotations

from typing import Any

from rollcall.orchestrator.config import TrainerConfig
from rollcall.workers.trainer.group import TrainerGroup
from rollcall.workers.trainer.timing import TimingTrainerGroup


def make_trainer(config: TrainerConfig, model_dir: str, **kwargs: Any) -> Any:
    """A ``TrainerGroup`` (``trainer.timing_model`` unset) or a ``TimingTrainerGroup``; both
    take the same arguments and offer the same methods to the job driver."""
    if config.timing_model is not None:
        return TimingTrainerGroup(config, model_dir, **kwargs)

    return TrainerGroup(config, model_dir, **kwargs)
