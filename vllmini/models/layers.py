"""Layers shared by every model: RMSNorm and the gated MLP (rotary embedding: rotary.py).

Numerics follow HF transformers (norms in fp32) so that the
parity tests can demand logits within 1e-4.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` over its root mean square, in float32."""
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self.normalize(x).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is an offset from 1, applied in float32 before the cast back
    (Llama casts first, then scales), as transformers' Gemma2/Gemma3RMSNorm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.normalize(x) * (1.0 + self.weight.float())).to(x.dtype)


# hidden_act -> the gate's activation (gelu_pytorch_tanh: Gemma's tanh-approximated GELU)
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}


class GatedMLP(nn.Module):
    """Gated MLP (SiLU, or Gemma's GELU) with gate and up projections fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, act: str = "silu",
                 act_field: str = "hidden_act") -> None:  # fmt: skip
        """``act_field``: the config key ``act`` came from, for the error (Gemma's is hidden_activation)."""
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"{act_field} {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        self.act = ACTIVATIONS[act]
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)
