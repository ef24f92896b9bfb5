"""LFM2's short-convolution mixer (its "conv" layers), over a varlen batch.

``in_proj`` gives three ``hidden``-wide blocks, B, C and x in that order; the layer convolves
``B * x`` with a depthwise causal kernel of ``conv_L_cache`` taps (no activation), multiplies the
result by C, and projects it back with ``out_proj``. Its memory of a sequence is only the
convolution's last ``K-1`` inputs (the ``B * x`` rows before this step), one state tensor per
slot in the model's dtype (kv/state_cache.py). Sequences are run as the Gated DeltaNet's are
(``run_by_slots``): single-token rows that continue a state run as one batch, the others one
by one; a sequence with ``seq_len == q_len`` starts from zeros, and without state tensors every
sequence starts from zeros and keeps nothing.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllmini.kv.state_cache import StateSpec
from vllmini.models.base import AttentionMetadata
from vllmini.models.causal_conv import causal_conv, causal_conv_step
from vllmini.models.state_plan import run_by_slots


class ShortConv(nn.Module):
    """The gated short convolution: ``out_proj(C * conv(B * x))``; ``conv_bias`` puts a bias on
    ``in_proj``, the convolution and ``out_proj`` alike."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, bool(getattr(config, "conv_bias", False))
        self.kernel = int(config.conv_L_cache)
        if self.kernel < 2:
            raise ValueError(f"conv_L_cache must be at least 2 (a kernel that reads earlier tokens), got {self.kernel}")
        self.hidden_size = hidden
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.conv = nn.Conv1d(hidden, hidden, self.kernel, groups=hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)

    def state_shapes(self) -> tuple[StateSpec]:
        """One sequence's state: the convolution's last ``K-1`` inputs (model dtype)."""
        return (StateSpec((self.hidden_size, self.kernel - 1)),)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, state: tuple[torch.Tensor] | None) -> torch.Tensor:
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        bx = b * h
        weight = self.conv.weight[:, 0]

        def step(rows: torch.Tensor, states: tuple[torch.Tensor]) -> tuple[torch.Tensor, tuple[torch.Tensor]]:
            conv_out, conv_state = causal_conv_step(bx.index_select(0, rows), weight, states[0], silu=False)
            return conv_out, (conv_state,)

        def prompt(span: slice, states: tuple[torch.Tensor] | None) -> tuple[torch.Tensor, tuple[torch.Tensor]]:
            conv_out, conv_state = causal_conv(bx[span], weight, None if states is None else states[0], silu=False)
            return conv_out, (conv_state,)

        out = run_by_slots(meta, state, torch.empty_like(bx), step, prompt)
        if self.conv.bias is not None:
            out = out + self.conv.bias
        return self.out_proj(c * out)
