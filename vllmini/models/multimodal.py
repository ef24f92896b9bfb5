"""Multimodal checkpoints served text-only: their language model, as vLLM serves text prompts.

Gemma 3 (4B and up), Mistral Small 3.1/3.2, Qwen2-VL, Qwen2.5-VL, Qwen3-VL (and its MoE), Qwen3.5 (and its MoE), Llama 4
(Scout, Maverick) and Llava releases are ``*ForConditionalGeneration`` checkpoints whose language model is an architecture served
here. The config's ``text_config`` becomes the model config (``text_config``), the checkpoint's
language-model tensors are renamed to the text model's names and the vision tower's and projector's
are skipped unread (``CheckpointMapper``). Image, video and audio inputs are refused where they
arrive (engine/chat.py, engine/input_processor.py).

Text positions of an M-RoPE model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) carry three equal components
(transformers' ``get_rope_index`` without vision tokens), so each section and the interleaved
layout rotate by the same angle: ordinary RoPE over the same ``inv_freq`` (tests/test_multimodal_text.py
checks it against transformers' rotations).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

# the ConditionalGeneration architectures served (their language model only)
MULTIMODAL_ARCHITECTURES = ("Gemma3ForConditionalGeneration", "LlavaForConditionalGeneration",
                            "Llama4ForConditionalGeneration",
                            "Mistral3ForConditionalGeneration", "Qwen2VLForConditionalGeneration",
                            "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
                            "Qwen3VLMoeForConditionalGeneration", "Qwen3_5ForConditionalGeneration",
                            "Qwen3_5MoeForConditionalGeneration")  # fmt: skip
# text_config.model_type -> the text architecture that runs it
TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                      "qwen2_vl_text": "Qwen2ForCausalLM", "qwen2_5_vl_text": "Qwen2ForCausalLM",
                      "qwen3_vl_text": "Qwen3ForCausalLM", "qwen3_vl_moe_text": "Qwen3MoeForCausalLM",
                      "llama4_text": "Llama4ForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                      "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}  # fmt: skip
# checkpoint prefixes of the language model, as each transformers version saves them -> the text model's
_RENAMES = (("model.language_model.", "model."),  # transformers >= 4.52 saves (Qwen3-VL's releases)
            ("language_model.model.", "model."),  # Llava-style older saves (Gemma 3, Mistral 3, Llava)
            ("language_model.lm_head.", "lm_head."))  # fmt: skip
# modules of the vision side (with or without a leading "model."): never read
_VISION_MODULES = ("vision_tower", "visual", "multi_modal_projector", "vision_model")  # (Llama 4's: vision_model)
# checkpoints storing every expert in one tensor, transposed (transformers' conversion mapping transposes them)
_TRANSPOSED_EXPERTS = ("Qwen3VLMoeForConditionalGeneration",)
_FUSED_EXPERT_SUFFIXES = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
# token ids transformers keeps at the top level of older configs
_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def is_multimodal(architectures: list[str] | None) -> bool:
    return bool(architectures) and architectures[0] in MULTIMODAL_ARCHITECTURES


def text_architecture(raw: dict) -> str:
    """The text architecture that serves config.json ``raw`` (a multimodal one); a ValueError
    naming its text model type when none here does."""
    text = raw.get("text_config")
    model_type = text.get("model_type") if isinstance(text, dict) else None
    if model_type is None:  # (Qwen2-VL's and Qwen2.5-VL's first configs: the text fields at the top level)
        model_type = {"qwen2_vl": "qwen2_vl_text", "qwen2_5_vl": "qwen2_5_vl_text"}.get(raw.get("model_type"))
    if model_type not in TEXT_ARCHITECTURES:
        raise ValueError(f"{raw['architectures'][0]} with a {model_type!r} language model (text_config.model_type) "
                         f"is not served; its language model must be one of {sorted(TEXT_ARCHITECTURES)}")  # fmt: skip
    return TEXT_ARCHITECTURES[model_type]


def text_config(config: Any, raw: dict) -> Any:
    """The config the engine runs with: ``config``'s text_config, named by its text architecture,
    with what transformers reads from the top level: ``tie_word_embeddings`` (the
    ConditionalGeneration model ties by it), the dtype, a quantization_config and the token ids
    a text config leaves unset. ``multimodal_architecture`` keeps the checkpoint's own
    architecture, which says how its tensors are named (``CheckpointMapper``)."""
    text = config.get_text_config(decoder=True)
    text.architectures = [text_architecture(raw)]
    text.multimodal_architecture = config.architectures[0]
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    if getattr(text, "dtype", None) is None:
        text.dtype = getattr(config, "dtype", None)
    if raw.get("quantization_config") is not None:
        text.quantization_config = raw["quantization_config"]
    for key in _TOKEN_KEYS:
        if getattr(text, key, None) is None and raw.get(key) is not None:
            setattr(text, key, raw[key])
    if text.model_type == "qwen3_vl_moe_text":  # (its router renormalises the top-k weights, whatever the config says)
        text.norm_topk_prob = True
    return text


@dataclass(frozen=True)
class CheckpointMapper:
    """A multimodal checkpoint's tensors as its text model loads them."""

    architecture: str

    @staticmethod
    def skip(name: str) -> bool:
        """Whether ``name`` is the vision side's (vision tower, projector): skipped before it is read."""
        return name.removeprefix("model.").split(".", 1)[0] in _VISION_MODULES

    @staticmethod
    def rename(name: str) -> str:
        for old, new in _RENAMES:
            if name.startswith(old):
                return new + name[len(old):]
        return name  # (lm_head., and Qwen2-VL's older model.layers...: already the text model's)

    def __call__(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        transposed = self.architecture in _TRANSPOSED_EXPERTS
        for name, tensor in weights:
            if transposed and name.endswith(_FUSED_EXPERT_SUFFIXES):
                tensor = tensor.transpose(1, 2)  # (the [E, H, 2I] and [E, I, H] on disk -> [E, 2I, H] and [E, H, I])
            yield self.rename(name), tensor


def checkpoint_mapper(config: Any) -> CheckpointMapper | None:
    """The mapper of a multimodal checkpoint's config (``text_config``'s result, or config.json
    as a dict); None for a text model's."""
    if isinstance(config, dict):
        arch = next(iter(config.get("architectures") or []), None)
        arch = arch if arch in MULTIMODAL_ARCHITECTURES else None
    else:
        arch = getattr(config, "multimodal_architecture", None)
    return CheckpointMapper(arch) if arch else None
