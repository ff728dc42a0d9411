"""The grader's data never enters a tool's address space (issue 58): ``call_tool`` sees only
the prompt fields its task declares (``tool_prompt_fields``), and code a tool launches runs in
a process tree that never held another call's request or answer (each call a spare of the
zygote's, never a fork of the tool server). Through ``ToolRunner`` at level ``sandbox``, as a
rollout node drives it, with a toy code-execution task (a fake plugin, named so: it runs the
model's Python in a subprocess, as any code-execution task does)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from typing import Any, ClassVar, cast

from rollcall.orchestrator.config import ToolSandboxConfig
from rollcall.tasks.base import BaseTask, Observation, TaskPlugin, TaskSpec
from rollcall.workers.episode import sandbox
from rollcall.workers.episode.tools import ToolRunner, tool_prompt

PROTECTIONS = sandbox.probe()


class CodeTask(BaseTask):
    """A fake code-execution task: its tool runs ``arguments["code"]`` with ``arguments["argv"]``
    in a subprocess and answers its output. The prompt row's ``answer`` is the reward's label."""

    name: ClassVar[str] = "code"
    description: ClassVar[str] = "runs the model's Python"
    Spec: ClassVar[type[TaskSpec]] = TaskSpec
    tool_prompt_fields: ClassVar[tuple[str, ...]] = ("question",)

    def call_tool(
        self,
        spec: TaskSpec,
        prompt: dict[str, Any],
        state: dict[str, Any],
        name: str,
        arguments: dict[str, Any],
    ) -> Observation:
        if name == "fields":
            return Observation(json.dumps(sorted(prompt)), state)
        argv = [str(a) for a in arguments.get("argv", [])]
        out = subprocess.run(
            [sys.executable, "-c", arguments["code"], *argv],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        return Observation(out.stdout + out.stderr, state)


# Reads the memory of every process of the call's it can (its pid namespace: the tool process
# and its children), itself aside, for the needles given reversed (so that no process holds
# them forward but where they leaked to): {needle: [pids]}, and how much it read of whom.
SCAN = r"""
import json, os, sys
needles = [a[::-1].encode() for a in sys.argv[1:]]
found, read = {}, {}
for pid in sorted(p for p in os.listdir("/proc") if p.isdigit()):
    if int(pid) == os.getpid():
        continue
    try:
        maps = open(f"/proc/{pid}/maps").read().splitlines()
        mem = open(f"/proc/{pid}/mem", "rb", 0)
    except OSError:
        continue
    for line in maps:
        span, perms = line.split()[:2]
        if not perms.startswith("r"):
            continue
        lo, hi = (int(x, 16) for x in span.split("-"))
        at = lo
        while at < hi:
            try:
                mem.seek(at)
                data = mem.read(min(hi - at, 8 << 20) + 256)
            except (OSError, ValueError, OverflowError):
                break
            read[pid] = read.get(pid, 0) + len(data)
            for n in needles:
                if n in data:
                    found.setdefault(n.decode(), []).append(pid)
            at += 8 << 20
print(json.dumps({"found": found, "read": read}))
"""


def test_a_tool_sees_only_its_fields_and_no_other_calls_data() -> None:
    assert PROTECTIONS.pids and PROTECTIONS.mounts, PROTECTIONS.problems  # fails, never skips
    tag = uuid.uuid4().hex
    label = f"LABEL-{tag}"  # the reward's label of the row the call plays
    before = {  # what an earlier call (another episode's row) sent and got
        "label": f"OLDLABEL-{tag}",
        "argument": f"OLDARG-{tag}",
        "state": f"OLDSTATE-{tag}",
        "answer": f"OLDANSWER-{tag}",
    }
    control = f"CONTROL-{tag}"  # this call's own argument: the scan must find it (it reads)
    task, spec = cast(TaskPlugin, CodeTask()), TaskSpec()  # (a tool's half of a plugin)
    row = {"question": "what is 6 * 7?", "answer": label}
    assert tool_prompt(task, row) == {"question": "what is 6 * 7?"}

    with ToolRunner(timeout_s=120, sandbox=ToolSandboxConfig()) as runner:
        r = runner.call(task, spec, row, {}, "fields", {})
        assert json.loads(r.observation) == ["question"], r

        old_row = {"question": "q", "answer": before["label"]}
        r = runner.call(
            task, spec, old_row, {"kept": before["state"]}, "run",
            {"code": "import sys; print(sys.argv[1][::-1])", "argv": [before["answer"][::-1]],
             "note": before["argument"]},
        )  # fmt: skip
        assert r.observation.strip() == before["answer"], r

        needles = [label, *before.values(), control]
        r = runner.call(
            task, spec, row, {"n": 1}, "run",
            {"code": SCAN, "argv": [n[::-1] for n in needles], "control": control},
        )  # fmt: skip
    assert not r.error, r.observation
    scan = json.loads(r.observation)
    assert scan["read"].get("1", 0) > 1 << 20, scan["read"]  # the tool process's memory, read
    assert control in scan["found"], scan  # what the call holds is found
    leaked = {n: pids for n, pids in scan["found"].items() if n != control}
    assert leaked == {}, f"found in the call's processes: {leaked}"
