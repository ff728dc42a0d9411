"""Ray's own messages to a driver, sent to the log (``driver.log``) instead of the terminal.

With ``log_to_driver=False`` the actors' output stays in Ray's session logs, but the driver
still prints the cluster's error messages as paragraphs on stdout: after a rollout node or the
trainer is killed, "(raylet) A worker died or was killed while executing a task by an
unexpected system error ... consider enabling resource isolation ...", between rollcall's own
line for the same event ("rollout-0: down (actor died); restarting in 2.0 s"). Ray has no
option for them (Ray 2.x: ``ray._private.worker.listen_error_messages``, a thread of every
driver, prints each through the module's ``print_to_stdstream``), so while a job runs that
function is replaced by one that logs each line under ``rollcall.ray`` (not under ``ray``, whose
logger may not propagate: Python would print the record on stderr); the job's log handlers take
it from there (RunDir.capture_logs: driver.log).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("rollcall.ray")


def _to_log(data: dict[str, Any], ignore_prefix: bool = False) -> None:
    source = data.get("pid") or "ray"
    for line in data.get("lines") or ():
        log.warning("(%s) %s", source, line)


def route_to_log() -> Callable[[], None]:
    """Send Ray's messages to this process's log from now on; returns what undoes it. A Ray
    without the hook (another version) keeps printing them, and nothing else changes."""
    from ray._private import worker

    original = getattr(worker, "print_to_stdstream", None)
    if original is None or original is _to_log:
        return lambda: None
    worker.print_to_stdstream = _to_log

    def undo() -> None:
        if getattr(worker, "print_to_stdstream", None) is _to_log:
            worker.print_to_stdstream = original

    return undo
