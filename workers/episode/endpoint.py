"""An OpenAI-compatible endpoint per rollout node: ``POST /v1/chat/completions``.

Agents written with any framework (the ``openai`` client, LangGraph-style loops) are trained by
pointing their client at ``ctx.base_url`` with ``ctx.api_key``: the key names the episode's
sample, and each request is served by that episode's ``AgentContext.chat``, so it is recorded,
replayed after a crash and trained on exactly as a ``ctx.chat`` call is (the tokens the engine
generated, their log-probs and policy version). A key is valid while its episode runs; a
request with another key is refused (401).

The server is one per process (``shared_endpoint``), started on first use, on loopback unless
the node is configured otherwise. Requests are served on threads; the agent's own code runs
on the agent loop's thread. Supported: ``messages`` (system, user, assistant, tool), ``tools``
(functions), ``max_tokens`` / ``max_completion_tokens``; the rollout's temperature is used (the
trainer's log-probs are taken at it). ``"rollcall": {"train": false}`` in the body (the
client's ``extra_body``) asks for an untrained call, as ``ctx.chat(..., train=False)``.
Refused with 400: ``stream``, ``n`` > 1.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from rollcall.orchestrator.inputs import too_big
from rollcall.workers.episode.api import AgentUsageError, ContextLimit, ReplayDivergence

if TYPE_CHECKING:
    from rollcall.workers.episode.context import AgentContext

_contexts: dict[str, AgentContext] = {}
_lock = threading.Lock()
_servers: dict[str, Endpoint] = {}


@contextmanager
def registered(ctx: AgentContext) -> Iterator[None]:
    """``ctx``'s key is valid on this process's endpoint while the block runs."""
    with _lock:
        _contexts[ctx.api_key] = ctx
    try:
        yield
    finally:
        with _lock:
            _contexts.pop(ctx.api_key, None)


def _error(status: int, message: str, kind: str) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"message": message, "type": kind, "code": status}}


def complete(ctx: AgentContext, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """One chat completion for ``ctx`` (the HTTP status and the JSON body)."""
    if body.get("stream"):
        return _error(400, "streaming is not supported by rollcall's endpoint", "invalid_request")
    if int(body.get("n") or 1) != 1:
        return _error(400, "n must be 1", "invalid_request")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return _error(400, "messages must be a non-empty list", "invalid_request")
    options = body.get("rollcall") or {}
    train = bool(options.get("train", True)) if isinstance(options, dict) else True
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    tools = body.get("tools") if body.get("tool_choice") != "none" else None
    try:
        reply = ctx.chat_sync(messages, tools, train, int(limit) if limit else None)
    except ReplayDivergence as e:
        return _error(409, f"replay diverged: {e}", "replay_diverged")
    except ContextLimit as e:  # the trajectory is full: OpenAI's own code for it
        status, body = _error(400, str(e), "invalid_request_error")
        body["error"]["code"] = "context_length_exceeded"
        return status, body
    except AgentUsageError as e:
        return _error(400, str(e), "invalid_request")
    finish = "tool_calls" if reply.tool_calls else reply.finish_reason
    prompt_tokens = len(ctx.trajectory.token_ids) - reply.num_tokens if train else 0
    return 200, {
        "id": f"chatcmpl-{ctx.api_key[-8:]}-{len(ctx.trajectory.turn_offsets)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": str(body.get("model") or "rollcall"),
        "choices": [
            {"index": 0, "message": reply.message, "finish_reason": finish, "logprobs": None}
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": reply.num_tokens,
            "total_tokens": prompt_tokens + reply.num_tokens,
        },
    }


# A refused request's body is read and thrown away (never kept) up to this many bytes within
# this many seconds, so that its client reads the answer instead of a reset connection.
DRAIN_BYTES = 256 * 1024 * 1024
DRAIN_S = 10.0


def _drain(connection: Any, rfile: Any, declared: int) -> None:
    import socket

    left = min(declared, DRAIN_BYTES)
    deadline = time.monotonic() + DRAIN_S
    try:
        connection.settimeout(1.0)
        while left > 0 and time.monotonic() < deadline:
            chunk = rfile.read1(min(left, 1 << 16))
            if not chunk:
                break
            left -= len(chunk)
        connection.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the client went away: nothing to tell it


@dataclass(frozen=True)
class _Refusal:
    status: int
    body: dict[str, Any]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # requests are recorded in the episode, not logged one by one

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _refuse(self, status: int, body: dict[str, Any], *, sent: bool = True) -> None:
        """Answer without keeping the request's body, and close the connection. A body the
        client is sending (``sent``) is read and thrown away first, up to ``DRAIN_BYTES``
        within ``DRAIN_S``: closing a socket with unread data resets it, and a client still
        sending would see a broken pipe instead of the answer."""
        self.close_connection = True
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()
        if sent:
            _drain(self.connection, self.rfile, self._declared())

    def _declared(self) -> int:
        try:
            return max(0, int(self.headers.get("Content-Length") or 0))
        except ValueError:
            return DRAIN_BYTES

    def _admission(self) -> tuple[AgentContext, int] | _Refusal:
        """The episode and the body's length, or why the request is refused (the status and
        the error body): the path, the key and the body's declared size, checked before any of
        the body is read (before ``100 Continue`` when the client asks for it)."""
        if self.path.rstrip("/") != "/v1/chat/completions":
            return _Refusal(*_error(404, f"no such path {self.path}", "not_found"))
        auth = self.headers.get("Authorization", "")
        key = auth.removeprefix("Bearer ").strip()
        with _lock:
            ctx = _contexts.get(key)
        if ctx is None:
            return _Refusal(*_error(401, "unknown or expired episode key", "invalid_api_key"))
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0 or "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return _Refusal(*_error(411, "the request needs a Content-Length", "invalid_request"))
        limit = ctx.limits.request_body_bytes
        if length > limit:
            why = too_big("the request body", length, "request_body_bytes", limit)
            return _Refusal(*_error(413, why, "request_too_large"))
        return ctx, length

    def handle_expect_100(self) -> bool:
        """``Expect: 100-continue``: the client waits for a go before it sends the body, so a
        refused request is answered without the body ever being sent."""
        admitted = self._admission()
        if isinstance(admitted, _Refusal):
            self._refuse(admitted.status, admitted.body, sent=False)
            return False
        return super().handle_expect_100()

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": "rollcall", "object": "model"}]})
        else:
            self._send(*_error(404, f"no such path {self.path}", "not_found"))

    def do_POST(self) -> None:
        admitted = self._admission()
        if isinstance(admitted, _Refusal):
            self._refuse(admitted.status, admitted.body)
            return
        ctx, length = admitted
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError as e:
            self._send(*_error(400, f"the body is not JSON ({e.msg})", "invalid_request"))
            return
        if not isinstance(body, dict):
            self._send(*_error(400, "the body must be a JSON object", "invalid_request"))
            return
        try:
            self._send(*complete(ctx, body))
        except Exception as e:
            if ctx.failure is not None:  # the engine or the checkpoint failed (it set it): the
                # agent's call fails, and the node decides
                self._send(*_error(503, f"{type(e).__name__}: {e}", "engine_error"))
            else:  # the request could not be served as sent (a template that refuses its
                # messages, a bad value): the agent's to handle, as from ctx.chat
                self._send(*_error(400, f"{type(e).__name__}: {e}", "invalid_request"))


class Endpoint:
    """A threaded HTTP server on ``host`` (any free port)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = ThreadingHTTPServer((host, port), _Handler)
        self.server.daemon_threads = True
        self.host, self.port = host, int(self.server.server_address[1])
        self.thread = threading.Thread(
            target=self.server.serve_forever, name="agent-endpoint", daemon=True
        )
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def shared_endpoint(host: str = "127.0.0.1") -> Endpoint:
    """This process's endpoint on ``host``, started on first use."""
    with _lock:
        server = _servers.get(host)
        if server is None:
            server = _servers[host] = Endpoint(host)
        return server
