"""Inference engines behind one protocol (``base.Engine``): ``hf`` (transformers, CPU or GPU)
and, in the optional ``vllm`` extra, vLLM."""
