"""Fakes at the weight broadcast's seam, for tests: ``fault`` arms the receiver of one node
process to SIGSTOP or SIGKILL itself mid-broadcast (``rollcall.workers.collective.FAULT_ENV``), once:
an ``arm`` file in the flags folder is consumed, so a restarted incarnation of the node is not
armed again."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rollcall.workers import collective


def fault(engine: Any, arg: str) -> Any:
    """``arg``: ``FLAGS_DIR:stop|kill:BUCKET:NODE``; the engine is returned unchanged."""
    flags, kind, bucket, who = arg.rsplit(":", 3)
    arm = Path(flags) / "arm"
    try:
        arm.unlink()
    except FileNotFoundError:
        return engine
    os.environ[collective.FAULT_ENV] = f"{kind}:{bucket}:{who}"
    (Path(flags) / f"armed-{os.getpid()}").touch()
    return engine
