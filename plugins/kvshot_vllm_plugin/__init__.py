"""vLLM plugin entry point (`vllm.general_plugins`): vLLM calls `register()` in every process
it starts (API server, engine core, workers), so the drafter architectures are known
everywhere, and the workaround of `kvshot_vllm.serving.cpu_fixes` is in place before vLLM's CPU
platform registers its kernels. Thin on purpose: the models live in `kvshot_vllm`."""


def register() -> None:
    from kvshot_vllm.serving import cpu_fixes
    from kvshot_vllm.serving.registry import register_drafters

    cpu_fixes.apply()
    register_drafters()
