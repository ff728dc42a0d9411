"""Running tool calls with a timeout, in isolation from the rollout node.

``ToolRunner`` executes ``plugin.call_tool`` in a child process (started once, reused): a tool
that raises, receives malformed arguments, runs past ``timeout_s`` or exceeds ``memory_mb``
yields an error observation for the model, and the node carries on. A child that hangs or dies
is killed and replaced. The environment state crosses the process boundary as JSON-ready data,
which is also what the buffer checkpoints.

The child is never a fork of the node: the node has threads (agent loops, heartbeats), and a
fork copies the locks they hold into the child, held there forever. Children come from a
forkserver instead, a single-threaded interpreter started once per process with this module
imported, which forks each child: a replacement after a timeout costs a fork, not a Python
start. The child acknowledges each call once it has read it (and imported the plugin's module
to do so), and ``timeout_s`` counts from there: it bounds the tool, not a start on a loaded
machine (bounded by ``START_TIMEOUT_S``).

A tool process needs neither the node's ``__main__`` (in a Ray actor, Ray's worker script,
which multiprocessing would otherwise run again in every child: 0.26 s of CPU and 40 MB per tool
process, measured) nor to import the task's module itself: the first is left out of the
children's start (``_preparation_data``), the second is imported once by the forkserver
(``preload``). Plugins and tools are importable modules (or, for an agent's own functions,
pickled by value), so nothing in a child needs ``__main__``.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.spawn
import resource
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Final

from tasks.base import Observation, TaskPlugin, TaskSpec, ToolError

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MEMORY_MB = 1024
START_TIMEOUT_S = 60.0

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


def _serve(conn: Connection, memory_mb: int) -> None:
    if memory_mb > 0:
        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "function":  # an agent's own callable (``call_function``)
            _serve_function(conn, msg[1])
            continue
        plugin, spec, prompt, state, name, arguments = msg
        conn.send(("started",))
        try:
            obs: Observation = plugin.call_tool(spec, prompt, state, name, arguments)
            conn.send(("ok", obs.text, obs.state, obs.done))
        except ToolError as e:
            conn.send(("tool_error", str(e), state, False))
        except MemoryError:
            conn.send(("crash", "the tool ran out of memory", state, False))
        except Exception as e:  # the tool's own bug: report it, keep serving
            last = traceback.extract_tb(e.__traceback__)[-1:]
            where = f" ({last[0].filename.rsplit('/', 1)[-1]}:{last[0].lineno})" if last else ""
            conn.send(("crash", f"{type(e).__name__}: {e}{where}", state, False))


def _serve_function(conn: Connection, payload: bytes) -> None:
    """Run ``(fn, args, kwargs)`` (cloudpickled: an agent's functions may live in a file that
    is no importable module) and send back its result or its error."""
    import asyncio
    import inspect
    import pickle

    try:
        fn, args, kwargs = pickle.loads(payload)
    except Exception as e:
        conn.send(("started",))
        conn.send(("crash", f"the function could not be unpickled: {type(e).__name__}: {e}"))
        return
    conn.send(("started",))
    try:
        value = fn(*args, **kwargs)
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
        conn.send(("ok", value))
    except MemoryError:
        conn.send(("crash", "the tool ran out of memory"))
    except Exception as e:
        conn.send(("crash", f"{type(e).__name__}: {e}"))


async def _awaited(value: Any) -> Any:
    return await value


class ToolRunner:
    """One isolated tool process. Calls take turns (a lock): an agent run abandoned after its
    episode timeout may still have a call in flight on its own thread, and the loop's next
    episode must neither read that call's answer nor have its own read by it; it waits for
    that call (bounded by the call's timeout) instead."""

    def __init__(
        self, timeout_s: float = DEFAULT_TIMEOUT_S, memory_mb: int = DEFAULT_MEMORY_MB
    ) -> None:
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self._ctx = _CTX
        self.start_method = START_METHOD
        self._proc: Any = None
        self._conn: Connection | None = None
        self.restarts = 0
        self._turn = threading.Lock()

    def _ensure(self) -> Connection:
        if self._proc is None or not self._proc.is_alive() or self._conn is None:
            if self._proc is not None:
                self.restarts += 1
            parent, child = self._ctx.Pipe()
            self._proc = self._ctx.Process(
                target=_serve, args=(child, self.memory_mb), daemon=True, name=PROCESS_NAME
            )
            self._proc.start()
            child.close()
            self._conn = parent
        return self._conn

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(timeout=5)
        if self._conn is not None:
            self._conn.close()
        self._conn = None

    def call(
        self,
        plugin: TaskPlugin,
        spec: TaskSpec,
        prompt: dict[str, Any],
        state: dict[str, Any],
        name: str,
        arguments: Any,
    ) -> ToolResult:
        if not isinstance(arguments, dict):
            return ToolResult("error: tool arguments must be a JSON object", state, False, True)
        answer = self._exchange(
            (plugin, spec, prompt, state, name, arguments), self.timeout_s, name
        )
        if isinstance(answer, str):
            return ToolResult(f"error: {answer}", state, False, True)
        kind, text, new_state, done = answer
        if kind == "ok":
            return ToolResult(text, new_state, done, False)
        return ToolResult(f"error: {text}", new_state, False, True)

    def call_function(
        self,
        fn: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout_s: float,
        name: str | None = None,
    ) -> tuple[bool, Any]:
        """Run ``fn(*args, **kwargs)`` (sync or async) in the tool process within
        ``timeout_s``: ``(True, result)`` or ``(False, why)``; a hung or crashed process is
        killed and replaced at the next call."""
        from ray import cloudpickle

        name = str(name or getattr(fn, "__name__", "tool"))
        try:
            payload = cloudpickle.dumps((fn, args, kwargs))
        except Exception as e:
            return False, f"the tool {name!r} cannot be sent to its process ({e})"
        answer = self._exchange(("function", payload), timeout_s, name)
        if isinstance(answer, str):
            return False, answer
        kind, value = answer
        return kind == "ok", value

    def _exchange(self, request: Any, timeout_s: float, name: str) -> tuple[Any, ...] | str:
        """Send one request to the tool process and wait for its answer: the answer, or why
        there is none (the process then killed, to be replaced at the next call). The tool must
        start within ``START_TIMEOUT_S`` and answer within ``timeout_s``. Requests take turns
        (``_turn``)."""
        with self._turn:
            conn = self._ensure()
            try:
                conn.send(request)
                if not conn.poll(START_TIMEOUT_S):
                    self._kill()
                    return f"the tool {name!r} could not be started within {START_TIMEOUT_S:g} s"
                conn.recv()  # ("started",): the tool runs from now
                if not conn.poll(timeout_s):
                    self._kill()
                    return f"the tool {name!r} did not answer within {timeout_s:g} s"
                answer: tuple[Any, ...] = conn.recv()
                return answer
            except (EOFError, OSError, BrokenPipeError):
                self._kill()
                return f"the tool {name!r} crashed"

    def close(self) -> None:
        self._kill()

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
