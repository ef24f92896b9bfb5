"""Microsoft Phi-3.5-MoE (``PhimoeForCausalLM``), as transformers' modeling_phimoe.py:
- Llama's pre-norm layer with LayerNorms (weight and bias, eps ``rms_norm_eps``), q/k/v/o biases from
  ``attention_bias``, the lm_head's from ``lm_head_bias``; sliding in every layer once ``sliding_window`` is set;
- experts (``block_sparse_moe``: ``w1``/``w3``/``w2``) ``intermediate_size`` wide in every layer, routed
  by the sparsemixer as it runs at inference: the best expert, weighted by a softmax over the logits
  within ``2 * router_jitter_noise`` (relative) of it, then the best of the rest, weighted likewise;
- longrope whose cos/sin are scaled by ``short_mscale`` / ``long_mscale`` rather than the usual factor.
Transformers 5.25 always rotates by the short factors and takes long_mscale once a sequence passes
``original_max_position_embeddings``; here, as vLLM and rotary.py's longrope, one choice per engine from
max_model_len: the same on every sequence within the original context."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllmini.models.llama import DecoderVariant
from vllmini.models.mixtral import MixtralForCausalLM
from vllmini.models.moe import FusedMoE
from vllmini.models.rotary import RotaryEmbedding, rope_parameters


def _masked_softmax_weight(scores: torch.Tensor, candidates: torch.Tensor, best: torch.Tensor, eps: float) -> torch.Tensor:
    """The softmax weight of ``best`` among ``candidates`` (scores, -inf where excluded) within
    ``2 * eps`` of it, relative to ``max(|score|, best's)``."""
    top = candidates.gather(-1, best)
    far = (top - scores) / scores.abs().clamp(min=top) > 2 * eps
    return torch.softmax(candidates.masked_fill(far, float("-inf")), dim=-1).gather(-1, best)


class PhimoeMoE(FusedMoE):
    """Mixtral's experts under the sparsemixer's top-2."""

    def __init__(self, config: Any) -> None:
        super().__init__(config.hidden_size, config.intermediate_size, config.num_local_experts, 2, False,
                         getattr(config, "hidden_act", "silu"))  # fmt: skip
        self.eps = float(getattr(config, "router_jitter_noise", 0.01))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.gate(x).float()
        first = scores.argmax(-1, keepdim=True)
        rest = scores.scatter(-1, first, float("-inf"))
        second = rest.argmax(-1, keepdim=True)
        weights = torch.cat((_masked_softmax_weight(scores, scores, first, self.eps),
                             _masked_softmax_weight(scores, rest, second, self.eps)), dim=-1)  # fmt: skip
        return torch.cat((first, second), dim=-1), weights.to(x.dtype)


class PhimoeRotaryEmbedding(RotaryEmbedding):
    """Longrope with cos/sin scaled by the config's short or long mscale."""

    def _inv_freq(self, device: torch.device | None = None) -> torch.Tensor:
        inv_freq = super()._inv_freq(device)
        if self.params["rope_type"] == "longrope":
            long = self.context_len > self.params["original_max_position_embeddings"]
            self.attention_scaling = float(self.params["long_mscale" if long else "short_mscale"])
        return inv_freq


class PhimoeForCausalLM(MixtralForCausalLM):
    """Mixtral's checkpoint names (``block_sparse_moe``, ``w1``/``w3``/``w2``) and experts, routed by the sparsemixer."""

    variant = DecoderVariant(mlp_bias=False, sliding="every_layer", norm=nn.LayerNorm)  # (q/k/v/o bias: attention_bias)

    def __init__(self, config: Any) -> None:
        if config.num_experts_per_tok != 2:
            raise ValueError(f"num_experts_per_tok={config.num_experts_per_tok} is not supported for "
                             f"PhimoeForCausalLM; supported: 2 (the sparsemixer's top-2)")  # fmt: skip
        super().__init__(config)
        self.model.rotary_emb = PhimoeRotaryEmbedding(self.head_dim, rope_parameters(config))
        if getattr(config, "lm_head_bias", False):
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=True)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return PhimoeMoE(self.config)
