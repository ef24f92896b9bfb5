"""Qwen3.5 (dense and MoE): a hybrid decoder, three Gated DeltaNet layers (linear attention with a
fixed-size state per sequence: models/gated_deltanet.py) to every full-attention layer, as
``layer_types`` says.

The full-attention layers are Qwen3's with an output gate: ``q_proj`` gives each head its query
and a gate (``[q_h, gate_h]`` per head), and the attention output is multiplied by
``sigmoid(gate)`` before ``o_proj``; RoPE turns the first ``partial_rotary_factor`` of each head.
Every RMSNorm but the linear layers' gated one is zero-centred (the weight is an offset from 1,
as Gemma's). Only the full-attention layers have a paged KV cache: attention layer ``j`` uses
``kv_caches[j]``, linear layer ``j`` the state tensors ``meta.state_caches[j]``. Qwen3-Next is this
model under other checkpoint names and layer plan (models/qwen3_next.py).
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from vllmini.models.attention import KVCache
from vllmini.models.base import AttentionMetadata
from vllmini.models.gated_deltanet import GatedDeltaNet
from vllmini.models.hybrid import StatefulHybrid
from vllmini.models.layers import GemmaRMSNorm
from vllmini.models.llama import DecoderAttention, DecoderLayer, DecoderVariant, LlamaForCausalLM
from vllmini.models.moe import SharedExpertMoE, num_experts
from vllmini.models.rotary import apply_rotary


class GatedAttention(DecoderAttention):
    """Qwen3's attention whose ``q_proj`` also gives a per-head output gate."""

    def __init__(self, config: Any, variant: DecoderVariant, use_rope: bool = True, window: int | None = None) -> None:
        super().__init__(config, variant, use_rope, window)
        self.qkv_proj = nn.Linear(config.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=self.qkv_proj.bias is not None)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                kv_cache: KVCache | None) -> torch.Tensor:  # fmt: skip
        q_gate, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = q_gate.view(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        out = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), meta, kv_cache, self.sinks)
        return self.o_proj(out * torch.sigmoid(gate.reshape(out.shape)))


class HybridDecoderLayer(DecoderLayer):
    """A decoder layer whose token mixer is ``attention_cls`` (gated attention) or, once ``make_linear``
    ran, ``linear_cls`` (a Gated DeltaNet; LFM2's layer: a short convolution), named ``linear_attn``."""

    attention_cls: type[DecoderAttention] = GatedAttention
    linear_cls: type[nn.Module] = GatedDeltaNet

    def __init__(self, config: Any, variant: DecoderVariant, mlp: nn.Module, use_rope: bool = True,
                 window: int | None = None) -> None:  # fmt: skip
        super().__init__(config, variant, mlp, use_rope, window)
        if self.attention_cls is not DecoderAttention:
            self.self_attn = self.attention_cls(config, variant, use_rope, window)
        self.linear_attn: nn.Module | None = None

    def make_linear(self, config: Any) -> None:
        self.self_attn, self.linear_attn = None, self.linear_cls(config)

    @property
    def state_mixer(self) -> nn.Module | None:
        return self.linear_attn

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                cache: Any) -> torch.Tensor:  # fmt: skip
        h = self.input_layernorm(x)
        h = self.linear_attn(h, meta, cache) if self.linear_attn is not None else self.self_attn(h, cos_sin, meta, cache)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5ForCausalLM(StatefulHybrid, LlamaForCausalLM):
    state_layers_name = "linear-attention layers (Gated DeltaNet)"
    variant = DecoderVariant(qk_norm=True, mlp_bias=False, norm=GemmaRMSNorm)
    layer_cls = HybridDecoderLayer
    linear_layer_type = "linear_attention"  # layer_types' name for a stateful layer (LFM2: "conv")

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        types, linear = list(getattr(config, "layer_types", None) or []), self.linear_layer_type
        if len(types) != config.num_hidden_layers or set(types) - {linear, "full_attention"}:
            raise ValueError(f"layer_types must name '{linear}' or 'full_attention' for each of the "
                             f"{config.num_hidden_layers} layers, got {types}")  # fmt: skip
        if "full_attention" not in types:
            raise ValueError("layer_types has no 'full_attention' layer; vllmini needs at least one")
        for layer, kind in zip(self.model.layers, types):
            if kind == linear:
                layer.make_linear(config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's, but its multi-token-prediction layer (``mtp.*``, for speculative decoding,
        which transformers skips too)."""
        return super().load_weights((name, t) for name, t in weights if not name.startswith("mtp."))


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE: every layer's MLP is ``num_experts`` experts (top ``num_experts_per_tok``, always
    renormalised) beside a shared expert scaled by ``sigmoid(shared_expert_gate)``."""

    def build_mlp(self, layer_idx: int) -> nn.Module:
        c = self.config
        return SharedExpertMoE(c.hidden_size, c.moe_intermediate_size, num_experts(c), c.num_experts_per_tok, True,
                               c.shared_expert_intermediate_size, getattr(c, "hidden_act", "silu"))  # fmt: skip
