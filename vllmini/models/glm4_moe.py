"""Zhipu GLM-4.5 / 4.6 (``Glm4MoeForCausalLM``: GLM-4.5, GLM-4.5-Air, GLM-4.6), as transformers'
modeling_glm4_moe.py:
- Llama's pre-norm layer; q/k/v biases from ``attention_bias``, none on o_proj; per-head q/k
  RMSNorm before RoPE where ``use_qk_norm`` says so; ``head_dim`` from the config;
- rotary embedding on the two halves (NeoX style, unlike GLM-4-0414's pairs) of the first
  ``partial_rotary_factor`` of each head (0.5 by default);
- a dense MLP in the first ``first_k_dense_replace`` layers, then DeepSeek-V3's mixture of experts
  (models/deepseek.py's ``DeepseekMoE``): sigmoid scores, noaux_tc choice over ``n_group`` groups
  with ``e_score_correction_bias``, ``norm_topk_prob``, ``routed_scaling_factor``, shared experts,
  the router's weight and bias in float32;
- the multi-token-prediction layers (``num_nextn_predict_layers``, stored as
  ``model.layers.<num_hidden_layers + i>``) are skipped, as transformers skips them.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from vllmini.models.deepseek import DeepseekMoE, without_mtp_layers
from vllmini.models.llama import DecoderVariant, LlamaForCausalLM


class Glm4MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any) -> None:
        qk_norm = bool(getattr(config, "use_qk_norm", False))
        self.variant = DecoderVariant(qk_norm=qk_norm, o_bias=False, mlp_bias=False)  # (q/k/v bias: attention_bias)
        super().__init__(config)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        if layer_idx >= int(getattr(self.config, "first_k_dense_replace", None) or 0):
            return DeepseekMoE(self.config, "sigmoid", "noaux_tc")
        return super().build_mlp(layer_idx)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(without_mtp_layers(weights, self.config.num_hidden_layers))
