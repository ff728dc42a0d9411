"""A multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``) in place of the
session's local Ray, for tests that lose a Ray node; the local Ray is back afterwards."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from tests.conftest import init_local_ray


@contextlib.contextmanager
def ray_cluster(**head_node_args: Any) -> Iterator[Any]:
    """Shut the session's Ray down, start a cluster whose head has ``head_node_args`` (the
    test adds the other nodes), and restore the local Ray when done."""
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args=head_node_args)
    try:
        ray.init(address=c.address, log_to_driver=False, configure_logging=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        os.environ.pop("RAY_ADDRESS", None)
        init_local_ray()
