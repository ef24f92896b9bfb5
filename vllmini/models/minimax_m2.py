"""MiniMax-M2 / M2.1 (``MiniMaxM2ForCausalLM``), as transformers' modeling_minimax_m2.py:
- Llama's pre-norm layer, no biases; q and k each normed by one RMSNorm over the whole projection
  (all heads at once, OLMo 2's way: ``qk_norm_type`` "per_layer"), the weight applied in float32;
- rotary embedding on the two halves of the first ``rotary_dim`` dims of each head (transformers
  turns ``rotary_dim`` into ``partial_rotary_factor``);
- experts in every layer (``block_sparse_moe``: ``w1``/``w3``/``w2`` for gate/up/down, each
  ``intermediate_size`` wide), routed as DeepSeek-V3 without groups: sigmoid scores, the top-k
  chosen on the scores plus ``e_score_correction_bias``, weighted by the unbiased scores renormalised;
  no shared experts; the router in float32, as vLLM runs it;
- the multi-token-prediction modules (``num_mtp_modules``, ``model.layers.<num_hidden_layers + i>``)
  are skipped.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from vllmini.models.deepseek import RouterGate, without_mtp_layers
from vllmini.models.llama import DecoderVariant
from vllmini.models.mixtral import MixtralForCausalLM
from vllmini.models.moe import FusedMoE, grouped_topk, num_experts
from vllmini.models.olmo2 import Olmo2RMSNorm


class MiniMaxM2MoE(FusedMoE):
    """Sigmoid router with a correction bias for the choice only, top-k renormalised."""

    def __init__(self, config: Any) -> None:
        scoring = getattr(config, "scoring_func", None) or "sigmoid"
        if scoring != "sigmoid":
            raise ValueError(f"scoring_func {scoring!r} is not supported for MiniMaxM2ForCausalLM; supported: sigmoid")
        super().__init__(config.hidden_size, config.intermediate_size, num_experts(config), config.num_experts_per_tok,
                         True, getattr(config, "hidden_act", "silu"))  # fmt: skip
        self.gate = RouterGate(config.hidden_size, self.num_experts, correction_bias=True)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.gate(x).sigmoid()
        ids = grouped_topk(scores, self.top_k, 1, 1, self.gate.e_score_correction_bias)
        weights = scores.gather(1, ids)
        return ids, (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)


class MiniMaxM2ForCausalLM(MixtralForCausalLM):
    """Mixtral's checkpoint names (``block_sparse_moe``, ``w1``/``w3``/``w2``); the router's correction
    bias sits beside its gate there (``block_sparse_moe.e_score_correction_bias``), in the gate here."""

    variant = DecoderVariant(qk_norm=True, qk_norm_all_heads=True, qkv_bias=False, o_bias=False, mlp_bias=False)
    checkpoint_renames = ((".block_sparse_moe.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
                          *MixtralForCausalLM.checkpoint_renames)  # fmt: skip

    def __init__(self, config: Any) -> None:
        kind = getattr(config, "qk_norm_type", None) or "per_layer"
        if kind != "per_layer":
            raise ValueError(f"qk_norm_type {kind!r} is not supported for MiniMaxM2ForCausalLM; supported: per_layer")
        super().__init__(config)
        for layer in self.model.layers:  # (q/k norms weight in float32, the layers' norms as Llama's)
            attn = layer.self_attn
            attn.q_norm = Olmo2RMSNorm(attn.q_size, config.rms_norm_eps)
            attn.k_norm = Olmo2RMSNorm(attn.kv_size, config.rms_norm_eps)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return MiniMaxM2MoE(self.config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(without_mtp_layers(weights, self.config.num_hidden_layers))
