"""IBM Granite 3.x (``GraniteForCausalLM``): the Llama decoder with four scalars from config.json,
as transformers' modeling_granite.py applies them:
- ``embedding_multiplier`` on the input embeddings;
- ``attention_multiplier`` as the attention scale (in place of head_dim**-0.5);
- ``residual_multiplier`` on each block's output before it joins the residual stream;
- ``logits_scaling``: the logits are divided by it.
"""
from __future__ import annotations

from typing import Any

import torch

from vllmini.models.attention import KVCache
from vllmini.models.base import AttentionMetadata
from vllmini.models.llama import DecoderLayer, DecoderVariant, LlamaForCausalLM


class GraniteDecoderLayer(DecoderLayer):
    """Llama's layer with the attention's and the MLP's outputs scaled by ``residual_multiplier``."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.residual_multiplier = float(config.residual_multiplier)

    def forward(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, kv_cache: KVCache | None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, meta, kv_cache) * self.residual_multiplier
        return x + self.mlp(self.post_attention_layernorm(x)) * self.residual_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    variant = DecoderVariant(attention_multiplier=True)  # (biases from attention_bias / mlp_bias, as Llama)
    layer_cls = GraniteDecoderLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * float(self.config.embedding_multiplier)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                      kv_caches: list[KVCache] | None = None,
                      inputs_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
        """As Llama's; prompt_embeds are scaled by ``embedding_multiplier`` too (transformers and vLLM
        scale whatever input embeddings they are given)."""
        if inputs_embeds is not None:
            rows, values = inputs_embeds
            inputs_embeds = (rows, values * float(self.config.embedding_multiplier))
        return super().hidden_states(input_ids, positions, attn_metadata, kv_caches, inputs_embeds)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return super().forward(*args, **kwargs) / float(self.config.logits_scaling)
