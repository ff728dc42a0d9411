"""Ray's token authentication for rollcall's jobs (docs/security.md).

Ray 2.60 cannot keep its ports on loopback: its gRPC servers (GCS, raylet, object manager, every
worker and driver) bind every interface, and ``ray.init`` replaces a loopback node address with
a reachable one. What it does offer for all of them is token authentication
(``RAY_AUTH_MODE=token``): every gRPC call and the runtime-env agent's HTTP need the cluster's
token, and a client without it is refused (``UNAUTHENTICATED``, 401). So a rollcall job runs Ray
with a token:

- a local job (``ray.address`` unset) generates one into ``ROLLCALL_HOME/ray_token`` (mode
  0600, once) and points Ray at it (``RAY_AUTH_TOKEN_PATH``), unless the operator's environment
  names a token already (``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH``);
- a job on a cluster uses the cluster's token from the operator's environment
  (``ops/deploy/ray-start.md``), as ``ray start`` did;
- ``RAY_AUTH_MODE=disabled`` set by the operator is respected, and said on the terminal.

The token is read from its file by Ray's processes; it is never put in an environment variable,
a log line or a file of rollcall's (the tool sandbox strips ``RAY_*`` from tools' environment).
Ray's autoscaler monitor, which a local ``ray.init`` starts, serves its Prometheus metrics on
all interfaces without authentication; a local job has no autoscaler, so it is stopped.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import tempfile
from pathlib import Path

from rollcall.orchestrator.errors import UserError
from rollcall.orchestrator.settings import ENV_HOME, rollcall_home

MODE_VAR = "RAY_AUTH_MODE"
TOKEN_VAR = "RAY_AUTH_TOKEN"
TOKEN_PATH_VAR = "RAY_AUTH_TOKEN_PATH"
TOKEN_FILE = "ray_token"
GCS_NODE_INFO = "/ray.rpc.NodeInfoGcsService/GetAllNodeInfo"  # a call every GCS serves


def token_path(home: str | Path | None = None) -> Path:
    """Where a local job's Ray token lives: ``ROLLCALL_HOME/ray_token``."""
    return rollcall_home(home) / TOKEN_FILE


