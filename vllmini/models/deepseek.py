"""DeepSeek-V2 / V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``: DeepSeek-V2(-Lite), V2.5,
V3, R1, Kimi-K2, Moonlight): the Llama decoder with multi-head latent attention (models/mla.py)
and DeepSeek's mixture of experts.

MoE layers (from ``first_k_dense_replace`` on, every ``moe_layer_freq``-th) are models/moe.py's
stacked experts with DeepSeek's router, plus ``n_shared_experts`` always-on experts (one MLP
``n_shared_experts x moe_intermediate_size`` wide) added to the routed sum:
- V2: softmax scores; ``greedy`` top-k, or ``group_limited_greedy`` (top-k within the ``topk_group``
  groups, of ``n_group``, whose best expert scores highest);
- V3: sigmoid scores; ``noaux_tc``: groups ranked and experts chosen on the scores plus
  ``e_score_correction_bias``, weighted by the unbiased scores.
The weights are renormalised where ``norm_topk_prob`` says so (as DeepSeek's code and vLLM; transformers'
V2 ignores it, and V2 checkpoints leave it false), then scaled by ``routed_scaling_factor``.
The router runs in float32 with its weight and bias kept in float32 (transformers keeps them so).
DeepSeek-V3's multi-token-prediction layer (``model.layers.<num_hidden_layers>.*``) is skipped.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllmini.models.layers import GatedMLP, RMSNorm
from vllmini.models.decoder_weights import copy_into
from vllmini.models.llama import DecoderLayer, DecoderVariant, LlamaForCausalLM
from vllmini.models.mla import MLAAttention
from vllmini.models.moe import FusedMoE, grouped_topk
from vllmini.models.rotary import RotaryEmbedding, rope_parameters

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")


class RouterGate(nn.Module):
    """``mlp.gate``: the router's ``weight [E, H]`` and, for noaux_tc, ``e_score_correction_bias [E]``,
    both float32 whatever the model's dtype; not an ``nn.Linear`` so the CPU prepacking leaves it be."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        bias = nn.Parameter(torch.empty(num_experts), requires_grad=False) if correction_bias else None
        self.e_score_correction_bias = bias

    def _apply(self, fn: Callable, recurse: bool = True) -> RouterGate:
        super()._apply(fn, recurse)
        for param in self.parameters(recurse=False):  # (model.to(dtype) casts every parameter)
            param.data = param.data.float()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class DeepseekMoE(FusedMoE):
    """models/moe.py's experts with DeepSeek's router and shared experts (``mlp.shared_experts``)."""

    def __init__(self, config: Any, scoring_func: str, topk_method: str) -> None:
        num_experts = int(config.n_routed_experts)
        renormalize, act = bool(getattr(config, "norm_topk_prob", False)), getattr(config, "hidden_act", "silu")
        super().__init__(config.hidden_size, config.moe_intermediate_size, num_experts, config.num_experts_per_tok,
                         renormalize, act)  # fmt: skip
        if scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func {scoring_func!r} is not supported; supported: {', '.join(SCORING_FUNCS)}")
        if topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method {topk_method!r} is not supported; supported: {', '.join(TOPK_METHODS)}")
        self.scoring_func, self.topk_method = scoring_func, topk_method
        self.num_group = int(getattr(config, "n_group", None) or 1) if topk_method != "greedy" else 1
        self.topk_group = int(getattr(config, "topk_group", None) or self.num_group) if self.num_group > 1 else 1
        if num_experts % self.num_group or not 0 < self.topk_group <= self.num_group:
            raise ValueError(f"n_group={self.num_group} must divide n_routed_experts={num_experts}, and topk_group "
                             f"({self.topk_group}) be in 1..n_group")  # fmt: skip
        if self.num_group > 1 and topk_method == "noaux_tc" and num_experts // self.num_group < 2:
            raise ValueError(f"noaux_tc ranks a group by its best two experts: n_group={self.num_group} leaves fewer")
        self.routed_scaling_factor = float(getattr(config, "routed_scaling_factor", None) or 1.0)
        self.gate = RouterGate(config.hidden_size, num_experts, correction_bias=topk_method == "noaux_tc")
        shared = int(getattr(config, "n_shared_experts", None) or 0)
        self.shared_experts = GatedMLP(config.hidden_size, config.moe_intermediate_size * shared) if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x)
        scores = logits.softmax(-1) if self.scoring_func == "softmax" else logits.sigmoid()
        ids = grouped_topk(scores, self.top_k, self.num_group, self.topk_group, self.gate.e_score_correction_bias)
        weights = scores.gather(1, ids)
        if self.renormalize:  # (at top_k 1 too: the weight becomes 1, as transformers and vLLM do)
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, (weights * self.routed_scaling_factor).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekDecoderLayer(DecoderLayer):
    """Llama's pre-norm layer (its forward) around MLA (``variant.rope_interleaved``: the rope's pair layout)."""

    def __init__(self, config: Any, variant: DecoderVariant, mlp: nn.Module, use_rope: bool = True,
                 window: int | None = None) -> None:  # fmt: skip
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAAttention(config, variant.rope_interleaved, window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 / V2-Lite / V2.5: rope on interleaved pairs (transformers' complex rotation)."""

    layer_cls = DeepseekDecoderLayer
    use_mla = True  # one latent per token in the KV cache (kv/cache.py's KVCacheSpec.use_mla)
    default_scoring, default_topk_method = "softmax", "greedy"

    def __init__(self, config: Any) -> None:
        self.variant = DecoderVariant(rope_interleaved=self.interleaved_rope(config))
        for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(config, key, None)
            positive = isinstance(value, int) and not isinstance(value, bool) and value >= 1
            if not positive and not (key == "q_lora_rank" and value is None):  # (null q_lora_rank: V2-Lite's q_proj)
                raise ValueError(f"{key} is {value!r}; it must be a positive integer")
        super().__init__(config)
        # (DecoderModel sizes its rope by config.head_dim, which transformers sets to qk_rope_head_dim)
        interleaved = self.variant.rope_interleaved
        self.model.rotary_emb = RotaryEmbedding(config.qk_rope_head_dim, rope_parameters(config), interleaved)

    @staticmethod
    def interleaved_rope(config: Any) -> bool:
        return True

    def build_mlp(self, layer_idx: int) -> nn.Module:
        config = self.config
        first_dense = int(getattr(config, "first_k_dense_replace", None) or 0)
        freq = int(getattr(config, "moe_layer_freq", None) or 1)
        if getattr(config, "n_routed_experts", None) and layer_idx >= first_dense and layer_idx % freq == 0:
            scoring = getattr(config, "scoring_func", None) or self.default_scoring
            return DeepseekMoE(config, scoring, getattr(config, "topk_method", None) or self.default_topk_method)
        bias = bool(getattr(config, "mlp_bias", False))
        return GatedMLP(config.hidden_size, config.intermediate_size, bias, getattr(config, "hidden_act", "silu"))

    def lora_targets(self) -> list[tuple[str, list[str], list[int]]]:
        raise ValueError(f"LoRA adapters are not supported for {type(self).__name__} (multi-head latent attention)")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The Llama loader, but ``self_attn.q_proj`` (V2-Lite's unfused query) is copied as it is, and
        DeepSeek-V3's MTP layers (index >= num_hidden_layers) are skipped."""
        params, direct = dict(self.named_parameters()), set()

        def rest() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in without_mtp_layers(weights, self.config.num_hidden_layers):
                if ".self_attn.q_proj." in name:
                    copy_into(self._param(params, name, name).data, tensor, name)
                    direct.add(name)
                    continue
                yield name, tensor

        return super().load_weights(rest()) | direct


def without_mtp_layers(weights: Iterable[tuple[str, torch.Tensor]],
                       num_layers: int) -> Iterable[tuple[str, torch.Tensor]]:  # fmt: skip
    """``weights`` less the multi-token-prediction layers stored after the last decoder layer
    (``model.layers.<num_layers + i>.*``: DeepSeek-V3, GLM-4.5): vllmini proposes no tokens with them."""
    for name, tensor in weights:
        parts = name.split(".")
        if not (name.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) >= num_layers):
            yield name, tensor


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1, Kimi-K2, Moonlight: sigmoid routing with noaux_tc; rope on interleaved pairs
    unless ``rope_interleave`` is false (then on halves)."""

    default_scoring, default_topk_method = "sigmoid", "noaux_tc"

    @staticmethod
    def interleaved_rope(config: Any) -> bool:
        return bool(getattr(config, "rope_interleave", True))
