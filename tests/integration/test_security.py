"""A local job exposes nothing to the network and leaks no secret (docs/security.md).

One real job, as a user runs it: ``rollcall run`` in its own process, on a fresh
``ROLLCALL_HOME`` (so the job makes its own Ray token there), a database URL with a password,
an agent task that calls the node's OpenAI-compatible endpoint with its episode keys, and one
prompt row over ``rollout.input_limits.prompt_bytes``. While it trains, every TCP socket its
process tree listens on is either on loopback or refuses a client without the token
(``ops/listeners.py``); after it, the database password, the Ray token and the episode keys
appear nowhere in the terminal output, the run directory (driver.log included) or the events.

The same job is a user's project: the agent file imports its sibling module named ``tasks``
(the example agent, copied), and ``PYTHONPATH`` holds the user's own packages named
``orchestrator``, ``workers``, ``tasks`` and ``migrations``, which fail if imported: rollcall's
packages are ``rollcall.*``, so the driver, the node and the evaluator import neither the
user's by mistake nor shadow the user's sibling module.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from ops import listeners

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "Db-Secret-pw-4711"  # the embedded server trusts local connections: never checked
KEY_RE = re.compile(r"rc-[A-Za-z0-9_-]{24}")  # an episode key (``AgentContext.api_key``)


def _user_project(tmp: Path) -> tuple[Path, Path]:
    """An agent folder (``agent.py`` importing its sibling ``tasks``) and a ``PYTHONPATH``
    folder of packages named as rollcall's that raise when imported."""
    agent_dir, shadows = tmp / "project", tmp / "pythonpath"
    agent_dir.mkdir()
    example = (ROOT / "examples" / "openai_client" / "agent.py").read_text()
    (agent_dir / "tasks.py").write_text(example)
    (agent_dir / "agent.py").write_text("from tasks import rollout  # noqa: F401 (the user's)\n")
    for name in ("orchestrator", "workers", "tasks", "migrations"):
        (shadows / name).mkdir(parents=True)
        (shadows / name / "__init__.py").write_text(
            f"raise ImportError('the user\\'s own {name} package was imported by rollcall')\n"
        )
    return agent_dir / "agent.py", shadows


def _config(tmp: Path, tiny: Path, agent: Path) -> Path:
    rows = (ROOT / "examples" / "arithmetic.jsonl").read_text().splitlines()[:60]
    rows.insert(3, json.dumps({"question": "q" * 3000, "answer": "0"}))  # over 2 KiB
    (tmp / "prompts.jsonl").write_text("\n".join(rows) + "\n")
    config = tmp / "job.yaml"
    config.write_text(
        "job: {name: secure}\n"
        f"model: {{path: {tiny}}}\n"
        "ray: {num_cpus: 2}\n"
        "buffer: {batch_groups: 1, max_attempts: 1}\n"
        "rollout: {concurrency: 4, max_tokens_per_turn: 32, max_tokens: 512,"
        " input_limits: {prompt_bytes: 2048}}\n"
        "trainer: {micro_batch_tokens: 1024}\n"
        f"run: {{total_steps: 5, dir: {tmp / 'run'}, eval: {{every: 0, episodes: 0}}}}\n"
        "tasks:\n"
        f"  - name: arithmetic\n"
        f"    agent: {agent}:rollout\n"
        f"    prompts: {{path: {tmp / 'prompts.jsonl'}, key: question}}\n"
        "    spec: {group_size: 2, max_turns: 2}\n"
    )
    return config


def test_a_local_job_exposes_nothing_and_leaks_no_secret(
    db_url: str, engine: sa.Engine, tiny_dir: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    url = db_url.replace("://postgres@", f"://postgres:{PASSWORD}@", 1)
    assert PASSWORD in url, db_url
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    agent, shadows = _user_project(tmp_path)
    env |= {"ROLLCALL_HOME": str(home), "ROLLCALL_DATABASE_URL": url, "COLUMNS": "200"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shadows), env.get("PYTHONPATH")]))
    rollcall = Path(sys.executable).with_name(
        "rollcall"
    )  # the installed command, as a user runs it
    proc = subprocess.Popen(
        [str(rollcall), "run", str(_config(tmp_path, tiny_dir, agent)), "--no-live"],
        cwd=agent.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout or []), daemon=True)
    reader.start()
    try:
        # training has begun: Ray, the trainer, the rollout node and its endpoint are all up
        deadline = time.monotonic() + 600
        while not any(line.startswith("step 1/") for line in out):
            assert proc.poll() is None, "".join(out)
            assert time.monotonic() < deadline, "".join(out)
            time.sleep(0.5)
        found = listeners.listeners(proc.pid)
        assert proc.poll() is None, "the job ended before its sockets were read"
    finally:
        code = proc.wait(timeout=600)
        reader.join(timeout=10)
    terminal = "".join(out)
    assert code == 0, terminal
    shown = "\n".join(x.line() for x in found)
    assert not [x for x in found if x.verdict == "OPEN"], shown
    assert any(x.verdict == "refused" and "gcs_server" in x.process for x in found), shown

    token_file = home / "ray_token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    assert len(token) == 64

    # the oversized prompt row: one sentence, quarantined, and the job went on
    sentence = "the prompt row is 3,0"
    with engine.connect() as c:
        events = [
            f"{r.kind} {r.message} {json.dumps(r.payload)}"
            for r in c.execute(sa.text("SELECT kind, message, payload FROM events ORDER BY id"))
        ]
        keys = c.execute(
            sa.text("SELECT count(*) FROM episodes WHERE status = 'quarantined'")
        ).scalar_one()
    assert keys == 1, events
    assert any(sentence in e and "prompt_bytes (2,048)" in e for e in events), events

    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert any(p.name == "driver.log" for p in files), files
    texts = {"terminal": terminal, "events": "\n".join(events)}
    texts |= {str(p): p.read_bytes().decode(errors="replace") for p in files}
    for where, text in texts.items():
        assert PASSWORD not in text, f"the database password is in {where}"
        assert token not in text, f"the Ray token is in {where}"
        assert not KEY_RE.search(text), f"an episode key is in {where}: {KEY_RE.search(text)}"


def test_a_job_without_the_clusters_token_is_refused_at_once_in_one_sentence(
    ray_local: Any, db_url: str, tmp_path: Path
) -> None:
    from tests.conftest import unchanged

    address = ray_local.get_runtime_context().gcs_address
    wrong = tmp_path / "wrong_token"
    wrong.write_text("0" * 64)
    config = ROOT / "configs" / "quickstart.yaml"
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    base |= {"ROLLCALL_DATABASE_URL": db_url, "HOME": str(tmp_path), "COLUMNS": "200"}
    cases = {
        f"the token in {wrong} is not the cluster's": {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(wrong),
        },
        "RAY_AUTH_MODE is not token here": {"RAY_AUTH_MODE": "disabled"},
    }
    for have, env in cases.items():
        t0 = time.monotonic()
        with unchanged(db_url):
            r = subprocess.run(
                [sys.executable, "-m", "rollcall.orchestrator.cli", "run", str(config),
                 f"ray.address={address}", "--no-live"],
                cwd=ROOT, env=base | env, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
        assert r.returncode != 0
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1, r.stderr
        assert lines[0].endswith(
            f"the Ray cluster at {address} refused rollcall's connection: its token "
            f"authentication is on and {have}; set RAY_AUTH_MODE=token and "
            "RAY_AUTH_TOKEN_PATH=FILE (the cluster's token, ops/deploy/ray-start.md)"
        ), r.stderr
        assert time.monotonic() - t0 < 60  # not after Ray's own retries
