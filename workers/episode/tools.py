"""Running tool calls with a timeout, in isolation from the rollout node.

``ToolRunner`` executes ``plugin.call_tool`` (and an agent's functions: ``call_function``) in a
tool process, never in the node: a tool that raises, receives malformed arguments, runs past
``timeout_s``, exceeds its memory or any other limit, or answers more than
``rollout.input_limits.observation_bytes`` yields an error observation for the model (or
``(False, why)``), and the node carries on. The environment state crosses the process boundary
as JSON-ready data, which is also what the buffer checkpoints; every answer comes back as JSON
(never a pickle: a tool cannot make the node run code by what it answers), and an observation
over its limit is refused in the tool process, so it never crosses the pipe (the node measures
it again, and never reads an answer longer than ``answer_bytes``: a crash).

How a call runs is ``rollout.tool_sandbox.level`` (docs/security.md):

- ``sandbox`` (the default): the tool server, started once per runner, runs each call in a fresh
  child that its clean zygote forked ahead of need (``rollcall.workers.episode.sandbox``), which
  sees only the prompt fields the task declares (``tool_prompt_fields``): its own network
  namespace unless the task is granted the network (``call(..., network=True)``), pid and mount
  namespaces, a fresh empty working directory, an environment without the node's secrets, and
  per-call limits on CPU, memory, processes, open files and file size. A call that hangs is
  killed with every process it started; the server survives every call and serves the next.
- ``process``: the tool server runs the tools itself, one call after the other, with an
  address-space limit only (``memory_mb``); a child that hangs or dies is killed and replaced.
  It shares the node's network, files, user and environment.

The server is never a fork of the node: the node has threads (agent loops, heartbeats), and a
fork copies the locks they hold into the child, held there forever. Servers come from a
forkserver instead, a single-threaded interpreter started once per process with this module
imported, which forks each server: a replacement after a timeout costs a fork, not a Python
start. The server acknowledges each call once it has read it (and imported the plugin's module
to do so; in ``sandbox``, once the call's child is set up), and ``timeout_s`` counts from
there: it bounds the tool, not a start on a loaded machine (bounded by ``START_TIMEOUT_S``).

A tool process needs neither the node's ``__main__`` (in a Ray actor, Ray's worker script,
which multiprocessing would otherwise run again in every child: 0.26 s of CPU and 40 MB per tool
process, measured) nor to import the task's module itself: the first is left out of the
children's start (``_preparation_data``), the second is imported once by the forkserver
(``preload``). Plugins and tools are importable modules (or, for an agent's own functions,
pickled by value), so nothing in a child needs ``__main__``.
"""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import multiprocessing.spawn
import pickle
import resource
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Final

from rollcall.orchestrator.inputs import text_bytes, too_big
from rollcall.tasks.base import Observation, TaskPlugin, TaskSpec, ToolError
from rollcall.workers.episode import sandbox
from rollcall.workers.episode.usercode import UserCodeError, code_location

if TYPE_CHECKING:
    from rollcall.orchestrator.config import ToolSandboxConfig

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_OBSERVATION_BYTES = 64 * 1024
START_TIMEOUT_S = 60.0
# sandbox: the server kills a call at its timeout and answers; the node waits this much more
# before it takes the server for hung and kills it
SERVER_GRACE_S = 2 * sandbox.KILL_WAIT_S + 5.0
MAX_ERROR_CHARS = 2000  # an exception's message, in the error observation
ANSWER_MARGIN = 1 << 20  # an answer's bytes beside its observation's (the state: JSON)


def answer_bytes(observation_bytes: int) -> int:
    """The most an answer may take (JSON escapes a character in up to 6 bytes); a longer one
    is the tool's crash (the server does not read it, the node refuses it)."""
    return 6 * observation_bytes + ANSWER_MARGIN


START_METHOD: Final = "forkserver"
_CTX = mp.get_context(START_METHOD)
# The forkserver imports this module (not the node's ``__main__``, which may be Ray's worker
# script); it is started on the first tool process, so this applies unless something else in
# the process started one first.
_PRELOAD = [__name__]
_CTX.set_forkserver_preload(_PRELOAD)
PROCESS_NAME = "rollcall-tool"
_stdlib_preparation_data = multiprocessing.spawn.get_preparation_data


