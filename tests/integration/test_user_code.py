"""User code that misbehaves on some inputs never takes a job down (``tests.support.
faulty_agents``): a NaN reward, an agent that raises, a wrong return type, an ``await`` that
never ends, a thread blocked by synchronous work. Each job runs through ``rollcall run`` (the
terminal output is what a user sees) on real Ray, PostgreSQL and the tiny model's ``hf``
engine, on one rollout node, with one task per fault, each asserted on its own rows.

Two jobs (module-scoped), each in a database of its own:

- ``usercode`` (``finishing``): four tasks that fail on one input in four (a NaN reward, a
  raise, an endless ``await``, a blocked thread) beside each other; the job finishes. Then, as
  a buffer written before rewards were checked, NaN and infinite rewards are put into its
  finished groups (one of them reserved by the next step) and the job continues with
  ``--resume``.
- ``pausing`` (``pausing``): two tasks whose code fails on every input (a raise, a wrong
  return type); both are paused and the job stops with exit code 8.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml

from rollcall.orchestrator.buffer.invariants import check_invariants
from rollcall.orchestrator.db.engine import Database
from tests.conftest import CliResult, PgServer, job_database, run_cli
from tests.integration.buffer_helpers import rows, scalar

pytestmark = pytest.mark.timeout(600)

AGENTS = "tests.support.faulty_agents"
AGENT_FILE = "faulty_agents.py"

# job ``usercode``: the task running each agent
NAN, RAISES, HANGS, BLOCKS = "nan", "raises", "hangs", "blocks"
STEPS = 8  # the first run's; ``--resume`` continues to STEPS + RESUMED
RESUMED = 1
# groups per step: half as many as the four tasks make at once, so that finished groups are
# left untrained when the first run ends (the ``--resume`` test's old rows)
BATCH = 2
# job ``pausing``
ALWAYS, WRONG = "always", "wrongtype"


def write_config(
    tmp: Path,
    model: Path,
    job: str,
    tasks: dict[str, dict[str, Any]],
    *,
    steps: int,
    batch_groups: int = 1,
    control_plane: dict[str, Any] | None = None,
    rollout: dict[str, Any] | None = None,
) -> Path:
    """``tasks``: name -> ``agent`` (a function of ``faulty_agents``), and optionally
    ``prompt`` (columns of every prompt row), ``spec``, ``max_inflight`` and ``max_staleness``.
    ``batch_groups`` and ``max_staleness`` size each task's admission (its outstanding work):
    ``ceil((max_staleness + 1) * batch_groups / tasks)`` groups."""
    entries = []
    for name, t in tasks.items():
        prompts = tmp / f"prompts-{name}.jsonl"
        prompts.write_text(
            "".join(json.dumps({"i": i, "every": 4, **t.get("prompt", {})}) + "\n"
                    for i in range(64))
        )  # fmt: skip
        entries.append(
            {
                "name": name,
                "agent": f"{AGENTS}:{t['agent']}",
                "prompts": {"path": str(prompts), "held_out_per_mille": 0},
                "max_inflight": t.get("max_inflight", 2),
                "max_staleness": t.get("max_staleness", 4),
                "spec": {"group_size": 2, "max_turns": 2, **t.get("spec", {})},
            }
        )
    data: dict[str, Any] = {
        "job": {"name": job},
        "model": {"path": str(model)},
        "buffer": {"batch_groups": batch_groups, "lease_s": 30, "retry_backoff_s": 0.2},
        "rollout": {
            "nodes": 1,
            "concurrency": 4,
            "max_tokens_per_turn": 8,
            "max_tokens": 128,
            "heartbeat_interval_s": 0.5,
            "restart_backoff_s": 0.5,
            **(rollout or {}),
        },
        "trainer": {"lr": 1e-3, "micro_batch_tokens": 512},
        "control_plane": {
            "seed_interval_s": 0.5,
            "dead_sweep_interval_s": 0.5,
            "supervise_interval_s": 0.5,
            "heartbeat_timeout_s": 5.0,
            "progress_timeout_s": 30.0,
            **(control_plane or {}),
        },
        "run": {"dir": str(tmp / "run"), "total_steps": steps, "eval": {"every": 0, "episodes": 0}},
        "tasks": entries,
    }
    path = tmp / f"{job}-{steps}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def bad_prompt(prompt: dict[str, Any]) -> bool:
    return int(prompt["i"]) % int(prompt["every"]) == 0


def bad_index(payload: dict[str, Any], every: int = 4) -> bool:
    """The event's prompt is one the agent fails on (the prompt stream's index is the row's)."""
    return int(payload["prompt_index"]) % every == 0


