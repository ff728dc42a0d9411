"""Golden trajectories: the episode runtime's output, pinned token for token.

Every built-in task plugin (``calculator``, ``echo``, ``guess``, ``retrieval`` and the
``longtail`` timing model; not ``agent``, the plugin of the user's own agents) and the example
agents that need no network or LLM judge (``examples/lookup``, ``examples/openrlhf``) are played
by the one episode runtime (``rollcall.workers.episode.play.player``: a plugin through its
adapter ``play_plugin``) on the shipped tiny model (``rollcall.workers.tiny_model.SHIPPED``)
with the ``hf`` engine, no Ray, no database (``on_turn`` only records what it is handed): 3
prompts (the plugin's ``prompt(spec, i)``, i = 0, 1, 2) x a group of 2 samples (``guess``, the
longest episodes: 1 sample; the agents: 2 prompts, 1 sample), each sample on a fresh engine
seeded with its own seed (``Case.seed_of``), one after the other. Each golden file in
``tests/golden/`` holds, per episode, the whole committed payload (``Trajectory.payload()``:
token ids, loss mask, behaviour log-probs, turn offsets and policy versions, prompt length,
environment state, finished), the reward and turn count, the decoded text (for reading), and
what the node was handed to checkpoint after every turn (``on_turn``: its length, turns and the
kinds of the calls recorded so far).

The plugins' trajectories, rewards and final states were recorded first by the plugin loop
that the runtime replaced (``AgentLoop``, deleted), and the runtime reproduced them: only the
checkpoints changed (one per turn as before, taken after the generation, the tool call recorded
with the next one).

The test replays the same episodes and requires everything discrete (tokens, masks, turns,
versions, states, rewards, stop reasons, text, checkpoints; not the agent runtime's own record
of calls, ``BOOKKEEPING``) to equal the golden files exactly,
and the behaviour log-probs to within 1e-4 absolute: CI runs on another x86 CPU of the same
class, where float results need not be bit-identical (episodes run on one thread, so the
thread count does not change how sums are split, but the kernels a CPU picks may). A
difference large enough to flip a sampled token shows as a token mismatch, not a tolerance.
(1e-5 was too tight: on 2026-12-07 a machine of CI's kind gave one of agent_lookup's 600-odd
log-probs 1.03e-5 from its golden value, on the commit that recorded it.)

Re-record (after a deliberate change of the runtime, the plugins or the shipped model; review
the diff of ``tests/golden/``)::

    .venv/bin/python -m tests.unit.test_golden_trajectories --record

The golden files also pin the shipped model's file digests: when the model is rebuilt, the
test says so instead of reporting token differences.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rollcall.tasks import registry
from rollcall.tasks.agent import AgentSpec
from rollcall.tasks.base import TaskSpec
from rollcall.workers.episode.chat import chat_for
from rollcall.workers.episode.play import player
from rollcall.workers.episode.tools import ToolRunner
from rollcall.workers.episode.trajectory import Limits, Trajectory
from rollcall.workers.rollout.engines.hf import HFEngine
from rollcall.workers.tiny_model import SHIPPED, deterministic_build, file_digests

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
LOGPROB_ATOL = 1e-4
VERSION = 3  # the engine's policy version: every turn must carry it
FORMAT = 1  # the golden files' layout
LIMITS = Limits(max_turns=4, max_tokens_per_turn=32, max_tokens=512)
AGENT_LIMITS = Limits(max_turns=4, max_tokens_per_turn=32, max_tokens=1024)


@dataclass(frozen=True)
class Case:
    """One golden file: a plugin (or an example agent), its spec, prompts, group and seeds."""

    name: str
    plugin: str  # a task plugin's name, or "agent"
    spec: dict[str, Any] = field(default_factory=dict)  # overrides of the default spec
    prompts: tuple[int, ...] = (0, 1, 2)
    group: int = 2
    seed: int = 0  # sample s of prompt i runs on an engine seeded seed + 10 * i + s
    limits: Limits = LIMITS

    def seed_of(self, prompt: int, sample: int) -> int:
        return self.seed + 10 * prompt + sample


CASES = [
    Case("calculator", "calculator", seed=100),
    Case("echo", "echo", seed=200),
    # 6 turns: a won game ends by the environment, a lost one by the turn limit; one sample
    # a prompt (its episodes are the longest, and the tiny model plays both samples alike)
    Case(
        "guess",
        "guess",
        group=1,
        seed=300,
        limits=Limits(max_turns=6, max_tokens_per_turn=32, max_tokens=512),
    ),
    Case("retrieval", "retrieval", seed=400),
    # short prompts and observations and a quick tool: the timing model, made fast
    Case(
        "longtail",
        "longtail",
        {
            "max_turns": 4,
            "turns_min": 1,
            "turns_max": 3,
            "obs_tokens_min": 2,
            "obs_tokens_max": 6,
            "prompt_tokens_min": 8,
            "prompt_tokens_max": 16,
            "time_scale": 0.0001,
        },
        seed=500,
    ),
    Case(
        "agent_lookup",
        "agent",
        {
            "agent": "examples/lookup/agent.py:rollout",
            "prompts": {"path": "examples/lookup/prompts.jsonl", "key": "question"},
        },
        prompts=(0, 1),
        group=1,
        seed=600,
        limits=AGENT_LIMITS,
    ),
    Case(
        "agent_openrlhf",
        "agent",
        {
            "agent": "examples/openrlhf/agent.py:rollout",
            "prompts": {"path": "examples/arithmetic.jsonl", "key": "question"},
        },
        prompts=(0, 1),
        group=1,
        seed=700,
        limits=AGENT_LIMITS,
    ),
]


# -- playing the episodes ---------------------------------------------------------------------


def _spec(case: Case) -> TaskSpec:
    plugin = registry.get(case.plugin)
    if case.plugin != "agent":
        return plugin.Spec.model_validate(case.spec)
    given = dict(case.spec)
    where, _, fn = given["agent"].rpartition(":")
    given["agent"] = f"{ROOT / where}:{fn}"  # paths of the repository, wherever it runs
    given["prompts"] = {**given["prompts"], "path": str(ROOT / given["prompts"]["path"])}
    return AgentSpec.model_validate(given)


def _payload_json(t: Trajectory) -> dict[str, Any]:
    """The committed payload, as JSON: what the buffer stores of a trajectory."""
    p = t.payload()
    return {
        "token_ids": [int(x) for x in p.token_ids],
        "loss_mask": [int(x) for x in p.loss_mask],
        "behaviour_logprobs": [float(x) for x in p.behaviour_logprobs],
        "turn_offsets": list(p.turn_offsets),
        "turn_versions": list(p.turn_versions),
        "prompt_tokens": p.prompt_tokens,
        "env_state": _plain(p.env_state),
        "finished": p.finished,
    }


def _plain(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples become lists, and so on)."""
    return json.loads(json.dumps(value))


