"""Registration of the drafter architectures with vLLM's model registry.

Called by the `vllm.general_plugins` entry point in every vLLM process. Registrations are lazy
("module:Class" strings) so that importing the plugin stays cheap and survives vLLM's
registry-inspection subprocess.
"""

from __future__ import annotations

from kvshot_vllm.models.registry import KVSHOT_ARCH, STOCK_EAGLE3_ARCH

# architecture name (as written in a checkpoint's config.json) -> "module:Class". The stock
# EAGLE-3 name is taken over by its subclass that checks shipped checkpoints' manifests.
DRAFTER_ARCHITECTURES: dict[str, str] = {
    KVSHOT_ARCH: "kvshot_vllm.serving.drafter:KVShotEagle3LlamaForCausalLM",
    STOCK_EAGLE3_ARCH: "kvshot_vllm.serving.drafter:VerifiedEagle3LlamaForCausalLM",
}


def register_drafters() -> None:
    from vllm import ModelRegistry

    for arch, target in DRAFTER_ARCHITECTURES.items():
        ModelRegistry.register_model(arch, target)
