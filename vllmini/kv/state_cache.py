"""Per-sequence states of linear-attention layers (Qwen3.5's Gated DeltaNet), beside the paged KV cache.

A linear layer's memory of a sequence does not grow: it is a fixed-size state (the short
convolution's last inputs and the delta rule's matrices: models/gated_deltanet.py) that each step
reads and overwrites. So instead of blocks, a sequence holds one *state slot* from admission to
its end, the same slot in every linear layer's tensors; ``max_num_seqs`` slots exist, as many as
sequences can run (fewer when their states would take over half the KV budget: ``state_slots_for_budget``). ``StatefulBlockManager`` hands the slots out alongside the KV blocks (the
full-attention layers still page their K/V), so the scheduler needs no second allocator: a new
sequence takes a slot when its first blocks are allocated, gives it back when freed (finished,
aborted or preempted: a preempted sequence is recomputed from its first token, from zeros), and
an ``n > 1`` sibling forked after the prompt gets its own slot with a copy of the parent's state.

A state summarises every token before it, so a prefix-cache hit (blocks whose K/V are kept, but
no state at that length) cannot be resumed, and a rejected speculative token cannot be taken
back: engine/engine_setup.py turns prefix caching off and refuses speculative decoding for these
models.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from vllmini.kv.block_hash import ROOT_HASH
from vllmini.kv.block_invariants import check
from vllmini.kv.block_manager import NoFreeBlocksError, SeqId

logger = logging.getLogger("vllmini")

StateShapes = list[tuple[tuple[int, ...], tuple[int, ...]]]  # per linear layer: (conv state, rule state) of one sequence


def state_bytes(shapes: StateShapes, conv_dtype: torch.dtype) -> int:
    """One slot's bytes over every linear layer (the rule's state is float32, the convolution's the model's dtype)."""
    conv_size, rule_size = torch.empty((), dtype=conv_dtype).element_size(), 4
    return sum(torch.Size(conv).numel() * conv_size + torch.Size(rule).numel() * rule_size for conv, rule in shapes)


def state_slots_for_budget(shapes: StateShapes, conv_dtype: torch.dtype, max_num_seqs: int, budget: int) -> tuple[int, int]:
    """(state slots, KV bytes left): a slot for each of ``max_num_seqs`` sequences when their states take
    at most half of ``budget``, else as many as half of it holds (fewer sequences then run at once, as
    in vLLM, where states and K/V share one pool); the KV cache gets the rest."""
    per_slot = state_bytes(shapes, conv_dtype)
    slots = min(max_num_seqs, budget // 2 // per_slot)
    if slots < 1:
        raise ValueError(f"kv_cache_memory / gpu_memory_utilization: a sequence's linear-attention state takes "
                         f"{per_slot} bytes, more than half the KV cache budget ({budget} bytes); raise it")  # fmt: skip
    if slots < max_num_seqs:
        logger.warning("max_num_seqs=%d lowered to %d: each sequence's linear-attention state takes %.1f MiB and the "
                       "states may use half of the KV cache budget (%.1f MiB); raise kv_cache_memory / "
                       "gpu_memory_utilization to run more at once", max_num_seqs, slots, per_slot / 2**20,
                       budget / 2**20)  # fmt: skip
    logger.info("linear-attention states: %d slots of %.2f MiB (%d layers)", slots, per_slot / 2**20, len(shapes))
    return slots, budget - slots * per_slot


def allocate_state_cache(
    shapes: StateShapes, num_slots: int, conv_dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per linear layer ([slots, *conv], [slots, *rule] float32), zeroed."""
    return [(torch.zeros(num_slots, *conv, dtype=conv_dtype, device=device),
             torch.zeros(num_slots, *rule, dtype=torch.float32, device=device)) for conv, rule in shapes]  # fmt: skip


class StatefulBlockManager:
    """A block manager (``BlockManager`` or ``HybridBlockManager``) whose sequences also hold a
    state slot each; everything but allocation, freeing and forking is the wrapped manager's."""

    def __init__(self, blocks: Any, num_slots: int) -> None:
        self.blocks = blocks
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # (popped from the end: slot 0 first)
        self._slots: dict[SeqId, int] = {}

    def __getattr__(self, name: str) -> Any:  # (only reached for what this class does not define)
        return getattr(self.blocks, name)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self.blocks

    def state_slot(self, seq_id: SeqId) -> int:
        return self._slots[seq_id]

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self, seq_id: SeqId, token_ids: Sequence[int], num_new_tokens: int,
                 cached_blocks: Any = None, root: bytes = ROOT_HASH) -> bool:  # fmt: skip
        """The wrapped allocation, and a slot for a new sequence (False: no free slot, or no blocks)."""
        new = seq_id not in self.blocks
        if new and not self._free:
            return False
        if not self.blocks.allocate(seq_id, token_ids, num_new_tokens, cached_blocks, root):
            return False
        if new:
            self._slots[seq_id] = self._free.pop()
        return True

    def free(self, seq_id: SeqId) -> None:
        self.blocks.free(seq_id)
        if (slot := self._slots.pop(seq_id, None)) is not None:
            self._free.append(slot)

    def can_fork(self, parent_id: SeqId, num_tokens: int) -> bool:
        return bool(self._free) and self.blocks.can_fork(parent_id, num_tokens)

    def fork(self, parent_id: SeqId, child_id: SeqId, num_tokens: int) -> list[tuple[int, int]]:
        """The wrapped fork (its KV block copies) and a slot for the child; the caller copies the
        parent's state into it (``ModelRunner.copy_state``)."""
        if not self._free:
            raise NoFreeBlocksError(f"no free state slot to fork {parent_id!r} into {child_id!r}")
        copies = self.blocks.fork(parent_id, child_id, num_tokens)
        self._slots[child_id] = self._free.pop()
        return copies

    def check_invariants(self) -> None:
        """The wrapped manager's, and exactly its sequences holding distinct slots."""
        self.blocks.check_invariants()
        held = list(self._slots.values())
        check(len(set(held)) == len(held), "a state slot held by two sequences")
        check(len(held) + len(self._free) == self.num_slots, "state slots lost or duplicated")
        check(set(self._slots) == set(self.blocks._seqs if hasattr(self.blocks, "_seqs") else self.blocks.groups[0]._seqs),
              "state slots held by sequences without blocks (or the reverse)")  # fmt: skip
