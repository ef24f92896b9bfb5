"""Cohere Command R (``CohereForCausalLM``) and Command R7B / Command A (``Cohere2ForCausalLM``), as
transformers' modeling_cohere.py / modeling_cohere2.py:
- one norm per layer feeding attention and the MLP side by side, both added to the residual
  (``x + attn(ln(x)) + mlp(ln(x))``); the norm a LayerNorm without bias (mean removed, weight
  applied in float32), eps ``layer_norm_eps``;
- RoPE on adjacent pairs (interleaved), biases from ``attention_bias`` (none in the MLP);
- the logits multiplied by ``logit_scale``; embeddings tied (``tie_word_embeddings``);
Cohere2 adds sliding-window attention in the layers ``layer_types`` marks (from
``sliding_window_pattern``: every 4th layer full), with RoPE, and no positions at all (NoPE) in the
full-attention layers. Command R+'s per-head q/k LayerNorm (``use_qk_norm``) is not built: refused.
"""
from __future__ import annotations

from typing import Any

import torch

from vllmini.models.attention import KVCache
from vllmini.models.base import AttentionMetadata
from vllmini.models.layers import RMSNorm
from vllmini.models.llama import DecoderLayer, DecoderVariant, LlamaForCausalLM


class CohereLayerNorm(RMSNorm):
    """A LayerNorm without bias: the mean removed, then RMSNorm's scaling, the weight in float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centered = x.float() - x.float().mean(-1, keepdim=True)
        return (self.weight.float() * self.normalize(centered)).to(x.dtype)


class CohereDecoderLayer(DecoderLayer):
    """Attention and MLP in parallel on one normed input."""

    def __init__(self, config: Any, variant: DecoderVariant, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, variant, *args, **kwargs)
        del self.post_attention_layernorm

    def forward(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, kv_cache: KVCache | None
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        return x + self.self_attn(h, cos_sin, meta, kv_cache) + self.mlp(h)


class CohereForCausalLM(LlamaForCausalLM):
    variant = DecoderVariant(mlp_bias=False, norm=CohereLayerNorm, rope_interleaved=True)
    layer_cls = CohereDecoderLayer

    def __init__(self, config: Any) -> None:
        if getattr(config, "use_qk_norm", False):
            raise ValueError(f"use_qk_norm=true (per-head q/k LayerNorm) is not supported for {type(self).__name__}")
        config.rms_norm_eps = config.layer_norm_eps  # (the shared decoder reads its norms' eps there)
        super().__init__(config)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return super().forward(*args, **kwargs) * float(self.config.logit_scale)


class Cohere2ForCausalLM(CohereForCausalLM):
    variant = DecoderVariant(mlp_bias=False, norm=CohereLayerNorm, rope_interleaved=True, sliding="by_layer_type")

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
        for layer, kind in zip(self.model.layers, types):  # the full-attention layers are NoPE
            layer.self_attn.use_rope = kind == "sliding_attention"
