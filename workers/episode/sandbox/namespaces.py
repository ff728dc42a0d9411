"""A call's set-up in its keeper: its namespaces and mounts (``_enter``, ``_cover``), as the
probe's plan (``Protections``) says. Standard library only."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from .linux import (
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWUSER,
    MS_BIND,
    MS_NODEV,
    MS_NOSUID,
    MS_PRIVATE,
    MS_REC,
    PR_SET_DUMPABLE,
    _mount,
    _prctl,
    _read_only,
    _unshare,
)
from .paths import Layout, _covered, _top_level

if TYPE_CHECKING:
    from .protections import Protections


# As root a call's tool process runs as this uid + its keeper's pid (pids are below 2^22): an
# id no account has, unique among the calls running at once
TOOL_UID_BASE = 2_000_000_000


def _enter(
    plan: Protections, lay: Layout, *, network: bool, workdir: str | None, size_mb: int
) -> list[str]:
    """In the keeper: the call's namespaces and mounts (as ``plan`` says); what it covers."""
    flags = plan.flags & ~(CLONE_NEWNET if network else 0)
    if plan.mode == "root" and flags:
        _unshare(flags)
    elif plan.mode == "userns":
        if plan.root and plan.drop_uid:  # a uid of its own first, then its user namespace
            uid = TOOL_UID_BASE + os.getpid()
            if workdir is not None:
                os.chown(workdir, uid, uid)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            _prctl(PR_SET_DUMPABLE, 1)  # else its /proc/self/uid_map is root's
        uid, gid = os.getuid(), os.getgid()
        _unshare(CLONE_NEWUSER | flags)
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
        Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")
    if plan.mode != "none" and flags & CLONE_NEWNS:
        return _cover(lay, workdir, size_mb)
    return []


def _cover(lay: Layout, workdir: str | None, size_mb: int) -> list[str]:
    """Cover ``lay.hide`` (an empty read-only tmpfs each) and ``lay.hide_files`` (/dev/null),
    replace ``lay.scratch`` with a fresh tmpfs (``size_mb`` each), bind ``lay.keep`` back
    read-only and ``workdir`` read-write, then cover again the hidden paths nested in what
    was bound back. Mounts stay in this namespace (made private first). What is hidden."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    binds = [*lay.keep, *([workdir] if workdir else [])]
    fds = {p: os.open(p, os.O_PATH | os.O_CLOEXEC) for p in binds}  # before they are covered
    top = _top_level(lay.hide)
    covers = [d for d in top if not _covered(d, lay.scratch)]  # (under a fresh tmpfs: gone)
    try:
        for d in lay.scratch:
            _mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV,
                   f"size={size_mb}m,nr_inodes={max(size_mb * 64, 1024)},mode=1777")  # fmt: skip
        for d in covers:
            _mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,nr_inodes=256,mode=0755")
        for p in sorted(binds):
            target = Path(p)
            if stat.S_ISDIR(os.fstat(fds[p]).st_mode):
                target.mkdir(parents=True, exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.touch()
            _mount(f"/proc/self/fd/{fds[p]}", p, None, MS_BIND | MS_REC)
            if p != workdir:
                _read_only(p)
    finally:
        for fd in fds.values():
            os.close(fd)
    for d in sorted(set(lay.hide) - set(top), key=len):  # nested: bound back with a keep?
        if Path(d).is_dir():
            _mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "size=4k,nr_inodes=16,mode=0755")
            _read_only(d)
    for d in covers:
        _read_only(d)
    for f in lay.hide_files:
        if Path(f).exists():
            _mount(os.devnull, f, None, MS_BIND)
    return [*lay.hide, *lay.hide_files]
