"""The job driver's held-out evaluation: the evaluator actor, the evaluations asked of it and
their results, recorded in the run directory as they come (the learning curve)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from rich.console import Console

from rollcall.orchestrator.config import EvalConfig, RollcallConfig
from rollcall.orchestrator.evalstats import pass_rates
from rollcall.orchestrator.runner.progress import Snapshot
from rollcall.orchestrator.runner.rundir import RunDir
from rollcall.workers.evaluation import EvalTask, evaluator_actor
from rollcall.workers.weights import pin, unpin, unpin_all


def eval_record(step: int, samples: dict[str, list[list[float]]], e: EvalConfig) -> dict[str, Any]:
    """An evaluation's ``metrics.jsonl`` record: the mean per task, each held-out prompt's
    reward (its samples' mean: the intervals and the paired gains are over prompts), and with
    several samples per prompt, pass@k and mean@n per task and the samples themselves."""
    rewards = {task: [sum(rs) / len(rs) for rs in prompts] for task, prompts in samples.items()}
    record: dict[str, Any] = {
        "kind": "eval",
        "step": step,
        "reward": {task: sum(rs) / len(rs) for task, rs in rewards.items() if rs},
        "rewards": rewards,
    }
    if e.samples > 1:
        record["pass"] = {
            task: pass_rates(prompts, e.ks, e.pass_threshold)
            for task, prompts in samples.items()
            if prompts
        }
        record["samples"] = samples
    return record


class Evaluations:
    def __init__(
        self,
        cfg: RollcallConfig,
        run_dir: RunDir,
        *,
        model_dir: Path,
        chat_template: Any,
        console: Console,
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.model_dir = model_dir
        self.chat_template = chat_template
        self.console = console
        self.evaluator: Any = None
        # (step, the evaluation's result ref, its version's folder, pinned till it ends)
        self.pending: list[tuple[int, Any, str | None]] = []
        unpin_all(run_dir.weights)  # pins of a driver that died are nobody's now

    def start(self) -> None:
        """The evaluator asks Ray for no resources (``num_cpus=0``), so it takes no reserved
        slot and always has somewhere to go."""
        if self.cfg.run.eval.episodes == 0:  # no evaluation (e.g. a benchmark's timing model)
            return
        r = self.cfg.rollout
        self.evaluator = evaluator_actor().remote(
            str(self.model_dir),
            max_tokens_per_turn=r.max_tokens_per_turn,
            max_tokens=r.max_tokens,
            temperature=self.cfg.run.eval.temperature,
            seed=self.cfg.run.seed + 7,
            tool_format=self.cfg.model.tool_format,
            chat_template=self.chat_template,
            tool_sandbox=r.tool_sandbox,
            input_limits=r.input_limits,
        )

    def evaluate(self, step: int, location: str | None) -> None:

        if self.evaluator is None:
            return
        tasks = [EvalTask(t.name, t.plugin, t.spec) for t in self.cfg.tasks]
        e = self.cfg.run.eval
        if location is not None:  # kept past trainer.keep_weights while the evaluator lags
            pin(location)
        ref = self.evaluator.evaluate_samples.remote(tasks, e.episodes, e.samples, step, location)
        self.pending.append((step, ref, location))

    def collect(self, snap: Snapshot, *, block: bool) -> None:
        import ray

        keep = []
        for step, ref, location in self.pending:
            ready, _ = ray.wait([ref], timeout=None if block else 0)
            if not ready:
                keep.append((step, ref, location))
                continue
            if location is not None:
                unpin(location)
            try:
                samples = ray.get(ref)
            except ray.exceptions.RayError as e:
                # evaluation is not the job: a lost evaluator (its machine died) is replaced,
                # and this point of the learning curve is missing
                self.console.print(
                    f"evaluation at step {step} failed ({type(e).__name__}); "
                    "restarting the evaluator",
                    markup=False,
                )
                with contextlib.suppress(Exception):
                    ray.kill(self.evaluator)
                self.start()
                continue
            record = eval_record(step, samples, self.cfg.run.eval)
            self.run_dir.append(record)
            snap.heldout = record["reward"]
        self.pending = keep

    def close(self) -> None:
        import ray

        if self.evaluator is not None:
            ray.kill(self.evaluator)
            self.evaluator = None
        for _, _, location in self.pending:
            if location is not None:
                unpin(location)
        self.pending = []
