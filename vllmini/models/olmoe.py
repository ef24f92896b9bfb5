"""AllenAI OLMoE (``OlmoeForCausalLM``: OLMoE-1B-7B), as transformers' modeling_olmoe.py: Llama's
pre-norm layer with q and k each normed by one RMSNorm over the whole projection (all heads, as
OLMo 2; Llama's RMSNorm, the weight after the cast), biases from ``attention_bias``, and experts
``intermediate_size`` wide in every layer: softmax over the router logits, top
``num_experts_per_tok``, renormalised only where ``norm_topk_prob`` says (false in the release).
``clip_qkv`` (null in the release) is refused."""
from __future__ import annotations

from typing import Any

from torch import nn

from vllmini.models.llama import DecoderVariant, LlamaForCausalLM
from vllmini.models.moe import FusedMoE, num_experts


class OlmoeForCausalLM(LlamaForCausalLM):
    variant = DecoderVariant(qk_norm=True, qk_norm_all_heads=True, mlp_bias=False)

    def __init__(self, config: Any) -> None:
        if getattr(config, "clip_qkv", None) is not None:
            raise ValueError(f"clip_qkv={config.clip_qkv} is not supported for OlmoeForCausalLM; supported: null")
        super().__init__(config)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        config = self.config
        return FusedMoE(config.hidden_size, config.intermediate_size, num_experts(config), config.num_experts_per_tok,
                        bool(getattr(config, "norm_topk_prob", False)), getattr(config, "hidden_act", "silu"))  # fmt: skip
