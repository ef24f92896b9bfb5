"""AllenAI OLMo 2 (``Olmo2ForCausalLM``) and OLMo 3 (``Olmo3ForCausalLM``), as transformers'
modeling_olmo2/3.py:
- no norm before attention or the MLP: each block's output is normed (``post_attention_layernorm``,
  ``post_feedforward_layernorm``) before it joins the residual stream;
- q and k normed by one RMSNorm over all heads each, straight after their projections;
- RMSNorm weights applied in float32, before the cast back (Llama casts first);
OLMo 3 adds sliding-window attention in the layers ``layer_types`` marks, with a rope per kind of layer.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllmini.models.attention import KVCache
from vllmini.models.base import AttentionMetadata
from vllmini.models.layer_type_rope import RopeByLayerType
from vllmini.models.layers import RMSNorm
from vllmini.models.llama import DecoderLayer, DecoderVariant, LlamaForCausalLM


class Olmo2RMSNorm(RMSNorm):
    """The weight applied to the float32 normalized values, then the cast (transformers' Olmo2RMSNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight.float() * self.normalize(x)).to(x.dtype)


class Olmo2DecoderLayer(DecoderLayer):
    """Norms after attention and after the MLP, none before them."""

    def __init__(self, config: Any, variant: DecoderVariant, mlp: nn.Module, use_rope: bool = True,
                 window: int | None = None) -> None:  # fmt: skip
        super().__init__(config, variant, mlp, use_rope, window)
        del self.input_layernorm
        self.post_feedforward_layernorm = variant.norm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, kv_cache: KVCache | None
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(x, cos_sin, meta, kv_cache))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2ForCausalLM(LlamaForCausalLM):
    # (q/k/v and o_proj biases from attention_bias, as transformers'; its MLP has none)
    variant = DecoderVariant(qk_norm=True, qk_norm_all_heads=True, mlp_bias=False, norm=Olmo2RMSNorm)
    layer_cls = Olmo2DecoderLayer


class Olmo3ForCausalLM(RopeByLayerType, Olmo2ForCausalLM):
    variant = DecoderVariant(qk_norm=True, qk_norm_all_heads=True, mlp_bias=False, norm=Olmo2RMSNorm,
                             sliding="by_layer_type")  # fmt: skip

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.init_layer_type_rope()
