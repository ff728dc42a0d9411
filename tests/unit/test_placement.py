"""``check_fits``: a job whose slots exceed the Ray cluster's resources is refused with one
sentence naming what is short and the config fields that set it."""

from __future__ import annotations

from typing import Any

import pytest

from rollcall.orchestrator.config import RollcallConfig
from rollcall.orchestrator.errors import UserError
from rollcall.orchestrator.runner.placement import check_fits, rollout_bundle, trainer_bundle


def _cfg(**sections: Any) -> RollcallConfig:
    return RollcallConfig.model_validate(sections)


def _refusal(cfg: RollcallConfig, cluster: dict[str, float], nodes: Any = None) -> str:
    with pytest.raises(UserError) as e:
        check_fits(cfg, cluster, nodes if nodes is not None else [cluster])
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_bundles_are_what_the_actors_ask_for() -> None:
    cfg = _cfg(
        trainer={"device": "cuda", "cpus_per_rank": 4, "resources": {"trainer": 1}},
        rollout={"cpus_per_node": 2, "gpus_per_node": 1, "resources": {"rollout": 1}},
    )
    assert trainer_bundle(cfg) == {"CPU": 4.0, "GPU": 1.0, "trainer": 1.0}
    assert rollout_bundle(cfg) == {"CPU": 2.0, "GPU": 1.0, "rollout": 1.0}
    assert trainer_bundle(_cfg()) == {"CPU": 1.0}  # no GPU key on CPU


def test_the_two_cpu_chaos_run_is_refused_naming_the_fields() -> None:
    # 2 rollout nodes of 1 CPU and a trainer of 1 CPU on a 2-CPU local Ray
    msg = _refusal(_cfg(rollout={"nodes": 2}), {"CPU": 2.0})
    assert msg.startswith("the job needs more than the Ray cluster has: 3 CPU (it has 2;")
    assert "rollout.nodes" in msg and "trainer.cpus_per_rank" in msg and "ray.num_cpus" in msg


def test_missing_gpus_and_custom_resources_are_named() -> None:
    cfg = _cfg(
        ray={"address": "auto"},
        trainer={"device": "cuda", "ranks": 2},
        rollout={"resources": {"rollout": 1}},
    )
    msg = _refusal(cfg, {"CPU": 64.0, "GPU": 1.0})
    assert "2 GPU (it has 1; trainer.ranks (1 GPU each with trainer.device cuda))" in msg
    assert "1 rollout (it has 0; rollout.nodes x rollout.resources.rollout)" in msg
    assert "add nodes to the Ray cluster" in msg and "CPU (" not in msg


def test_a_slot_that_fits_no_single_node_is_refused() -> None:
    two_nodes = [{"CPU": 4.0}, {"CPU": 4.0}]
    fits = _cfg(rollout={"nodes": 2, "cpus_per_node": 3})
    check_fits(fits, {"CPU": 8.0}, two_nodes)  # 1 + 3 + 3 CPUs, each slot on one node
    big = _cfg(trainer={"cpus_per_rank": 5})
    msg = _refusal(big, {"CPU": 8.0}, two_nodes)  # 6 CPUs in all, but 5 on one node
    assert msg.startswith("no Ray node can hold one trainer rank (5 CPU)")
    assert "trainer.cpus_per_rank" in msg
