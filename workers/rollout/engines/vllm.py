"""The ``vllm`` engine: vLLM's offline ``LLM`` behind the engine protocol (production, GPU).

It is a thin adapter, written against vLLM's documented API and installed with the optional
``rollcall[vllm]`` extra, which only installs on machines with CUDA. Importing this module is
always safe; constructing the engine without vLLM raises ``EngineUnavailable`` with the fix.

- Prompts go in as token ids (``TokensPrompt``), so the trajectory stays token-in/token-out.
- Log-probs: ``logprobs_mode="processed_logprobs"`` with ``logprobs=0`` returns the log-prob of
  each sampled token under the distribution it was sampled from (after temperature), the
  behaviour log-probs the GRPO loss corrects against; no top-k/top-p is set.
- ``enable_prefix_caching`` keeps the KV cache of a trajectory's earlier turns between turns;
  ``enable_chunked_prefill`` and ``gpu_memory_utilization`` come from the config.
- Weights of a version are loaded from a published ``save_pretrained`` folder by a worker
  extension (``RollcallWorkerExtension``) through ``LLM.collective_rpc``, between generate calls.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workers.rollout.engines.base import EngineHealth, Generation, GenerationRequest


class EngineUnavailable(RuntimeError):
    pass


class RollcallWorkerExtension:
    """Mixed into vLLM's GPU workers (``worker_extension_cls``): load published weights."""

    model_runner: Any

    def rollcall_load_weights(self, location: str) -> int:
        from safetensors.torch import load_file

        state = load_file(str(Path(location) / "model.safetensors"), device="cpu")
        self.model_runner.model.load_weights(weights=iter(state.items()))
        return len(state)


class VLLMEngine:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        gpu_memory_utilization: float = 0.85,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        max_model_len: int | None = None,
        version: int = 0,
        seed: int = 0,
    ) -> None:
        try:
            import vllm
        except ImportError:
            raise EngineUnavailable(
                "the vllm engine needs vLLM, which installs only on machines with a CUDA GPU: "
                "pip install 'rollcall[vllm]', or use engine kind 'hf'"
            ) from None
        self._vllm = vllm
        self.llm = vllm.LLM(
            model=str(model_dir),
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            max_model_len=max_model_len,
            seed=seed,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.RollcallWorkerExtension",
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.eos_id = int(self.tokenizer.eos_token_id)
        self._version = version
        self._tokens = 0
        self._requests = 0

    @property
    def version(self) -> int:
        return self._version

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        version = self._version
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        params = [
            SamplingParams(
                temperature=r.temperature,
                max_tokens=r.max_new_tokens,
                logprobs=0,
                stop_token_ids=[self.eos_id],
                detokenize=False,
            )
            for r in requests
        ]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        gens = []
        for out in outputs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            lps = [float(step[tok].logprob) for step, tok in zip(c.logprobs, ids, strict=True)]
            reason = "stop" if c.finish_reason == "stop" else "length"
            gens.append(Generation(ids, lps, reason, version))
            self._tokens += len(ids)
        self._requests += len(requests)
        return gens

    def load_weights(self, version: int, location: str) -> None:
        self.llm.collective_rpc("rollcall_load_weights", args=(location,))
        self._version = version

    def health(self) -> EngineHealth:
        return EngineHealth(self._version, self._tokens, self._requests)