def no_traceback(r: Any) -> None:
    assert "Traceback" not in r.out + r.err, r.out + r.err


def node_incarnations(engine: sa.Engine) -> int:
    return int(scalar(engine, "SELECT count(*) FROM workers WHERE role = 'rollout'"))


def user_errors(engine: sa.Engine) -> list[tuple[str, dict[str, Any]]]:
    return [
        (m, p)
        for m, p in rows(
            engine, "SELECT message, payload FROM events WHERE kind = 'episode.user_error' "
            "ORDER BY id",
        )
    ]  # fmt: skip


def by_task(engine: sa.Engine, sql: str) -> dict[str, list[Any]]:
    """``sql``'s rows (its first column the task's name) per task, the name left out."""
    out: dict[str, list[Any]] = {}
    for r in rows(engine, sql):
        out.setdefault(r[0], []).append(r[1] if len(r) == 2 else tuple(r[1:]))
    return out


def invariants(db: Database, engine: sa.Engine, job: str) -> tuple[bool, str]:
    report = check_invariants(db, scalar(engine, "SELECT id FROM jobs WHERE name = :n", n=job))
    return report.ok, report.summary()


rollcall = run_cli  # ``rollcall ARGS`` in-process against a module-scoped job's database


# -- job ``usercode``: four tasks failing on some inputs; the job finishes, then resumes --------


@dataclass
class Finishing:
    """What the first run left (read right after it), and what ``--resume`` did."""

    run: CliResult
    invariants: tuple[bool, str]
    incarnations: int
    errors: dict[str, list[tuple[str, dict[str, Any]]]]  # per task
    rewards: dict[str, list[float | None]]
    quarantined: dict[str, list[tuple[dict[str, Any], str]]]
    trained: dict[str, list[dict[str, Any]]]
    done: dict[str, list[dict[str, Any]]]
    driver_log: str
    ready: list[int] = field(default_factory=list)  # finished groups not trained
    bad: list[int] = field(default_factory=list)  # those given non-finite rewards
    resumed: CliResult | None = None
    statuses: list[tuple[str, str]] = field(default_factory=list)
    nonfinite_events: list[int] = field(default_factory=list)
    resumed_invariants: tuple[bool, str] = (False, "not resumed")


