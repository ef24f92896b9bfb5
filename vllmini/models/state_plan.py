"""How one step's sequences meet a stateful layer's per-sequence states (kv/state_cache.py): shared by
every such mixer (Gated DeltaNet: models/gated_deltanet.py, Mamba2: models/mamba2.py).

Single-token rows that continue a state (decode) run as one batch, each reading and writing its
slot; every other sequence (a prompt, a prefill chunk, a recomputed preempted sequence) runs on its
own, from zeros when its context starts in this step (``seq_len == q_len``), else from its slot.
The plan is made once per step, by the first stateful layer, and kept on the metadata.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllmini.models.base import AttentionMetadata


@dataclass
class LinearPlan:
    """How one step's sequences are run, made at the first stateful layer and kept on the metadata."""

    decode_rows: torch.Tensor | None  # rows of single-token sequences continuing a state, run as one batch
    decode_slots: torch.Tensor | None  # their state slots
    others: list[tuple[int, int, int | None, bool]]  # (first row, rows, slot, continues its state), one by one


def plan_linear_step(meta: AttentionMetadata) -> LinearPlan:
    # (no state tensors: every sequence from zeros, nothing kept; what a forward without a cache runs)
    slots = None if meta.state_indices is None or meta.state_caches is None else meta.state_indices.tolist()
    rows, decode, others = 0, [], []
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        slot = None if slots is None else slots[i]
        continues = slot is not None and seq_len > q_len
        if q_len == 1 and continues:
            decode.append((rows, slot))
        else:
            others.append((rows, q_len, slot, continues))
        rows += q_len
    if not decode:
        return LinearPlan(None, None, others)
    device = meta.seq_lens.device
    as_long = {"dtype": torch.long, "device": device}
    return LinearPlan(torch.tensor([r for r, _ in decode], **as_long), torch.tensor([s for _, s in decode], **as_long),
                      others)  # fmt: skip
