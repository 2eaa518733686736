"""The drafter paradigms, each defined and registered by its own module (`@register_paradigm`).

A paradigm's entry says what it is, so that the config's choices, `build_drafter`, the CLI, the
serving checks, the bench and the tests' parameter lists all derive from one place: adding a
paradigm is one module and its registration (docs/adding_a_paradigm.md). The registry imports
the paradigm modules by name on first use, never at import time, and imports no model module
itself: `config.py` imports it, and every paradigm module imports `config.py`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from kvshot_vllm.errors import KVShotError

if TYPE_CHECKING:
    from kvshot_vllm.models.drafter import DraftLayers

# Architecture names in a checkpoint's config.json: vLLM's own EAGLE-3 one, and the plugin's.
STOCK_EAGLE3_ARCH = "Eagle3LlamaForCausalLM"
KVSHOT_ARCH = "KVShotLlamaEagle3"

# The modules whose import registers the built-in paradigms, in the order they are listed.
PARADIGM_MODULES = ("kvshot_vllm.models.hidden", "kvshot_vllm.models.kv_only",
                    "kvshot_vllm.models.hybrid", "kvshot_vllm.models.block")


@dataclass(frozen=True)
class Paradigm:
    name: str
    definition: "DraftLayers"  # its layers and their math, run in training and in vLLM
    # attends the target's cached K/V of the sampled layers (`kv_layers`), read in place
    reads_target_kv: bool
    # fuses the target's aux hidden states (EAGLE-3's fc)
    uses_aux_hidden: bool
    # has EAGLE-3 self-attention layers, hence a draft KV cache of its own
    self_attention: bool
    # drafts the whole proposal in one causal pass (block rows), not one token per pass
    one_block: bool
    summary: str

    @property
    def architecture(self) -> str:
        """The architecture name in config.json: vLLM's own for plain EAGLE-3, so that such
        checkpoints also load in stock vLLM; the plugin's for anything that reads target KV."""
        return KVSHOT_ARCH if self.reads_target_kv else STOCK_EAGLE3_ARCH


_REGISTRY: dict[str, Paradigm] = {}


def register_paradigm(name: str, *, reads_target_kv: bool, uses_aux_hidden: bool,
                      self_attention: bool, one_block: bool = False
                      ) -> Callable[[type["DraftLayers"]], type["DraftLayers"]]:
    """Class decorator of a `DraftLayers` subclass; its docstring's first line is the summary."""

    def register(cls: type["DraftLayers"]) -> type["DraftLayers"]:
        if name in _REGISTRY and type(_REGISTRY[name].definition) is not cls:
            raise KVShotError(f"paradigm {name!r} is registered twice "
                              f"({type(_REGISTRY[name].definition).__qualname__}, "
                              f"{cls.__qualname__})")
        summary = (cls.__doc__ or name).strip().splitlines()[0].rstrip(".")
        _REGISTRY[name] = Paradigm(name, cls(), reads_target_kv, uses_aux_hidden, self_attention,
                                   one_block, summary)
        return cls

    return register


def _load() -> None:
    for module in PARADIGM_MODULES:
        importlib.import_module(module)


def paradigm_names() -> list[str]:
    """Built-in paradigms in the order of PARADIGM_MODULES (whatever order they were imported
    in), then others in registration order."""
    _load()
    rank = {module: i for i, module in enumerate(PARADIGM_MODULES)}
    return sorted(_REGISTRY, key=lambda n: rank.get(type(_REGISTRY[n].definition).__module__,
                                                      len(rank)))


def paradigm(name: str) -> Paradigm:
    _load()
    if name not in _REGISTRY:
        raise KVShotError(f"unknown paradigm {name!r}; {choices_message()}")
    return _REGISTRY[name]


def choices_message() -> str:
    """"Input should be 'a', 'b' or 'c'", as pydantic words a Literal."""
    names = [f"'{n}'" for n in paradigm_names()]
    return "Input should be " + (" or ".join([", ".join(names[:-1]), names[-1]])
                                 if len(names) > 1 else names[0])