def ensure_token(path: Path) -> Path:
    """The token file at ``path``, created (64 hex digits, mode 0600) if missing; an existing
    one readable by others is refused. Written whole to a private temporary file, then linked
    into place: a job starting beside this one reads either no file or the whole token."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        fd, tmp = tempfile.mkstemp(prefix=".ray_token-", dir=path.parent)  # mode 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
            with contextlib.suppress(FileExistsError):  # another job made it first: theirs
                Path(path).hardlink_to(tmp)
        finally:
            Path(tmp).unlink()
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise UserError(
            f"the Ray token {path} is readable by others (mode {mode:o}); make it private "
            f"(chmod 600 {path}) or remove it to have a new one made"
        )
    if not path.read_text().strip():
        raise UserError(f"the Ray token {path} is empty; remove it to have a new one made")
    return path


def configure_local(home: str | Path | None = None) -> str:
    """Set this process's environment (inherited by the Ray it starts) for a local job: token
    authentication with ``ROLLCALL_HOME/ray_token``. Returns a line for the terminal when
    authentication is off (the operator's ``RAY_AUTH_MODE=disabled``), else ``""``."""
    mode = os.environ.get(MODE_VAR, "").lower()
    if mode == "disabled":
        return (
            "Ray token authentication is off (RAY_AUTH_MODE=disabled): anyone who reaches this "
            "machine's Ray ports can run code in the job (docs/security.md)"
        )
    if not os.environ.get(TOKEN_VAR) and not os.environ.get(TOKEN_PATH_VAR):
        os.environ[TOKEN_PATH_VAR] = str(ensure_token(token_path(home)))
    os.environ[MODE_VAR] = "token"
    # the job's home, as its actors see it: the tool sandbox hides it from tools
    os.environ[ENV_HOME] = str(rollcall_home(home).resolve())
    _refresh()
    return ""


def configure_cluster() -> None:
    """For a job on a cluster: the operator's token (``RAY_AUTH_TOKEN``,
    ``RAY_AUTH_TOKEN_PATH``, or Ray's ``~/.ray/auth_token``) turns token mode on when
    ``RAY_AUTH_MODE`` is unset, as ``ray start`` does with it."""
    if os.environ.get(MODE_VAR):
        _refresh()
        return
    default = Path.home() / ".ray" / "auth_token"
    if os.environ.get(TOKEN_VAR) or os.environ.get(TOKEN_PATH_VAR) or default.exists():
        os.environ[MODE_VAR] = "token"
        _refresh()


def configure_client(home: str | Path | None = None) -> None:
    """For a rollcall command that talks to a job's Ray (``node list``, drills): the operator's
    token if the environment names one, else the local jobs' token when it exists."""
    mode = os.environ.get(MODE_VAR, "").lower()
    if mode == "disabled":
        return
    if not os.environ.get(TOKEN_VAR) and not os.environ.get(TOKEN_PATH_VAR):
        path = token_path(home)
        if not path.exists():
            return  # Ray's own default (~/.ray/auth_token when there is one)
        os.environ[TOKEN_PATH_VAR] = str(path)
    os.environ[MODE_VAR] = "token"
    _refresh()


def _refresh() -> None:
    """Have an already imported Ray read the mode and token again (it reads them when first
    imported; Ray's own ``ray.init`` refreshes the same way when it turns token mode on)."""
    import sys

    if "ray" not in sys.modules:
        return
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def refusal(error: BaseException | None, address: str) -> str | None:
    """One sentence for a connection to a cluster refused for want of the right token; None
    when the cluster takes this process's token (or wants none, or cannot be asked). Ray
    itself says only that it could not connect, after about 20 s of retries: ``check`` asks
    the cluster's GCS directly, before ``ray.init``."""
    text = f"{type(error).__name__}: {error}" if error is not None else ""
    mine = own_token()
    if not (
        "AuthenticationError" in text or "InvalidAuthToken" in text or wants_token(address, mine)
    ):
        return None
    if os.environ.get(MODE_VAR, "").lower() != "token":
        have = f"{MODE_VAR} is not token here"
    elif mine is None:
        have = "this process has no token"
    elif os.environ.get(TOKEN_VAR):
        have = f"the token in {TOKEN_VAR} is not the cluster's"
    else:
        where = os.environ.get(TOKEN_PATH_VAR) or str(Path.home() / ".ray" / "auth_token")
        have = f"the token in {where} is not the cluster's"
    return (
        f"the Ray cluster at {address} refused rollcall's connection: its token "
        f"authentication is on and {have}; set {MODE_VAR}=token and {TOKEN_PATH_VAR}=FILE "
        "(the cluster's token, ops/deploy/ray-start.md)"
    )


def own_token() -> str | None:
    """The token this process would present (token mode only): ``RAY_AUTH_TOKEN``, else the
    file at ``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``, as Ray looks for it."""
    if os.environ.get(MODE_VAR, "").lower() != "token":
        return None
    if os.environ.get(TOKEN_VAR):
        return os.environ[TOKEN_VAR].strip()
    path = Path(os.environ.get(TOKEN_PATH_VAR) or Path.home() / ".ray" / "auth_token")
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def grpc_status(address: str, method: str, token: str | None = None, timeout_s: float = 5.0) -> str:
    """The gRPC status name an empty call of ``method`` at ``HOST:PORT`` ends with, carrying
    ``token`` (or no credentials): ``OK``, ``UNAUTHENTICATED``, ``UNIMPLEMENTED``,
    ``UNAVAILABLE`` (nothing there, or not gRPC), ..."""
    import grpc

    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(
            method, request_serializer=lambda x: x, response_deserializer=lambda x: x
        )
        try:
            call(b"", timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as e:
            return str(e.code().name)
    return "OK"


def wants_token(address: str, token: str | None = None, timeout_s: float = 5.0) -> bool:
    """Whether the GCS at ``HOST:PORT`` refuses a call carrying ``token`` (or none): False
    when it takes it, or cannot be asked (another address form, nothing there)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in host:
        return False
    try:
        code = grpc_status(address, GCS_NODE_INFO, token, timeout_s)
    except Exception:
        return False
    return code == "UNAUTHENTICATED"


def stop_monitor() -> bool:
    """Stop the autoscaler monitor a local ``ray.init`` started (its metrics port listens on
    every interface without authentication, and a local job has no autoscaler). True when one
    was stopped."""
    from ray._private import worker

    node = getattr(worker, "_global_node", None)
    if node is None or "monitor" not in getattr(node, "all_processes", {}):
        return False
    node.kill_monitor(check_alive=False)
    return True
