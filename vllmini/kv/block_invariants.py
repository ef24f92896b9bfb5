"""``check_invariants``: the block manager's bookkeeping checked against itself (tests, debugging).

Kept out of block_manager.py: the engine never calls it, and it restates every rule the
allocator keeps (block states, ref counts, hashes, tables, the sliding window) in one place.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllmini.kv.block_manager import BlockManager


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)


def check_invariants(bm: BlockManager, *others: BlockManager) -> None:
    """Raise AssertionError if the bookkeeping is inconsistent. ``others``: the other KV groups'
    managers sharing ``bm``'s pool (kv/hybrid_block_manager.py): a block's references are theirs
    together."""
    groups = (bm, *others)
    refs = Counter(bid for g in groups for s in g._seqs.values() for bid in s.block_table[s.num_released :])
    free, evictable = set(bm._free), set(bm._evictable)
    check(len(free) == len(bm._free), "duplicate block in the free list")
    check(not free & evictable, f"blocks both free and evictable: {free & evictable}")
    check(len(free) + len(evictable) + len(refs) == bm.num_blocks, "free + evictable + referenced != total")
    for bid, blk in enumerate(bm.blocks):
        if blk is None:  # never handed out
            check(bid in free, f"block {bid} never handed out but not free")
            continue
        check(blk.ref_count == refs.get(bid, 0), f"block {bid}: ref {blk.ref_count} != {refs.get(bid, 0)}")
        if bid in free:
            check(blk.ref_count == 0 and blk.block_hash is None, f"free block {bid} owned or hashed")
        elif bid in evictable:
            check(blk.ref_count == 0 and blk.block_hash is not None, f"evictable block {bid} owned or unhashed")
        if blk.block_hash is not None:
            check(bm._cached.get(blk.block_hash) == bid, f"block {bid} hash not registered to it")
    for h, bid in bm._cached.items():
        check(bm.blocks[bid].block_hash == h, f"registered hash maps to block {bid} with another hash")
    if not bm.enable_prefix_caching:
        check(not bm._cached and not evictable, "prefix caching disabled but blocks are cached")
    for g in groups:
        check(g.blocks is bm.blocks and g._free is bm._free and g._cached is bm._cached, "KV groups with other pools")
        check_tables(g)


def check_tables(bm: BlockManager) -> None:
    """The sequences' tables, hashes and released entries of one manager (one KV group)."""
    bs = bm.block_size
    for sid, s in bm._seqs.items():
        check(len(s.block_table) == -(-s.num_tokens // bs), f"seq {sid!r}: table size != ceil(tokens/bs)")
        check(len(s.block_hashes) <= s.num_tokens // bs, f"seq {sid!r}: hash of a non-full block")
        check(s.num_released <= bm._blocks_behind_window(s.num_tokens), f"seq {sid!r}: released a block in the window")
        check(all(b == bm.null_block for b in s.block_table[: s.num_released]), f"seq {sid!r}: not the null block")
        for i, h in enumerate(s.block_hashes[s.num_released :], start=s.num_released):
            bh = bm.blocks[s.block_table[i]].block_hash
            check(bh is None or bh == h + bm.cache_key, f"seq {sid!r}: block {i} hashed for other tokens")
