"""Per-sequence states of stateful layers (Qwen3.5's Gated DeltaNet, Granite 4.0's Mamba2), beside the paged KV cache.

(Any layer whose memory of a sequence is a fixed-size state fits here: a model declares each such
layer's state tensors with ``state_shapes()`` -> ``StateShapes``, and reads them from
``meta.state_caches[j]`` at the rows ``meta.state_indices`` gives.)

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
from dataclasses import dataclass
from typing import Any

import torch

from vllmini.kv.block_hash import ROOT_HASH
from vllmini.kv.block_invariants import check
from vllmini.kv.block_manager import NoFreeBlocksError, SeqId

logger = logging.getLogger("vllmini")

@dataclass(frozen=True)
class StateSpec:
    """One per-sequence state tensor of a layer: its shape, and whether it is a recurrent state (summing
    the whole sequence: float32 unless ``mamba_ssm_cache_dtype`` says otherwise) or a window of recent
    inputs (a convolution's: the model's dtype unless ``mamba_cache_dtype`` says otherwise)."""

    shape: tuple[int, ...]
    recurrent: bool = False


@dataclass(frozen=True)
class StateDtypes:
    """The dtypes the state tensors are kept in: a convolution's window and a recurrent state."""

    window: torch.dtype
    recurrent: torch.dtype = torch.float32

    def of(self, spec: StateSpec) -> torch.dtype:
        return self.recurrent if spec.recurrent else self.window

    @classmethod
    def resolve(cls, model_dtype: torch.dtype, mamba_cache_dtype: str = "auto",
                mamba_ssm_cache_dtype: str = "auto") -> StateDtypes:  # fmt: skip
        """vLLM's two settings: ``auto`` keeps the window in the model's dtype and the recurrent state in
        float32 (vLLM's ``auto`` for the latter is the window's dtype; float32 is what the recurrence
        sums in, so vllmini keeps it unless asked)."""
        window = model_dtype if mamba_cache_dtype == "auto" else getattr(torch, mamba_cache_dtype)
        return cls(window, torch.float32 if mamba_ssm_cache_dtype == "auto" else getattr(torch, mamba_ssm_cache_dtype))


STATE_DTYPES = ("auto", "float32", "bfloat16", "float16")  # what mamba_cache_dtype / mamba_ssm_cache_dtype take


StateShapes = list[tuple[StateSpec, ...]]  # per stateful layer, its state tensors (of one sequence)
LayerState = tuple[torch.Tensor, ...]  # one layer's state tensors over every slot: [slots, *spec.shape] each


def state_bytes(shapes: StateShapes, dtypes: StateDtypes) -> int:
    """One slot's bytes over every stateful layer."""
    return sum(torch.Size(spec.shape).numel() * torch.empty((), dtype=dtypes.of(spec)).element_size()
               for layer in shapes for spec in layer)  # fmt: skip


def state_slots_for_budget(shapes: StateShapes, dtypes: StateDtypes, max_num_seqs: int, budget: int) -> tuple[int, int]:
    """(state slots, KV bytes left): a slot for each of ``max_num_seqs`` sequences when their states take
    at most half of ``budget``, else as many as half of it holds (fewer sequences then run at once, as
    in vLLM, where states and K/V share one pool); the KV cache gets the rest."""
    per_slot = state_bytes(shapes, dtypes)
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


def allocate_state_cache(shapes: StateShapes, num_slots: int, dtypes: StateDtypes,
                         device: torch.device) -> list[LayerState]:  # fmt: skip
    """Per stateful layer, its state tensors over ``num_slots`` slots, zeroed."""
    return [tuple(torch.zeros(num_slots, *spec.shape, dtype=dtypes.of(spec), device=device) for spec in layer)
            for layer in shapes]  # fmt: skip


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
