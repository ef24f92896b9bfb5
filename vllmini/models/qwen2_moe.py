"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases); each sparse
layer's experts plus a shared expert that every token goes through, scaled by a sigmoid gate."""
from __future__ import annotations

from torch import nn

from vllmini.models.moe import SharedExpertMoE, is_sparse_layer, num_experts
from vllmini.models.qwen2 import Qwen2ForCausalLM


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    def build_mlp(self, layer_idx: int) -> nn.Module:
        config = self.config
        if not is_sparse_layer(config, layer_idx):
            return super().build_mlp(layer_idx)
        return SharedExpertMoE(config.hidden_size, config.moe_intermediate_size, num_experts(config),
                               config.num_experts_per_tok, bool(getattr(config, "norm_topk_prob", False)),
                               config.shared_expert_intermediate_size, getattr(config, "hidden_act", "silu"))  # fmt: skip
