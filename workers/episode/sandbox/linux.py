"""The kernel's interface the sandbox uses (through ``ctypes``: ``unshare``, ``mount``, ``prctl``,
``capset``), and small process and file-descriptor helpers. Standard library only."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
from pathlib import Path

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
_FLAG_NAMES = {
    CLONE_NEWUSER: "CLONE_NEWUSER",
    CLONE_NEWNET: "CLONE_NEWNET",
    CLONE_NEWNS: "CLONE_NEWNS",
    CLONE_NEWPID: "CLONE_NEWPID",
    CLONE_NEWIPC: "CLONE_NEWIPC",
}
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME = 32, 1024, 2048
MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 4096, 16384, 1 << 18, 1 << 21
# the flags of a mount that a read-only remount keeps (a user namespace may not drop them)
_KEPT_FLAGS = (
    (os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
    (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME),
)  # fmt: skip
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]  # fmt: skip
_libc.unshare.argtypes = [ctypes.c_int]
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                        ctypes.c_ulong]  # fmt: skip


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]  # fmt: skip


def _drop_bounding_set() -> None:
    """Drop every capability from the bounding set (needs CAP_SETPCAP; EINVAL: past the last
    capability this kernel has)."""
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            e = ctypes.get_errno()
            if e == errno.EINVAL:
                break
            raise OSError(e, f"prctl(PR_CAPBSET_DROP, {cap}): {os.strerror(e)}")


def _drop_capabilities() -> None:
    """Empty the effective, permitted and inheritable sets (and so the ambient one)."""
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if _libc.capset(ctypes.byref(header), data) != 0:
        _raise("capset")


def _read_only(path: str) -> None:
    """Remount ``path`` read-only, keeping the flags a user namespace may not drop; left as it
    is where the kernel refuses."""
    f = os.statvfs(path).f_flag
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY
    for st_flag, ms_flag in _KEPT_FLAGS:
        if f & st_flag:
            flags |= ms_flag
    with contextlib.suppress(OSError):
        _mount(None, path, None, flags)


def _unshare(flags: int) -> None:
    if _libc.unshare(flags) != 0:
        names = "|".join(n for f, n in _FLAG_NAMES.items() if f & flags)
        _raise(f"unshare({names})")


def _setns(fd: int, nstype: int) -> None:
    if _libc.setns(fd, nstype) != 0:
        _raise(f"setns({_FLAG_NAMES.get(nstype, nstype)})")


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    rc = _libc.mount(
        src.encode() if src else None,
        target.encode(),
        fstype.encode() if fstype else None,
        flags,
        data.encode() if data else None,
    )
    if rc != 0:
        _raise(f"mount {src} on {target}" if src else f"mount on {target}")


def _prctl(option: int, value: int) -> None:
    if _libc.prctl(option, value, 0, 0, 0) != 0:
        _raise(f"prctl({option})")


def _raise(step: str) -> None:
    e = ctypes.get_errno()
    raise OSError(e, f"{step}: {os.strerror(e)}")


def _oserror(e: BaseException) -> str:
    """``EPERM: unshare(CLONE_NEWUSER|CLONE_NEWNET): Operation not permitted``."""
    if isinstance(e, OSError) and e.errno is not None:
        where = f" ({e.filename})" if e.filename else ""
        return f"{errno.errorcode.get(e.errno, str(e.errno))}: {e.strerror}{where}"
    return f"{type(e).__name__}: {e}"


def _processes_of(uid: int) -> int:
    n = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                n += entry.stat().st_uid == uid
    return n


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
