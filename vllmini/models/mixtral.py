"""Mixtral (8x7B, 8x22B): Mistral's attention, experts in every layer's MLP (``block_sparse_moe``
in its checkpoints, projections ``w1``/``w3``/``w2`` for gate/up/down), top-k weights renormalised."""
from __future__ import annotations

from torch import nn

from vllmini.models.llama import MistralForCausalLM
from vllmini.models.moe import mixtral_moe_block


class MixtralForCausalLM(MistralForCausalLM):
    expert_projections = ("w1", "w3", "w2")
    checkpoint_renames = ((".block_sparse_moe.", ".mlp."),)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return mixtral_moe_block(self.config)
