"""Layers shared by every model: RMSNorm, rotary embedding (incl. linear and llama3 scaling), gated MLP.

Numerics follow HF transformers (norms in fp32, rotary angles in fp32) so that the
parity tests can demand logits within 1e-4.
"""
from __future__ import annotations

import math
from typing import Any

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


def rope_parameters(config: Any) -> dict[str, Any]:
    """One dict for rope settings, whether the config uses transformers 5's
    ``rope_parameters`` or the older ``rope_theta`` + ``rope_scaling`` pair."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None)
    if scaling:
        params = {**scaling, **params}
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths are slowed by ``factor``,
    short ones kept, the band between interpolated smoothly."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding over the full head dim; angles computed per forward
    from the positions (cheap, and no cache sized by a 128k context)."""

    SUPPORTED = ("default", "linear", "llama3")

    def __init__(self, head_dim: int, params: dict[str, Any]) -> None:
        super().__init__()
        rope_type = params["rope_type"]
        if rope_type not in self.SUPPORTED:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(self.SUPPORTED)}")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported")
        self.head_dim = head_dim
        self.params = params
        # Built on the meta device (weight_loader), the buffer is only a placeholder until
        # reset_buffers: computing it there would run meta ops, which import torch._dynamo.
        on_meta = torch.empty(0).device.type == "meta"
        inv_freq = torch.empty(head_dim // 2) if on_meta else self._inv_freq()
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _inv_freq(self, device: torch.device | None = None) -> torch.Tensor:
        theta = float(self.params["rope_theta"])
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
        inv_freq = 1.0 / (theta**exponents)
        if self.params["rope_type"] == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, self.params)
        elif self.params["rope_type"] == "linear":  # position interpolation: every angle slowed by factor
            inv_freq = inv_freq / float(self.params["factor"])
        return inv_freq

    def reset_buffers(self) -> None:
        """Recompute ``inv_freq`` (in fp32) after the model was materialized from the meta device."""
        self.inv_freq = self._inv_freq(self.inv_freq.device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[T, head_dim]`` in fp32 for the flat batch's positions."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` by per-token angles (HF's rotate_half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


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
