"""Gemma 3 (text: ``Gemma3ForCausalLM``, config ``gemma3_text``, e.g. gemma-3-1b/270m) and Gemma 2.

Both are the Llama decoder with, as transformers' modeling_gemma2/3.py:
- RMSNorm weights as offsets from 1, applied in float32 (``GemmaRMSNorm``), and four norms per
  layer: before and after attention, before and after the MLP (``GemmaDecoderLayer``);
- input embeddings scaled by sqrt(hidden_size), in the model's dtype (bfloat16 rounds it);
- scores scaled by ``query_pre_attn_scalar**-0.5``; a tanh-gated GELU MLP (``hidden_activation``);
- sliding-window attention in the layers ``layer_types`` marks (no use_sliding_window switch);
- ``final_logit_softcapping`` (set in Gemma 2, None in Gemma 3) on the logits.
Gemma 3 adds q/k RMSNorm and a second rope: its sliding layers turn at ``rope_local_base_freq``
(unscaled), the full ones at ``rope_theta`` with ``rope_scaling``. Gemma 2 caps its attention
scores (``attn_logit_softcapping``), which every attention backend applies but flash-attn before 2.6
and torch's varlen_attn (2.13's takes no softcap): backend_select.py skips those, and refuses them by
name when forced.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllmini.models.attention import KVCache
from vllmini.models.base import AttentionMetadata
from vllmini.models.layers import GatedMLP, GemmaRMSNorm
from vllmini.models.llama import DecoderLayer, DecoderVariant, LlamaForCausalLM
from vllmini.models.layer_type_rope import RopeByLayerType
from vllmini.models.rotary import rope_parameters


class GemmaDecoderLayer(DecoderLayer):
    """Norms on both sides of attention and of the MLP; ``post_attention_layernorm`` normalizes
    the attention's output here (in Llama it is the MLP's input norm)."""

    def __init__(self, config: Any, variant: DecoderVariant, mlp: nn.Module, use_rope: bool = True,
                 window: int | None = None) -> None:  # fmt: skip
        super().__init__(config, variant, mlp, use_rope, window)
        self.pre_feedforward_layernorm = variant.norm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = variant.norm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, kv_cache: KVCache | None
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos_sin, meta, kv_cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma2ForCausalLM(LlamaForCausalLM):
    variant = DecoderVariant(mlp_bias=False, sliding="by_layer_type", norm=GemmaRMSNorm, query_pre_attn_scalar=True,
                             attn_softcapping=True)  # fmt: skip
    layer_cls = GemmaDecoderLayer

    def __init__(self, config: Any) -> None:
        if getattr(config, "use_bidirectional_attention", False):  # (EmbeddingGemma: an encoder)
            raise ValueError("use_bidirectional_attention is not supported: this engine's attention is causal")
        super().__init__(config)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        field = "hidden_activation" if getattr(self.config, "hidden_activation", None) else "hidden_act"
        act = getattr(self.config, field, None) or "gelu_pytorch_tanh"
        return GatedMLP(self.config.hidden_size, self.config.intermediate_size, False, act, field)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype).item()  # (a host scalar: graph-safe)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        logits = super().forward(*args, **kwargs)
        cap = getattr(self.config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(RopeByLayerType, Gemma2ForCausalLM):
    variant = DecoderVariant(qk_norm=True, mlp_bias=False, sliding="by_layer_type", norm=GemmaRMSNorm,
                             query_pre_attn_scalar=True)  # fmt: skip

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.init_layer_type_rope(gemma3_rope_parameters)


def gemma3_rope_parameters(config: Any, layer_type: str) -> dict[str, Any]:
    """The rope of one kind of Gemma 3 layer: transformers 5 keeps a set per kind in
    ``rope_parameters``; older configs have ``rope_theta`` + ``rope_scaling`` for the full layers
    and ``rope_local_base_freq`` (unscaled) for the sliding ones."""
    params = rope_parameters(config, layer_type)
    nested = isinstance((getattr(config, "rope_parameters", None) or {}).get(layer_type), dict)
    if layer_type == "sliding_attention" and not nested:
        base = getattr(config, "rope_local_base_freq", 10000.0)
        params = {**params, "rope_type": "default", "rope_theta": base, "factor": None}
    return params
