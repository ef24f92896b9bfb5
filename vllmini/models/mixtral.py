"""Mixtral (8x7B, 8x22B): Mistral's attention, experts in every layer's MLP (``block_sparse_moe``
in its checkpoints, projections ``w1``/``w3``/``w2`` for gate/up/down), top-k weights renormalised."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from vllmini.models.llama import MistralForCausalLM
from vllmini.models.moe import mixtral_moe_block


class MixtralForCausalLM(MistralForCausalLM):
    expert_projections = ("w1", "w3", "w2")

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return mixtral_moe_block(self.config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((name.replace(".block_sparse_moe.", ".mlp."), t) for name, t in weights)

    def checkpoint_names(self, param: str) -> list[str]:
        return [name.replace(".mlp.", ".block_sparse_moe.") for name in super().checkpoint_names(param)]
