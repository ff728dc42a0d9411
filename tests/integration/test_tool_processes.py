"""Tool processes started by a rollout node (a Ray actor) are cheap: they do not run Ray's
worker script again as their main module (multiprocessing's default for a forkserver child:
0.26 s of CPU and 40 MB each, measured; at 64 agent loops per node that is a tool process per
loop), and they start with the task's module already imported by the forkserver."""

from __future__ import annotations

import sys
from typing import Any


def _child_facts() -> dict[str, Any]:
    main = sys.modules.get("__mp_main__")
    return {
        "mp_main_file": getattr(main, "__file__", None),
        "longtail_imported": "rollcall.tasks.longtail" in sys.modules,
    }


def test_a_tool_process_in_a_node_skips_the_main_module_and_has_the_plugin(
    ray_local: Any,
) -> None:
    class Node:
        def facts(self) -> tuple[dict[str, Any], dict[str, Any]]:
            from rollcall.workers.episode import tools

            tools.preload(
                "rollcall.tasks.longtail"
            )  # as a node does when it admits a longtail episode
            runner = tools.ToolRunner()
            try:
                ok, facts = runner.call_function(_child_facts, (), {}, timeout_s=60)
                assert ok, facts
                return facts, {"main": getattr(sys.modules["__main__"], "__file__", None)}
            finally:
                runner.close()

    node = ray_local.remote(num_cpus=0)(Node).remote()
    child, actor = ray_local.get(node.facts.remote(), timeout=300)
    assert actor["main"] and "ray" in actor["main"]  # the actor's main: Ray's worker script
    assert child["mp_main_file"] is None
    assert child["longtail_imported"] is True
