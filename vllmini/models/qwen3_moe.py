"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, experts in the MLP of every
``decoder_sparse_step``-th layer not listed in ``mlp_only_layers`` (the others keep a dense MLP)."""
from __future__ import annotations

from torch import nn

from vllmini.models.moe import FusedMoE, is_sparse_layer, num_experts
from vllmini.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def build_mlp(self, layer_idx: int) -> nn.Module:
        config = self.config
        if not is_sparse_layer(config, layer_idx):
            return super().build_mlp(layer_idx)
        return FusedMoE(config.hidden_size, config.moe_intermediate_size, num_experts(config),
                        config.num_experts_per_tok, bool(getattr(config, "norm_topk_prob", False)),
                        getattr(config, "hidden_act", "silu"))  # fmt: skip
