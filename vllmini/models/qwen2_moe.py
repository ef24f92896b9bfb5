"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases); each sparse
layer's experts plus a shared expert that every token goes through, scaled by a sigmoid gate."""
from __future__ import annotations

from torch import nn

from vllmini.models.moe import is_sparse_layer, qwen_moe_block
from vllmini.models.qwen2 import Qwen2ForCausalLM


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    def build_mlp(self, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(self.config, layer_idx):
            return super().build_mlp(layer_idx)
        return qwen_moe_block(self.config, shared_expert=True)
