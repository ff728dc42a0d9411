"""How the supervisor reads a node's death: an exception the node's own code raised (an
``EngineFailure``) is the node's failure and counts against its restart budget, whatever its
message says; its reason names the cause."""

from __future__ import annotations

from rollcall.orchestrator.runner.slots import _death_reason, _machine_lost
from rollcall.workers.episode.engine import EngineFailure


def _raised_by_the_node(e: BaseException) -> BaseException:
    from ray.exceptions import RayTaskError

    # as Ray builds it for an exception raised in an actor method
    tb = (
        "ray::RolloutNode.run() (pid=4242, ip=127.0.0.1, repr=<RolloutNode object>)\n"
        "Traceback (most recent call last):\n"
        '  File "workers/rollout/node.py", line 160, in run\n'
        f"{type(e).__module__}.{type(e).__name__}: {e}"
    )
    error = RayTaskError("RolloutNode.run", tb, e, proctitle="ray::RolloutNode.run()")
    return error.as_instanceof_cause()  # what ray.get raises: also an instance of the cause


def test_an_engine_failure_is_the_nodes_own_failure_not_a_lost_machine() -> None:
    # Ray's text of it says "RolloutNode" and "died": text matching took it for a lost machine,
    # so the failure was never counted and a crash-looping engine restarted forever
    e = _raised_by_the_node(EngineFailure("rollout-0: vLLM's EngineCore died (EngineDeadError)"))
    assert not _machine_lost(e)
    assert _death_reason(e) == "EngineFailure: rollout-0: vLLM's EngineCore died (EngineDeadError)"


def test_ray_reporting_the_machine_gone_is_a_lost_machine() -> None:
    from ray.exceptions import NodeDiedError

    assert _machine_lost(NodeDiedError("node abc died"))


def _actor_died(**context: object) -> BaseException:
    from ray.core.generated.common_pb2 import ActorDiedErrorContext  # type: ignore[attr-defined]
    from ray.exceptions import ActorDiedError

    return ActorDiedError(
        ActorDiedErrorContext(class_name="RolloutNode", actor_id=b"\x01" * 16, pid=42, **context)
    )


def test_a_killed_node_on_a_live_machine_counts_against_its_budget(ray_local: object) -> None:
    # "The actor died unexpectedly ... class_name: RolloutNode ... worker process has died":
    # the old text match read "node" and "died" as a lost machine, so a node killed every
    # minute never used up its budget. Judged from Ray's node table: its machine is alive.
    import ray

    e = _actor_died(error_message="The actor is dead because its worker process has died.")
    assert not _machine_lost(e, ray.get_runtime_context().get_node_id())
    assert not _machine_lost(e)  # no node recorded: counted


def test_a_node_whose_constructor_raised_counts_against_its_budget() -> None:
    from ray.exceptions import ActorDiedError, RayTaskError

    error = FileNotFoundError("model folder /nope has no config.json")
    tb = f"ray::RolloutNode.__init__() (pid=4242, ip=127.0.0.1)\nFileNotFoundError: {error}"
    cause = RayTaskError("RolloutNode.__init__", tb, error, actor_id="01" * 16)
    e = ActorDiedError(cause)  # as Ray raises it for a constructor that raised
    assert e.actor_init_failed and not _machine_lost(e)
    assert _death_reason(e).startswith("constructor raised FileNotFoundError")


def test_a_node_declared_dead_is_described_by_the_words_its_row_keeps() -> None:
    from rollcall.orchestrator.runner.slots import _declared_dead

    row = {"id": 7, "status": "dead", "status_reason": None}
    # a breaker that tripped marks the row dead before the node's run returns: the supervisor
    # read that as "declared dead by the control plane (hung)" (seen 2 in 6 restarts)
    tripped = {**row, "status_reason": "breaker tripped: 3 episodes failed in a row (x)"}
    assert _declared_dead(tripped, 7) == "breaker tripped: 3 episodes failed in a row (x)"
    swept = {**row, "status_reason": "declared dead by the control plane (no heartbeat for 9 s)"}
    assert _declared_dead(swept, 7) == swept["status_reason"]
    assert _declared_dead(row, 7) == "declared dead by the control plane"
    assert _declared_dead({**row, "status": "alive"}, 7) is None
    assert _declared_dead(row, 8) is None  # an older incarnation's row
    assert _declared_dead(None, 7) is None
