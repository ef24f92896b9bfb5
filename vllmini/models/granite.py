"""IBM Granite 3.x (``GraniteForCausalLM``, and ``GraniteMoeForCausalLM`` with experts): the Llama decoder with four scalars from config.json,
as transformers' modeling_granite.py applies them:
- ``embedding_multiplier`` on the input embeddings;
- ``attention_multiplier`` as the attention scale (in place of head_dim**-0.5);
- ``residual_multiplier`` on each block's output before it joins the residual stream;
- ``logits_scaling``: the logits are divided by it.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from vllmini.models.attention import KVCache
from vllmini.models.base import AttentionMetadata
from vllmini.models.llama import DecoderLayer, DecoderVariant, LlamaForCausalLM
from vllmini.models.moe import mixtral_moe_block


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


# GraniteMoe checkpoint names (after ``block_sparse_moe.``; transformers >= 5's in-memory names too)
# -> ours (after ``mlp.``): all experts' gate/up and down in one tensor each, gate first, as ours
_MOE_NAMES = {"input_linear.weight": "experts.gate_up_proj", "output_linear.weight": "experts.down_proj",
              "router.layer.weight": "gate.weight", "router.weight": "gate.weight",
              "experts.gate_up_proj": "experts.gate_up_proj", "experts.down_proj": "experts.down_proj"}  # fmt: skip
_MOE_PARAMS = {"experts.w13": "input_linear.weight", "experts.w2": "output_linear.weight", "gate.weight": "router.layer.weight"}


class GraniteMoeForCausalLM(GraniteForCausalLM):
    """Granite 3.0/3.1 MoE (granite-3.x-1b-a400m, 3b-a800m): Granite with a mixture of experts in
    every layer's MLP (``block_sparse_moe``), softmax over the top-k router logits (equal to
    renormalised top-k probabilities)."""

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return mixtral_moe_block(self.config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((_moe_name(name), t) for name, t in weights)

    def checkpoint_names(self, param: str) -> list[str]:
        layer, sep, leaf = param.partition(".mlp.")
        return [f"{layer}.block_sparse_moe.{_MOE_PARAMS[leaf]}"] if sep and leaf in _MOE_PARAMS else [param]


def _moe_name(name: str) -> str:
    layer, sep, leaf = name.partition(".block_sparse_moe.")
    return f"{layer}.mlp.{_MOE_NAMES.get(leaf, leaf)}" if sep else name
