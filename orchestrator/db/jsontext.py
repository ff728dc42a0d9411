"""JSON as the database stores it: any text, U+0000 included, read back exactly.

PostgreSQL's ``jsonb`` rejects the character U+0000 (``unsupported Unicode escape sequence``)
and a ``text`` column rejects the byte 0. Models emit it now and then (byte-level tokens decode
to it), and model and tool text reaches ``jsonb`` in agent journals, environment state and event
payloads. Every JSON value the engine writes goes through :func:`dumps` and every one it reads
through :func:`loads` (``Database`` installs both on its connections, for SQLAlchemy and the raw
psycopg cursors alike), so the escape is invisible to the rest of the code.

The escape uses one private-use character, ``ESC`` (U+E000): in every string and key, ``ESC``
is written ``ESC ESC`` and U+0000 ``ESC 0``. Text without either character, nearly all of it,
takes the fast path: plain :mod:`json`, one substring test on the way in and on the way out.
"""

from __future__ import annotations

import json
import re
from typing import Any

ESC = "\ue000"
# how json.dumps (ensure_ascii) writes the two characters the escape is about
_DUMPED = ("\\u0000", "\\ue000")
# how PostgreSQL hands jsonb back: non-ASCII characters as UTF-8, but accept \u escapes too
_LOADED_TEXT = (ESC, "\\ue000")
_LOADED_BYTES = (ESC.encode(), b"\\ue000")
_UNESCAPE = re.compile(ESC + "(.)", re.DOTALL)


def _escape_str(s: str) -> str:
    if ESC not in s and "\x00" not in s:
        return s
    return s.replace(ESC, ESC + ESC).replace("\x00", ESC + "0")


def _unescape_str(s: str) -> str:
    if ESC not in s:
        return s
    return _UNESCAPE.sub(lambda m: "\x00" if m[1] == "0" else m[1], s)


def _walk(value: Any, f: Any) -> Any:
    if isinstance(value, str):
        return f(value)
    if isinstance(value, dict):
        return {(f(k) if isinstance(k, str) else k): _walk(v, f) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_walk(v, f) for v in value]
    return value


def dumps(value: Any) -> str:
    text = json.dumps(value)
    if not any(d in text for d in _DUMPED):
        return text
    return json.dumps(_walk(value, _escape_str))


def loads(data: str | bytes | bytearray | memoryview) -> Any:
    if isinstance(data, memoryview):
        data = bytes(data)
    value = json.loads(data)
    marks = _LOADED_TEXT if isinstance(data, str) else _LOADED_BYTES
    if not any(m in data for m in marks):  # type: ignore[operator]
        return value
    return _walk(value, _unescape_str)


def plain_text(s: str) -> str:
    """``s`` for a ``text`` column (an event's message): U+0000 shown as ``\\x00``, lossy but
    readable. Structured values belong in JSON, which keeps them exactly."""
    return s.replace("\x00", "\\x00") if "\x00" in s else s
