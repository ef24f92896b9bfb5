"""rednote dots.llm1 (``Dots1ForCausalLM``), as transformers' modeling_dots1.py: Qwen3's attention
(per-head q/k RMSNorm before RoPE, biases from ``attention_bias``; sliding in the layers
``layer_types`` marks, which transformers derives from ``sliding_window`` and ``max_window_layers``)
and GLM-4.5's layer plan: a dense MLP in the first ``first_k_dense_replace`` layers, then
DeepSeek-V3's mixture of experts (models/deepseek.py's ``DeepseekMoE``: sigmoid, noaux_tc over
``n_group`` groups with ``e_score_correction_bias``, shared experts, ``routed_scaling_factor``)."""
from __future__ import annotations

from typing import Any

from vllmini.models.glm4_moe import Glm4MoeForCausalLM
from vllmini.models.llama import DecoderVariant, LlamaForCausalLM


class Dots1ForCausalLM(Glm4MoeForCausalLM):
    def __init__(self, config: Any) -> None:
        self.variant = DecoderVariant(qk_norm=True, mlp_bias=False, sliding="by_layer_type")
        LlamaForCausalLM.__init__(self, config)  # (GLM-4.5's variant reads use_qk_norm; this one is fixed)