def _checkpoint(t: Trajectory) -> dict[str, Any]:
    """What ``on_turn`` handed the node, less the tokens (a prefix of the final ones) and the
    record of calls (its kinds only: the entries' results are the tokens and states pinned
    elsewhere)."""
    p = t.payload()
    env = _plain(p.env_state)
    journal = env.get("state", {}).pop("journal", [])
    env["state"].pop("journal_stored", None)
    return {
        "num_tokens": p.num_tokens,
        "turns": len(p.turn_offsets),
        "finished": p.finished,
        "calls": "".join(str(e["k"])[0] for e in journal),  # c(hat), t(ool), s(tep)
        "env_state": env,
    }


def play(case: Case, prompt_index: int, sample: int, runner: ToolRunner) -> dict[str, Any]:
    """One episode of ``case``, on a fresh engine with its own seed, as a golden record."""
    seed = case.seed_of(prompt_index, sample)
    engine = HFEngine(SHIPPED, seed=seed, version=VERSION)
    plugin = registry.get(case.plugin)
    spec = _spec(case)
    prompt = plugin.prompt(spec, prompt_index)
    checkpoints: list[dict[str, Any]] = []
    prefixes: list[list[int]] = []

    def on_turn(t: Trajectory) -> None:
        checkpoints.append(_checkpoint(t))
        prefixes.append(list(t.token_ids))

    chat = chat_for(engine.tokenizer)
    loop = player(engine, chat, plugin, spec, prompt, runner, case.limits, sample_index=sample)
    out = loop.run(on_turn=on_turn)
    t = out.trajectory
    # every checkpoint's tokens are a prefix of the final trajectory's (so are not stored)
    assert all(t.token_ids[: len(ids)] == ids for ids in prefixes), "a checkpoint was rewritten"
    return {
        "prompt_index": prompt_index,
        "sample": sample,
        "seed": seed,
        "prompt": _plain(prompt),
        "reward": out.reward,
        "turns": out.turns,
        "text": engine.tokenizer.decode(t.token_ids),
        "checkpoints": checkpoints,
        "payload": _payload_json(t),
    }


