"""Liquid AI's LFM2 (LFM2-350M / 700M / 1.2B / 2.6B) and LFM2-MoE (LFM2-8B-A1B): a hybrid decoder of short-convolution layers
(models/short_conv.py: a fixed-size state per sequence, the convolution's last inputs) and
full-attention layers (a paged KV cache), as ``layer_types`` says ("conv" / "full_attention";
transformers builds it from the older ``full_attn_idxs``).

The attention is Llama's with a per-head RMSNorm on q and k before RoPE (``q_layernorm`` /
``k_layernorm``), no biases; norms are plain RMSNorms of eps ``norm_eps`` (``operator_norm``
before the mixer, ``ffn_norm`` before the MLP, ``embedding_norm`` after the last layer, despite
its name); the MLP is SwiGLU (``w1`` gate, ``w3`` up, ``w2`` down) whose width
``block_auto_adjust_ff_dim`` may shrink to two thirds of ``intermediate_size``, scaled by
``block_ffn_dim_multiplier`` and rounded up to ``block_multiple_of``. The hybrid machinery (which
layers page their KV, state slots, refusals) is Qwen3.5's (models/qwen3_5.py); checkpoint names are
mapped onto it as they load.

LFM2-MoE keeps that body; its first ``num_dense_layers`` MLPs are dense (``intermediate_size`` as it
is), the others ``num_experts`` SwiGLU experts (``moe_intermediate_size``) behind a sigmoid router:
the top ``num_experts_per_tok`` are chosen on the scores plus ``expert_bias`` (when
``use_expert_bias``), weighted by the unbiased scores, renormalised (``norm_topk_prob``, 1e-6 in the
denominator as transformers) and scaled by ``routed_scaling_factor``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllmini.models.deepseek import RouterGate
from vllmini.models.layers import GatedMLP
from vllmini.models.llama import DecoderAttention, DecoderVariant
from vllmini.models.moe import FusedMoE, grouped_topk
from vllmini.models.qwen3_5 import HybridDecoderLayer, Qwen3_5ForCausalLM
from vllmini.models.short_conv import ShortConv

# (checkpoint's, ours): transformers' LFM2 names onto the shared decoder's
LFM2_RENAMES: tuple[tuple[str, str], ...] = (
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
    (".conv.in_proj.", ".linear_attn.in_proj."),
    (".conv.conv.", ".linear_attn.conv."),
    (".conv.out_proj.", ".linear_attn.out_proj."),
    (".operator_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
    (".feed_forward.", ".mlp."),
    (".mlp.w1.", ".mlp.gate_proj."),
    (".mlp.w3.", ".mlp.up_proj."),
    (".mlp.w2.", ".mlp.down_proj."),
    ("model.embedding_norm.", "model.norm."),
)


def lfm2_ffn_size(config: Any) -> int:
    """The dense MLP's width as transformers' Lfm2MLP sizes it from the config."""
    size = int(config.intermediate_size)
    if getattr(config, "block_auto_adjust_ff_dim", False):
        size = int(2 * size / 3)
        multiplier = getattr(config, "block_ffn_dim_multiplier", None)
        if multiplier is not None:
            multiple = int(config.block_multiple_of)
            if multiple <= 0:
                raise ValueError(f"block_multiple_of must be positive, got {multiple}")
            size = int(multiplier * size)
            size = multiple * ((size + multiple - 1) // multiple)
    return size


class Lfm2DecoderLayer(HybridDecoderLayer):
    """A pre-norm layer whose token mixer is attention or, once ``make_linear`` ran, a short
    convolution (``linear_attn``: the name the hybrid machinery reads)."""

    attention_cls = DecoderAttention
    linear_cls = ShortConv


class Lfm2ForCausalLM(Qwen3_5ForCausalLM):
    variant = DecoderVariant(qk_norm=True, qkv_bias=False, o_bias=False, mlp_bias=False)
    layer_cls = Lfm2DecoderLayer
    linear_layer_type = "conv"
    state_layers_name = "short-convolution layers"
    checkpoint_renames = LFM2_RENAMES

    def __init__(self, config: Any) -> None:
        config.rms_norm_eps = config.norm_eps  # (the shared decoder reads its norms' eps there)
        super().__init__(config)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return GatedMLP(self.config.hidden_size, lfm2_ffn_size(self.config))



class Lfm2MoE(FusedMoE):
    """models/moe.py's experts behind LFM2-MoE's sigmoid router (in float32: ``RouterGate``, whose
    correction bias is the checkpoint's ``feed_forward.expert_bias``)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config.hidden_size, config.moe_intermediate_size, int(config.num_experts),
                         int(config.num_experts_per_tok), bool(getattr(config, "norm_topk_prob", True)))  # fmt: skip
        self.routed_scaling_factor = float(getattr(config, "routed_scaling_factor", None) or 1.0)
        self.gate = RouterGate(config.hidden_size, self.num_experts, bool(getattr(config, "use_expert_bias", True)))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.gate(x).sigmoid()
        ids = grouped_topk(scores, self.top_k, 1, 1, self.gate.e_score_correction_bias)
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
        return ids, (weights * self.routed_scaling_factor).to(x.dtype)


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    expert_projections = ("w1", "w3", "w2")  # (each expert's gate, up, down in the checkpoint)
    checkpoint_renames = (*LFM2_RENAMES, (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"))

    def build_mlp(self, layer_idx: int) -> nn.Module:
        c = self.config
        if layer_idx < int(getattr(c, "num_dense_layers", 0) or 0):
            return GatedMLP(c.hidden_size, int(c.intermediate_size))
        return Lfm2MoE(c)
