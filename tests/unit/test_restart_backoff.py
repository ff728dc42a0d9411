"""The supervisor's restart backoff: ``restart_backoff_s x 2^(n-1)`` over a slot's *streak* of
deaths, each within ``HEALTHY_RESET_S`` of its start (a crash loop); an incarnation that ran
that long before it died starts the backoff over. The budget still counts every restart in
``restart_window_s``. (The soak's nodes, killed every few minutes after running healthily,
waited 8-30 s per restart: the delay had doubled with every restart in the window.)"""

from __future__ import annotations

from typing import Any

from rollcall.orchestrator.runner import supervisor as sup_module
from rollcall.orchestrator.runner.supervisor import Supervisor


class Buffer:  # a fake control-plane buffer: what the supervisor records, kept
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def node_health(self) -> list[dict[str, Any]]:
        return []

    def event(self, kind: str, message: str, payload: dict[str, Any]) -> None:
        self.events.append((kind, payload))

    def record_slot(self, *args: Any, **kwargs: Any) -> None:
        pass


class Actor:  # a fake node actor: its remote calls return nothing
    def __getattr__(self, name: str) -> Any:
        class Method:
            def remote(self, *args: Any) -> None:
                return None

        return Method()


def _delays(uptimes: list[float], monkeypatch: Any) -> list[float]:
    """The restart delays of one slot whose incarnations die after ``uptimes`` seconds."""
    clock = [1000.0]
    monkeypatch.setattr(sup_module.time, "monotonic", lambda: clock[0])
    buffer = Buffer()
    sup = Supervisor(
        buffer,  # type: ignore[arg-type]
        lambda index: Actor(),
        nodes=1,
        max_restarts=100,
        restart_window_s=10_000,
        backoff_base_s=1.0,
        backoff_cap_s=30.0,
    )
    (slot,) = sup.slots
    for up in uptimes:
        clock[0] += up
        slot.died_at = clock[0]
        clock[0] += 70.0  # Ray's word on its machine came later: the death's time counts
        sup._counted(slot, "killed")
        clock[0] = slot.next_start_at
        sup.place(slot, clock[0])  # restarted
    return [p["delay_s"] for kind, p in buffer.events if kind == "worker.restarting"]


def test_a_crash_loop_backs_off_exponentially(monkeypatch: Any) -> None:
    assert _delays([1.0] * 7, monkeypatch) == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_a_node_that_ran_healthily_before_it_died_restarts_after_the_base_delay(
    monkeypatch: Any,
) -> None:
    healthy = sup_module.HEALTHY_RESET_S + 1
    assert _delays([healthy] * 5, monkeypatch) == [1.0] * 5
    # a crash loop after a healthy run backs off from the start again
    assert _delays([healthy, 1.0, 1.0, healthy, 1.0], monkeypatch) == [1.0, 2.0, 4.0, 1.0, 2.0]
