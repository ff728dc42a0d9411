"""What every config model shares: the strict base model, names, and the bounded number types
(``orchestrator/bounds.py``)."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict

from rollcall.orchestrator import bounds as b

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


def check_name(value: str, field: str) -> str:
    """Names of jobs and tasks: lowercase letters, digits, '-' and '_', starting with a letter."""
    if not _NAME_RE.match(value):
        raise ValueError(
            f"{field} {value!r} is not a valid name; use 1-63 lowercase letters, digits, '-' or "
            "'_', starting with a letter"
        )
    return value
