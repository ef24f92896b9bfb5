"""How one step's sequences meet a stateful layer's per-sequence states (kv/state_cache.py): shared by
every such mixer (Gated DeltaNet: models/gated_deltanet.py, Mamba2: models/mamba2.py).

Single-token rows that continue a state (decode) run as one batch, each reading and writing its
slot; every other sequence (a prompt, a prefill chunk, a recomputed preempted sequence) runs on its
own, from zeros when its context starts in this step (``seq_len == q_len``), else from its slot.
The plan is made once per step, by the first stateful layer, and kept on the metadata;
``run_by_slots`` runs a layer by it, reading and writing the slots, so each mixer only says how it
advances a batch of decode rows and a sequence's span.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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


States = tuple[torch.Tensor, ...]  # a layer's state tensors: [slots, ...] in the cache, one sequence's (or rows') in the steps
StepFn = Callable[[torch.Tensor, States], tuple[torch.Tensor, States]]
PromptFn = Callable[[slice, "States | None"], tuple[torch.Tensor, States]]


def run_by_slots(meta: AttentionMetadata, state: States | None, out: torch.Tensor, step: StepFn,
                 prompt: PromptFn) -> torch.Tensor:  # fmt: skip
    """One stateful layer's step over the batch, every slot read and written here, so a mixer only
    says how it advances: ``step(rows, states)`` for the decode rows at once (their states gathered,
    one row each; returns their outputs and new states, scattered back), ``prompt(span, states)`` for
    every other sequence (its slot's states when it continues them, else None: from zeros; returns
    the span's output and the states after it, kept when it has a slot). Fills and returns ``out``."""
    if meta.state_plan is None:
        meta.state_plan = plan_linear_step(meta)
    plan: LinearPlan = meta.state_plan
    if plan.decode_rows is not None and state is not None:
        rows, slots = plan.decode_rows, plan.decode_slots
        rows_out, new = step(rows, tuple(t.index_select(0, slots) for t in state))
        for cache, value in zip(state, new):
            cache.index_copy_(0, slots, value.to(cache.dtype))
        out.index_copy_(0, rows, rows_out)
    for first, count, slot, continues in plan.others:
        span = slice(first, first + count)
        keep = state is not None and slot is not None
        span_out, new = prompt(span, tuple(t[slot] for t in state) if keep and continues else None)
        if keep:
            for cache, value in zip(state, new):
                cache[slot] = value
        out[span] = span_out
    return out
