"""Maps ``config.architectures`` to model classes."""
from __future__ import annotations

import importlib

from torch import nn

# architecture name -> (module, class); imported lazily so that adding a model costs nothing at start-up.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("vllmini.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("vllmini.models.llama", "MistralForCausalLM"),
    "Phi3ForCausalLM": ("vllmini.models.llama", "Phi3ForCausalLM"),
    "Qwen2ForCausalLM": ("vllmini.models.qwen2", "Qwen2ForCausalLM"),
    "SmolLM3ForCausalLM": ("vllmini.models.llama", "SmolLM3ForCausalLM"),
    "Qwen3ForCausalLM": ("vllmini.models.qwen3", "Qwen3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    """The first supported entry of ``architectures``; a clear error when none is."""
    for arch in architectures or []:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(
        f"unsupported architecture {architectures!r} in config.json; "
        f"supported: {', '.join(supported_architectures())}"
    )
