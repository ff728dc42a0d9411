"""A seccomp filter for the tool process (level ``sandbox``): a classic BPF program, built here
by hand, that denies what a container's default profile denies (Docker's, roughly): new
namespaces (``unshare``, and ``clone`` with a ``CLONE_NEW*`` flag; ``clone3``, whose flags are
behind a pointer, answers ENOSYS so that glibc falls back to ``clone``), ``setns``, io_uring,
``socket(AF_VSOCK)``, the kernel keyring, ``bpf``, tracing and other processes' memory, kernel
modules, ``kexec``, mounting, swap, reboot, the clocks, ``userfaultfd``, file handles and a few
obsolete or privileged calls (``DENIED``). Everything else is allowed. Only for x86_64 (its
64-bit ABI; the i386 and x32 ABIs are denied whole); elsewhere ``available`` says why not and no
filter is installed. Standard library only (``ctypes``)."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
import sys
from typing import Any

from .linux import _libc

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000

CLONE_NEWTIME = 0x00000080  # (unshare only: in clone's flags this byte is the exit signal)
CLONE_NEW = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
AF_VSOCK = 40

# classic BPF
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]
_NR, _ARCH, _ARG0_LOW = 0, 4, 16

# x86_64 system call numbers (arch/x86/entry/syscalls/syscall_64.tbl)
CLONE, SOCKET, UNSHARE, CLONE3 = 56, 41, 272, 435
DENIED: dict[str, int] = {
    "setns": 308, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321, "ptrace": 101,
    "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "pidfd_getfd": 438,
    "perf_event_open": 298, "kexec_load": 246, "kexec_file_load": 320, "init_module": 175,
    "finit_module": 313, "delete_module": 176, "create_module": 174, "get_kernel_syms": 177,
    "query_module": 178, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
    "fspick": 433, "mount_setattr": 442, "open_tree_attr": 467, "swapon": 167, "swapoff": 168,
    "reboot": 169, "acct": 163, "settimeofday": 164, "clock_settime": 227,
    "clock_adjtime": 305, "adjtimex": 159, "sethostname": 170, "setdomainname": 171,
    "userfaultfd": 323, "open_by_handle_at": 304, "name_to_handle_at": 303,
    "lookup_dcookie": 212, "quotactl": 179, "quotactl_fd": 443, "syslog": 103, "vhangup": 153,
    "fanotify_init": 300, "iopl": 172, "ioperm": 173, "uselib": 134, "nfsservctl": 180,
    "_sysctl": 156, "afs_syscall": 183, "tuxcall": 184, "security": 185, "vserver": 236,
}  # fmt: skip


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]  # fmt: skip


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def available() -> str:
    """ "" if a filter can be made for this machine's ABI; else why not."""
    machine = platform.machine()
    if sys.platform != "linux" or machine != "x86_64" or struct.calcsize("P") != 8:
        return f"no seccomp filter for {sys.platform}/{machine} (x86_64 only)"
    return ""


def program() -> list[tuple[int, int, int, int]]:
    """The filter, as (code, jt, jf, k) instructions."""
    eperm = SECCOMP_RET_ERRNO | errno.EPERM
    enosys = SECCOMP_RET_ERRNO | errno.ENOSYS
    # the checks, then their targets: ALLOW, EPERM, ENOSYS (labels resolved below)
    code: list[tuple[int, str | int, str | int, int]] = [
        (_LD_W_ABS, 0, 0, _ARCH),
        (_JEQ_K, 0, "enosys", AUDIT_ARCH_X86_64),  # i386 (int 0x80) and any other: none
        (_LD_W_ABS, 0, 0, _NR),
        (_JGE_K, "enosys", 0, X32_SYSCALL_BIT),  # the x32 ABI
        (_JEQ_K, "clone", 0, CLONE),
        (_JEQ_K, "unshare", 0, UNSHARE),
        (_JEQ_K, "socket", 0, SOCKET),
        (_JEQ_K, "enosys", 0, CLONE3),
        *((_JEQ_K, "eperm", 0, nr) for nr in sorted(DENIED.values())),
        (_RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ]
    labels: dict[str, int] = {}
    tail: list[tuple[int, str | int, str | int, int]] = []

    def label(name: str, *insns: tuple[int, str | int, str | int, int]) -> None:
        labels[name] = len(code) + len(tail)
        tail.extend(insns)

    label("clone", (_LD_W_ABS, 0, 0, _ARG0_LOW), (_JSET_K, "eperm", "allow", CLONE_NEW))
    label("unshare", (_LD_W_ABS, 0, 0, _ARG0_LOW),
          (_JSET_K, "eperm", "allow", CLONE_NEW | CLONE_NEWTIME))  # fmt: skip
    label("socket", (_LD_W_ABS, 0, 0, _ARG0_LOW), (_JEQ_K, "eperm", "allow", AF_VSOCK))
    label("allow", (_RET_K, 0, 0, SECCOMP_RET_ALLOW))
    label("eperm", (_RET_K, 0, 0, eperm))
    label("enosys", (_RET_K, 0, 0, enosys))
    out = []
    for i, (op, jt, jf, k) in enumerate([*code, *tail]):

        def to(j: str | int, i: int = i) -> int:
            if isinstance(j, int):
                return j
            off = labels[j] - i - 1
            assert 0 <= off < 256, (j, off)
            return off

        out.append((op, to(jt), to(jf), k))
    return out


_compiled: list[Any] = []  # [the sock_fprog, its array]: built once (``prepare``)


def prepare() -> None:
    """Build the filter's program in this process, so that the processes it forks install it
    without building it (each call's process would otherwise, at its CPU's expense)."""
    if not _compiled:
        insns = program()
        array = (_SockFilter * len(insns))(*(_SockFilter(*i) for i in insns))
        _compiled.extend((_SockFprog(len(insns), array), array))


def install() -> None:
    """Install the filter in this process (and so its future children): after
    ``PR_SET_NO_NEW_PRIVS``, single-threaded. OSError if the kernel refuses."""
    prepare()
    prog = _compiled[0]
    if _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"prctl(PR_SET_SECCOMP): {os.strerror(e)}")


def try_here() -> str:
    """In a forked child (the probe's): install the filter and check that it denies
    ``unshare(CLONE_NEWUSER)`` and still lets a thread start. "" if it works; else why not."""
    if why := available():
        return why
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - a child
        said = b"the filter's check failed"
        try:
            os.close(r)
            _libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
            install()
            said = _check()
        except BaseException as e:
            said = f"{type(e).__name__}: {e}".encode()
        finally:
            os.write(w, said)
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 4096):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return data.decode(errors="replace") if data != b"ok" else ""


def _check() -> bytes:  # pragma: no cover - in the probe's child
    import threading

    if _libc.unshare(0x10000000) == 0 or ctypes.get_errno() != errno.EPERM:
        return b"the filter let unshare(CLONE_NEWUSER) through"
    done: list[int] = []
    t = threading.Thread(target=lambda: done.append(1))
    t.start()
    t.join()
    return b"ok" if done else b"a thread did not run under the filter"
