"""Meta Llama 4 (``Llama4ForCausalLM``; Scout and Maverick are ``Llama4ForConditionalGeneration``,
served text-only through models/multimodal.py), as transformers' modeling_llama4.py:
- RoPE on adjacent pairs (transformers' complex rotation), llama3 scaling where the config sets it,
  only in the layers ``no_rope_layers`` marks with 1; the others are NoPE layers;
- in the RoPE layers, with ``use_qk_norm``, q and k L2-normed per head after RoPE (an RMSNorm
  without weight, eps ``rms_norm_eps``);
- in the NoPE layers, with ``attn_temperature_tuning``, q scaled per position p by
  ``1 + attn_scale * log(1 + floor((p + 1) / floor_scale))``;
- a mixture of experts in the layers ``moe_layers`` lists (every ``interleave_moe_layer_step``-th),
  a dense MLP ``intermediate_size_mlp`` wide elsewhere. The router takes the top-k logits and their
  sigmoid scales each expert's INPUT (not its output); one shared expert is added;
- chunked local attention (``attention_chunk_size``) in the RoPE layers: not built. Within one
  chunk it is plain causal attention, so ``max_model_len`` is capped at the chunk size
  (config.py's ``resolve_max_model_len``) and every sequence served stays inside one chunk.
Checkpoints keep the experts stacked, transposed against ours (``experts.gate_up_proj [E, H, 2I]``,
``experts.down_proj [E, I, H]``); the MLP is ``feed_forward`` and the router ``feed_forward.router``.
"""
from __future__ import annotations

import re
from typing import Any, Iterable

import torch
from torch import nn

from vllmini.models.attention import KVCache
from vllmini.models.base import AttentionMetadata
from vllmini.models.layers import GatedMLP, RMSNorm
from vllmini.models.llama import DecoderAttention, DecoderLayer, DecoderVariant, LlamaForCausalLM
from vllmini.models.moe import FusedMoE
from vllmini.models.rotary import apply_rotary

_STACKED_EXPERTS = re.compile(r"\.feed_forward\.experts\.(gate_up_proj|down_proj)$")


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama4TextL2Norm: RMSNorm without a weight, in float32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4Attention(DecoderAttention):
    """RoPE layers: rotary then the weightless q/k norm; NoPE layers: q times the position's temperature,
    which ``Llama4ForCausalLM.rope_tables`` hands over in place of their unused cos/sin table."""

    def __init__(self, config: Any, variant: DecoderVariant, use_rope: bool = True, window: int | None = None) -> None:
        super().__init__(config, variant, use_rope, window)
        self.qk_l2_norm = bool(getattr(config, "use_qk_norm", False)) and use_rope
        self.temperature_tuning = bool(getattr(config, "attn_temperature_tuning", False)) and not use_rope
        self.eps = float(config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, kv_cache: KVCache | None
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.use_rope:
            q, k = apply_rotary(q, *cos_sin, True), apply_rotary(k, *cos_sin, True)
            if self.qk_l2_norm:
                q, k = l2_norm(q, self.eps), l2_norm(k, self.eps)
        elif self.temperature_tuning:
            q = (q * cos_sin[0][:, None, None]).to(q.dtype)
        return self.o_proj(self.attn(q, k, v, meta, kv_cache, self.sinks))


class Llama4DecoderLayer(DecoderLayer):
    """Llama's pre-norm layer around :class:`Llama4Attention`."""

    def __init__(self, config: Any, variant: DecoderVariant, mlp: nn.Module, use_rope: bool = True,
                 window: int | None = None) -> None:  # fmt: skip
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Llama4Attention(config, variant, use_rope, window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp


class Llama4MoE(FusedMoE):
    """Top-k experts by router logit, each fed the token scaled by the sigmoid of its logit (the
    expert's output is not weighted), plus the always-on ``shared_expert``."""

    def __init__(self, config: Any) -> None:
        act = getattr(config, "hidden_act", "silu")
        super().__init__(config.hidden_size, config.intermediate_size, int(config.num_local_experts),
                         int(config.num_experts_per_tok), False, act)  # fmt: skip
        self.shared_expert = GatedMLP(config.hidden_size, config.intermediate_size, False, act)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, ids = self.gate(x).topk(self.top_k, dim=-1)
        return ids, torch.sigmoid(top.float()).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, scores = self.route(x)
        flat = ids.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        rows = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts)
        xs = x.index_select(0, rows) * scores.flatten().index_select(0, order)[:, None]
        routed = torch.zeros_like(x).index_add_(0, rows, self.run_experts(xs, counts))
        return self.shared_expert(x) + routed


def moe_layers(config: Any) -> list[int]:
    """The layers with experts: ``moe_layers``, else every ``interleave_moe_layer_step``-th (transformers' default)."""
    layers = getattr(config, "moe_layers", None)
    if layers is not None:
        return list(layers)
    step = int(getattr(config, "interleave_moe_layer_step", None) or 1)
    return list(range(step - 1, config.num_hidden_layers, step))


class Llama4ForCausalLM(LlamaForCausalLM):
    variant = DecoderVariant(mlp_bias=False, rope_interleaved=True)  # (q/k/v/o biases: attention_bias)
    layer_cls = Llama4DecoderLayer
    checkpoint_renames = ((".feed_forward.router.", ".mlp.gate."), (".feed_forward.", ".mlp."))

    def __init__(self, config: Any) -> None:
        self._moe_layers = set(moe_layers(config))
        super().__init__(config)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        if layer_idx in self._moe_layers:
            return Llama4MoE(self.config)
        config = self.config
        return GatedMLP(config.hidden_size, config.intermediate_size_mlp, False, getattr(config, "hidden_act", "silu"))

    def rope_tables(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The cos/sin table for the RoPE layers; for the NoPE layers each row's attention temperature
        (transformers' ``attn_scales``) in its place."""
        cos_sin = self.model.rotary_emb.cos_sin(positions)
        config = self.config
        floor = torch.floor((positions.float() + 1.0) / float(config.floor_scale))
        scales = torch.log1p(floor) * float(config.attn_scale) + 1.0
        return [cos_sin if layer.self_attn.use_rope else (scales, scales) for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's stacked experts transposed to ours (its names: ``checkpoint_renames``)."""
        transposed = ((name, t.transpose(1, 2) if _STACKED_EXPERTS.search(name) else t) for name, t in weights)
        return super().load_weights(transposed)  # ([E, H, 2I] / [E, I, H] -> [E, 2I, H] / [E, H, I])
