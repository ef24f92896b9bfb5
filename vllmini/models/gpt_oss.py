"""OpenAI gpt-oss (``GptOssForCausalLM``: gpt-oss-20b, gpt-oss-120b), as transformers' modeling_gpt_oss.py:
- Llama's layer with biases on q/k/v and o_proj, and attention *sinks*: a learned logit per query
  head joins each softmax as one more column, then is dropped (every backend applies them, or
  backend_select.py skips it);
- sliding-window attention (128 keys) in the layers ``layer_types`` marks, full in the others: the
  KV cache groups them as vLLM's hybrid KV cache manager does (kv/kv_groups.py);
- a mixture of experts in every layer: a router with a bias picks the top-k experts by logit, the
  k logits softmaxed; each expert's gate/up and down projections have biases, and its activation
  is a clamped SwiGLU: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with
  ``g = min(gate, limit)``;
- RMSNorm weights applied in float32, before the cast back (as OLMo 2's);
- YaRN rope (models/rotary.py, ``truncate: false``).
Checkpoints hold the experts as transformers >= 5 does in memory (``experts.gate_up_proj [E, H, 2I]``
with gate and up interleaved along the last axis, ``experts.down_proj [E, I, H]``, ``*_bias``), or,
as OpenAI publishes them, in MXFP4 (``*_blocks`` / ``*_scales``), dequantized while loading
(models/mxfp4.py).
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from vllmini.models.llama import DecoderVariant, LlamaForCausalLM
from vllmini.models.moe import ExpertWeights, FusedMoE, num_experts
from vllmini.models.olmo2 import Olmo2RMSNorm


class GptOssMoE(FusedMoE):
    """gpt-oss's MLP: ``router`` (with a bias) and biased experts with the clamped SwiGLU."""

    def __init__(self, config: Any) -> None:
        nn.Module.__init__(self)  # (not FusedMoE's: its router is ``gate``, unbiased; this one keeps the checkpoint's name)
        self.num_experts, self.top_k = num_experts(config), int(config.num_experts_per_tok)
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..num_local_experts ({self.num_experts}), got {self.top_k}")
        self.alpha, self.limit = float(config.swiglu_alpha), float(config.swiglu_limit)
        self.router = nn.Linear(config.hidden_size, self.num_experts, bias=True)
        self.experts = ExpertWeights(self.num_experts, config.hidden_size, config.intermediate_size, bias=True)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k experts by router logit, weighted by the softmax of those k logits (in float32)."""
        top, ids = self.router(x).topk(self.top_k, dim=-1)
        return ids, torch.softmax(top.float(), dim=-1).to(x.dtype)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        return (up.clamp(-self.limit, self.limit) + 1) * gate * torch.sigmoid(gate * self.alpha)


class GptOssForCausalLM(LlamaForCausalLM):
    variant = DecoderVariant(qkv_bias=True, o_bias=True, sliding="by_layer_type", norm=Olmo2RMSNorm, attn_sinks=True)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return GptOssMoE(self.config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(_our_expert_layout(weights))


def _our_expert_layout(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss's expert tensors in ``ExpertWeights``' layout and names, the rest as they come:
    ``gate_up_proj [E, H, 2I]`` (gate and up interleaved) -> ``w13 [E, 2I, H]`` gate first;
    ``down_proj [E, I, H]`` -> ``w2 [E, H, I]``; biases likewise. (MXFP4 experts come here
    dequantized: models/mxfp4.py, ``dequantize_mxfp4_weights``.)"""
    for name, tensor in weights:
        if name.endswith(".experts.gate_up_proj"):
            yield name[: -len("gate_up_proj")] + "w13", _gate_first(tensor.transpose(1, 2), dim=1)
        elif name.endswith(".experts.down_proj"):
            yield name[: -len("down_proj")] + "w2", tensor.transpose(1, 2)
        elif name.endswith(".experts.gate_up_proj_bias"):
            yield name[: -len("gate_up_proj_bias")] + "b13", _gate_first(tensor, dim=1)
        elif name.endswith(".experts.down_proj_bias"):
            yield name[: -len("down_proj_bias")] + "b2", tensor
        else:
            yield name, tensor


def _gate_first(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate/up rows along ``dim`` (gate at even indices) -> all gates, then all ups."""
    lead = (slice(None),) * dim
    return torch.cat((tensor[(*lead, slice(0, None, 2))], tensor[(*lead, slice(1, None, 2))]), dim=dim)
