"""``rollcall rollout``: run episodes without a job, for operators to inspect."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from rollcall.orchestrator.cli.common import console, print_json
from rollcall.orchestrator.errors import UserError
from rollcall.orchestrator.settings import rollcall_home

app = typer.Typer(help="Rollouts outside a job.", no_args_is_help=True)


def _turns(tokenizer: Any, t: Any) -> list[dict[str, Any]]:
    """Split a trajectory into turns: generated tokens (trained on), then the observation."""
    out = []
    bounds = [*t.turn_offsets, len(t.token_ids)]
    for k, start in enumerate(t.turn_offsets):
        end = bounds[k + 1]
        gen_end = start
        while gen_end < end and t.loss_mask[gen_end] == 1:
            gen_end += 1
        out.append(
            {
                "version": t.turn_versions[k],
                "generated": tokenizer.decode(t.token_ids[start:gen_end]),
                "generated_tokens": gen_end - start,
                "observation": tokenizer.decode(t.token_ids[gen_end:end]),
                "observation_tokens": end - gen_end,
            }
        )
    return out


def _model_dir(ctx: typer.Context, model: str) -> Path:
    """``--model``: a built-in model's folder (put in place on first use, as a job would), or
    the folder given."""
    from rollcall.orchestrator.cli.common import err_console, options
    from rollcall.orchestrator.cli.run import builtin_model
    from rollcall.orchestrator.config import BUILTIN_MODELS

    if model in BUILTIN_MODELS:
        return builtin_model(model, rollcall_home(options(ctx).home), err_console())
    path = Path(model).expanduser()
    if not (path / "config.json").exists():
        raise UserError(
            f"--model {model} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) nor a "
            "folder holding a model (config.json missing); build one with `rollcall model init`"
        )
    return path


@app.command()
def preview(
    ctx: typer.Context,
    task: Annotated[str, typer.Option("--task", help="Registered plugin name.")],
    model: Annotated[
        str,
        typer.Option(
            "--model",
            help="A built-in model (tiny, smollm2-135m; put in ROLLCALL_HOME/models on first "
            "use) or a model folder (save_pretrained; ./tiny for a folder named tiny).",
        ),
    ] = "tiny",
    n: Annotated[int, typer.Option("-n", help="Episodes.")] = 3,
    temperature: Annotated[float, typer.Option(help="Sampling temperature.")] = 1.0,
    max_tokens_per_turn: Annotated[int, typer.Option(help="Tokens per generated turn.")] = 64,
    held_out: Annotated[bool, typer.Option("--held-out", help="Use held-out prompts.")] = False,
    spec: Annotated[
        Path | None, typer.Option("--spec", help="Task spec YAML.", show_default=False)
    ] = None,
    tool_format: Annotated[
        str,
        typer.Option(help="Tool-call format: auto, hermes, json or rollcall."),
    ] = "auto",
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Run N episodes of a task and show each turn, what is trained on, tool calls and rewards.

    No job and no database: each turn's generated text (trained on), the tool observations
    (not trained on), the answer and the reward."""
    from rollcall.orchestrator import bounds
    from rollcall.orchestrator.config import read_yaml_mapping
    from rollcall.orchestrator.services.tasks import resolve_plugin, validate_spec
    from rollcall.tasks import registry

    bounds.PREVIEW_EPISODES.check("-n", n)
    bounds.TEMPERATURE.check("--temperature", temperature)
    bounds.tokens(1).check("--max-tokens-per-turn", max_tokens_per_turn)
    resolve_plugin(task)
    model_dir = _model_dir(ctx, model)
    plugin = registry.get(task)
    spec_data = validate_spec(
        task, read_yaml_mapping(spec, "spec") if spec else {}, str(spec or "spec")
    )
    task_spec = plugin.Spec.model_validate(spec_data)

    from rollcall.workers.episode.chat import Chat, ChatTemplateError
    from rollcall.workers.episode.play import player
    from rollcall.workers.episode.toolcalls import FORMATS
    from rollcall.workers.episode.tools import ToolRunner
    from rollcall.workers.episode.trajectory import Limits
    from rollcall.workers.episode.usercode import UserCodeError
    from rollcall.workers.rollout.engines.hf import HFEngine

    if tool_format != "auto" and tool_format not in FORMATS:
        raise UserError(
            f"--tool-format {tool_format!r} is not a format; use auto, {', '.join(FORMATS)}"
        )
    engine = HFEngine(model_dir)
    try:
        chat = Chat(engine.tokenizer, tool_format=tool_format)
    except ChatTemplateError as e:
        raise UserError(f"--model {model_dir}: {e}") from None
    limits = Limits(
        max_turns=task_spec.max_turns,
        max_tokens_per_turn=max_tokens_per_turn,
        temperature=temperature,
    )
    episodes: list[dict[str, Any]] = []
    with ToolRunner() as runner:
        for i in range(n):
            prompt = plugin.eval_prompt(task_spec, i) if held_out else plugin.prompt(task_spec, i)
            try:
                outcome = player(engine, chat, plugin, task_spec, prompt, runner, limits).run()
            except UserCodeError as e:  # the task's code failed on this prompt: shown, go on
                episodes.append({"prompt": prompt, **e.payload()})
                continue
            t = outcome.trajectory
            episodes.append(
                {
                    "prompt": prompt,
                    "instructions": plugin.instructions(task_spec, prompt),
                    "turns": _turns(engine.tokenizer, t),
                    "answer": t.answer,
                    "stop_reason": t.stop_reason,
                    "reward": outcome.reward,
                    "tokens": len(t.token_ids),
                    "trained_tokens": sum(t.loss_mask),
                }
            )
    if json_out:
        print_json(episodes)
        return
    out = console()
    for i, ep in enumerate(episodes):
        if "error" in ep:
            out.rule(f"episode {i}: failed in the task's code")
            out.print(f"{ep['error']} ({ep['location']})", markup=False, style="red")
            out.print(ep["traceback"], markup=False, style="dim")
            continue
        out.rule(f"episode {i}: reward {ep['reward']:.3f} ({ep['stop_reason']})")
        out.print(ep["instructions"], markup=False, style="dim")
        for k, turn in enumerate(ep["turns"]):
            trained = turn["generated_tokens"]
            out.print(
                f"[bold]turn {k}[/] (version {turn['version']}, {trained} tokens trained on):"
            )
            out.print(turn["generated"], markup=False, style="green")
            if turn["observation_tokens"]:
                out.print(
                    f"  observation ({turn['observation_tokens']} tokens, not trained on):",
                    style="dim",
                )
                out.print(turn["observation"].strip(), markup=False, style="yellow")
        out.print(
            f"answer: {ep['answer']!r}; {ep['trained_tokens']}/{ep['tokens']} tokens trained on",
            markup=False,
        )
