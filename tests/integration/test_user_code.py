"""User code that misbehaves on some inputs never takes a job down (``tests.support.
faulty_agents``): a NaN reward, an agent that raises, a wrong return type, an ``await`` that
never ends, a thread blocked by synchronous work. Each job runs through ``rollcall run`` (the
terminal output is what a user sees) on real Ray, PostgreSQL and the tiny model's ``hf``
engine, one task on one rollout node."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml

from rollcall.orchestrator.buffer.invariants import check_invariants
from rollcall.orchestrator.db.engine import Database
from tests.integration.buffer_helpers import rows, scalar

pytestmark = pytest.mark.timeout(600)

AGENTS = "tests.support.faulty_agents"
AGENT_FILE = "faulty_agents.py"


def write_config(
    tmp: Path,
    model: Path,
    agent: str,
    *,
    steps: int = 15,
    every: int = 4,
    spec: dict[str, Any] | None = None,
    prompt: dict[str, Any] | None = None,
    control_plane: dict[str, Any] | None = None,
    rollout: dict[str, Any] | None = None,
    max_inflight: int = 2,
    name: str = "usercode",
) -> Path:
    prompts = tmp / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"i": i, "every": every, **(prompt or {})}) + "\n" for i in range(64))
    )
    data: dict[str, Any] = {
        "job": {"name": name},
        "model": {"path": str(model)},
        "buffer": {"batch_groups": 1, "lease_s": 30, "retry_backoff_s": 0.2},
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
        "tasks": [
            {
                "name": "inventory",
                "agent": agent,
                "prompts": {"path": str(prompts), "held_out_per_mille": 0},
                "max_inflight": max_inflight,
                "max_staleness": 4,
                "spec": {"group_size": 2, "max_turns": 2, **(spec or {})},
            }
        ],
    }
    path = tmp / "job.yaml"
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


def check_nothing_lost(db: Database, engine: sa.Engine) -> None:
    job = scalar(engine, "SELECT id FROM jobs WHERE name = 'usercode'")
    report = check_invariants(db, job)
    assert report.ok, report.summary()


def test_a_nan_reward_on_some_prompts_quarantines_them_and_the_job_finishes(
    ray_local: Any, tiny_dir: Path, db: Database, engine: sa.Engine, cli: Any, tmp_path: Path
) -> None:
    config = write_config(tmp_path, tiny_dir, f"{AGENTS}:nan_on_some")
    r = cli("run", str(config), "--no-live")
    print(r.out, r.err)
    assert r.code == 0, r.out + r.err
    no_traceback(r)
    assert "job usercode: 15 steps" in r.out
    check_nothing_lost(db, engine)
    # no NaN reached the buffer's trainable rows, let alone the trainer
    rewards = [
        x for (x,) in rows(engine, "SELECT reward FROM trajectories WHERE reward IS NOT NULL")
    ]
    assert rewards and all(math.isfinite(x) for x in rewards)
    # every bad prompt that was tried failed as the input's fault, naming the value; after the
    # task's attempts it is quarantined, never trained
    errors = user_errors(engine)
    assert errors, "no user-code failure was recorded"
    for message, payload in errors:
        assert payload["task"] == "inventory" and bad_index(payload), payload
        assert "reward nan is not a finite number" in message, message
    quarantined = rows(
        engine, "SELECT prompt, last_error FROM episodes WHERE status = 'quarantined'"
    )
    assert quarantined, "no bad prompt was quarantined"
    for prompt, error in quarantined:
        assert bad_prompt(prompt) and "nan" in error, (prompt, error)
    trained = rows(engine, "SELECT prompt FROM episodes WHERE consumed_step IS NOT NULL")
    assert len(trained) >= 15 and not any(bad_prompt(p) for (p,) in trained)
    assert node_incarnations(engine) == 1  # the input's fault, never the node's
    # the terminal names the fault once, with the agent's file and line
    lines = [ln for ln in r.out.splitlines() if "reward nan is not a finite number" in ln]
    assert len(lines) == 1, r.out
    assert re.search(rf"{AGENT_FILE}:\d+", lines[0]), lines[0]


def test_rows_with_nan_rewards_from_before_the_fix_are_quarantined_and_the_job_resumes(
    ray_local: Any, tiny_dir: Path, db: Database, engine: sa.Engine, cli: Any, tmp_path: Path
) -> None:
    """A buffer written before rewards were checked holds NaN rewards, one group of them
    claimed by the step the trainer was taking: ``--resume`` quarantines them and finishes."""
    config = write_config(tmp_path, tiny_dir, f"{AGENTS}:good", steps=2)
    r = cli("run", str(config), "--no-live")
    assert r.code == 0, r.out + r.err
    # what the old code left: the next step's batch reserved (claimed) with NaN rewards, and
    # another finished group with NaN rewards waiting in the buffer
    with engine.begin() as conn:
        ready = (
            conn.execute(
                sa.text(
                    "SELECT id FROM episodes WHERE status = 'done' AND consumed_step IS NULL "
                    "ORDER BY id"
                )
            )
            .scalars()
            .all()
        )
        assert len(ready) >= 1, "the first run left no finished group behind"
        claimed, rest = ready[0], ready[1:]
        conn.execute(sa.text("UPDATE episodes SET claimed_step = 2 WHERE id = :e"), {"e": claimed})
        conn.execute(
            sa.text(
                "UPDATE trajectories SET status = 'claimed', claimed_step = 2, reward = 'NaN' "
                "WHERE episode_id = :e"
            ),
            {"e": claimed},
        )
        conn.execute(sa.text("UPDATE jobs SET pending_step = 2, pending_mix = '{}'"))
        if rest:
            conn.execute(
                sa.text("UPDATE trajectories SET reward = 'Infinity' WHERE episode_id = :e"),
                {"e": rest[0]},
            )
    r = cli("run", str(write_config(tmp_path, tiny_dir, f"{AGENTS}:good", steps=5)), "--resume",
            "--no-live")  # fmt: skip
    print(r.out, r.err)
    assert r.code == 0, r.out + r.err
    no_traceback(r)
    assert "job usercode: 5 steps" in r.out
    bad = [claimed, *rest[:1]]
    statuses = rows(engine, "SELECT status::text, last_error FROM episodes WHERE id = ANY(:ids)",
                    ids=bad)  # fmt: skip
    for status, error in statuses:
        assert status == "quarantined" and "non-finite reward" in error, (status, error)
    events = rows(
        engine, "SELECT payload FROM events WHERE kind = 'episode.quarantined' "
        "AND payload->>'reason' = 'non-finite reward'",
    )  # fmt: skip
    assert sorted(p["episode_id"] for (p,) in events) == sorted(bad)
    shown = [ln for ln in r.out.splitlines() if "are not all finite numbers" in ln]
    assert len(shown) == len(bad), r.out
    check_nothing_lost(db, engine)


def test_an_agent_raising_on_some_inputs_never_restarts_the_node(
    ray_local: Any, tiny_dir: Path, db: Database, engine: sa.Engine, cli: Any, tmp_path: Path
) -> None:
    # as the job: 8 agent loops on one node
    config = write_config(
        tmp_path, tiny_dir, f"{AGENTS}:raise_on_some", rollout={"concurrency": 8}, max_inflight=4
    )
    r = cli("run", str(config), "--no-live")
    print(r.out, r.err)
    assert r.code == 0, r.out + r.err
    no_traceback(r)
    assert "job usercode: 15 steps" in r.out
    assert node_incarnations(engine) == 1, r.out
    assert "restarting" not in r.out and "breaker" not in r.out, r.out
    check_nothing_lost(db, engine)
    errors = user_errors(engine)
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
    quarantined = rows(engine, "SELECT prompt FROM episodes WHERE status = 'quarantined'")
    assert quarantined and all(bad_prompt(p) for (p,) in quarantined)
    # one line on the terminal for the error, with the agent's file:line
    first = [ln for ln in r.out.splitlines() if "inventory service returned 500" in ln]
    assert len(first) == 1, r.out
    assert re.search(rf"{AGENT_FILE}:\d+", first[0]), first[0]
    # the traceback is in driver.log
    log = (tmp_path / "run" / "driver.log").read_text()
    assert "in check_stock" in log and "RuntimeError: inventory service returned 500" in log


def test_an_agent_raising_on_every_input_pauses_its_task_and_the_job_stops(
    ray_local: Any, tiny_dir: Path, db: Database, engine: sa.Engine, cli: Any, tmp_path: Path
) -> None:
    config = write_config(tmp_path, tiny_dir, f"{AGENTS}:raise_always", steps=50)
    r = cli("run", str(config), "--no-live")
    print(r.out, r.err)
    no_traceback(r)
    assert r.code == 8, r.out + r.err
    assert "task 'inventory' paused" in r.err and "inventory service returned 500" in r.err
    assert "rollcall task resume inventory --job usercode" in r.err, r.err
    assert re.search(rf"{AGENT_FILE}:\d+", r.err), r.err
    assert node_incarnations(engine) == 1
    # paused within a few episodes: six quarantined (each after its three attempts), and the
    # few in flight then
    assert "its code failed on 6 of the last 6 episodes that ended" in r.err, r.err
    paused = json.loads(cli("events", "--job", "usercode", "--kind", "task.paused", "--json").out)
    assert len(paused) == 1, paused  # one verdict, however many loops met the failures
    failed = {p["episode_id"] for _, p in user_errors(engine)}
    assert 6 <= len(failed) <= 10, failed
    assert scalar(engine, "SELECT status::text FROM tasks WHERE name = 'inventory'") == "paused"
    assert scalar(engine, "SELECT status::text FROM jobs WHERE name = 'usercode'") == "stopped"
    status = cli("status", "--job", "usercode")
    assert "inventory service returned 500" in status.out, status.out
    events = cli("events", "--job", "usercode", "--kind", "task.")
    assert "paused" in events.out, events.out


def test_a_wrong_return_type_pauses_the_task_at_its_first_occurrence(
    ray_local: Any, tiny_dir: Path, db: Database, engine: sa.Engine, cli: Any, tmp_path: Path
) -> None:
    config = write_config(tmp_path, tiny_dir, f"{AGENTS}:wrong_type", steps=50)
    r = cli("run", str(config), "--no-live")
    print(r.out, r.err)
    no_traceback(r)
    assert r.code == 8, r.out + r.err
    assert "returned dict, not an Outcome" in r.err, r.err
    assert node_incarnations(engine) == 1
    # every loop may have met it at once; no episode was tried twice
    failed = [p["episode_id"] for _, p in user_errors(engine)]
    assert 1 <= len(failed) <= 4 and len(set(failed)) == len(failed), failed


def test_an_agent_awaiting_forever_is_cancelled_at_the_episode_timeout(
    ray_local: Any, tiny_dir: Path, db: Database, engine: sa.Engine, cli: Any, tmp_path: Path
) -> None:
    config = write_config(
        tmp_path, tiny_dir, f"{AGENTS}:hang_on_some", steps=6, spec={"episode_timeout_s": 6}
    )
    r = cli("run", str(config), "--no-live")
    print(r.out, r.err)
    assert r.code == 0, r.out + r.err
    no_traceback(r)
    assert node_incarnations(engine) == 1, r.out
    errors = user_errors(engine)
    assert errors
    for message, payload in errors:
        assert bad_index(payload), payload
        assert "did not finish within 6 s" in message, message
    check_nothing_lost(db, engine)


def test_an_agent_blocking_its_thread_does_not_get_the_node_declared_hung(
    ray_local: Any, tiny_dir: Path, db: Database, engine: sa.Engine, cli: Any, tmp_path: Path
) -> None:
    """Synchronous work in the agent (8 s on every loop at once) is longer than the progress
    timeout (4 s): slow user code, not a hung node."""
    config = write_config(
        tmp_path,
        tiny_dir,
        f"{AGENTS}:block_on_some",
        steps=4,
        prompt={"block_s": 8},
        spec={"tool_timeout_s": 0.5},
        rollout={"tool_timeout_s": 0.5},
        control_plane={"heartbeat_timeout_s": 3.0, "progress_timeout_s": 4.0},
    )
    r = cli("run", str(config), "--no-live")
    print(r.out, r.err)
    assert r.code == 0, r.out + r.err
    no_traceback(r)
    assert node_incarnations(engine) == 1, r.out
    assert user_errors(engine) == []
    blocked = rows(
        engine, "SELECT prompt FROM episodes WHERE status = 'done' AND (prompt->>'i')::int % 4 = 0"
    )
    assert blocked, "no blocking prompt finished"
    check_nothing_lost(db, engine)
