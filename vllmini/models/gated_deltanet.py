"""Gated DeltaNet: the linear-attention layer of Qwen3.5 and Qwen3-Next, over a varlen batch.

Instead of K/V that grow with the sequence, each sequence carries a fixed-size state per layer
(kv/state_cache.py): the last ``K-1`` inputs of the short convolution and the delta rule's
``[Hv, Dk, Dv]`` matrix (models/gated_delta_rule.py). ``meta.state_indices`` gives each
sequence's slot in those tensors; a sequence whose context starts in this step (``seq_len ==
q_len``: a new prompt, or one preempted and recomputed) starts from zeros, any other continues
its slot's state, and every sequence leaves its state after its last scheduled token there.
Without state tensors (a forward with no cache) every sequence starts from zeros and keeps nothing.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllmini.kv.state_cache import StateSpec
from vllmini.models.base import AttentionMetadata
from vllmini.models.causal_conv import causal_conv, causal_conv_step
from vllmini.models.gated_delta_rule import delta_rule_chunked, delta_rule_step, prepare_qk
from vllmini.models.state_plan import run_by_slots

LinearState = tuple[torch.Tensor, torch.Tensor]  # ([slots, conv_dim, K-1], [slots, Hv, Dk, Dv] float32)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output (its own weight, not offset from 1), times SiLU of the gate."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        x = x.float()
        x = (self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)).float()
        return (x * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's projections (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``; Qwen3-Next's
    fused ones are split into them as they load: models/qwen3_next.py), the short convolution over
    q/k/v, the gated delta rule and a gated RMSNorm before ``out_proj``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.num_k_heads})")  # fmt: skip
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = config.linear_conv_kernel_dim
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def state_shapes(self) -> tuple[StateSpec, StateSpec]:
        """One sequence's state: the convolution's last inputs, the delta rule's matrices (float32)."""
        return (StateSpec((self.conv_dim, self.conv_kernel - 1)),
                StateSpec((self.num_v_heads, self.head_k_dim, self.head_v_dim), recurrent=True))  # fmt: skip

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, state: LinearState | None) -> torch.Tensor:
        mixed = self.in_proj_qkv(x)
        beta = self.in_proj_b(x).sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        weight = self.conv1d.weight[:, 0]

        def step(rows: torch.Tensor, states: LinearState) -> tuple[torch.Tensor, LinearState]:
            conv_out, conv_state = causal_conv_step(mixed.index_select(0, rows), weight, states[0])
            o, s = delta_rule_step(*self._split(conv_out), g.index_select(0, rows), beta.index_select(0, rows), states[1])
            return o, (conv_state, s)

        def prompt(span: slice, states: LinearState | None) -> tuple[torch.Tensor, LinearState]:
            conv_out, conv_state = causal_conv(mixed[span], weight, None if states is None else states[0])
            o, s = delta_rule_chunked(*self._split(conv_out), g[span], beta[span], None if states is None else states[1])
            return o, (conv_state, s)

        out = x.new_empty(x.shape[0], self.num_v_heads, self.head_v_dim, dtype=torch.float32)
        run_by_slots(meta, state, out, step, prompt)
        z = self.in_proj_z(x).view(-1, self.num_v_heads, self.head_v_dim)
        return self.out_proj(self.norm(out.to(x.dtype), z, x.dtype).reshape(x.shape[0], self.value_dim))

    def _split(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolved q/k/v of ``[N, conv_dim]`` rows as the rule reads them (q, k prepared)."""
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = prepare_qk(q.view(-1, self.num_k_heads, self.head_k_dim), k.view(-1, self.num_k_heads, self.head_k_dim),
                          self.num_v_heads)  # fmt: skip
        return q, k, v.view(-1, self.num_v_heads, self.head_v_dim).float()
