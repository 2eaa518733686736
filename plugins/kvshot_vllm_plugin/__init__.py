"""vLLM plugin entry point (`vllm.general_plugins`): vLLM calls `register()` in every process
it starts (API server, engine core, workers), so the drafter architectures are known
everywhere. Thin on purpose: the models live in `kvshot_vllm`."""


def register() -> None:
    from kvshot_vllm.serving.registry import register_drafters

    register_drafters()
