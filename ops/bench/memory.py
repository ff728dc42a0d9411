"""What the memory benchmarks share: peak RSS of this process, and one configuration per child
process (so peaks do not mix), stopped when its memory passes a cap instead of letting the
machine's OOM killer pick a victim."""

from __future__ import annotations

import resource
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

GIB = 2**30


def peak_rss() -> int:
    """The peak resident memory of this process so far, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def rss(pid: int | str = "self") -> int:
    """The resident memory of a process now, in bytes (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def available() -> int:
    """The machine's available memory now, in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


@dataclass(frozen=True)
class ChildResult:
    stdout: str
    returncode: int
    over_cap: bool  # stopped: its memory passed the cap, or the machine's ran short
    timed_out: bool
    max_rss: int  # the largest RSS the parent saw, in bytes


def run_child(
    cmd: list[str], *, cap: int, timeout_s: float, reserve: int = GIB, poll_s: float = 0.05
) -> ChildResult:
    """Run ``cmd``, killing it when its RSS passes ``cap`` bytes, when the machine has less than
    ``reserve`` bytes available (other processes grew meanwhile), or when it runs past
    ``timeout_s``."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    seen = 0
    over = timed_out = False
    while proc.poll() is None:
        now = rss(proc.pid)
        seen = max(seen, now)
        if now > cap or available() < reserve:
            over = True
        elif time.monotonic() > deadline:
            timed_out = True
        if over or timed_out:
            proc.kill()
            break
        time.sleep(poll_s)
    out, _ = proc.communicate()
    return ChildResult(out, proc.returncode, over, timed_out, seen)
