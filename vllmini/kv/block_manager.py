"""Paged KV block manager: block pool, ref counts, per-sequence block tables, prefix cache.

Pure bookkeeping, no tensors: the model runner turns block tables into slot mappings
(token position p of a sequence lives at slot ``table[p // block_size] * block_size +
p % block_size``) and performs the block copies that :meth:`BlockManager.fork` returns.

A block is free, evictable (ref 0, hashed: its KV reusable by a later prompt with the same
prefix) or referenced; kv/block_pool.py holds the pool and moves blocks between those states.

With a sliding window (every layer attends only to its last ``sliding_window`` positions),
a sequence's leading blocks fall out of every future query's reach as it advances; they are
released (to the prefix cache if hashed) at its next allocation, and their table entries
hold ``null_block`` instead, so that positions still map to table indices: a block outside
the pool that the KV cache keeps zeroed (nothing writes it). Backends that read whole tiles
or tables mask it out, and its zeros keep that masking exact (stale K/V of another sequence
could be NaN, and a masked NaN still poisons a softmax or a product with zero weight).

Prefix-cache hashes are registered when :meth:`BlockManager.allocate` hands out the slots,
i.e. *before* the forward pass that writes the KV. This is sound as long as every allocated
step is actually run: the forward writes all new K/V of a layer before any sequence of the
batch attends over it. A caller that allocates a step and then drops it without running the
forward (e.g. preempting a sequence it already scheduled this step) must call
:meth:`BlockManager.forget_unwritten` before ``free`` (or ``reset_prefix_cache`` after it), or
the cache may hand out blocks whose KV was never written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Union

from vllmini.kv.block_hash import ROOT_HASH, chain_hashes, hash_block
from vllmini.kv.block_invariants import check_invariants
from vllmini.kv.block_pool import Block, BlockPool  # noqa: F401 (Block: re-exported, as before)

SeqId = Union[int, str]


class NoFreeBlocksError(RuntimeError):
    """Raised by fork when no block can be had for the child's copy of the partial block."""


@dataclass(slots=True)
class _SeqState:
    block_table: list[int]
    num_tokens: int  # token slots covered (computed + scheduled)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks so far
    num_cached_tokens: int = 0  # prefix tokens taken from the prefix cache at admission
    num_released: int = 0  # leading table entries behind the sliding window (placeholders, not owned)
    root: bytes = ROOT_HASH  # parent hash of its first block (prefix_root)


