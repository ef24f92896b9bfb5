"""Maps ``config.architectures`` to model classes."""
from __future__ import annotations

import importlib

from torch import nn

from vllmini.models.multimodal import MULTIMODAL_ARCHITECTURES

# architecture name -> (module, class); imported lazily so that adding a model costs nothing at start-up.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("vllmini.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("vllmini.models.llama", "MistralForCausalLM"),
    "Phi3ForCausalLM": ("vllmini.models.llama", "Phi3ForCausalLM"),
    "Qwen2ForCausalLM": ("vllmini.models.qwen2", "Qwen2ForCausalLM"),
    "SmolLM3ForCausalLM": ("vllmini.models.llama", "SmolLM3ForCausalLM"),
    "Qwen3ForCausalLM": ("vllmini.models.qwen3", "Qwen3ForCausalLM"),
    "MixtralForCausalLM": ("vllmini.models.mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("vllmini.models.qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("vllmini.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "Gemma2ForCausalLM": ("vllmini.models.gemma3", "Gemma2ForCausalLM"),
    "Ernie4_5ForCausalLM": ("vllmini.models.ernie45", "Ernie4_5ForCausalLM"),
    "Exaone4ForCausalLM": ("vllmini.models.exaone4", "Exaone4ForCausalLM"),
    "Gemma3ForCausalLM": ("vllmini.models.gemma3", "Gemma3ForCausalLM"),
    "FalconH1ForCausalLM": ("vllmini.models.falcon_h1", "FalconH1ForCausalLM"),
    "GraniteForCausalLM": ("vllmini.models.granite", "GraniteForCausalLM"),
    "GraniteMoeForCausalLM": ("vllmini.models.granite", "GraniteMoeForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("vllmini.models.granite4", "GraniteMoeHybridForCausalLM"),
    "Olmo2ForCausalLM": ("vllmini.models.olmo2", "Olmo2ForCausalLM"),
    "Olmo3ForCausalLM": ("vllmini.models.olmo2", "Olmo3ForCausalLM"),
    "GptOssForCausalLM": ("vllmini.models.gpt_oss", "GptOssForCausalLM"),
    "DeepseekV2ForCausalLM": ("vllmini.models.deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("vllmini.models.deepseek", "DeepseekV3ForCausalLM"),
    "Glm4ForCausalLM": ("vllmini.models.glm4", "Glm4ForCausalLM"),
    "Glm4MoeForCausalLM": ("vllmini.models.glm4_moe", "Glm4MoeForCausalLM"),
    "MiniMaxM2ForCausalLM": ("vllmini.models.minimax_m2", "MiniMaxM2ForCausalLM"),
    "SeedOssForCausalLM": ("vllmini.models.seed_oss", "SeedOssForCausalLM"),
    "OlmoeForCausalLM": ("vllmini.models.olmoe", "OlmoeForCausalLM"),
    "CohereForCausalLM": ("vllmini.models.cohere", "CohereForCausalLM"),
    "Cohere2ForCausalLM": ("vllmini.models.cohere", "Cohere2ForCausalLM"),
    "Dots1ForCausalLM": ("vllmini.models.dots1", "Dots1ForCausalLM"),
    "Llama4ForCausalLM": ("vllmini.models.llama4", "Llama4ForCausalLM"),
    "HunYuanDenseV1ForCausalLM": ("vllmini.models.hunyuan", "HunYuanDenseV1ForCausalLM"),
    "HunYuanMoEV1ForCausalLM": ("vllmini.models.hunyuan", "HunYuanMoEV1ForCausalLM"),
    "PhimoeForCausalLM": ("vllmini.models.phimoe", "PhimoeForCausalLM"),
    "Starcoder2ForCausalLM": ("vllmini.models.starcoder2", "Starcoder2ForCausalLM"),
    "Qwen3_5ForCausalLM": ("vllmini.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("vllmini.models.qwen3_5", "Qwen3_5MoeForCausalLM"),
    "Qwen3NextForCausalLM": ("vllmini.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Lfm2ForCausalLM": ("vllmini.models.lfm2", "Lfm2ForCausalLM"),
    "Lfm2MoeForCausalLM": ("vllmini.models.lfm2", "Lfm2MoeForCausalLM"),
    "NemotronHForCausalLM": ("vllmini.models.nemotron_h", "NemotronHForCausalLM"),
}
# decoder bodies saved without a language-model head (e5-mistral's MistralModel, ...): they only
# pool (runner "pooling"), as vLLM's runner "auto" treats *Model architectures; the same classes
# load them, their lm_head dropped (weight_loader.load_model)
_HEADLESS: dict[str, str] = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
                             "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM",
                             "Gemma2Model": "Gemma2ForCausalLM", "Gemma3TextModel": "Gemma3ForCausalLM"}  # fmt: skip
# sequence classifiers (and cross-encoder rerankers, num_labels == 1): the decoder body and transformers'
# ``score`` head (hidden -> num_labels, no bias) over the last token; they only pool (classify / score),
# loaded by the same classes with the head in place of lm_head (weight_loader.load_model)
_CLASSIFIERS: dict[str, str] = {"LlamaForSequenceClassification": "LlamaForCausalLM",
                                "MistralForSequenceClassification": "MistralForCausalLM",
                                "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
                                "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
                                "Gemma2ForSequenceClassification": "Gemma2ForCausalLM",
                                "Gemma3TextForSequenceClassification": "Gemma3ForCausalLM"}  # fmt: skip
# token classifiers: the same body and ``score`` head (with transformers' bias, ``token_classification_bias``)
# over every token; they only pool (token_classify)
_TOKEN_CLASSIFIERS: dict[str, str] = {"LlamaForTokenClassification": "LlamaForCausalLM",
                                      "MistralForTokenClassification": "MistralForCausalLM",
                                      "Qwen2ForTokenClassification": "Qwen2ForCausalLM",
                                      "Qwen3ForTokenClassification": "Qwen3ForCausalLM"}  # fmt: skip
_POOLING_ONLY = {**_HEADLESS, **_CLASSIFIERS, **_TOKEN_CLASSIFIERS}


def supported_architectures() -> list[str]:
    """The generating architectures, the multimodal ones served text-only (their language model:
    models/multimodal.py), then those that only pool."""
    return (sorted(_MODELS) + sorted(MULTIMODAL_ARCHITECTURES) + sorted(_HEADLESS) + sorted(_CLASSIFIERS)
            + sorted(_TOKEN_CLASSIFIERS))  # fmt: skip


def _first_supported(architectures: list[str] | None) -> str | None:
    return next((a for a in architectures or [] if a in _MODELS or a in _POOLING_ONLY), None)


def is_pooling_architecture(architectures: list[str] | None) -> bool:
    """Whether the first supported entry of ``architectures`` has no language-model head."""
    return _first_supported(architectures) in _POOLING_ONLY


def is_classifier_architecture(architectures: list[str] | None) -> bool:
    """Whether the first supported entry of ``architectures`` has a ``score`` head: a
    ``*ForSequenceClassification`` or a ``*ForTokenClassification``."""
    arch = _first_supported(architectures)
    return arch in _CLASSIFIERS or arch in _TOKEN_CLASSIFIERS


def is_token_classifier_architecture(architectures: list[str] | None) -> bool:
    """Whether the first supported entry of ``architectures`` is a ``*ForTokenClassification``."""
    return _first_supported(architectures) in _TOKEN_CLASSIFIERS


def classifier_architecture(architectures: list[str] | None) -> str | None:
    """The ``*ForSequenceClassification`` over the body of the first supported entry of
    ``architectures`` (a ``*ForCausalLM`` or ``*Model``): what vLLM's ``convert="classify"`` makes
    of it; None when there is none here."""
    arch = _first_supported(architectures)
    body = _HEADLESS.get(arch, arch)
    return next((name for name, of in _CLASSIFIERS.items() if of == body), None)


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    """The first supported entry of ``architectures``; a clear error when none is."""
    for arch in architectures or []:
        arch = _POOLING_ONLY.get(arch, arch)
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(
        f"unsupported architecture {architectures!r} in config.json; "
        f"supported: {', '.join(supported_architectures())}"
    )
