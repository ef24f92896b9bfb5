"""Layers shared by every model: RMSNorm and the gated MLP (rotary embedding: rotary.py).

Numerics follow HF transformers (norms in fp32) so that the
parity tests can demand logits within 1e-4.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GatedMLP(nn.Module):
    """SiLU-gated MLP with gate and up projections fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, act: str = "silu") -> None:
        super().__init__()
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported; supported: silu")
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
