"""What a running job exposes to the network: every listening socket of a process tree, and
whether a client without credentials is refused on it.

    python ops/listeners.py PID      # the driver's pid (``rollcall run`` / ``quickstart``)

Walks ``PID`` and its descendants (``/proc``: for a local job the GCS, raylet, agents, actors
and their engines are all below the driver), lists each TCP socket in LISTEN, and probes each
one not bound to loopback from this host's own non-loopback address, with no credentials:

- a gRPC call of each of Ray's services (GCS node info, raylet node stats, core worker stats,
  object manager pull): ``UNAUTHENTICATED`` from any of them is a refusal;
- an HTTP ``GET /``: 401 or 403 is a refusal.

A socket on loopback is ``loopback``; a refusal is ``refused``; anything else is ``OPEN`` (its
answer shown). Exit status 1 when any socket is open. ``docs/security.md`` says what a job
listens on and why.
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollcall.orchestrator import procfs, rayauth

# one unary method of each gRPC service Ray serves: a server checks the token only for the
# methods it has (UNIMPLEMENTED otherwise)
RAY_METHODS = (
    rayauth.GCS_NODE_INFO,
    "/ray.rpc.NodeManagerService/GetNodeStats",
    "/ray.rpc.CoreWorkerService/GetCoreWorkerStats",
    "/ray.rpc.ObjectManagerService/Pull",
)


@dataclass(frozen=True)
class Listener:
    pid: int
    process: str
    address: str
    port: int
    verdict: str  # loopback | refused | OPEN
    detail: str

    def line(self) -> str:
        return (
            f"{self.verdict:8} {self.address}:{self.port:<6} pid {self.pid:<7} "
            f"{self.process[:60]}  {self.detail}"
        )


def host_address() -> str:
    """This host's address as another host would reach it (not loopback): the source address
    of a route outwards (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # TEST-NET-1: never reached, only routed
        addr = str(s.getsockname()[0])
    if ipaddress.ip_address(addr).is_loopback:
        raise RuntimeError("this host has no non-loopback address to probe from")
    return addr


def _loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip.split("%")[0]).is_loopback
    except ValueError:
        return False


def probe(host: str, port: int, timeout_s: float = 3.0) -> tuple[str, str]:
    """``(verdict, detail)`` of a client with no credentials at ``host:port``."""
    answers: list[str] = []
    for method in RAY_METHODS:
        name = method.rsplit("/", 1)[1]
        code = rayauth.grpc_status(f"{host}:{port}", method, timeout_s=timeout_s)
        if code == "UNAUTHENTICATED":
            return "refused", f"gRPC {name}: UNAUTHENTICATED"
        if code == "OK":
            answers.append(f"{name}: answered")
        elif code != "UNIMPLEMENTED":
            answers.append(f"gRPC: {code}")
            break  # not a gRPC server (or not answering): try HTTP
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/", timeout=timeout_s) as r:
            answers.append(f"HTTP {r.status}")
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            return "refused", f"HTTP {e.code}"
        answers.append(f"HTTP {e.code}")
    except Exception as e:  # not HTTP
        answers.append(f"HTTP: {type(e).__name__}")
    return "OPEN", "; ".join(answers)


def listeners(pid: int, *, host: str | None = None) -> list[Listener]:
    """Every TCP listening socket of ``pid``'s process tree, probed."""
    found: list[Listener] = []
    seen: set[tuple[str, int]] = set()
    target = host or host_address()
    for p in [pid, *procfs.descendants_of(pid)]:
        for ip, port in procfs.listening(p):
            if (ip, port) in seen:
                continue
            seen.add((ip, port))
            name = procfs.cmdline(p)
            if _loopback(ip):
                verdict, detail = "loopback", ""
            else:
                verdict, detail = probe(target, port)
            if verdict == "OPEN" and (ip, port) not in procfs.listening(p):
                continue  # closed while probed (its process ended): nothing listens there now
            found.append(Listener(p, name, ip, port, verdict, detail))
    return sorted(found, key=lambda x: (x.verdict != "OPEN", x.process, x.port))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pid", type=int, help="the driver's process id")
    args = ap.parse_args(argv)
    found = listeners(args.pid)
    for x in found:
        print(x.line())
    opened = [x for x in found if x.verdict == "OPEN"]
    print(f"{len(found)} listening sockets: {len(opened)} open without credentials")
    return 1 if opened else 0


if __name__ == "__main__":
    sys.exit(main())
