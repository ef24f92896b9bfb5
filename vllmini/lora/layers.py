"""A linear layer plus the LoRA deltas of up to ``max_loras`` adapters, applied per token.

Every adapter slot's ``A`` matrices are stacked into one ``lora_a [slots * shards * r, in]``
and its ``B`` matrices laid into one ``lora_b [out, slots * shards * r]`` (block-diagonal per
shard: q's ``B`` only fills q's output rows). A step's tokens then take their deltas in two
matmuls whatever mix of adapters the batch holds:

    y = base(x) + ((x @ lora_a.T) * mask) @ lora_b.T

where ``mask [T, slots * shards * r]`` is 1 in the columns of the token's slot and 0
elsewhere (all 0 for a token without adapter). Fixed shapes, no per-adapter loop: the
dense form of vLLM's punica shrink/expand kernels, fine for the few slots one engine holds.
"""
from __future__ import annotations

import torch
from torch import nn


class LoRAStepState:
    """The current step's token -> slot mapping, shared by every LoRALinear of one model.
    Set by the model runner before each forward (``set``), read by the layers during it."""

    def __init__(self, max_loras: int, max_rank: int) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.token_slots: torch.Tensor | None = None  # [T] long, -1: no adapter; None: none in the step
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def set(self, token_slots: torch.Tensor | None) -> None:
        self.token_slots = token_slots
        self._masks = {}

    def mask(self, shards: int, dtype: torch.dtype) -> torch.Tensor:
        """``[T, slots * shards * r]``: 1 where the column belongs to the token's slot (built once per step)."""
        key = (shards, dtype)
        if key not in self._masks:
            slots = torch.arange(self.max_loras, device=self.token_slots.device)
            onehot = (self.token_slots[:, None] == slots[None, :]).to(dtype)
            self._masks[key] = onehot.repeat_interleave(shards * self.max_rank, dim=1)
        return self._masks[key]


class LoRALinear(nn.Module):
    """``base`` (any linear: nn.Linear, PackedLinear) whose output is split into ``shard_sizes``
    (q/k/v, gate/up; one shard for a plain projection), each adaptable on its own."""

    def __init__(self, base: nn.Module, shard_sizes: list[int], state: LoRAStepState, dtype: torch.dtype,
                 device: torch.device) -> None:  # fmt: skip
        super().__init__()
        self.base_layer = base
        self.state = state
        self.shard_sizes = list(shard_sizes)
        self.in_features, self.out_features = base.in_features, base.out_features
        cols = state.max_loras * len(shard_sizes) * state.max_rank
        self.register_buffer("lora_a", torch.zeros(cols, self.in_features, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(self.out_features, cols, dtype=dtype, device=device))

    def _cols(self, slot: int, shard: int) -> slice:
        start = (slot * len(self.shard_sizes) + shard) * self.state.max_rank
        return slice(start, start + self.state.max_rank)

    def set_slot(self, slot: int, shard_weights: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write one adapter's (A, scaled B) per shard into ``slot`` (None: that shard not adapted)."""
        self.lora_a[self._cols(slot, 0).start : self._cols(slot, len(self.shard_sizes) - 1).stop].zero_()
        row = 0
        for shard, (size, ab) in enumerate(zip(self.shard_sizes, shard_weights)):
            cols = self._cols(slot, shard)
            self.lora_b[:, cols].zero_()
            if ab is not None:
                a, b = ab
                self.lora_a[cols.start : cols.start + a.shape[0]] = a
                self.lora_b[row : row + size, cols.start : cols.start + a.shape[0]] = b
            row += size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        if self.state.token_slots is None:
            return y
        xa = nn.functional.linear(x, self.lora_a) * self.state.mask(len(self.shard_sizes), x.dtype)
        return y + nn.functional.linear(xa, self.lora_b)

    def extra_repr(self) -> str:
        return f"shards={self.shard_sizes}, max_loras={self.state.max_loras}, max_rank={self.state.max_rank}"
