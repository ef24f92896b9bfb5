"""A linear layer plus the LoRA deltas of up to ``max_loras`` adapters, applied per token.

Each adapter slot holds, stacked over the layer's output shards (q/k/v, gate/up; one shard
for a plain projection), ``lora_a[slot] [shards * r, in]`` and ``lora_b[slot] [out, shards * r]``,
block-diagonal in ``B``: q's ``B`` only fills q's output rows. A step's rows come grouped by
adapter (the model runner orders the batch so), and each run of rows with the same adapter
adds its delta in two matmuls on a slice:

    y[start:end] += x[start:end] @ lora_a[slot].T @ lora_b[slot].T

so a token costs only its own adapter's rank (vLLM's punica kernels do this per token on a GPU).
Measured on this 2-core CPU with torch.mm (fp32, 64 rows over 4 adapters of rank 16, SmolLM2's
q/k/v): 232 us per layer this way, 404 us for the dense form that multiplies every row by every
slot's matrices and masks. Over a prepacked (oneDNN) base the two matmuls go through oneDNN
instead (see ``LoRALinear``): batch invariant, and slower per call (README, "Benchmarks").
"""
from __future__ import annotations

import torch
from torch import nn

from vllmini.models.packed_linear import PackedLinear, pack_weight, packed_linear


class LoRAStepState:
    """The current step's row runs ``(slot, start, end)``, shared by every LoRALinear of one
    model: set by the model runner before each forward, read by the layers during it."""

    def __init__(self, max_loras: int, max_rank: int) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.runs: list[tuple[int, int, int]] = []  # rows without an adapter are in no run

    def set(self, seq_slots: list[int], query_lens: list[int]) -> None:
        """``seq_slots[i]``: the slot of sequence ``i`` (-1: the base model), whose rows are the
        next ``query_lens[i]`` of the flat batch."""
        runs: list[tuple[int, int, int]] = []
        row = 0
        for slot, n in zip(seq_slots, query_lens):
            if slot >= 0 and runs and runs[-1][0] == slot and runs[-1][2] == row:
                runs[-1] = (slot, runs[-1][1], row + n)
            elif slot >= 0:
                runs.append((slot, row, row + n))
            row += n
        self.runs = runs


class LoRALinear(nn.Module):
    """``base`` (any linear: nn.Linear, PackedLinear) whose output is split into ``shard_sizes``,
    each adaptable on its own."""

    def __init__(self, base: nn.Module, shard_sizes: list[int], state: LoRAStepState, dtype: torch.dtype,
                 device: torch.device) -> None:  # fmt: skip
        super().__init__()
        self.base_layer = base
        self.state = state
        self.shard_sizes = list(shard_sizes)
        self.in_features, self.out_features = base.in_features, base.out_features
        cols = len(shard_sizes) * state.max_rank
        self.register_buffer("lora_a", torch.zeros(state.max_loras, cols, self.in_features, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(state.max_loras, self.out_features, cols, dtype=dtype, device=device))
        # a prepacked (oneDNN, CPU) base gives a row the same bits whatever rows share its step, which
        # seeded sampling relies on; torch.mm does not (a lone row rounds apart), so each slot's A
        # and B are packed too and the delta goes through the same kernel
        self.packed: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None
        if isinstance(base, PackedLinear):
            self.packed = [None] * state.max_loras

    def set_slot(self, slot: int, shard_weights: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write one adapter's (A, scaled B) per shard into ``slot`` (None: that shard not adapted)."""
        a_slot, b_slot, r = self.lora_a[slot], self.lora_b[slot], self.state.max_rank
        a_slot.zero_()
        b_slot.zero_()
        row = 0
        for shard, (size, ab) in enumerate(zip(self.shard_sizes, shard_weights)):
            if ab is not None:
                a, b = ab
                a_slot[shard * r : shard * r + a.shape[0]] = a
                b_slot[row : row + size, shard * r : shard * r + a.shape[0]] = b
            row += size
        if self.packed is not None:
            self.packed[slot] = (pack_weight(a_slot), pack_weight(b_slot))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        if self.packed is not None:
            for slot, start, end in self.state.runs:
                a, b = self.packed[slot]
                y[start:end] += packed_linear(packed_linear(x[start:end], a), b)
            return y
        for slot, start, end in self.state.runs:  # (mm + addmm_ in place: ~30% less than linear, linear, +=)
            y[start:end].addmm_(torch.mm(x[start:end], self.lora_a[slot].t()), self.lora_b[slot].t())
        return y

    def extra_repr(self) -> str:
        return f"shards={self.shard_sizes}, max_loras={self.state.max_loras}, max_rank={self.state.max_rank}"
