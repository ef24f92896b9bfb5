"""BigCode StarCoder2 (``Starcoder2ForCausalLM``: starcoder2-3b/7b/15b), as transformers'
modeling_starcoder2.py: Llama's pre-norm layer with LayerNorms (weight and bias, eps ``norm_epsilon``),
every bias from ``use_bias`` (q/k/v/o and the MLP), a non-gated MLP (``c_fc``, the activation, ``c_proj``),
sliding in every layer once ``sliding_window`` is set; the dropouts are training-only."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllmini.models.layers import ACTIVATIONS
from vllmini.models.llama import DecoderVariant, LlamaForCausalLM


class Starcoder2MLP(nn.Module):
    """``c_proj(act(c_fc(x)))``: no gate."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, act: str) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported for Starcoder2ForCausalLM; "
                             f"supported: {', '.join(ACTIVATIONS)}")  # fmt: skip
        self.act = ACTIVATIONS[act]
        self.c_fc = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.c_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Starcoder2ForCausalLM(LlamaForCausalLM):
    variant = DecoderVariant(sliding="every_layer", norm=nn.LayerNorm, bias_key="use_bias")

    def __init__(self, config: Any) -> None:
        config.rms_norm_eps = config.norm_epsilon  # (the shared decoder reads its norms' eps there)
        super().__init__(config)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        config = self.config
        return Starcoder2MLP(config.hidden_size, config.intermediate_size, bool(getattr(config, "use_bias", True)),
                             getattr(config, "hidden_act", "gelu_pytorch_tanh"))  # fmt: skip
