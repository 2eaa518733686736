"""The vLLM side: drafter models, the attention backend that serves the verified prefix, and
their registration. The only place in kvshot_vllm that imports vLLM internals."""
