"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, experts in the MLP of every
``decoder_sparse_step``-th layer not listed in ``mlp_only_layers`` (the others keep a dense MLP)."""
from __future__ import annotations

from torch import nn

from vllmini.models.moe import is_sparse_layer, qwen_moe_block
from vllmini.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def build_mlp(self, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(self.config, layer_idx):
            return super().build_mlp(layer_idx)
        return qwen_moe_block(self.config, shared_expert=False)