@pytest.fixture(scope="module")
def finishing(
    ray_local: Any, tiny_dir: Path, pg: PgServer, template_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Finishing]:  # fmt: skip
    """Four tasks on one node of 8 agent loops (as the issue's job), each failing on
    one prompt in four: ``nan`` (a NaN reward), ``raises`` (a tool that raises, 4 episodes in
    flight), ``hangs`` (an ``await`` that never ends; the episode timeout is 6 s), ``blocks``
    (8 s of synchronous work, longer than the progress timeout of 4 s: slow user code, not a
    hung node; its tool timeout fits the 4 s). Then NaN rewards, as an older rollcall stored
    them, in the finished groups left, and ``--resume``."""
    tmp = tmp_path_factory.mktemp("usercode")
    tasks: dict[str, dict[str, Any]] = {
        NAN: {"agent": "nan_on_some"},
        RAISES: {"agent": "raise_on_some", "max_inflight": 4},
        HANGS: {"agent": "hang_on_some", "spec": {"episode_timeout_s": 6}},
        BLOCKS: {"agent": "block_on_some", "prompt": {"block_s": 8}},
    }
    for t in tasks.values():
        # every task's tool timeout within the progress timeout's room; admission: 5 groups
        # (as a job of one task, batch_groups 1 and max_staleness 4), 4 of them in flight
        t["spec"] = {"tool_timeout_s": 0.5, **t.get("spec", {})}
        t["max_staleness"] = 9
    settings: dict[str, Any] = {
        "batch_groups": BATCH,
        "rollout": {"concurrency": 8, "tool_timeout_s": 0.5},
        "control_plane": {"heartbeat_timeout_s": 3.0, "progress_timeout_s": 4.0},
    }
    with job_database(pg, "usercode") as (url, db, engine):
        config = write_config(tmp, tiny_dir, "usercode", tasks, steps=STEPS, **settings)
        r = rollcall(url, "run", str(config), "--no-live")
        print(r.out, r.err)
        errors: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        for message, payload in user_errors(engine):
            errors.setdefault(payload["task"], []).append((message, payload))
        log = tmp / "run" / "driver.log"
        got = Finishing(
            run=r,
            invariants=invariants(db, engine, "usercode"),
            incarnations=node_incarnations(engine),
            errors=errors,
            rewards=by_task(engine, "SELECT k.name, t.reward FROM trajectories t "
                                    "JOIN tasks k ON k.id = t.task_id"),
            quarantined=by_task(engine, "SELECT k.name, e.prompt, e.last_error FROM episodes e "
                                        "JOIN tasks k ON k.id = e.task_id "
                                        "WHERE e.status = 'quarantined'"),
            trained=by_task(engine, "SELECT k.name, e.prompt FROM episodes e JOIN tasks k "
                                    "ON k.id = e.task_id WHERE e.consumed_step IS NOT NULL"),
            done=by_task(engine, "SELECT k.name, e.prompt FROM episodes e JOIN tasks k "
                                 "ON k.id = e.task_id WHERE e.status = 'done'"),
            driver_log=log.read_text() if log.exists() else "",
        )  # fmt: skip
        # what an older rollcall left: the next step's batch reserved (claimed) with NaN
        # rewards, and another finished group with infinite rewards waiting in the buffer
        with engine.begin() as conn:
            got.ready = list(
                conn.execute(
                    sa.text(
                        "SELECT id FROM episodes WHERE status = 'done' AND consumed_step IS NULL "
                        "ORDER BY min_policy_version DESC, id"  # the freshest: none expires
                    )
                ).scalars()
            )
            if r.code == 0 and got.ready:
                claimed, rest = got.ready[0], got.ready[1:]
                conn.execute(
                    sa.text("UPDATE episodes SET claimed_step = :s WHERE id = :e"),
                    {"e": claimed, "s": STEPS},
                )
                conn.execute(
                    sa.text(
                        "UPDATE trajectories SET status = 'claimed', claimed_step = :s, "
                        "reward = 'NaN' WHERE episode_id = :e"
                    ),
                    {"e": claimed, "s": STEPS},
                )
                conn.execute(
                    sa.text("UPDATE jobs SET pending_step = :s, pending_mix = '{}'"), {"s": STEPS}
                )
                if rest:
                    conn.execute(
                        sa.text(
                            "UPDATE trajectories SET reward = 'Infinity' WHERE episode_id = :e"
                        ),
                        {"e": rest[0]},
                    )
                got.bad = [claimed, *rest[:1]]
        if got.bad:
            config = write_config(tmp, tiny_dir, "usercode", tasks, steps=STEPS + RESUMED,
                                  **settings)  # fmt: skip
            got.resumed = rollcall(url, "run", str(config), "--resume", "--no-live")
            print(got.resumed.out, got.resumed.err)
            got.statuses = [
                (s, e)
                for s, e in rows(
                    engine, "SELECT status::text, last_error FROM episodes WHERE id = ANY(:ids)",
                    ids=got.bad,
                )
            ]  # fmt: skip
            got.nonfinite_events = [
                p["episode_id"]
                for (p,) in rows(
                    engine, "SELECT payload FROM events WHERE kind = 'episode.quarantined' "
                    "AND payload->>'reason' = 'non-finite reward'",
                )
            ]  # fmt: skip
            got.resumed_invariants = invariants(db, engine, "usercode")
        yield got


def test_the_job_with_every_task_failing_on_some_inputs_finishes_on_its_first_node(
    finishing: Finishing,
) -> None:
    r = finishing.run
    assert r.code == 0, r.out + r.err
    no_traceback(r)
    assert f"job usercode: {STEPS} steps" in r.out
    # the inputs' faults, never the node's: no restart, no breaker, no hang verdict
    assert finishing.incarnations == 1, r.out
    assert "restarting" not in r.out and "breaker" not in r.out, r.out
    ok, summary = finishing.invariants
    assert ok, summary
    # no NaN reached the buffer's trainable rows, let alone the trainer
    rewards = [x for xs in finishing.rewards.values() for x in xs if x is not None]
    assert rewards and all(math.isfinite(x) for x in rewards)


