"""Zhipu GLM-4-0414 and GLM-Z1 (``Glm4ForCausalLM``: GLM-4-9B/32B-0414, GLM-Z1-9B/32B-0414), as
transformers' modeling_glm4.py:
- each block's output is normed again before it joins the residual stream
  (``post_self_attn_layernorm``, ``post_mlp_layernorm``), beside Llama's pre-norms;
- rotary embedding on adjacent pairs of dims (GLM style), over the first ``partial_rotary_factor``
  of each head (0.5 by default);
- q/k/v biases from ``attention_bias`` (true by default), none on o_proj or the MLP;
- checkpoints hold the MLP's ``gate_up_proj`` already fused (gate first), q/k/v apart.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllmini.models.attention import KVCache
from vllmini.models.base import AttentionMetadata
from vllmini.models.llama import DecoderLayer, DecoderVariant, LlamaForCausalLM


class Glm4DecoderLayer(DecoderLayer):
    """Llama's pre-norm layer with a second norm on the attention's and the MLP's outputs."""

    def __init__(self, config: Any, variant: DecoderVariant, mlp: nn.Module, use_rope: bool = True,
                 window: int | None = None) -> None:  # fmt: skip
        super().__init__(config, variant, mlp, use_rope, window)
        self.post_self_attn_layernorm = variant.norm(config.hidden_size, config.rms_norm_eps)
        self.post_mlp_layernorm = variant.norm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, kv_cache: KVCache | None
    ) -> torch.Tensor:
        x = x + self.post_self_attn_layernorm(self.self_attn(self.input_layernorm(x), cos_sin, meta, kv_cache))
        return x + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(x)))


class Glm4ForCausalLM(LlamaForCausalLM):
    variant = DecoderVariant(o_bias=False, mlp_bias=False, rope_interleaved=True)  # (q/k/v bias: attention_bias)
    layer_cls = Glm4DecoderLayer

    def checkpoint_names(self, param: str) -> list[str]:
        """A missing MLP is the checkpoint's fused ``mlp.gate_up_proj`` (q/k/v come apart, as Llama's)."""
        return [param] if param.endswith(".mlp.gate_up_proj.weight") else super().checkpoint_names(param)

    def lora_targets(self) -> list[tuple[str, list[str], list[int]]]:
        """Llama's, but an adapter names the checkpoint's fused ``mlp.gate_up_proj`` itself."""
        targets = []
        for path, names, sizes in super().lora_targets():
            fused = path.endswith(".mlp.gate_up_proj")
            targets.append((path, [path], [sum(sizes)]) if fused else (path, names, sizes))
        return targets
