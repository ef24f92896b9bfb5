"""Multi-head latent attention (MLA, DeepSeek-V2/V3), run as vLLM runs it: the KV cache holds one
latent per token, not per-head keys and values.

Each token's ``kv_a_proj_with_mqa`` output is a compressed KV ``c`` (``kv_lora_rank`` values,
RMS-normed) and a key part ``k_pe`` (``qk_rope_head_dim``, rotated) shared by all heads. Per head,
transformers expands ``c`` with ``kv_b_proj`` into ``k_nope = W_UK c`` and ``v = W_UV c``. Since
``q_nope . (W_UK c) = (W_UK^T q_nope) . c``, the ``W_UK`` part is absorbed into the query instead,
and ``W_UV`` is applied after attention (it is linear, the softmax weights sum to one). Attention
then runs as MQA over one KV head of ``kv_lora_rank + qk_rope_head_dim`` dims: the latent
``[c, k_pe]`` is the key, and its first ``kv_lora_rank`` dims are the value. The backends take
keys and values of one width, so the whole latent goes in as the value too, and the output's
``k_pe`` columns are dropped; the cache's K and V are one tensor (``KVCacheSpec.use_mla``): a
token costs ``(kv_lora_rank + qk_rope_head_dim) x dtype`` bytes per layer (DeepSeek-V3: 576 values,
where per-head K/V would be 128 x (192 + 128)).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from vllmini.models.attention import Attention, KVCache
from vllmini.models.base import AttentionMetadata
from vllmini.models.layers import RMSNorm
from vllmini.models.rotary import apply_rotary, rope_parameters

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers and DeepSeek's code leave rms_norm_eps out


class LatentProjection(nn.Module):
    """``kv_b_proj``'s weight ``[heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]``, read in
    slices by :class:`MLAAttention`, never called as a linear (so not an ``nn.Linear``: the CPU
    prepacking would replace it with an opaque packed one)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)


def mla_softmax_scale(config: Any) -> float:
    """``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2``
    when the rope is scaled and ``mscale_all_dim`` is set (transformers' ``yarn_apply_mscale``)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    factor, m_all = params.get("factor"), params.get("mscale_all_dim")
    if params["rope_type"] != "default" and m_all and factor and factor > 1:
        mscale = 0.1 * float(m_all) * math.log(float(factor)) + 1.0
        scale *= mscale * mscale
    return scale


class MLAAttention(nn.Module):
    """DeepSeek's attention (checkpoint names: ``q_proj`` or ``q_a_proj``/``q_a_layernorm``/``q_b_proj``,
    ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``) over a latent cache."""

    def __init__(self, config: Any, rope_interleaved: bool, window: int | None = None) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.num_heads, self.q_lora_rank, self.kv_lora_rank = heads, config.q_lora_rank, config.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.qk_head_dim = self.nope_dim + self.rope_dim
        self.rope_interleaved = rope_interleaved
        bias = bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank is None:  # (DeepSeek-V2-Lite)
            self.q_proj = nn.Linear(hidden, heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora_rank, heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = LatentProjection(self.kv_lora_rank, heads * (self.nope_dim + self.v_dim))
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=bias)
        # one KV head of the whole latent (the model's num_kv_heads / head_dim, what the cache holds)
        self.num_kv_heads, self.head_dim = 1, self.kv_lora_rank + self.rope_dim
        self.attn = Attention(heads, 1, self.head_dim, mla_softmax_scale(config), window)
        self.sinks = None  # (what the decoder's properties read: no attention sinks)

    def forward(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
        kv_cache: KVCache | None,
    ) -> torch.Tensor:  # fmt: skip
        tokens, heads = x.shape[0], self.num_heads
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(tokens, heads, self.qk_head_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_pe = apply_rotary(q_pe, *cos_sin, self.rope_interleaved)
        k_pe = apply_rotary(k_pe[:, None, :], *cos_sin, self.rope_interleaved)
        w = self.kv_b_proj.weight.view(heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, kv_lora_rank]
        latent = torch.cat((self.kv_a_layernorm(c)[:, None, :], k_pe), dim=-1)  # [T, 1, head_dim]
        out = self.attn(torch.cat((q_latent, q_pe), dim=-1), latent, latent, meta, kv_cache)
        out = out.view(tokens, heads, self.head_dim)[..., : self.kv_lora_rank]
        values = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2))  # [H, T, v_head_dim]
        return self.o_proj(values.transpose(0, 1).reshape(tokens, heads * self.v_dim))
