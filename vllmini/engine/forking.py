"""n > 1: a request's sibling sequences share its first sequence's prompt KV.

Only the first sequence of an ``n > 1`` request is queued; once its prompt is computed, its
siblings are forked from it (its full blocks shared, its last partial block copied) instead
of prefilling the same prompt again, and they sample from its prompt logits in that step.
"""
from __future__ import annotations

from typing import Any

from vllmini.engine.output_processor import RequestState
from vllmini.kv.block_manager import NoFreeBlocksError
from vllmini.kv.hybrid_block_manager import KVBlockManager
from vllmini.kv.state_cache import StatefulBlockManager
from vllmini.scheduler.scheduler import Scheduler
from vllmini.scheduler.sequence import Sequence


def fork_children(
    state: RequestState, parent: Sequence, scheduler: Scheduler, block_manager: KVBlockManager, runner: Any,
    max_num_seqs: int,
) -> list[Sequence]:  # fmt: skip
    """The siblings forked now (running from the next step): those still pending when ``parent``
    has just computed its prompt. Each counts toward max_num_seqs (as vLLM's child requests
    do). Without a free slot, or a free block for the copy, a sibling falls back to the queue,
    where the prefix cache still shares the full blocks. ``runner``: the ModelRunner whose KV
    cache takes the copies."""
    if not state.pending or parent.num_output_tokens:
        return []
    children, state.pending = state.pending, []
    forked = []
    for child in children:
        if len(scheduler.running) >= max_num_seqs:
            scheduler.add(child)
            continue
        try:
            copies = block_manager.fork(parent.seq_id, child.seq_id, parent.num_computed_tokens)
        except NoFreeBlocksError:
            scheduler.add(child)
            continue
        runner.copy_blocks(copies)
        if isinstance(block_manager, StatefulBlockManager):  # (its linear-attention state after the prompt too)
            runner.copy_state(block_manager.state_slot(parent.seq_id), block_manager.state_slot(child.seq_id))
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.first_scheduled_time = parent.first_scheduled_time
        scheduler.add_running(child)
        forked.append(child)
    return forked
