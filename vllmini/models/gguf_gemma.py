"""Gemma 2 and Gemma 3 (text) GGUF files, as llama.cpp's convert_hf_to_gguf.py writes them and its
loader (llama-model.cpp) reads them.

Why this is its own step: much of what a Gemma model needs is not in the file, because llama.cpp
hardcodes it per architecture, and transformers' GGUF config reader then falls back to its config
classes' defaults (one checkpoint's: ``query_pre_attn_scalar`` 256, softcaps 50 / 30 whatever the
file states, no rope scaling, a 4096 window where Gemma 3 has none). Read as llama.cpp reads them:
  * tensors: the four norms per layer are ``attn_norm``, ``post_attention_norm``, ``ffn_norm`` (the
    pre-feedforward one) and ``post_ffw_norm``; every RMSNorm weight (q/k norms included) is stored
    with Gemma's ``1 +`` folded in; Q/K rows are HF's (llama.cpp ropes Gemma NEOX-style, i.e.
    rotate-half: no permutation); the embedding is HF's, unscaled, and tied (no ``output``);
  * the attention scale is ``head_dim**-0.5``, but ``(hidden / heads)**-0.5`` for the 27B models,
    which llama.cpp recognises by their layer count;
  * Gemma 2: even layers slide over ``attention.sliding_window`` (default 4096), scores and logits are
    capped by ``attn_logit_softcapping`` / ``final_logit_softcapping`` (defaults 50 and 30);
  * Gemma 3: with a window, 5 sliding layers to 1 full; the sliding ones rotate at base 10000,
    unscaled, the full ones at ``rope.freq_base`` with the file's rope scaling (linear only); a final
    softcap only where the file states one (llama.cpp's sliding-window graph leaves it out; the HF
    model it came from applies it, so it is applied here);
  * generation also ends on ``<end_of_turn>``, as HF's generation configs of the -it models say.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from vllmini.models.gguf_moe import field_value

GEMMA_ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
_NORMS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
          "post_ffw_norm": "post_feedforward_layernorm"}  # fmt: skip
GEMMA_BLOCK_NAMES = dict.fromkeys(GEMMA_ARCHITECTURES, _NORMS)  # merged into gguf_convert's names
# llama.cpp's layer counts of the 27B models, whose attention scale is (hidden / heads)**-0.5
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}
_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}  # every n-th layer is full (llama.cpp's set_swa_pattern)
_GEMMA2_WINDOW, _GEMMA2_SOFTCAPS = 4096, {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
_LOCAL_ROPE_BASE = 10000.0  # Gemma 3's sliding layers (llama.cpp's rope_freq_base_train_swa)
# the instruction-tuned models end their turn with it, not <eos>: HF's generation configs list both, and
# llama.cpp ends generation on it by its text
_END_OF_TURN = b"<end_of_turn>"


def check_rope(gguf_path: Path, arch: str, rope: dict[str, Any]) -> None:
    """Gemma 3 scales only its full layers' rope, and only linearly (as Gemma 3 4B+ files state it):
    what llama.cpp would do with another type beside unscaled sliding layers is not mapped."""
    params = rope.get("rope_parameters")
    if arch == "gemma3" and params and params["rope_type"] != "linear":
        raise ValueError(f"{gguf_path}: gemma3.rope.scaling.type {params['rope_type']!r} is not supported for gemma3 "
                         "files (linear only); use the model's HF safetensors checkpoint instead")  # fmt: skip


def query_pre_attn_scalar(arch: str, layers: int, hidden: int, heads: int, head_dim: int) -> int:
    """The attention scale's divisor llama.cpp uses (its f_attention_scale, squared and inverted)."""
    return hidden // heads if layers == _LAYERS_27B[arch] else head_dim


def gemma_config(config, reader, arch: str, rope: dict[str, Any]):
    """``config`` with the Gemma fields llama.cpp hardcodes or transformers' GGUF reader drops."""
    def key(name: str) -> Any:
        return field_value(reader, f"{arch}.{name}")

    layers, hidden, heads = int(key("block_count")), int(key("embedding_length")), int(key("attention.head_count"))
    if key("attention.key_length") is None:  # (llama.cpp's default; Gemma's config classes say 256)
        config.head_dim = hidden // heads
    config.query_pre_attn_scalar = query_pre_attn_scalar(arch, layers, hidden, heads, config.head_dim)
    config.hidden_activation = "gelu_pytorch_tanh"  # llama.cpp's GELU is the tanh approximation
    window = key("attention.sliding_window")
    if arch == "gemma2":
        config.sliding_window = _GEMMA2_WINDOW if window is None else int(window)
        for name, default in _GEMMA2_SOFTCAPS.items():
            setattr(config, name, default if key(name) is None else float(_shortest(key(name))))
    else:
        final = key("final_logit_softcapping")
        config.final_logit_softcapping = float(_shortest(final)) if final else None
        config.attn_logit_softcapping = None
        config.sliding_window = int(window) if window else None
        config.rope_parameters = gemma3_rope_parameters(key("rope.freq_base"), rope.get("rope_parameters"))
    pattern = _SLIDING_PATTERN[arch] if config.sliding_window else 1
    config.layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    eos, end_of_turn = field_value(reader, "tokenizer.ggml.eos_token_id"), token_id(reader, _END_OF_TURN)
    if eos is not None and end_of_turn not in (None, int(eos)):
        config.eos_token_id = [int(eos), end_of_turn]  # (into generation_config.json: the engine stops on either)
    return config


def token_id(reader, token: bytes) -> int | None:
    """A token's id, read from the vocabulary's raw parts (parsing all 262k of Gemma 3's costs seconds)."""
    field = reader.fields.get("tokenizer.ggml.tokens")
    for i, part in enumerate(field.data if field is not None else ()):
        if field.parts[part].tobytes() == token:
            return i
    return None


def _shortest(value: float) -> str:
    """A float32 key as the decimal it was written from (0.3, not 0.30000001192092896)."""
    return str(np.float32(value))


def gemma3_rope_parameters(base: float | None, scaling: dict[str, Any] | None) -> dict[str, Any]:
    """transformers 5's per-layer-type rope of Gemma 3: the full layers at ``rope.freq_base``
    (llama.cpp's default 10000 when absent) with the file's scaling, the sliding ones unscaled."""
    full = {"rope_type": "default", "rope_theta": 10000.0 if base is None else float(base), **(scaling or {})}
    return {"full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": _LOCAL_ROPE_BASE}}


def hf_weight(hf_name: str, w: np.ndarray, arch: str) -> np.ndarray:
    """Gemma's RMSNorm weights without the ``1 +`` llama.cpp folds into them."""
    return w - 1.0 if arch in GEMMA_ARCHITECTURES and hf_name.endswith("norm.weight") else w
