"""Mixtral (8x7B, 8x22B): Mistral's attention, experts in every layer's MLP (``block_sparse_moe``
in its checkpoints, projections ``w1``/``w3``/``w2`` for gate/up/down), top-k weights renormalised."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from vllmini.models.llama import MistralForCausalLM
from vllmini.models.moe import FusedMoE, num_experts


class MixtralForCausalLM(MistralForCausalLM):
    expert_projections = ("w1", "w3", "w2")

    def build_mlp(self, layer_idx: int) -> nn.Module:
        config = self.config
        return FusedMoE(config.hidden_size, config.intermediate_size, num_experts(config),
                        config.num_experts_per_tok, True, getattr(config, "hidden_act", "silu"))  # fmt: skip

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((name.replace(".block_sparse_moe.", ".mlp."), t) for name, t in weights)

    def checkpoint_names(self, param: str) -> list[str]:
        return [name.replace(".mlp.", ".block_sparse_moe.") for name in super().checkpoint_names(param)]