def _preparation_data(name: str) -> dict[str, Any]:
    """multiprocessing's start data for a child, without the main module for a tool process."""
    data: dict[str, Any] = _stdlib_preparation_data(name)
    if name.startswith(PROCESS_NAME):
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
    return data


multiprocessing.spawn.get_preparation_data = _preparation_data


def preload(module: str) -> None:
    """Have the forkserver import ``module`` (a task plugin's) so that tool processes start
    with it; effective until this process's forkserver has started, harmless after."""
    if module not in _PRELOAD:
        _PRELOAD.append(module)
        _CTX.set_forkserver_preload(list(_PRELOAD))


@dataclass(frozen=True)
class ToolResult:
    observation: str
    state: dict[str, Any]
    done: bool
    error: bool  # the call failed (bad call, exception, timeout); ``observation`` says why


# -- in the tool process: a call and its answer (JSON) ----------------------------------------


def _tool_answer(
    plugin: TaskPlugin,
    spec: TaskSpec,
    prompt: dict[str, Any],
    state: dict[str, Any],
    name: str,
    arguments: dict[str, Any],
    limits: sandbox.Limits,
    observation_bytes: int,
) -> list[Any]:
    try:
        obs: Observation = plugin.call_tool(spec, prompt, state, name, arguments)
    except ToolError as e:
        return ["tool_error", _cut(str(e))]
    except MemoryError:
        return ["crash", "the tool ran out of memory"]
    except Exception as e:  # the tool's own bug: report it, keep serving
        return ["crash", _describe(e, limits, where=True)]
    text = obs.text if isinstance(obs.text, str) else str(obs.text)
    if (size := text_bytes(text)) > observation_bytes:
        return ["crash", _too_big(size, observation_bytes)]
    try:
        json.dumps(obs.state)
    except (TypeError, ValueError) as e:
        return ["not_json", _cut(str(e))]
    return ["ok", text, obs.state, bool(obs.done)]