def test_a_nan_reward_on_some_prompts_quarantines_them_and_the_job_finishes(
    finishing: Finishing,
) -> None:
    r = finishing.run
    assert [x for x in finishing.rewards.get(NAN, []) if x is not None], "no reward of nan"
    # every bad prompt that was tried failed as the input's fault, naming the value; after the
    # task's attempts it is quarantined, never trained
    errors = finishing.errors.get(NAN)
    assert errors, "no user-code failure was recorded"
    for message, payload in errors:
        assert payload["task"] == NAN and bad_index(payload), payload
        assert "reward nan is not a finite number" in message, message
    quarantined = finishing.quarantined.get(NAN)
    assert quarantined, "no bad prompt was quarantined"
    for prompt, error in quarantined:
        assert bad_prompt(prompt) and "nan" in error, (prompt, error)
    trained = finishing.trained.get(NAN, [])
    assert len(trained) >= 2 and not any(bad_prompt(p) for p in trained), trained
    # the terminal names the fault once, with the task, the agent's file and line
    lines = [ln for ln in r.out.splitlines() if "reward nan is not a finite number" in ln]
    assert len(lines) == 1, r.out
    assert lines[0].startswith(f"{NAN}: ") and re.search(rf"{AGENT_FILE}:\d+", lines[0]), lines


def test_an_agent_raising_on_some_inputs_never_restarts_the_node(finishing: Finishing) -> None:
    r = finishing.run
    errors = finishing.errors.get(RAISES)
    assert errors
    for message, payload in errors:
        assert bad_index(payload), payload
        assert "RuntimeError: inventory service returned 500" in message, message
        # the innermost frame of the user's code, and the traceback with it in the event
        assert re.search(rf"{AGENT_FILE}:\d+ in check_stock", payload["location"]), payload
        assert (
            "check_stock" in payload["traceback"] and "raise RuntimeError" in (payload["traceback"])
        ), payload["traceback"]
    # retried with backoff, then quarantined as the input's fault
    quarantined = finishing.quarantined.get(RAISES)
    assert quarantined and all(bad_prompt(p) for p, _ in quarantined)
    # one line on the terminal for the error, with the agent's file:line
    first = [ln for ln in r.out.splitlines() if "inventory service returned 500" in ln]
    assert len(first) == 1, r.out
    assert first[0].startswith(f"{RAISES}: ") and re.search(rf"{AGENT_FILE}:\d+", first[0])
    # the traceback is in driver.log
    log = finishing.driver_log
    assert "in check_stock" in log and "RuntimeError: inventory service returned 500" in log


def test_an_agent_awaiting_forever_is_cancelled_at_the_episode_timeout(
    finishing: Finishing,
) -> None:
    errors = finishing.errors.get(HANGS)
    assert errors
    for message, payload in errors:
        assert bad_index(payload), payload
        assert "did not finish within 6 s" in message, message
    # the job's node was never restarted, nothing lost: the first test


def test_an_agent_blocking_its_thread_does_not_get_the_node_declared_hung(
    finishing: Finishing,
) -> None:
    """Synchronous work in the agent (8 s) is longer than the job's progress timeout (4 s):
    slow user code, not a hung node (one node incarnation, the first test) nor a failure.
    The other tasks' loops generate meanwhile only until their admission is full (5 groups
    each, trained 2 groups a step): then every busy loop waits on ``blocks``' or ``hangs``'
    code and the engine's probe is the node's progress, as in a job of this task alone (by
    chance, there as here: nothing counts those windows)."""
    assert finishing.errors.get(BLOCKS, []) == []
    blocked = [p for p in finishing.done.get(BLOCKS, []) if int(p["i"]) % 4 == 0]
    assert blocked, "no blocking prompt finished"


def test_rows_with_nan_rewards_from_before_the_fix_are_quarantined_and_the_job_resumes(
    finishing: Finishing,
) -> None:
    """A buffer written before rewards were checked holds NaN rewards, one group of them
    claimed by the step the trainer was taking: ``--resume`` quarantines them and finishes."""
    assert len(finishing.ready) >= 1, "the first run left no finished group behind"
    r = finishing.resumed
    assert r is not None, "not resumed: the first run failed"
    assert r.code == 0, r.out + r.err
    no_traceback(r)
    assert f"job usercode: {STEPS + RESUMED} steps" in r.out
    for status, error in finishing.statuses:
        assert status == "quarantined" and "non-finite reward" in error, (status, error)
    assert len(finishing.statuses) == len(finishing.bad)
    assert sorted(finishing.nonfinite_events) == sorted(finishing.bad)
    shown = [ln for ln in r.out.splitlines() if "are not all finite numbers" in ln]
    assert len(shown) == len(finishing.bad), r.out
    ok, summary = finishing.resumed_invariants
    assert ok, summary


