"""Inference engines behind one protocol (``rollcall.workers.episode.engine.Engine``): ``hf``
(transformers, CPU or GPU) and, in the optional ``vllm`` extra, vLLM."""