def _function_answer(
    fn: Any, args: Any, kwargs: Any, limits: sandbox.Limits, observation_bytes: int
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` (sync or async): its value as JSON when it is JSON, else its
    ``str``, within ``observation_bytes`` as the agent's tool message will say it."""
    import asyncio
    import inspect

    try:
        value = fn(*args, **kwargs)
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
    except MemoryError:
        return ["crash", "the tool ran out of memory"]
    except Exception as e:
        return ["crash", _describe(e, limits, where=False)]
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value)
        except (TypeError, ValueError):
            text = value = str(value)
    if (size := text_bytes(text)) > observation_bytes:
        return ["crash", _too_big(size, observation_bytes)]
    return ["ok", value]


async def _awaited(value: Any) -> Any:
    return await value


def _run_request(
    kind: str, payload: bytes, limits: sandbox.Limits, observation_bytes: int
) -> list[Any]:
    """A request's answer; ``payload`` is the node's pickle of the call (unpickled here: for
    ``sandbox``, in the call's own process, after its environment was emptied)."""
    try:
        call = pickle.loads(payload)
    except Exception as e:
        what = "the function" if kind == "function" else "the tool call"
        return ["crash", f"{what} could not be unpickled: {type(e).__name__}: {_cut(str(e))}"]
    if kind == "function":
        fn, args, kwargs = call
        return _function_answer(fn, args, kwargs, limits, observation_bytes)
    plugin, spec, prompt, state, name, arguments = call
    return _tool_answer(plugin, spec, prompt, state, name, arguments, limits, observation_bytes)


def _encode(answer: list[Any]) -> bytes:
    try:
        return json.dumps(answer).encode()
    except (TypeError, ValueError) as e:  # the answer's value cannot be said in JSON
        return json.dumps(["crash", f"the tool's answer cannot be sent: {_cut(str(e))}"]).encode()


def _describe(e: BaseException, limits: sandbox.Limits, *, where: bool) -> str:
    if isinstance(e, OSError) and e.errno == errno.EFBIG and limits.level == "sandbox":
        return limits.file_message()
    at = ""
    if where:
        last = traceback.extract_tb(e.__traceback__)[-1:]
        at = f" ({last[0].filename.rsplit('/', 1)[-1]}:{last[0].lineno})" if last else ""
    return f"{type(e).__name__}: {_cut(str(e))}{at}"


def _too_big(size: int, limit: int) -> str:
    return too_big("the tool's observation", size, "observation_bytes", limit)


def _cut(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."


# -- the tool servers ---------------------------------------------------------------------------


def _serve(conn: Connection, limits: sandbox.Limits, observation_bytes: int) -> None:
    """Level ``process``: the tools run here, one call after the other."""
    if limits.memory_mb > 0:
        limit = limits.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    while True:
        try:
            kind, _timeout_s, _network, _modules, payload = conn.recv()
        except EOFError:
            return
        conn.send_bytes(b'["started"]')
        with sandbox.forwarded_output():  # to the log, escaped, before the answer
            answer = _encode(_run_request(kind, payload, limits, observation_bytes))
        conn.send_bytes(answer)


def _serve_sandbox(
    conn: Connection,
    limits: sandbox.Limits,
    plan: sandbox.Protections,
    observation_bytes: int,
) -> None:
    """Level ``sandbox``: each call in a fresh tool process (``sandbox.Sandbox``), a spare the
    zygote forked ahead of need. The environment is emptied first; then the zygote is forked,
    before the first request is read: no call's process is a fork of a process that has seen
    another call's request or answer (the zygote imports the calls' modules itself)."""
    lay = sandbox.layout()  # where the node's secrets are: read before the environment goes
    sandbox.scrub_environment()
    sandbox.sweep(lay.workdirs)  # what servers killed during a call left
    sandbox.sweep_groups(plan)  # (and their cgroups)
    if limits.memory_mb > 0:
        limit = limits.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    def handle(request: bytes) -> bytes:  # in the call's tool process
        kind, _, payload = request.partition(b"\0")
        return _encode(_run_request(kind.decode(), payload, limits, observation_bytes))

    box = sandbox.Sandbox(limits, plan, lay, handle, answer_bytes(observation_bytes))
    box.start()
    try:
        while not box.broken:
            try:
                kind, timeout_s, network, modules, payload = conn.recv()
            except EOFError:
                return
            request = kind.encode() + b"\0" + payload
            _sandbox_call(conn, box, request, float(timeout_s), bool(network), tuple(modules))
    finally:
        box.close()


def _sandbox_call(
    conn: Connection,
    box: sandbox.Sandbox,
    request: bytes,
    timeout_s: float,
    network: bool,
    modules: tuple[str, ...],
) -> None:
    """One call in its own tool process; says ``started`` once it is set up, then the answer."""
    said = False

    def started() -> None:
        nonlocal said
        if not said:
            said = True
            conn.send_bytes(b'["started"]')

    try:
        outcome = box.run(
            request, network=network, timeout_s=timeout_s, started=started, modules=modules
        )
        if outcome.answer is not None:
            answer = outcome.answer
        else:
            answer = _encode(["failed", outcome.failure, outcome.detail])
    except Exception as e:  # the call could not be run: its failure, not the server's
        answer = _encode(["failed", "setup", f"{type(e).__name__}: {_cut(str(e))}"])
    started()
    conn.send_bytes(answer)
    box.prepare(network, modules)  # the next call's set-up, while the model generates


# -- the node's side --------------------------------------------------------------------------


class ToolRunner:
    """One tool server (see the module docstring). Calls take turns (a lock): an agent run
    abandoned after its episode timeout may still have a call in flight on its own thread, and
    the loop's next episode must neither read that call's answer nor have its own read by it;
    it waits for that call (bounded by the call's timeout) instead.

    ``sandbox``: ``rollout.tool_sandbox`` (None: its defaults); ``memory_mb`` overrides its
    memory limit. ``restarts`` counts tool processes lost to a hang or a crash (``process``:
    the server replaced; ``sandbox``: a call's child killed or dead)."""

    def __init__(
        self,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        sandbox: ToolSandboxConfig | None = None,
        observation_bytes: int = DEFAULT_OBSERVATION_BYTES,
        memory_mb: int | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.limits = _limits(sandbox, memory_mb)
        self.memory_mb = self.limits.memory_mb
        self.observation_bytes = observation_bytes
        self._ctx = _CTX
        self.start_method = START_METHOD
        self._proc: Any = None
        self._conn: Connection | None = None
        self.restarts = 0
        self._turn = threading.Lock()
        self._ending = threading.Lock()  # the process and pipe handed over once (``_kill``)

    @property
    def level(self) -> str:
        return self.limits.level

    def _ensure(self) -> Connection:
        if self._proc is None or not self._proc.is_alive() or self._conn is None:
            if self._proc is not None:
                self.restarts += 1
            parent, child = self._ctx.Pipe()
            if self.level == "sandbox":
                target: Any = _serve_sandbox
                args: tuple[Any, ...] = (child, self.limits, _protections(), self.observation_bytes)
            else:
                target, args = _serve, (child, self.limits, self.observation_bytes)
            self._proc = self._ctx.Process(target=target, args=args, daemon=True, name=PROCESS_NAME)
            self._proc.start()
            child.close()
            self._conn = parent
        return self._conn

    def _kill(self) -> None:
        with self._ending:  # ``close`` from another thread and a failing call both end here
            proc, conn, self._conn = self._proc, self._conn, None
            if proc is not None:
                proc.kill()
                proc.join(timeout=5)
            if conn is not None:
                conn.close()

    def call(
        self,
        plugin: TaskPlugin,
        spec: TaskSpec,
        prompt: dict[str, Any],
        state: dict[str, Any],
        name: str,
        arguments: Any,
        network: bool = False,
    ) -> ToolResult:
        """``plugin.call_tool(...)`` in the tool process; ``network``: the task is granted the
        network (``rollout.tool_sandbox.network_tasks``)."""
        if not isinstance(arguments, dict):
            return ToolResult("error: tool arguments must be a JSON object", state, False, True)
        try:
            seen = tool_prompt(plugin, prompt)  # the row's label never reaches the tool
            payload = pickle.dumps((plugin, spec, seen, state, name, arguments))
        except Exception as e:
            return ToolResult(f"error: the tool call cannot be sent ({e})", state, False, True)
        request = ("tool", self.timeout_s, network, (type(plugin).__module__,), payload)
        answer = self._exchange(request, self.timeout_s, name)
        if isinstance(answer, str):
            return ToolResult(f"error: {answer}", state, False, True)
        kind = answer[0]
        if kind == "ok" and len(answer) == 4:
            text = str(answer[1])
            if (size := text_bytes(text)) > self.observation_bytes:  # the tool's own word
                return ToolResult(f"error: {_too_big(size, self.observation_bytes)}", state,
                                  False, True)  # fmt: skip
            return ToolResult(text, answer[2], bool(answer[3]), False)
        if kind == "not_json":  # as the loop's own check would say it (``check_json``)
            who = "the task's state after a tool call"
            raise UserCodeError(
                f"{who} must be JSON with finite numbers ({answer[1]})",
                location=code_location(plugin.call_tool),
                kind="returned",
                head=f"{who} is not JSON",
            )
        return ToolResult(f"error: {answer[1] if len(answer) > 1 else answer}", state, False, True)

    def call_function(
        self,
        fn: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout_s: float,
        name: str | None = None,
        network: bool = False,
    ) -> tuple[bool, Any]:
        """Run ``fn(*args, **kwargs)`` (sync or async) in the tool process within
        ``timeout_s``: ``(True, result)`` or ``(False, why)``. The result comes back as JSON
        (a value JSON cannot say: its ``str``). A hung or crashed call is killed (``process``:
        the process too, replaced at the next call)."""
        from ray import cloudpickle

        name = str(name or getattr(fn, "__name__", "tool"))
        try:
            payload = cloudpickle.dumps((fn, args, kwargs))
        except Exception as e:
            return False, f"the tool {name!r} cannot be sent to its process ({e})"
        request = ("function", timeout_s, network, ("ray.cloudpickle",), payload)
        answer = self._exchange(request, timeout_s, name)
        if isinstance(answer, str):
            return False, answer
        value = answer[1] if len(answer) > 1 else answer
        if answer[0] == "ok":
            text = value if isinstance(value, str) else json.dumps(value)
            if (size := text_bytes(text)) > self.observation_bytes:  # the tool's own word
                return False, _too_big(size, self.observation_bytes)
        return answer[0] == "ok", value

    def _exchange(self, request: Any, timeout_s: float, name: str) -> list[Any] | str:
        """Send one request to the tool server and wait for its answer: the answer, or why
        there is none (``process``: the server then killed, to be replaced at the next call).
        The tool must start within ``START_TIMEOUT_S`` and answer within ``timeout_s``.
        Requests take turns (``_turn``)."""
        grace = SERVER_GRACE_S if self.level == "sandbox" else 0.0
        with self._turn:
            conn = self._ensure()
            try:
                conn.send(request)
                if not conn.poll(START_TIMEOUT_S):
                    self._kill()
                    return f"the tool {name!r} could not be started within {START_TIMEOUT_S:g} s"
                conn.recv_bytes(64)  # ["started"]: the tool runs from now
                if not conn.poll(timeout_s + grace):
                    self._kill()  # (a restart: counted when the next server starts)
                    return f"the tool {name!r} did not answer within {timeout_s:g} s"
                # longer: the tool's crash (OSError), the server then replaced
                answer = json.loads(conn.recv_bytes(answer_bytes(self.observation_bytes)))
            except (EOFError, OSError, BrokenPipeError, ValueError):
                self._kill()
                return f"the tool {name!r} crashed"
        if not isinstance(answer, list) or not answer:
            return f"the tool {name!r} crashed"
        if answer[0] != "failed":
            return answer
        failure, detail = [*answer, "", ""][1:3]
        self.restarts += failure in ("timeout", "crashed", "cpu", "file", "memory")
        if failure == "timeout":
            return f"the tool {name!r} did not answer within {timeout_s:g} s"
        if failure in ("cpu", "file", "memory"):
            return str(detail)
        if failure == "setup":
            return f"the tool {name!r} could not be started: the sandbox failed ({detail})"
        return f"the tool {name!r} crashed ({detail})" if detail else f"the tool {name!r} crashed"

    def close(self) -> None:
        """Kill the server; a call waiting on it (another thread) then sees it crashed. The
        pipe is closed by whoever holds the turn, so a waiting call never reads a closed one."""
        with self._ending:
            if self._proc is not None:
                self._proc.kill()
        if self._turn.acquire(timeout=10):
            try:
                self._kill()
            finally:
                self._turn.release()
        else:
            self._kill()

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tool_prompt(plugin: TaskPlugin, prompt: dict[str, Any]) -> dict[str, Any]:
    """The prompt row as ``call_tool`` sees it: only the fields the task declares for its tools
    (``tool_prompt_fields``, default none), so that the reward's label and whatever else the
    row holds never enter the tool's process."""
    fields = getattr(plugin, "tool_prompt_fields", ())
    if isinstance(fields, str):  # ("secret") for ("secret",)
        fields = (fields,)
    return {k: prompt[k] for k in fields if k in prompt}


def _limits(config: ToolSandboxConfig | None, memory_mb: int | None) -> sandbox.Limits:
    return sandbox.Limits.of(config, memory_mb)


def _protections() -> sandbox.Protections:
    return sandbox.probe()


def describe(config: ToolSandboxConfig | None = None) -> str:
    """The node's line for the terminal: what a tool call gets here (``sandbox.probe``)."""
    limits = sandbox.Limits.of(config)
    network_tasks = config.network_tasks if config is not None else []
    plan = sandbox.probe() if limits.level == "sandbox" else sandbox.Protections()
    return plan.describe(limits, network_tasks)
