"""Terminal hygiene: text that a tool, the user's code or the model controls is escaped on its
way to the operator's terminal or rollcall's logs, never where it is training data.

``escape_controls`` turns every C0 and C1 control character but newline and tab (ESC, CSI
``\\x9b``, BEL, backspace, carriage return, DEL, ...) into its visible ``\\xNN``: an exception
message cannot clear the screen, colour the lines after it, set the window title, hide text
behind a hyperlink or overwrite a line with ``\\r``. Its users: the CLI's and the driver's
consoles (``SafeConsole``: every string they print, table cells included), the log handlers
(``EscapingFormatter``: driver.log and the error line on stderr). The tool server escapes a
call's forwarded output with its own copy (``rollcall.workers.episode.sandbox.server``, which
imports nothing of rollcall's; a unit test holds the two equal) and prefixes each of its lines
with ``tool| ``, so that a tool's "job finished" cannot pass for rollcall's own line.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from rich.console import Console
from rich.text import Text

_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0))}


def escape_controls(text: str) -> str:
    """``text`` with each control character but ``\\n`` and ``\\t`` as ``\\xNN`` (four
    visible characters); ``text`` itself when it has none (the common case: one regex scan)."""
    if _CONTROL.search(text) is None:
        return text
    return text.translate(_ESCAPES)


def safe_text(text: str, **kwargs: Any) -> Text:
    """A rich ``Text`` of ``text`` escaped (``Text`` objects do not pass ``render_str``)."""
    return Text(escape_controls(text), **kwargs)


class SafeConsole(Console):
    """A rich console whose every printed string is escaped first: ``print``'s strings, rules'
    titles and strings in tables (the console turns each into a ``Text`` here). A ``Text``
    made elsewhere is not: make it with ``safe_text``. Rich's own styles are unaffected."""

    def render_str(self, text: str, **kwargs: Any) -> Text:
        return super().render_str(escape_controls(text), **kwargs)


class EscapingFormatter(logging.Formatter):
    """A ``logging.Formatter`` whose output (message, exception and traceback) is escaped."""

    def format(self, record: logging.LogRecord) -> str:
        return escape_controls(super().format(record))