class BlockManager(BlockPool):
    """Allocates KV blocks to sequences, shares full blocks through the prefix cache and fork
    (the pool itself, its free list and the LRU of cached blocks: ``BlockPool``)."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, sliding_window: int | None = None,
        null_block: int | None = None, pool: BlockPool | None = None, cache_key: bytes = b"",
    ) -> None:  # fmt: skip
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be > 0, got {sliding_window}")
        null_block = num_blocks if null_block is None else null_block  # the placeholder's id
        if 0 <= null_block < num_blocks:
            raise ValueError(f"null_block must lie outside the pool [0, {num_blocks}), got {null_block}")
        super().__init__(num_blocks)
        if pool is not None:  # one KV group of several (kv/hybrid_block_manager.py): their pool is one
            self.share_pool(pool)
        self.block_size = block_size
        # appended to a block's chained hash to key the prefix cache: the KV groups sharing a pool
        # hash the same tokens alike, and each keys its blocks apart (kv/hybrid_block_manager.py)
        self.cache_key = cache_key
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.null_block = null_block
        self._seqs: dict[SeqId, _SeqState] = {}
        # Counters for metrics and tests, in tokens (BlockPool.num_evictions counts blocks).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- queries -------------------------------------------------------------------------
    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: SeqId) -> list[int]:
        """The sequence's block table (the live list: read it, do not mutate it)."""
        return self._seqs[seq_id].block_table

    @property
    def num_groups(self) -> int:
        """KV cache groups, each with its own block table (kv/kv_groups.py): one here."""
        return 1

    def block_tables(self, seq_id: SeqId) -> list[list[int]]:
        """The sequence's block table of every KV group (``HybridBlockManager``'s interface)."""
        return [self._seqs[seq_id].block_table]

    def num_tokens(self, seq_id: SeqId) -> int:
        """Token slots the sequence's block table covers (computed + scheduled)."""
        return self._seqs[seq_id].num_tokens

    def num_cached_tokens(self, seq_id: SeqId) -> int:
        return self._seqs[seq_id].num_cached_tokens

    def num_owned_blocks(self, seq_id: SeqId) -> int:
        """Blocks the sequence holds (its table less the entries released behind the window)."""
        seq = self._seqs[seq_id]
        return len(seq.block_table) - seq.num_released

    def max_blocks_per_step(self, max_new_tokens: int) -> int | None:
        """With a sliding window, the most blocks one sequence holds in a step that computes at
        most ``max_new_tokens`` tokens, however long it is (None: no window, it grows without
        bound): the window behind its first new token plus the new tokens, block-aligned."""
        if self.sliding_window is None:
            return None
        return -(-(self.sliding_window - 1 + max_new_tokens) // self.block_size) + 1

    def blocks_held(self, num_tokens: int, max_new_tokens: int) -> int:
        """The most blocks a sequence of ``num_tokens`` holds in steps of at most ``max_new_tokens``."""
        per_step = self.max_blocks_per_step(max_new_tokens)
        needed = -(-num_tokens // self.block_size)
        return needed if per_step is None else min(needed, per_step)

    def capacity_tokens(self, max_new_tokens: int, max_model_len: int) -> int:
        """The longest sequence the pool can hold: ``max_model_len`` when a window plus a step of
        ``max_new_tokens`` fits (it releases what falls behind), else the pool's slots."""
        per_step = self.max_blocks_per_step(max_new_tokens)
        if per_step is not None and per_step <= self.num_blocks:
            return max_model_len
        return self.num_blocks * self.block_size

    # ---- prefix cache --------------------------------------------------------------------
    def find_cached_prefix(
        self, token_ids: Sequence[int], root: bytes = ROOT_HASH, max_tokens: int | None = None,
        chain: Sequence[bytes] = (),
    ) -> tuple[list[int], int]:
        """Longest cached start of ``token_ids``, in whole blocks: (block ids, tokens), at most
        ``max_tokens`` tokens. ``root``: the sequence's :func:`prefix_root` (its LoRA adapter's).
        With a sliding window only the blocks that the first query after the hit can see must
        be cached; those behind it are ``null_block`` placeholders in the list.

        Never covers the last token: it must be computed to get logits, and a sequence
        never writes into a shared block. Changes no state (not even the counters). ``chain``: the
        blocks' chained hashes where the caller has them (:func:`chain_hashes`), else computed."""
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        limit = max(0, (len(token_ids) - 1) // bs)
        if max_tokens is not None:
            limit = min(limit, max_tokens // bs)
        found: list[int | None] = []
        parent = root
        for i in range(limit):
            parent = chain[i] if i < len(chain) else hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            found.append(self._cached.get(parent + self.cache_key))
            if found[-1] is None and self.sliding_window is None:
                break
        # the most blocks h such that every block the query at h * bs sees is cached: blocks
        # behind(h) .. h - 1, i.e. the run of cached blocks ending at h - 1 reaches back that far
        best, run = 0, 0
        for h in range(1, len(found) + 1):
            run = run + 1 if found[h - 1] is not None else 0
            if run >= h - self._blocks_behind_window(h * bs):
                best = h
        skip = self._blocks_behind_window(best * bs)
        return [self.null_block] * skip + found[skip:best], best * bs  # type: ignore[list-item]

    # ---- allocation ----------------------------------------------------------------------
    def allocate(
        self,
        seq_id: SeqId,
        token_ids: Sequence[int],
        num_new_tokens: int,
        cached_blocks: list[int] | None = None,
        root: bytes = ROOT_HASH,
    ) -> bool:
        """Extend the sequence's table to cover ``num_computed + num_new_tokens`` slots.

        A new sequence starts from ``cached_blocks`` (from :meth:`find_cached_prefix`, just
        before, with the same ``root``). ``token_ids`` is every token known now; newly full
        blocks get hashed and registered incrementally. All-or-nothing for the new slots:
        returns False and takes no block when the pool is short (with a sliding window, the
        blocks behind the window of the first new token are released either way: no query from
        there on reads them).
        Raises ValueError on misuse (stale or misplaced ``cached_blocks``)."""
        new = seq_id not in self._seqs
        chain = chain_hashes(token_ids, root, len(cached_blocks or ()), self.block_size) if new else ()  # hashed once
        if self.blocks_to_take(seq_id, token_ids, num_new_tokens, cached_blocks, root, chain) > self.num_free_blocks:
            return False
        if new:
            self.admit(seq_id, token_ids, cached_blocks, root, chain)
        self.grow(seq_id, token_ids, num_new_tokens)
        return True

    def blocks_to_take(
        self, seq_id: SeqId, token_ids: Sequence[int], num_new_tokens: int, cached_blocks: list[int] | None = None,
        root: bytes = ROOT_HASH, chain: Sequence[bytes] = (),
    ) -> int:  # fmt: skip
        """How many of the pool's allocatable blocks :meth:`allocate` would use: new blocks plus
        cached ones it takes out of the evictable LRU. A sequence already allocated first
        releases the blocks behind its window (the only state this changes)."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        seq = self._seqs.get(seq_id)
        if seq is not None:
            if cached_blocks:
                raise ValueError(f"cached_blocks given for already allocated sequence {seq_id!r}")
            if self.sliding_window is not None:
                self._release_behind_window(seq)
            return max(0, -(-(seq.num_tokens + num_new_tokens) // self.block_size) - len(seq.block_table))
        cached = list(cached_blocks or ())
        self._check_cached(token_ids, cached, root, chain)
        kept = cached[self._blocks_behind_window(len(cached) * self.block_size) :]
        reclaimed = sum(1 for bid in kept if bid in self._evictable)  # ref 0: they leave the allocatable pool
        total = len(cached) * self.block_size + num_new_tokens
        return max(0, -(-total // self.block_size) - len(cached)) + reclaimed

    def admit(
        self, seq_id: SeqId, token_ids: Sequence[int], cached_blocks: list[int] | None, root: bytes,
        chain: Sequence[bytes] = (),
    ) -> None:  # fmt: skip
        """A new sequence holding its prefix-cache hit, no new block yet (:meth:`allocate` once
        :meth:`blocks_to_take` blocks are known to be free): taking a new block may evict an
        unreferenced cached one, so every KV group claims its hit before any group grows."""
        bs = self.block_size
        cached = list(cached_blocks or ())
        hashes = self._check_cached(token_ids, cached, root, chain)
        num_computed = len(cached) * bs
        # cached blocks behind the window are not taken: they stay in the cache as they are
        skip = self._blocks_behind_window(num_computed)
        table = [self.null_block] * skip + cached[skip:]
        for bid in cached[skip:]:
            self._evictable.pop(bid, None)
            self.blocks[bid].ref_count += 1
        self._seqs[seq_id] = _SeqState(table, num_computed, hashes, num_computed, skip, root)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += len(token_ids)
            self.prefix_cache_hits += num_computed

    def grow(self, seq_id: SeqId, token_ids: Sequence[int], num_new_tokens: int, chain: Sequence[bytes] = ()) -> None:
        """Extend an admitted sequence's table by ``num_new_tokens`` slots (blocks known to be free);
        ``chain``: its blocks' chained hashes where the caller has them (another KV group's)."""
        bs = self.block_size
        seq = self._seqs[seq_id]
        seq.num_tokens += num_new_tokens
        for _ in range(max(0, -(-seq.num_tokens // bs) - len(seq.block_table))):
            bid = self._take_block()
            self.blocks[bid].ref_count = 1
            seq.block_table.append(bid)
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, token_ids, chain)

    def free(self, seq_id: SeqId) -> None:
        """Drop a finished/aborted/preempted sequence; unknown ids are a no-op.

        Blocks are released tail first, so that the tail (least likely to be shared by a
        later prompt) is evicted before the head."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        for bid in reversed(seq.block_table[seq.num_released :]):
            self._release(bid)

    def forget_unwritten(self, seq_id: SeqId, num_written: int) -> None:
        """Unregister the prefix-cache hashes of the sequence's blocks not fully written (those
        past its first ``num_written`` tokens): its last allocation is dropped without a forward.
        Call before :meth:`free`. Unknown ids are a no-op."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return
        first = num_written // self.block_size
        for i in range(max(first, seq.num_released), len(seq.block_hashes)):
            blk = self.blocks[seq.block_table[i]]
            if blk.block_hash == seq.block_hashes[i] + self.cache_key:  # registered by this sequence (not a duplicate)
                del self._cached[blk.block_hash]
                blk.block_hash = None
        del seq.block_hashes[first:]

    def rollback(self, seq_id: SeqId, num_tokens: int) -> None:
        """Shrink the sequence's slots to its first ``num_tokens`` (speculative decoding: the
        rejected drafts' slots), releasing the blocks no longer needed. Those slots held no
        known token when allocated, so no hash covers them (``allocate`` hashes known tokens only)."""
        seq = self._seqs[seq_id]
        if not len(seq.block_hashes) * self.block_size <= num_tokens <= seq.num_tokens:
            raise ValueError(f"cannot roll sequence {seq_id!r} back to {num_tokens} tokens "
                             f"(holds {seq.num_tokens}, {len(seq.block_hashes)} hashed blocks)")  # fmt: skip
        seq.num_tokens = num_tokens
        keep = max(-(-num_tokens // self.block_size), seq.num_released)
        for bid in reversed(seq.block_table[keep:]):
            self._release(bid)
        del seq.block_table[keep:]

    def can_fork(self, parent_id: SeqId, num_tokens: int) -> bool:
        """Whether :meth:`fork` would find a block for the copy of the partial block."""
        return parent_id in self._seqs and (num_tokens % self.block_size == 0 or self.num_free_blocks > 0)

    def fork(self, parent_id: SeqId, child_id: SeqId, num_tokens: int) -> list[tuple[int, int]]:
        """Give ``child_id`` the parent's first ``num_tokens`` slots (for n > 1 sampling).

        Full blocks are shared (ref +1); the partial last block, which both will write
        into, is copied to a new block. Returns the (src, dst) block copies the model
        runner must do. Raises NoFreeBlocksError (state unchanged) if no block is left
        for the copy; check :meth:`can_fork` first."""
        parent = self._seqs[parent_id]
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already exists")
        if not 0 <= num_tokens <= parent.num_tokens:
            raise ValueError(f"num_tokens {num_tokens} outside [0, {parent.num_tokens}]")
        if parent.num_released > self._blocks_behind_window(num_tokens):
            raise ValueError(f"cannot fork {parent_id!r} at {num_tokens}: its sliding window reaches released blocks")
        n_full, rem = divmod(num_tokens, self.block_size)
        if rem and not self.num_free_blocks:
            raise NoFreeBlocksError(f"no free block to fork {parent_id!r} into {child_id!r}")
        table = parent.block_table[:n_full]
        released = parent.num_released
        for bid in table[released:]:
            self.blocks[bid].ref_count += 1
        copies: list[tuple[int, int]] = []
        if rem:
            dst = self._take_block()
            self.blocks[dst].ref_count = 1
            table.append(dst)
            copies.append((parent.block_table[n_full], dst))
        self._seqs[child_id] = _SeqState(
            table, num_tokens, parent.block_hashes[:n_full], min(parent.num_cached_tokens, num_tokens), released,
            parent.root,
        )
        return copies

    # ---- internals -----------------------------------------------------------------------
    def _blocks_behind_window(self, first_query: int) -> int:
        """How many leading blocks hold only positions that a query at ``first_query`` or later
        cannot see: with window W it sees keys after ``first_query - W``."""
        if self.sliding_window is None:
            return 0
        return max(0, first_query - self.sliding_window + 1) // self.block_size

    def _release_behind_window(self, seq: _SeqState) -> None:
        """Release the blocks behind the window of the sequence's next query (at ``num_tokens``:
        its earlier slots are computed, or computing in a forward launched before any that could
        write a released block)."""
        behind = min(self._blocks_behind_window(seq.num_tokens), len(seq.block_table))
        for i in range(seq.num_released, behind):
            self._release(seq.block_table[i])
            seq.block_table[i] = self.null_block
        seq.num_released = max(seq.num_released, behind)

    def _check_cached(
        self, token_ids: Sequence[int], cached: list[int], root: bytes, chain: Sequence[bytes] = ()
    ) -> list[bytes]:  # fmt: skip
        """Hashes of the cached prefix blocks; raises if they are not (or no longer) what
        the prefix cache holds for these tokens, e.g. evicted since find_cached_prefix."""
        if not cached:
            return []
        if not self.enable_prefix_caching:
            raise ValueError("cached_blocks given but prefix caching is disabled")
        bs = self.block_size
        if len(cached) * bs > len(token_ids):
            raise ValueError("cached_blocks cover more tokens than token_ids")
        hashes: list[bytes] = []
        parent = root
        skip = self._blocks_behind_window(len(cached) * bs)  # placeholders: not taken, need not be cached
        for i, bid in enumerate(cached):
            parent = chain[i] if i < len(chain) else hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            if i >= skip and self._cached.get(parent + self.cache_key) != bid:
                raise ValueError(f"stale cached block {bid} at index {i}: call find_cached_prefix again")
            hashes.append(parent)
        return hashes

    def _register_full_blocks(self, seq: _SeqState, token_ids: Sequence[int], chain: Sequence[bytes] = ()) -> None:
        """Hash the blocks that became full with known tokens since the last call."""
        bs = self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else seq.root
        for i in range(len(seq.block_hashes), min(seq.num_tokens, len(token_ids)) // bs):
            parent = chain[i] if i < len(chain) else hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            seq.block_hashes.append(parent)
            if i < seq.num_released:  # (a window of a few tokens) released before its last token was known
                continue
            blk = self.blocks[seq.block_table[i]]
            # First writer wins: a duplicate of an already cached block stays unhashed and
            # goes back to the free pool when released.
            key = parent + self.cache_key
            if blk.block_hash is None and key not in self._cached:
                blk.block_hash = key
                self._cached[key] = blk.block_id

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests, debugging; kv/block_invariants.py)."""
        check_invariants(self)
