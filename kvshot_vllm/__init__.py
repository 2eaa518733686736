"""kvshot-vllm: speculative-decoding drafters that reuse the target's KV cache in vLLM."""

__version__ = "0.1.0"
