"""The job driver's Ray: join the configured cluster or start a local Ray, and reserve the
job's slots (placement groups, ``orchestrator/runner/placement.py``) before anything starts."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console

from rollcall.orchestrator import rayauth
from rollcall.orchestrator.config import RayConfig, RollcallConfig
from rollcall.orchestrator.errors import UserError
from rollcall.orchestrator.runner import raylog, raynodes
from rollcall.orchestrator.runner.placement import group_state
from rollcall.orchestrator.runner.placement import reserve as reserve_slots


def local_env(cfg: RayConfig) -> dict[str, str]:
    """The environment a local Ray starts with (``ray.init`` reads it, and its raylet and
    workers inherit it): its workers at niceness 0, and its own log files (raylet, GCS, each
    worker's output under /tmp/ray/session_*/logs) rotated at ``ray.log_max_mb`` with
    ``ray.log_backups`` older files kept (Ray's default: 512 MB and 5 per file). Each is a
    default: an operator's value in the environment wins."""
    return {
        # Ray starts its workers at niceness 15 by default: beside ordinary work (nice 0)
        # on a busy machine the job's own actors would get next to no CPU, and heartbeats,
        # starts and steps would stall. The job is the machine's work: run them at 0.
        "RAY_worker_niceness": "0",
        "RAY_ROTATION_MAX_BYTES": str(cfg.log_max_mb * 1_000_000),
        "RAY_ROTATION_BACKUP_COUNT": str(cfg.log_backups),
    }


@contextlib.contextmanager
def environment_defaults(env: dict[str, str]) -> Iterator[None]:
    """``env``'s variables that the environment lacks, set for the block and removed after it
    (a later local Ray in this process reads its own config's)."""
    added = {k: v for k, v in env.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def start(cfg: RollcallConfig, home: Path, console: Console) -> tuple[bool, Callable[[], None]]:
    """The driver's Ray (``init_ray``), its messages routed to driver.log: whether this
    process started a local Ray, and the function that gives its messages back."""
    import ray

    first = not ray.is_initialized()
    started = init_ray(cfg, home, console)
    if started:
        rayauth.stop_monitor()
    # the cluster's error paragraphs too ("(raylet) A worker died ..."): rollcall says in one
    # line what happened to its actor
    release = raylog.route_to_log()
    if first:
        # Ray's logger does not propagate, and with configure_logging=False it has no handler:
        # Python's last resort would print its warnings on the terminal. Up to the root logger
        # they go to driver.log (RunDir.capture_logs).
        logging.getLogger("ray").propagate = True
    return started, release


def init_ray(cfg: RollcallConfig, home: Path, console: Console) -> bool:
    """Join ``ray.address``'s cluster, or start a new local Ray when none is set and this
    process has none yet. Returns whether this process started a local Ray (it stops the
    local Ray's autoscaler monitor, ``rayauth.stop_monitor``, and shuts Ray down when the job
    ends)."""
    import ray

    if not ray.is_initialized() and cfg.ray.address:
        # the actors' output stays in Ray's session logs; Ray's own log records go to
        # driver.log (configure_logging=False: no handler of Ray's on the terminal). The
        # cluster's token comes from the operator's environment (ops/deploy/ray-start.md).
        rayauth.configure_cluster()
        why = rayauth.refusal(None, cfg.ray.address)
        if why is not None:  # at once, not after Ray's 20 s of retries
            raise UserError(why)
        try:
            ray.init(address=cfg.ray.address, log_to_driver=False, configure_logging=False)
        except Exception as e:
            why = rayauth.refusal(e, cfg.ray.address)
            if why is None:
                raise
            raise UserError(why) from None
    elif not ray.is_initialized():
        # Ray's ports listen on every interface: token authentication, with a token of
        # this ROLLCALL_HOME's (docs/security.md)
        warning = rayauth.configure_local(home)
        if warning:
            console.print(warning, markup=False)
        # log_to_driver=False: the actors' stdout and stderr stay in Ray's session logs
        # (/tmp/ray/session_*/logs; sessionlogs.py prunes the exited workers'); their errors
        # reach the driver as exceptions of the calls. The raylet's own error messages
        # ("(raylet) A worker died ...") are printed whatever the options: raylog sends them
        # to driver.log.
        with environment_defaults(local_env(cfg.ray)):
            ray.init(
                address="local",  # a new local Ray, never one left behind by `ray start`
                num_cpus=cfg.ray.num_cpus,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
        return True
    return False


def reserve(cfg: RollcallConfig, console: Console) -> Any:
    """Reserve every trainer rank's and rollout node's slot before starting any (placement
    groups, ``orchestrator/runner/placement.py``); a job the cluster cannot hold is refused
    with one sentence, before the job writes anything."""
    placement = reserve_slots(cfg, timeout_s=cfg.ray.placement_timeout_s)
    console.print(placed(placement), markup=False)
    return placement


def placed(p: Any) -> str:
    """One line: which Ray node holds the trainer's and each rollout slot's bundles."""
    table = raynodes.nodes()
    where: dict[str, list[str]] = {}
    for name, group in [("trainer", p.group)] + [
        (f"rollout-{i}", g) for i, g in enumerate(p.slots)
    ]:
        node = group_state(group)[1]
        where.setdefault(raynodes.host(table, node), []).append(name)
    return "placed: " + "; ".join(f"{', '.join(v)} on {k}" for k, v in where.items())


def gcs_address() -> str | None:
    import ray

    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:  # only informs operators' commands
        return None
