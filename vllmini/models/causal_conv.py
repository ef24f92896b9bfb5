"""The short causal depthwise convolution that linear-attention and state-space layers run before
their recurrence (Gated DeltaNet, Mamba2) or as their whole mixer (LFM2), over one sequence or a
batch of single-token decode rows. Its per-sequence state is the ``K-1`` inputs before the next one."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None,
                bias: torch.Tensor | None = None, silu: bool = True) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Depthwise causal convolution of one sequence's ``x [T, C]`` (kernel ``weight [C, K]``, optional
    ``bias [C]``: Mamba2's) continuing from ``state [C, K-1]``, the K-1 inputs before it (None: zeros),
    then SiLU (unless ``silu`` is False: LFM2's short convolution has no activation).
    Returns the output ``[T, C]`` and the new state (the last K-1 inputs)."""
    width = weight.shape[1] - 1
    if state is None:
        state = x.new_zeros(x.shape[1], width)
    extended = torch.cat([state.to(x.dtype), x.t()], dim=1)  # [C, K-1+T]
    out = F.conv1d(extended[None], weight[:, None, :], bias, groups=weight.shape[0])[0].t()  # [T, C]
    return F.silu(out) if silu else out, extended[:, extended.shape[1] - width :]


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, bias: torch.Tensor | None = None,
                     silu: bool = True) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One token per row: ``x [B, C]`` after ``state [B, C, K-1]``; returns (the output, SiLU'd unless
    ``silu`` is False; the new state)."""
    extended = torch.cat([state.to(x.dtype), x[:, :, None]], dim=2)  # [B, C, K]
    out = (extended * weight).sum(-1)
    out = out if bias is None else out + bias
    return F.silu(out) if silu else out, extended[:, :, 1:]