# -- job ``pausing``: two tasks failing on every input; both paused, the job stops ---------------


@dataclass
class Pausing:
    run: CliResult
    incarnations: int
    paused_events: list[dict[str, Any]]
    failed: dict[str, list[int]]  # the episodes whose user code failed, per task (each failure)
    task_status: dict[str, str]
    job_status: str
    status: CliResult
    events: CliResult


@pytest.fixture(scope="module")
def pausing(
    ray_local: Any, tiny_dir: Path, pg: PgServer, template_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Pausing]:  # fmt: skip
    """``always`` raises on every input; ``wrongtype`` returns a dict on every input. 50
    steps asked for: the job stops long before, when both are paused. One group per batch:
    a task's admission stays small (at most 5 groups outstanding, as a job of one task), so
    few episodes start while the failed ones wait out their backoff."""
    tmp = tmp_path_factory.mktemp("pausing")
    tasks: dict[str, dict[str, Any]] = {
        ALWAYS: {"agent": "raise_always"},
        WRONG: {"agent": "wrong_type"},
    }
    with job_database(pg, "pausing") as (url, _db, engine):
        r = rollcall(url, "run", str(write_config(tmp, tiny_dir, "pausing", tasks, steps=50)),
                     "--no-live")  # fmt: skip
        print(r.out, r.err)
        failed: dict[str, list[int]] = {}
        for _, payload in user_errors(engine):
            failed.setdefault(payload["task"], []).append(payload["episode_id"])
        events = rollcall(url, "events", "--job", "pausing", "--kind", "task.paused", "--json")
        yield Pausing(
            run=r,
            incarnations=node_incarnations(engine),
            paused_events=json.loads(events.out),
            failed=failed,
            task_status=dict(rows(engine, "SELECT name, status::text FROM tasks")),
            job_status=scalar(engine, "SELECT status::text FROM jobs WHERE name = 'pausing'"),
            status=rollcall(url, "status", "--job", "pausing"),
            events=rollcall(url, "events", "--job", "pausing", "--kind", "task."),
        )


def paused_verdicts(pausing: Pausing, task: str) -> int:
    return sum(e["message"].startswith(f"task '{task}' paused") for e in pausing.paused_events)


def test_an_agent_raising_on_every_input_pauses_its_task_and_the_job_stops(
    pausing: Pausing,
) -> None:
    r = pausing.run
    no_traceback(r)
    assert r.code == 8, r.out + r.err
    assert f"task '{ALWAYS}' paused" in r.err and "inventory service returned 500" in r.err
    assert f"rollcall task resume {ALWAYS} --job pausing" in r.err, r.err
    assert re.search(rf"{AGENT_FILE}:\d+", r.err), r.err
    assert pausing.incarnations == 1
    # paused within a few episodes: six quarantined (each after its three attempts), and the
    # few in flight then
    assert "its code failed on 6 of the last 6 episodes that ended" in r.err, r.err
    # one verdict per task, however many loops met the failures
    assert len(pausing.paused_events) == 2, pausing.paused_events
    assert paused_verdicts(pausing, ALWAYS) == 1, pausing.paused_events
    failed = set(pausing.failed.get(ALWAYS, []))
    assert 6 <= len(failed) <= 10, failed
    assert pausing.task_status[ALWAYS] == "paused"
    assert pausing.job_status == "stopped"
    assert "inventory service returned 500" in pausing.status.out, pausing.status.out
    assert "paused" in pausing.events.out, pausing.events.out


def test_a_wrong_return_type_pauses_the_task_at_its_first_occurrence(pausing: Pausing) -> None:
    r = pausing.run
    no_traceback(r)
    assert r.code == 8, r.out + r.err
    assert "returned dict, not an Outcome" in r.err, r.err
    assert f"task '{WRONG}' paused" in r.err, r.err
    assert f"rollcall task resume {WRONG} --job pausing" in r.err, r.err
    assert "so the task was paused at its first occurrence" in r.err, r.err
    assert pausing.incarnations == 1
    assert paused_verdicts(pausing, WRONG) == 1, pausing.paused_events
    # every loop may have met it at once; no episode was tried twice
    failed = pausing.failed.get(WRONG, [])
    assert 1 <= len(failed) <= 4 and len(set(failed)) == len(failed), failed
    assert pausing.task_status[WRONG] == "paused"
