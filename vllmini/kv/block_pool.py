"""The pool of KV blocks and the states a block moves through (vLLM v1's ``BlockPool``).

Kept apart from block_manager.py, whose subject is the sequences (their block tables, the
prefix-cache lookups, fork, rollback, the sliding window): this is what any of those takes a
block from and gives it back to, and the one place where a block changes state.

Every block is in exactly one of three states:
  * free: ref 0, no hash; handed out first;
  * evictable: ref 0 but its chained hash is registered, so its KV can be reused by a
    later prompt with the same prefix; handed out (evicted, LRU first) when no free block is left;
  * referenced: ref > 0, in the block table of one or more live sequences.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set only while registered in the prefix cache


class BlockPool:
    """Free list, LRU of evictable (cached, unreferenced) blocks, and the hash -> block map.
    ``BlockManager`` is one: it shares these fields with its sequence bookkeeping."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # made on first use (a small model's 1 GiB pool holds ~10^5 blocks: building them all up
        # front took a fifth of a second); a block never handed out is free, ref 0, unhashed
        self.blocks: list[Block | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # first = least recently freed
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self.num_evictions = 0  # blocks evicted from the prefix cache (metrics and tests)

    def share_pool(self, pool: BlockPool) -> None:
        """Use ``pool``'s blocks, free list, LRU and hash map as this one's: the KV groups of a
        hybrid model draw their block ids from one pool (kv/hybrid_block_manager.py)."""
        if pool.num_blocks != self.num_blocks:
            raise ValueError(f"a shared pool must have {self.num_blocks} blocks, not {pool.num_blocks}")
        self.blocks, self._free, self._evictable, self._cached = pool.blocks, pool._free, pool._evictable, pool._cached

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: truly free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def reset_prefix_cache(self) -> None:
        """Forget the hashes of all unreferenced blocks (they become truly free)."""
        while self._evictable:
            self._free.append(self._drop_lru())

    def _release(self, bid: int) -> None:
        """Drop one reference; an unreferenced block is evictable if hashed, else free."""
        blk = self.blocks[bid]
        blk.ref_count -= 1
        if blk.ref_count == 0:
            if blk.block_hash is not None:
                self._evictable[bid] = None
            else:
                self._free.append(bid)

    def _take_block(self) -> int:
        """A block with ref 0 and no hash: a free one, else the LRU evictable one."""
        if not self._free:
            return self._drop_lru(evict=True)
        bid = self._free.popleft()
        if self.blocks[bid] is None:
            self.blocks[bid] = Block(bid)
        return bid

    def _drop_lru(self, evict: bool = False) -> int:
        bid, _ = self._evictable.popitem(last=False)
        blk = self.blocks[bid]
        del self._cached[blk.block_hash]  # type: ignore[arg-type]
        blk.block_hash = None
        if evict:
            self.num_evictions += 1
        return bid