@contextmanager
def _runtime() -> Iterator[ToolRunner]:
    """One thread and deterministic kernels (the thread count changes how sums are split),
    and a tool runner."""
    with deterministic_build(), ToolRunner(timeout_s=5.0) as runner:
        yield runner


def play_case(case: Case, runner: ToolRunner) -> dict[str, Any]:
    """The golden document of ``case``: how it was played, and every episode."""
    return {
        "format": FORMAT,
        "case": case.name,
        "plugin": case.plugin,
        "spec": case.spec,
        "limits": dataclasses.asdict(case.limits),
        "engine": {"kind": "hf", "version": VERSION, "seed": "seed + 10 * prompt + sample"},
        "model": {
            "path": "rollcall.workers.tiny_model.SHIPPED",
            "files": file_digests(SHIPPED),
        },
        "episodes": [play(case, i, s, runner) for i in case.prompts for s in range(case.group)],
    }


# -- the golden files ---------------------------------------------------------------------------


def golden_path(case: Case) -> Path:
    return GOLDEN / f"{case.name}.json"


def dumps(value: Any, indent: int = 0) -> str:
    """JSON with one key per line and every list of numbers or strings on one line (token
    lists stay compact; floats are written by ``repr``, their shortest exact form)."""
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(k)}: {dumps(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        items = [f"{inner}{dumps(v, indent + 1)}" for v in value]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    if isinstance(value, list):
        return "[" + ",".join(json.dumps(v, allow_nan=False) for v in value) + "]"
    return json.dumps(value, allow_nan=False)


def record(names: list[str] | None = None) -> None:
    GOLDEN.mkdir(parents=True, exist_ok=True)
    with _runtime() as runner:
        for case in CASES:
            if names and case.name not in names:
                continue
            doc = play_case(case, runner)
            path = golden_path(case)
            path.write_text(dumps(doc) + "\n")
            sizes = [len(e["payload"]["token_ids"]) for e in doc["episodes"]]
            print(f"{path.relative_to(ROOT)}: {path.stat().st_size} bytes, tokens {sizes}")


# -- the test -------------------------------------------------------------------------------------


# The agent runtime's own bookkeeping in an agent's state: how it records calls (its storage
# format, e.g. the append-only journal's mark), not what the episode did. Compared: everything
# else, the plugins' states included
BOOKKEEPING = frozenset({"journal", "journal_stored", "calls"})


def _diff(path: str, want: Any, got: Any, out: list[str]) -> None:
    """Every difference of ``got`` from ``want`` (log-probs within ``LOGPROB_ATOL``), by path."""
    if isinstance(want, dict) and isinstance(got, dict):
        keys = set(want) | set(got)
        if path.endswith(".env_state.state"):
            keys -= BOOKKEEPING
        for k in sorted(keys):
            if k not in got or k not in want:
                out.append(f"{path}.{k}: {'missing' if k not in got else 'unexpected'}")
            else:
                _diff(f"{path}.{k}", want[k], got[k], out)
        return
    if path.endswith(".behaviour_logprobs"):
        if len(want) != len(got):
            out.append(f"{path}: {len(got)} values, golden {len(want)}")
            return
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            if not math.isclose(w, g, rel_tol=0.0, abs_tol=LOGPROB_ATOL):
                out.append(f"{path}[{i}]: {g!r}, golden {w!r} (tolerance {LOGPROB_ATOL})")
        return
    nested = isinstance(want, list) and any(isinstance(v, dict | list) for v in want)
    if nested and isinstance(got, list) and len(want) == len(got):
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            _diff(f"{path}[{i}]", w, g, out)
        return
    if type(want) is not type(got) or want != got:
        if isinstance(want, list) and isinstance(got, list):
            first = next(
                (i for i, (w, g) in enumerate(zip(want, got, strict=False)) if w != g),
                min(len(want), len(got)),
            )
            out.append(
                f"{path}: differs from index {first} (length {len(got)}, golden {len(want)}): "
                f"{got[first : first + 8]!r}, golden {want[first : first + 8]!r}"
            )
        else:
            out.append(f"{path}: {got!r}, golden {want!r}")


@pytest.fixture(scope="module")
def runner() -> Iterator[ToolRunner]:
    with _runtime() as r:
        yield r


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_episodes_equal_their_golden_trajectories(case: Case, runner: ToolRunner) -> None:
    path = golden_path(case)
    assert path.exists(), f"no {path}: python -m tests.unit.test_golden_trajectories --record"
    want = json.loads(path.read_text())
    assert want["model"]["files"] == file_digests(SHIPPED), (
        f"the shipped tiny model ({SHIPPED}) is not the one {path.name} was recorded with: "
        "re-record (python -m tests.unit.test_golden_trajectories --record) and review the diff"
    )
    got = _plain(play_case(case, runner))
    # log-probs as JSON reads them back: a float's repr round-trips exactly
    problems: list[str] = []
    _diff(case.name, want, got, problems)
    assert not problems, f"{len(problems)} differences from {path.name}:\n" + "\n".join(
        problems[:40]
    )
    # what the goldens must be about: every episode's payload is self-consistent
    for e in got["episodes"]:
        p = e["payload"]
        n = len(p["token_ids"])
        assert len(p["loss_mask"]) == len(p["behaviour_logprobs"]) == n
        assert p["turn_versions"] == [VERSION] * len(p["turn_offsets"]) == [VERSION] * e["turns"]
        assert all(c["num_tokens"] <= n for c in e["checkpoints"])
        for m, lp in zip(p["loss_mask"], p["behaviour_logprobs"], strict=True):
            assert (lp == 0.0) if m == 0 else (lp <= 0.0)


def test_a_changed_token_mask_bit_or_reward_is_reported() -> None:
    """The comparison itself: a golden with one token, one mask bit, one reward or one
    log-prob (beyond the tolerance) changed does not pass."""
    doc = json.loads(golden_path(CASES[0]).read_text())
    assert doc["episodes"], "a golden without episodes pins nothing"
    for change in (
        lambda p, e: p["token_ids"].__setitem__(-1, p["token_ids"][-1] + 1),
        lambda p, e: p["loss_mask"].__setitem__(-1, 1 - p["loss_mask"][-1]),
        lambda p, e: e.__setitem__("reward", e["reward"] + 0.5),
        lambda p, e: p["behaviour_logprobs"].__setitem__(-1, p["behaviour_logprobs"][-1] - 1e-3),
        lambda p, e: p["env_state"].__setitem__("stop_reason", "other"),
    ):
        changed = json.loads(json.dumps(doc))
        episode = changed["episodes"][0]
        change(episode["payload"], episode)
        problems: list[str] = []
        _diff("golden", doc, changed, problems)
        assert len(problems) == 1, problems
    near = json.loads(json.dumps(doc))
    lps = near["episodes"][0]["payload"]["behaviour_logprobs"]
    lps[-1] += LOGPROB_ATOL / 2
    problems = []
    _diff("golden", doc, near, problems)
    assert not problems, problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--record", action="store_true", help="write the golden files")
    ap.add_argument("names", nargs="*", help="only these cases (default: all)")
    args = ap.parse_args()
    if not args.record:
        ap.error("nothing to do: pass --record (the test is run by pytest)")
    record(args.names or None)


if __name__ == "__main__":
    main()
