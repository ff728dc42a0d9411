"""Agent functions end to end (``rollcall.workers.episode``): a job whose one task is the user's own
agent (``tests.support.agents``: ``steady`` through ``ctx.chat`` and the node's OpenAI endpoint
with the ``openai`` client, ``flaky`` not deterministic), on real Ray, PostgreSQL and the tiny
model on the ``hf`` engine. The rollout node is SIGKILLed in the middle of ``steady``'s third
call: the episode resumes, its first two calls come back from PostgreSQL (the engine's calls
are counted: none repeated), ``flaky``'s replay is found to diverge (event, metric) and is
restarted, and nothing is lost or duplicated."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa

from rollcall.orchestrator.buffer.invariants import check_invariants
from rollcall.orchestrator.config import RollcallConfig
from rollcall.orchestrator.db.engine import Database
from tests.chaos.test_faults import _driver
from tests.integration.buffer_helpers import rows, scalar
from tests.support.agents import digest

pytestmark = pytest.mark.timeout(600)

HOOKS = "tests.support.agents"


def agent_config(tmp: Path, model: Path, prompts: Path, agent: str, **over: Any) -> RollcallConfig:
    data: dict[str, Any] = {
        "job": {"name": "agents"},
        "model": {"path": str(model)},
        "buffer": {"batch_groups": 1, "lease_s": 30},
        "rollout": {
            "nodes": 1,
            "concurrency": 2,
            "max_tokens_per_turn": 12,
            "max_tokens": 256,
            "heartbeat_interval_s": 0.5,
            "tool_timeout_s": 2.0,
            "restart_backoff_s": 0.5,
            "restart_window_s": 20.0,
        },
        "trainer": {"lr": 1e-3, "micro_batch_tokens": 512},
        "control_plane": {
            "seed_interval_s": 0.5,
            "dead_sweep_interval_s": 0.5,
            "heartbeat_timeout_s": 5.0,
            # the kill is found by the actor's death; a busy machine (a vLLM start beside the
            # trainer on 2 cores) must not make a slow first generation read as a hang
            "progress_timeout_s": 45.0,
            "supervise_interval_s": 0.5,
        },
        "run": {"dir": str(tmp / "run"), "total_steps": 3, "eval": {"every": 0, "episodes": 0}},
        "tasks": [
            {
                "name": "mine",
                "agent": agent,
                "prompts": {"path": str(prompts), "key": "question"},
                "max_inflight": 1,
                "max_staleness": 2,
                "spec": {"group_size": 2, "max_turns": 4},
            }
        ],
    }
    data.update(over)
    return RollcallConfig.model_validate(data)


def write_prompts(path: Path, flags: Path, n: int = 40, **extra: Any) -> Path:
    path.write_text(
        "".join(
            json.dumps({"question": f"Question {i}: say something.", "flags": str(flags), **extra})
            + "\n"
            for i in range(n)
        )
    )
    return path


def test_an_agent_killed_mid_call_resumes_from_postgres_without_regenerating(
    ray_local: Any, tiny_dir: Path, db: Database, engine: sa.Engine, tmp_path: Path
) -> None:
    kill_mid_call_and_replay(tiny_dir, db, engine, tmp_path)


def test_a_bad_agent_config_is_refused_before_anything_is_written(
    cli: Any, db_url: str, tmp_path: Path
) -> None:
    from tests.conftest import unchanged

    write_prompts(tmp_path / "prompts.jsonl", tmp_path)
    config = tmp_path / "bad.yaml"
    config.write_text(
        "job: {name: bad}\n"
        "tasks:\n"
        "  - {name: t, agent: 'nope_module:rollout', prompts: {path: prompts.jsonl}}\n"
    )
    with unchanged(db_url):
        r = cli("run", str(config), "--no-live")
    assert r.code != 0
    assert "agent 'nope_module:rollout': no module named 'nope_module'" in r.err, r.err
    assert len(r.err.strip().splitlines()) == 1, r.err
    # evaluation asked for, and no prompt held out for it
    config.write_text(
        "job: {name: bad}\n"
        "run: {eval: {episodes: 4}}\n"
        "tasks:\n"
        f"  - {{name: t, agent: '{HOOKS}:steady', prompts: {{path: prompts.jsonl, "
        "held_out_per_mille: 0}}\n"
    )
    with unchanged(db_url):
        r = cli("run", str(config), "--no-live")
    assert r.code != 0
    assert "task t: its prompts have no held-out rows to evaluate on" in r.err, r.err


def kill_mid_call_and_replay(
    model: Path,
    db: Database,
    engine: sa.Engine,
    tmp_path: Path,
    rollout: dict[str, Any] | None = None,
    *,
    hook: str = "kill_third",
    endpoint_turns: tuple[int, ...] = (1, 3),
) -> dict[str, Any]:
    """The job with ``either`` whose node (``hook``) is SIGKILLed in ``steady``'s third call
    (through the endpoint when ``endpoint_turns`` holds 2); what must hold after it (shared
    with the vLLM tests, ``rollout`` overrides the node's settings). Returns the figures."""
    flags = tmp_path / "flags"
    flags.mkdir()
    (flags / "arm").touch()
    prompts = write_prompts(tmp_path / "prompts.jsonl", flags, endpoint_turns=list(endpoint_turns))
    cfg = agent_config(tmp_path, model, prompts, f"{HOOKS}:either")
    if rollout:
        cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update=rollout)})
    driver = _driver(cfg, db, model, tmp_path)
    driver.engine_hooks[0] = f"{HOOKS}:{hook}:{flags}"
    try:
        driver.setup()
        result = driver.run()
    finally:
        driver.close()
    assert result.steps == 3
    assert (flags / "killed").exists(), "the node was never killed"

    job = scalar(engine, "SELECT id FROM jobs WHERE name = 'agents'")
    report = check_invariants(db, job)
    assert report.ok, report.summary()
    assert scalar(engine, "SELECT count(*) FROM episodes WHERE status = 'leased'") == 0
    assert scalar(engine, "SELECT count(*) FROM episodes WHERE status = 'quarantined'") == 0
    assert scalar(engine, "SELECT count(*) FROM workers WHERE role = 'rollout'") >= 2  # restarted

    generated = Counter(line.split()[1] for line in (flags / "generates").read_text().splitlines())
    trajectories = rows(
        engine,
        "SELECT episode_id, sample_index, "
        "(SELECT string_agg(s.token_ids, ''::bytea ORDER BY s.start_token) "
        " FROM trajectory_segments s WHERE s.episode_id = tr.episode_id "
        " AND s.sample_index = tr.sample_index), "
        "(SELECT string_agg(s.loss_mask, ''::bytea ORDER BY s.start_token) "
        " FROM trajectory_segments s WHERE s.episode_id = tr.episode_id "
        " AND s.sample_index = tr.sample_index), "
        "turn_offsets, reward_info "
        "FROM trajectories tr WHERE status IN ('ready', 'claimed', 'consumed')",
    )
    assert trajectories
    resumed = []
    for episode_id, sample, raw, mask, offsets, info in trajectories:
        ids = np.frombuffer(raw, dtype="<i4").tolist()
        trained = np.frombuffer(mask, dtype=np.uint8)
        # token-in/token-out: the context of every turn is exactly what the engine was given,
        # and only generated spans are trained on
        for k, off in enumerate(offsets):
            assert generated[digest(ids[:off])] >= 1, (episode_id, sample, k)
            end = offsets[k + 1] if k + 1 < len(offsets) else len(ids)
            assert trained[off:end].any() and not trained[:off][-1:].any()
        if info["calls"]["replayed"]:
            resumed.append((episode_id, sample, ids, offsets, info))

    # steady: two chat calls and two steps replayed from PostgreSQL; the engine generated its
    # first two contexts once only, and the third twice (the call in flight when killed)
    steady = [r for r in resumed if r[1] == 0]
    infos = [(e, s, i) for e, s, *_, i in trajectories]
    infos.append(rows(engine, "SELECT kind, message FROM events ORDER BY id"))  # type: ignore[arg-type]
    assert len(steady) == 1, f"no resumed sample 0 of steady: {infos}"
    _, _, ids, offsets, info = steady[0]
    assert info["calls"]["replayed"] == 4, info
    assert len(offsets) == 4
    counts = [generated[digest(ids[:off])] for off in offsets]
    print("steady: generate calls per turn context:", counts, "calls:", info["calls"])
    assert counts[:2] == [1, 1] and counts[2] == 2 and counts[3] == 1, counts

    # flaky: its replay diverged, was reported and counted, and it ran again from scratch
    events = rows(
        engine, "SELECT message, payload FROM events WHERE kind = 'agent.replay_diverged'"
    )
    assert len(events) == 1, f"divergence events: {events}; samples: {infos}"
    message, payload = events[0]
    assert payload["sample"] == 1 and payload["chat_calls_discarded"] == 2, payload
    assert "not deterministic" in message, message
    print("divergence event:", message)

    # on-policy tokens (trained by the version that generated them) weigh 1
    steps = [
        json.loads(line)
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        if '"is_weight_onpolicy_mean"' in line
    ]
    assert steps, "no step trained on-policy tokens"
    for s in steps:
        assert abs(s["is_weight_onpolicy_mean"] - 1) < 1e-3, s
    return {"generate_calls_per_turn": counts, "calls": info["calls"], "divergence": message}
