"""LG EXAONE 4.0 (``Exaone4ForCausalLM``: EXAONE-4.0-1.2B, -32B), as transformers' modeling_exaone4.py:
OLMo 2's layer (a norm after attention and after the MLP, none before), per-head q/k RMSNorm
before RoPE, no biases; with ``sliding_window`` set, a hybrid: the layers ``layer_types`` marks
slide, with RoPE, and the others attend to every token without positions (global NoPE)."""
from __future__ import annotations

from typing import Any

from vllmini.models.llama import DecoderVariant, LlamaForCausalLM
from vllmini.models.olmo2 import Olmo2DecoderLayer


class Exaone4ForCausalLM(LlamaForCausalLM):
    variant = DecoderVariant(qk_norm=True, qkv_bias=False, o_bias=False, mlp_bias=False, sliding="by_layer_type")
    layer_cls = Olmo2DecoderLayer

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        if getattr(config, "sliding_window", None) is not None:  # hybrid: the full layers are NoPE
            types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
            for layer, kind in zip(self.model.layers, types):
                layer.self_attn.use_rope = kind == "sliding_attention"
