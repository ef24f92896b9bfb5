"""KV blocks of a model with several KV cache groups (kv/kv_groups.py): sliding-window layers
and full-attention layers mixed, as Gemma 2/3 (vLLM's hybrid KV cache manager).

One ``BlockManager`` per group keeps that group's block tables (a sliding group releases the
blocks behind its window, a full group keeps them all); all of them take block ids from one
shared ``BlockPool``, so memory goes wherever it is needed. The groups hash a sequence's blocks
alike (the chain is computed once and handed to every group) and key their prefix-cache entries
apart (``cache_key``: a block's KV is one group's layers), and a prefix hit is the longest one
every group can serve: the full groups need all of its blocks cached, a sliding group only
those its window sees. The engine talks to this exactly as to a ``BlockManager``;
``block_table`` is the first (full-attention) group's, ``block_tables`` every group's.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Union

from vllmini.kv.block_hash import ROOT_HASH, chain_hashes
from vllmini.kv.block_invariants import check, check_invariants
from vllmini.kv.block_manager import BlockManager, NoFreeBlocksError, SeqId
from vllmini.kv.block_pool import BlockPool

if TYPE_CHECKING:
    from vllmini.kv.state_cache import StatefulBlockManager


class HybridBlockManager:
    """Block tables per KV group over one pool; the ``BlockManager`` interface."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool, group_windows: Sequence[int | None],
        null_block: int | None = None,
    ) -> None:  # fmt: skip
        if len(group_windows) < 2:
            raise ValueError(f"a hybrid KV cache has two or more groups, got {len(group_windows)}")
        self.pool = BlockPool(num_blocks)
        self.groups = [
            BlockManager(num_blocks, block_size, enable_prefix_caching, window, null_block, pool=self.pool,
                         cache_key=bytes([i]) if i else b"")
            for i, window in enumerate(group_windows)
        ]  # fmt: skip
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.null_block = self.groups[0].null_block
        self.sliding_window = None  # (not one window for every layer: some groups have none)

    # ---- queries (the first group's where every group agrees) -----------------------------
    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self.groups[0]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def block_table(self, seq_id: SeqId) -> list[int]:
        return self.groups[0].block_table(seq_id)

    def block_tables(self, seq_id: SeqId) -> list[list[int]]:
        return [g.block_table(seq_id) for g in self.groups]

    def num_tokens(self, seq_id: SeqId) -> int:
        return self.groups[0].num_tokens(seq_id)

    def num_cached_tokens(self, seq_id: SeqId) -> int:
        return self.groups[0].num_cached_tokens(seq_id)

    def num_owned_blocks(self, seq_id: SeqId) -> int:
        return sum(g.num_owned_blocks(seq_id) for g in self.groups)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_evictions(self) -> int:
        return sum(g.num_evictions for g in self.groups)

    @property
    def prefix_cache_queries(self) -> int:
        return self.groups[0].prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.groups[0].prefix_cache_hits

    def blocks_held(self, num_tokens: int, max_new_tokens: int) -> int:
        """The most blocks a sequence of ``num_tokens`` holds over every group."""
        return sum(g.blocks_held(num_tokens, max_new_tokens) for g in self.groups)

    def capacity_tokens(self, max_new_tokens: int, max_model_len: int) -> int:
        """The longest sequence the pool holds: the full groups' tables grow with it, a sliding
        group's stop at a window plus a step."""
        bs = self.block_size
        if self.blocks_held(max_model_len, max_new_tokens) <= self.num_blocks:
            return max_model_len
        lo, hi = 0, -(-max_model_len // bs)  # the most blocks that fit: blocks_held grows with the length
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.blocks_held(mid * bs, max_new_tokens) <= self.num_blocks else (lo, mid - 1)
        return lo * bs

    # ---- prefix cache ---------------------------------------------------------------------
    def find_cached_prefix(
        self, token_ids: Sequence[int], root: bytes = ROOT_HASH, max_tokens: int | None = None
    ) -> tuple[list[list[int]], int]:
        """The longest hit every group serves: per group its blocks (placeholders behind a
        window), and the tokens. A sliding group's valid hits are not every shorter length,
        so the groups are asked again with the shorter limit until they agree."""
        if not self.enable_prefix_caching:
            return [[] for _ in self.groups], 0
        limit = len(token_ids) if max_tokens is None else max_tokens
        chain = chain_hashes(token_ids, root, min(len(token_ids) - 1, limit) // self.block_size, self.block_size)
        while True:
            found = [g.find_cached_prefix(token_ids, root, limit, chain) for g in self.groups]
            tokens = min(n for _, n in found)
            if all(n == tokens for _, n in found):
                return [blocks for blocks, _ in found], tokens
            limit = tokens

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    # ---- allocation -----------------------------------------------------------------------
    def allocate(
        self, seq_id: SeqId, token_ids: Sequence[int], num_new_tokens: int,
        cached_blocks: list[list[int]] | None = None, root: bytes = ROOT_HASH,
    ) -> bool:  # fmt: skip
        """All groups' tables extended together, or none (False: the pool is short). The first
        group hashes the blocks; the others take its chain."""
        cached = cached_blocks or [[] for _ in self.groups]
        new = seq_id not in self
        chain = chain_hashes(token_ids, root, len(cached[0]), self.block_size) if new else ()
        parts = zip(self.groups, cached)
        if sum(g.blocks_to_take(seq_id, token_ids, num_new_tokens, blocks, root, chain) for g, blocks in parts) \
                > self.pool.num_free_blocks:  # fmt: skip
            return False
        if new:  # every group claims its hit first: a new block may evict another group's
            for g, blocks in zip(self.groups, cached):
                g.admit(seq_id, token_ids, blocks, root, chain)
        first, *others = self.groups
        first.grow(seq_id, token_ids, num_new_tokens)
        for g in others:
            g.grow(seq_id, token_ids, num_new_tokens, first._seqs[seq_id].block_hashes)
        return True

    def free(self, seq_id: SeqId) -> None:
        for g in self.groups:
            g.free(seq_id)

    def forget_unwritten(self, seq_id: SeqId, num_written: int) -> None:
        for g in self.groups:
            g.forget_unwritten(seq_id, num_written)

    def rollback(self, seq_id: SeqId, num_tokens: int) -> None:
        for g in self.groups:
            g.rollback(seq_id, num_tokens)

    def can_fork(self, parent_id: SeqId, num_tokens: int) -> bool:
        """Whether :meth:`fork` finds a block for every group's copy of the partial block."""
        partial = num_tokens % self.block_size != 0
        return parent_id in self and self.pool.num_free_blocks >= partial * len(self.groups)

    def fork(self, parent_id: SeqId, child_id: SeqId, num_tokens: int) -> list[tuple[int, int]]:
        """Every group's fork (see ``BlockManager.fork``); all or none."""
        if not self.can_fork(parent_id, num_tokens) and parent_id in self:
            raise NoFreeBlocksError(f"no free blocks to fork {parent_id!r} into {child_id!r} in every KV group")
        return [copy for g in self.groups for copy in g.fork(parent_id, child_id, num_tokens)]

    def check_invariants(self) -> None:
        """Each group's bookkeeping over the shared pool, and the groups agreeing on every sequence."""
        check_invariants(*self.groups)
        owned = [{b for s in g._seqs.values() for b in s.block_table[s.num_released :]} for g in self.groups]
        check(sum(map(len, owned)) == len(set().union(*owned)), "a block held by two KV groups")
        first = self.groups[0]
        for g in self.groups[1:]:
            check(g._seqs.keys() == first._seqs.keys(), "KV groups hold different sequences")
            for sid, s in g._seqs.items():
                check(s.num_tokens == first._seqs[sid].num_tokens, f"seq {sid!r}: groups cover different tokens")


KVBlockManager = Union[BlockManager, HybridBlockManager, "StatefulBlockManager"]  # what the scheduler and the runner allocate through
