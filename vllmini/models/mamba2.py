"""The Mamba2 mixer (Granite 4.0's ``mamba`` layers, the Mamba2 half of Falcon-H1's) over a varlen batch.

``in_proj`` gives, per token, a gate ``z``, the convolution's input ``xBC`` and a step ``dt`` per
head. ``xBC`` goes through a short causal depthwise convolution (with bias) and SiLU, then splits
into the heads' input ``x`` and the groups' ``B`` and ``C``; the SSD recurrence (models/ssd.py)
turns them into ``y``, normalised group-wise after the gate (``RMSNorm(y * silu(z))`` per group of
``intermediate / n_groups`` channels; Falcon-H1 may normalise before the gate, or not at all), then
``out_proj``.

Each sequence carries a fixed-size state per layer (kv/state_cache.py): the convolution's last
``K-1`` inputs (model dtype) and the recurrence's ``[heads, head_dim, d_state]`` (float32), read and
written at ``meta.state_indices`` as models/state_plan.py plans the step (decode rows batched, a
sequence whose context starts in this step from zeros). Without state tensors every sequence starts
from zeros and keeps nothing.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllmini.kv.state_cache import StateSpec
from vllmini.models.base import AttentionMetadata
from vllmini.models.causal_conv import causal_conv, causal_conv_step
from vllmini.models.ssd import ssd_chunked, ssd_step
from vllmini.models.state_plan import run_by_slots

MambaState = tuple[torch.Tensor, torch.Tensor]  # ([slots, conv_dim, K-1], [slots, H, P, N] float32)


class GroupGatedRMSNorm(nn.Module):
    """RMSNorm over each of ``groups`` contiguous channel groups with a SiLU gate: by default the gate
    applied before the norm (``RMSNorm(y * silu(z))``, Mamba2's ``norm_before_gate=False``, Granite 4.0);
    ``norm_before_gate``: ``RMSNorm(y) * silu(z)`` (Falcon-H1's ``mamba_norm_before_gate``)."""

    def __init__(self, dim: int, groups: int, eps: float, norm_before_gate: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.groups, self.eps, self.norm_before_gate = groups, eps, norm_before_gate

    def forward(self, y: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        h = y.float() if self.norm_before_gate else y.float() * F.silu(gate.float())
        h = h.view(*h.shape[:-1], self.groups, -1)
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        if self.norm_before_gate:
            return (self.weight.float() * h * F.silu(gate.float())).to(dtype)
        return self.weight * h.to(dtype)


class SiluGate(nn.Module):
    """``y * silu(z)`` with no norm (Falcon-H1 with ``mamba_rms_norm`` false: no ``norm`` weight either)."""

    def forward(self, y: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (y.float() * F.silu(gate.float())).to(dtype)


def _time_step_limit(config: Any) -> tuple[float, float] | None:
    """``time_step_limit`` as a clamp on dt (None: the default ``(0, inf)``, which softplus never leaves)."""
    limit = getattr(config, "time_step_limit", None)
    if limit is None:
        return None
    if len(limit) != 2 or float(limit[0]) > float(limit[1]):
        raise ValueError(f"time_step_limit must be (low, high) with low <= high, got {limit!r}")
    low, high = float(limit[0]), float(limit[1])
    return None if low <= 0.0 and math.isinf(high) else (low, high)


class Mamba2Mixer(nn.Module):
    """Checkpoint names as Granite 4.0's and Falcon-H1's ``mamba.*`` (Nemotron-H's ``mixer.*``): ``in_proj``,
    ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``. The config's names are Granite's.

    The width is ``intermediate_size`` when given (Nemotron-H: heads x head_dim, whatever ``expand``
    says), else ``mamba_d_ssm`` when the config sets it (Falcon-H1), else ``mamba_expand * hidden_size``.
    Falcon-H1 changes (keyword arguments, off by default): ``in_multiplier`` scales the input of
    ``in_proj``; ``proj_multipliers`` (five: z, x, B, C, dt) scale the parts of its output (muP);
    ``out_proj_bias`` (None: ``mamba_proj_bias`` as ``in_proj``); ``gated_norm`` False: no norm, the
    output only gated; ``norm_before_gate``."""

    def __init__(self, config: Any, intermediate_size: int | None = None, in_multiplier: float = 1.0,
                 proj_multipliers: Sequence[float] | None = None, out_proj_bias: bool | None = None,
                 gated_norm: bool = True, norm_before_gate: bool = False) -> None:  # fmt: skip
        super().__init__()
        hidden = config.hidden_size
        self.num_heads, self.head_dim = int(config.mamba_n_heads), int(config.mamba_d_head)
        self.n_groups, self.d_state = int(config.mamba_n_groups), int(config.mamba_d_state)
        d_ssm = getattr(config, "mamba_d_ssm", None)
        if intermediate_size is not None:
            self.intermediate, width = int(intermediate_size), "the Mamba width"
        elif d_ssm is not None:
            self.intermediate, width = int(d_ssm), "mamba_d_ssm"
        else:
            self.intermediate, width = int(config.mamba_expand * hidden), "mamba_expand * hidden_size"
        if self.num_heads * self.head_dim != self.intermediate:
            raise ValueError(f"mamba_n_heads * mamba_d_head ({self.num_heads} * {self.head_dim}) must equal "
                             f"{width} ({self.intermediate})")  # fmt: skip
        if self.num_heads % self.n_groups:
            raise ValueError(f"mamba_n_groups ({self.n_groups}) must divide mamba_n_heads ({self.num_heads})")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported for Mamba2 layers; supported: silu")
        self.chunk_size = int(config.mamba_chunk_size)
        self.time_step_limit = _time_step_limit(config)
        self.conv_dim = self.intermediate + 2 * self.n_groups * self.d_state
        self.conv_kernel = int(config.mamba_d_conv)
        proj_bias = bool(getattr(config, "mamba_proj_bias", False))
        self.in_proj = nn.Linear(hidden, self.intermediate + self.conv_dim + self.num_heads, bias=proj_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel, groups=self.conv_dim,
                                bias=bool(getattr(config, "mamba_conv_bias", True)))  # fmt: skip
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = (GroupGatedRMSNorm(self.intermediate, self.n_groups, config.rms_norm_eps, norm_before_gate)
                     if gated_norm else SiluGate())  # fmt: skip
        out_bias = proj_bias if out_proj_bias is None else bool(out_proj_bias)
        self.out_proj = nn.Linear(self.intermediate, hidden, bias=out_bias)
        self.in_multiplier = float(in_multiplier)
        self.proj_multipliers = None if proj_multipliers is None else [float(m) for m in proj_multipliers]
        if self.proj_multipliers is not None:
            if len(self.proj_multipliers) != 5:
                raise ValueError(f"ssm_multipliers must have 5 values (z, x, B, C, dt), got {list(proj_multipliers)}")
            # (a placeholder on the meta device until reset_buffers, as models/rotary.py's inv_freq)
            self.register_buffer("proj_scale", torch.empty(self.in_proj.out_features), persistent=False)
            if torch.empty(0).device.type != "meta":
                self.reset_buffers()

    def reset_buffers(self) -> None:
        """``in_proj``'s per-channel muP scale (float32), rebuilt after the model left the meta device."""
        if self.proj_multipliers is None:
            return
        gs = self.n_groups * self.d_state
        sizes = [self.intermediate, self.intermediate, gs, gs, self.num_heads]
        scale = torch.cat([torch.full((n,), m) for n, m in zip(sizes, self.proj_multipliers)])
        self.proj_scale = scale.to(self.proj_scale.device)

    def state_shapes(self) -> tuple[StateSpec, StateSpec]:
        """One sequence's state: the convolution's last inputs, the recurrence's matrices (float32)."""
        return (StateSpec((self.conv_dim, self.conv_kernel - 1)),
                StateSpec((self.num_heads, self.head_dim, self.d_state), recurrent=True))  # fmt: skip

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, state: MambaState | None) -> torch.Tensor:
        zxbcdt = self.in_proj(x * self.in_multiplier if self.in_multiplier != 1.0 else x)
        if self.proj_multipliers is not None:
            zxbcdt = (zxbcdt.float() * self.proj_scale).to(x.dtype)
        gate, xbc, dt = zxbcdt.split([self.intermediate, self.conv_dim, self.num_heads], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        if self.time_step_limit is not None:
            dt = dt.clamp(*self.time_step_limit)
        A, D = -self.A_log.float().exp(), self.D.float()
        weight, bias = self.conv1d.weight[:, 0], self.conv1d.bias

        def step(rows: torch.Tensor, states: MambaState) -> tuple[torch.Tensor, MambaState]:
            conv_out, conv_state = causal_conv_step(xbc.index_select(0, rows), weight, states[0], bias)
            xs, B, C = self._split(conv_out)
            o, s = ssd_step(xs, dt.index_select(0, rows), A, B, C, D, states[1])
            return o, (conv_state, s)

        def prompt(span: slice, states: MambaState | None) -> tuple[torch.Tensor, MambaState]:
            conv_out, conv_state = causal_conv(xbc[span], weight, None if states is None else states[0], bias)
            xs, B, C = self._split(conv_out)
            o, s = ssd_chunked(xs, dt[span], A, B, C, D, None if states is None else states[1], self.chunk_size)
            return o, (conv_state, s)

        y = x.new_empty(x.shape[0], self.num_heads, self.head_dim, dtype=torch.float32)
        run_by_slots(meta, state, y, step, prompt)
        return self.out_proj(self.norm(y.flatten(1), gate, x.dtype))

    def _split(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolved ``[N, conv_dim]`` rows as the heads' input ``[N, H, P]`` and the groups' B, C ``[N, G, N_state]``."""
        xs, B, C = conv_out.split([self.intermediate, self.n_groups * self.d_state, self.n_groups * self.d_state], dim=-1)
        return (xs.view(-1, self.num_heads, self.head_dim), B.view(-1, self.n_groups, self.d_state),
                C.view(-1, self.n_groups, self.d_state))  # fmt: skip
