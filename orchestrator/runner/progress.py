"""Live progress of a running job: a rich panel on a terminal, one line per step elsewhere."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text


@dataclass
class Snapshot:
    job: str
    mode: str
    step: int
    total_steps: int
    version: int
    elapsed_s: float
    busy_frac: float = 0.0
    eta_s: float | None = None
    reward: dict[str, float] = field(default_factory=dict)  # last batch, per task
    mix: dict[str, int] = field(default_factory=dict)  # groups per task in the last batch
    heldout: dict[str, float] = field(default_factory=dict)  # last evaluation
    staleness_mean: float = 0.0
    staleness_max: float = 0.0
    depth: dict[str, int] = field(default_factory=dict)
    nodes: list[dict[str, Any]] = field(default_factory=list)
    waiting: str = ""


class Pace:
    """The ETA of a run from the pace of its steps since the first one it saw done: the first
    step of a run also waits for the rollout nodes' start and the first full batch's rollout,
    so counting it as a step would show an hour at step 1 of a ten-minute run."""

    def __init__(self) -> None:
        self._first: tuple[float, int] | None = None  # (elapsed, steps) at the first step seen

    def eta_s(self, *, elapsed_s: float, steps: int, left: int) -> float | None:
        """Seconds left for ``left`` more steps, ``steps`` done in ``elapsed_s`` this run;
        None until a step beyond the first is done."""
        if steps < 1:
            return None
        if self._first is None:
            self._first = (elapsed_s, steps)
        t0, n0 = self._first
        if steps <= n0:
            return None
        return (elapsed_s - t0) / (steps - n0) * left


def _eta(s: Snapshot) -> str:
    if s.eta_s is None:
        return "-"
    m, sec = divmod(int(s.eta_s), 60)
    return f"{m}m{sec:02d}s"


def render(s: Snapshot) -> Group:
    head = Text.assemble(
        (f"job {s.job} ", "bold"),
        f"({s.mode})  step {s.step}/{s.total_steps}  version {s.version}  ",
        f"elapsed {int(s.elapsed_s)}s  ETA {_eta(s)}  trainer busy {s.busy_frac:.0%}",
    )
    tasks = Table(box=None, pad_edge=False)
    for col in ("task", "batch reward", "held-out", "groups in batch"):
        tasks.add_column(col)
    for name in sorted(set(s.reward) | set(s.heldout)):
        held = s.heldout.get(name)
        tasks.add_row(
            name,
            f"{s.reward[name]:.3f}" if name in s.reward else "-",
            f"{held:.3f}" if held is not None else "-",
            str(s.mix.get(name, 0)),
        )
    depth = "  ".join(f"{k} {v}" for k, v in sorted(s.depth.items()))
    nodes = "  ".join(
        f"{n['name']}: {n['status']} v{n['loaded_version']} beat {n['heartbeat_age_s']:.0f}s ago"
        for n in s.nodes
    )
    lines: list[Any] = [
        head,
        tasks,
        Text(f"staleness mean {s.staleness_mean:.2f} max {s.staleness_max:.0f}   buffer: {depth}"),
        Text(f"nodes: {nodes}"),
    ]
    if s.waiting:
        lines.append(Text(s.waiting, style="dim"))
    return Group(*lines)


def line(s: Snapshot) -> str:
    rewards = " ".join(f"{k}={v:.3f}" for k, v in sorted(s.reward.items()))
    held = " ".join(f"{k}={v:.3f}" for k, v in sorted(s.heldout.items()))
    return (
        f"step {s.step}/{s.total_steps} v{s.version} reward[{rewards}] held-out[{held}] "
        f"stale {s.staleness_mean:.2f}/{s.staleness_max:.0f} busy {s.busy_frac:.0%} "
        f"ETA {_eta(s)}"
    )


class Progress:
    """``update`` often (it redraws at most a few times a second); ``step_done`` once per step
    (prints a line when the output is not a terminal)."""

    def __init__(self, console: Console, enabled: bool = True) -> None:
        self.console = console
        self.live: Live | None = None
        if enabled and console.is_terminal:
            self.live = Live(console=console, refresh_per_second=4, transient=False)
            self.live.start()

    def update(self, s: Snapshot) -> None:
        if self.live is not None:
            self.live.update(render(s))

    def step_done(self, s: Snapshot) -> None:
        if self.live is not None:
            self.live.update(render(s))
        else:
            self.console.print(line(s), markup=False, highlight=False)

    def message(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
