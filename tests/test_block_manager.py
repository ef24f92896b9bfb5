"""Tests for the KV block manager: unit tests plus a hypothesis state machine that checks
the bookkeeping against a simulated KV cache (which prefix each slot's KV was computed from)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import vllmini.kv.block_manager as bm_mod
from vllmini.kv.block_manager import BlockManager, NoFreeBlocksError


def snapshot(bm: BlockManager) -> tuple:
    """Everything allocate/fork may change, to assert that a refusal changed nothing."""
    seqs = sorted(
        ((str(k), tuple(s.block_table), s.num_tokens, tuple(s.block_hashes), s.num_cached_tokens)
         for k, s in bm._seqs.items())
    )
    return (
        seqs,
        tuple(bm._free),
        tuple(bm._evictable),
        dict(bm._cached),
        tuple((0, None) if b is None else (b.ref_count, b.block_hash) for b in bm.blocks),  # (None: never handed out)
        (bm.prefix_cache_queries, bm.prefix_cache_hits, bm.num_evictions),
    )


def slots(bm: BlockManager, seq_id, n: int) -> list[int]:
    table = bm.block_table(seq_id)
    return [table[p // bm.block_size] * bm.block_size + p % bm.block_size for p in range(n)]


# ---- unit tests ---------------------------------------------------------------------------
def test_prefill_allocates_ceil_blocks():
    bm = BlockManager(8, 4)
    assert bm.allocate("a", list(range(10)), 10)
    assert len(bm.block_table("a")) == 3 and bm.num_tokens("a") == 10
    assert bm.num_free_blocks == 5 and bm.usage == pytest.approx(3 / 8)
    assert len(set(slots(bm, "a", 10))) == 10
    bm.check_invariants()


def test_chunked_prefill_extends_table():
    bm = BlockManager(8, 4)
    prompt = list(range(10))
    assert bm.allocate(1, prompt, 3)
    assert len(bm.block_table(1)) == 1
    first = list(bm.block_table(1))
    assert bm.allocate(1, prompt, 4)
    assert len(bm.block_table(1)) == 2 and bm.block_table(1)[:1] == first
    assert bm.allocate(1, prompt, 3)
    assert len(bm.block_table(1)) == 3 and bm.num_tokens(1) == 10
    bm.check_invariants()


def test_decode_allocates_a_block_every_block_size_tokens():
    bm = BlockManager(8, 4)
    toks = [1, 2, 3, 4]
    assert bm.allocate("a", toks, 4)
    assert len(bm.block_table("a")) == 1
    for step in range(8):
        toks = toks + [step]
        assert bm.allocate("a", toks, 1)
        assert len(bm.block_table("a")) == -(-len(toks) // 4)
        bm.check_invariants()
    assert bm.num_free_blocks == 5


def test_hashing_is_incremental(monkeypatch):
    calls = []
    real = bm_mod.hash_block
    monkeypatch.setattr(bm_mod, "hash_block", lambda p, t: calls.append(len(t)) or real(p, t))
    bm = BlockManager(64, 4)
    toks = [7] * 5
    assert bm.allocate("a", toks, 5)
    assert len(calls) == 1
    for i in range(95):
        toks = toks + [i]
        assert bm.allocate("a", toks, 1)
    assert len(calls) == 100 // 4  # one hash per block, when it becomes full


def test_all_or_nothing():
    bm = BlockManager(4, 4)
    assert bm.allocate("a", list(range(12)), 12)
    before = snapshot(bm)
    assert not bm.allocate("b", list(range(100, 108)), 8)
    assert snapshot(bm) == before and "b" not in bm
    assert bm.allocate("a", list(range(16)), 4)  # fills the last block
    before = snapshot(bm)
    assert not bm.allocate("a", list(range(17)), 1)
    assert snapshot(bm) == before
    bm.check_invariants()


def test_all_or_nothing_counts_cached_blocks_taken_from_the_pool():
    bm = BlockManager(4, 4)
    p = list(range(9))
    assert bm.allocate("a", p, 9)
    bm.free("a")  # 2 full blocks evictable, the partial one truly free
    assert bm.allocate("b", list(range(50, 58)), 8)  # takes the 2 truly free blocks
    blocks, n = bm.find_cached_prefix(p + [1])
    assert n == 8 and bm.num_free_blocks == 2
    before = snapshot(bm)
    # needs 1 new block, but the only allocatable blocks are the 2 cached ones it would pin
    assert not bm.allocate("c", p + [1], 2, blocks)
    assert snapshot(bm) == before
    bm.check_invariants()


def test_free_returns_everything():
    bm = BlockManager(16, 4)
    prompt = list(range(10))
    assert bm.allocate("a", prompt, 10)
    blocks, n = bm.find_cached_prefix(prompt + [5, 6])
    assert bm.allocate("b", prompt + [5, 6], 12 - n, blocks)
    bm.fork("b", "c", 11)
    for sid in ("a", "b", "c", "unknown"):
        bm.free(sid)
        bm.check_invariants()
    assert bm.num_free_blocks == 16 and bm.usage == 0.0


def test_prefix_hit_shares_full_blocks():
    bm = BlockManager(16, 4)
    a = list(range(10))
    assert bm.allocate("a", a, 10)
    b = a[:8] + [99, 98, 97]
    blocks, n = bm.find_cached_prefix(b)
    assert blocks == bm.block_table("a")[:2] and n == 8
    assert bm.allocate("b", b, len(b) - n, blocks)
    assert bm.block_table("b")[:2] == blocks and bm.block_table("b")[2] != bm.block_table("a")[2]
    assert [bm.blocks[x].ref_count for x in blocks] == [2, 2]
    assert bm.num_cached_tokens("b") == 8 and bm.num_cached_tokens("a") == 0
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10 + 11, 8)
    assert bm.num_free_blocks == 16 - 4
    bm.check_invariants()
    # still cached after both finish: a third prompt takes them back out of the evictable pool
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 16
    c = a[:8] + [1]
    blocks2, n2 = bm.find_cached_prefix(c)
    assert blocks2 == blocks and n2 == 8
    assert bm.allocate("c", c, 1, blocks2)
    assert bm.num_free_blocks == 16 - 3
    bm.check_invariants()


def test_prefix_cache_disabled():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    a = list(range(10))
    assert bm.allocate("a", a, 10)
    assert bm.find_cached_prefix(a) == ([], 0)
    bm.free("a")
    assert bm.find_cached_prefix(a) == ([], 0)
    assert all(b is None or b.block_hash is None for b in bm.blocks)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (0, 0)
    with pytest.raises(ValueError):
        bm.allocate("b", a, 2, [0, 1])
    bm.check_invariants()


def test_whole_prompt_hit_drops_last_block():
    bm = BlockManager(16, 4)
    p = list(range(8))
    assert bm.allocate("a", p, 8)
    assert bm.find_cached_prefix(p) == (bm.block_table("a")[:1], 4)
    assert bm.find_cached_prefix(p[:5]) == (bm.block_table("a")[:1], 4)
    assert bm.find_cached_prefix(p[:4]) == ([], 0)
    assert bm.find_cached_prefix(p + [0]) == (bm.block_table("a"), 8)
    assert bm.find_cached_prefix([]) == ([], 0)


def test_stale_cached_blocks_rejected():
    bm = BlockManager(2, 4)
    p = list(range(8))
    assert bm.allocate("a", p, 8)
    bm.free("a")
    blocks, _ = bm.find_cached_prefix(p + [1])
    assert len(blocks) == 2
    assert bm.allocate("x", [50, 51, 52, 53, 54], 5)  # evicts both
    bm.free("x")
    with pytest.raises(ValueError):
        bm.allocate("b", p + [1], 1, blocks)
    bm.check_invariants()


def test_eviction_is_lru_tail_first_and_drops_hash():
    bm = BlockManager(4, 4)
    a = list(range(8))
    assert bm.allocate("a", a, 8)
    head, tail = bm.block_table("a")
    tail_hash = bm.blocks[tail].block_hash
    bm.free("a")
    assert bm.allocate("b", list(range(20, 28)), 8)  # truly free blocks go first
    assert bm.num_evictions == 0
    bm.free("b")  # evictable now: a.tail, a.head, b.tail, b.head (oldest first)
    assert bm.num_free_blocks == 4
    assert bm.allocate("c", [40, 41, 42], 3)
    assert bm.block_table("c") == [tail] and bm.num_evictions == 1
    assert bm.blocks[tail].block_hash is None
    assert bm.find_cached_prefix(a + [0]) == ([head], 4)  # a's tail hash is gone
    assert bm.allocate("c", [40, 41, 42, 43], 1)  # now full: hashed with c's tokens
    assert bm.blocks[tail].block_hash not in (None, tail_hash)
    assert bm.allocate("d", list(range(60, 72)), 12)  # evicts a.head, b.tail, b.head
    assert bm.num_evictions == 4 and bm.num_free_blocks == 0
    assert bm.find_cached_prefix(a + [0]) == ([], 0)
    bm.check_invariants()


def test_reset_prefix_cache():
    bm = BlockManager(8, 4)
    a, b = list(range(9)), list(range(30, 39))
    assert bm.allocate("a", a, 9) and bm.allocate("b", b, 9)
    bm.free("a")
    bm.reset_prefix_cache()
    bm.check_invariants()
    assert bm.find_cached_prefix(a) == ([], 0)
    assert bm.find_cached_prefix(b) == (bm.block_table("b")[:2], 8)  # referenced blocks keep theirs
    assert bm.num_free_blocks == 5


def test_fork_shares_full_blocks_and_copies_partial():
    bm = BlockManager(5, 4)
    p = list(range(10))
    assert bm.allocate("p", p, 10)
    pt = list(bm.block_table("p"))
    copies = bm.fork("p", "c1", 10)
    ct = bm.block_table("c1")
    assert ct[:2] == pt[:2] and ct[2] not in pt
    assert copies == [(pt[2], ct[2])]
    assert [bm.blocks[x].ref_count for x in pt] == [2, 2, 1]
    assert bm.num_tokens("c1") == 10
    assert bm.fork("p", "c2", 8) == []
    assert bm.block_table("c2") == pt[:2]
    bm.check_invariants()
    assert bm.allocate("c1", p + [3, 4], 2)  # c1 fills its own copy, the parent's block is untouched
    assert bm.num_free_blocks == 1 and bm.can_fork("p", 10)
    bm.fork("p", "c3", 10)
    assert not bm.can_fork("p", 10) and bm.can_fork("p", 4)
    before = snapshot(bm)
    with pytest.raises(NoFreeBlocksError):
        bm.fork("p", "c4", 9)
    assert snapshot(bm) == before
    with pytest.raises(ValueError):
        bm.fork("p", "c1", 4)
    with pytest.raises(ValueError):
        bm.fork("p", "c5", 11)
    for sid in ("p", "c1", "c2", "c3"):
        bm.free(sid)
    assert bm.num_free_blocks == 5
    bm.check_invariants()


# ---- stateful test ------------------------------------------------------------------------
NB, BS = 16, 4
BASES = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
    [1, 2, 3, 4, 7, 7, 7, 7, 1, 2, 3, 4],
    [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5],
    [],
]


class SequenceRules:
    """What the block-manager state machines share: live sequences in ``tokens`` / ``nslots`` /
    ``first_query``, picking one, prefilling a chunk of it (its ``_extend``), preempting."""

    def _preempt_newest(self) -> None:
        """What the scheduler does when blocks run out: free the newest sequence; its full
        blocks stay cached (evictable), which keeps hits and evictions frequent."""
        if self.tokens:
            sid = next(reversed(self.tokens))
            self.bm.free(sid)
            del self.tokens[sid], self.nslots[sid], self.first_query[sid]

    def _pick(self, data, cond) -> object:
        return data.draw(st.sampled_from(sorted((s for s in self.tokens if cond(s)), key=str)))

    @precondition(lambda self: any(self.nslots[s] < len(t) for s, t in self.tokens.items()))
    @rule(data=st.data(), chunk=st.integers(1, 8))
    def prefill_chunk(self, data, chunk) -> None:
        sid = self._pick(data, lambda s: self.nslots[s] < len(self.tokens[s]))
        self._extend(sid, self.tokens[sid], min(chunk, len(self.tokens[sid]) - self.nslots[sid]))


class BlockManagerMachine(SequenceRules, RuleBasedStateMachine):
    """Drives the manager and simulates the KV cache: ``kv[slot]`` is the token prefix the
    KV at that slot was computed from. Every live sequence must always read back its own
    prefixes (with a sliding window: those its last step's queries could see), and every
    prefix-cache hit must return blocks holding the prompt's prefix."""

    @initialize(caching=st.sampled_from([True, True, True, False]), window=st.sampled_from([None, None, 1, 3, 6]))
    def setup(self, caching: bool, window: int | None) -> None:
        self.caching, self.window = caching, window
        self.bm = BlockManager(NB, BS, enable_prefix_caching=caching, sliding_window=window)
        self.tokens: dict[object, list[int]] = {}  # every known token of a live sequence
        self.nslots: dict[object, int] = {}  # slots allocated (= tokens computed after the step)
        # the first position a query of the sequence still makes: its last step's (or next one's)
        self.first_query: dict[object, int] = {}
        self.kv: dict[int, tuple[int, ...]] = {}
        self.next_id = 0

    def _slot(self, sid, p: int) -> int:
        return self.bm.block_table(sid)[p // BS] * BS + p % BS

    def _write(self, sid, start: int, end: int) -> None:
        """What the forward does: compute and store KV for positions [start, end)."""
        for p in range(start, end):
            self.kv[self._slot(sid, p)] = tuple(self.tokens[sid][: p + 1])

    def _fits(self, table_len: int, total: int, cached: list[int] = (), released: list[int] = ()) -> bool:
        reclaimed = sum(1 for b in cached if self.bm.blocks[b].ref_count == 0)
        gained = sum(1 for b in released if self.bm.blocks[b].ref_count == 1)
        return -(-total // BS) - table_len <= self.bm.num_free_blocks - reclaimed + gained

    def _behind_window(self, first_query: int) -> int:
        """Leading blocks no query from ``first_query`` on can see."""
        return 0 if self.window is None else max(0, first_query - self.window + 1) // BS

    def _extend(self, sid, tokens: list[int], num_new: int) -> None:
        table, start = self.bm.block_table(sid), self.nslots[sid]
        was_released = len(table) - self.bm.num_owned_blocks(sid)
        released = table[was_released : self._behind_window(start)]
        fits = self._fits(len(table), start + num_new, released=released)
        before = snapshot(self.bm)
        ok = self.bm.allocate(sid, tokens, num_new)
        assert ok == fits
        assert len(table) - self.bm.num_owned_blocks(sid) == max(was_released, self._behind_window(start))
        if ok:
            self.tokens[sid], self.nslots[sid], self.first_query[sid] = tokens, start + num_new, start
            self._write(sid, start, start + num_new)
        else:
            if not released:  # (the blocks behind the window are released either way)
                assert snapshot(self.bm) == before
            self.first_query[sid] = start  # its next query, whose window the release kept
            self._preempt_newest()


    @rule(
        base=st.sampled_from(BASES),
        prefix_len=st.sampled_from([4, 5, 8, 9, 12]) | st.integers(0, 12),
        tail=st.lists(st.integers(0, 2), max_size=4),
        chunk=st.integers(1, 16),
        use_cache=st.sampled_from([True, True, True, False]),
    )
    def admit(self, base, prefix_len, tail, chunk, use_cache) -> None:
        prompt = base[:prefix_len] + tail or [0]
        blocks, n = self.bm.find_cached_prefix(prompt)
        assert n == len(blocks) * BS and n < len(prompt)
        assert self.caching or not blocks
        skip = self._behind_window(n)  # blocks behind the window: placeholders, not looked up nor taken
        assert blocks[:skip] == [NB] * skip
        for p in range(skip * BS, n):
            assert self.kv[blocks[p // BS] * BS + p % BS] == tuple(prompt[: p + 1])
        if not use_cache:
            blocks, n, skip = [], 0, 0
        sid, self.next_id = self.next_id, self.next_id + 1
        num_new = min(chunk, len(prompt) - n)
        fits = self._fits(len(blocks), n + num_new, blocks[skip:])
        before = snapshot(self.bm)
        ok = self.bm.allocate(sid, prompt, num_new, blocks)
        assert ok == fits
        if ok:
            self.tokens[sid], self.nslots[sid], self.first_query[sid] = prompt, n + num_new, n
            assert self.bm.num_cached_tokens(sid) == n
            assert self.bm.block_table(sid)[: len(blocks)] == [NB] * skip + blocks[skip:]  # NB: the null block
            self._write(sid, n, n + num_new)
        else:
            assert snapshot(self.bm) == before and sid not in self.bm
            self._preempt_newest()

    @precondition(lambda self: any(self.nslots[s] == len(t) for s, t in self.tokens.items()))
    @rule(data=st.data(), tok=st.integers(0, 2))
    def decode(self, data, tok) -> None:
        sid = self._pick(data, lambda s: self.nslots[s] == len(self.tokens[s]))
        self._extend(sid, self.tokens[sid] + [tok], 1)

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = self._pick(data, lambda s: True)
        n = data.draw(st.integers(0, self.nslots[parent]))
        child, self.next_id = f"fork-{self.next_id}", self.next_id + 1
        if len(self.bm.block_table(parent)) - self.bm.num_owned_blocks(parent) > self._behind_window(n):
            before = snapshot(self.bm)
            with pytest.raises(ValueError, match="sliding window"):  # its window reaches released blocks
                self.bm.fork(parent, child, n)
            assert snapshot(self.bm) == before
            return
        if not self.bm.can_fork(parent, n):
            before = snapshot(self.bm)
            with pytest.raises(NoFreeBlocksError):
                self.bm.fork(parent, child, n)
            assert snapshot(self.bm) == before
            return
        copies = self.bm.fork(parent, child, n)
        pt, ct = self.bm.block_table(parent), self.bm.block_table(child)
        assert ct[: n // BS] == pt[: n // BS]
        assert len(copies) == (n % BS != 0)
        for src, dst in copies:  # what the model runner does
            assert src == pt[n // BS] and dst == ct[-1] and dst not in pt[len(pt) - self.bm.num_owned_blocks(parent) :]
            for off in range(n % BS):
                self.kv[dst * BS + off] = self.kv[src * BS + off]
        self.tokens[child], self.nslots[child] = self.tokens[parent][:n], n
        self.first_query[child] = n

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def free(self, data) -> None:
        sid = self._pick(data, lambda s: True)
        self.bm.free(sid)
        del self.tokens[sid], self.nslots[sid], self.first_query[sid]
        assert sid not in self.bm

    @rule(unknown=st.sampled_from(["nobody", 10**6]), reset=st.integers(0, 3))
    def free_unknown_or_reset(self, unknown, reset) -> None:
        """Rarely reset the prefix cache, so that cache hits and evictions stay frequent."""
        before = snapshot(self.bm)
        self.bm.free(unknown)
        assert snapshot(self.bm) == before
        if reset == 0:
            self.bm.reset_prefix_cache()
            assert not self.bm._evictable

    @invariant()
    def consistent(self) -> None:
        bm = self.bm
        bm.check_invariants()
        owners: dict[int, list[tuple[object, int]]] = {}
        for sid, toks in self.tokens.items():
            table, n = bm.block_table(sid), self.nslots[sid]
            assert bm.num_tokens(sid) == n and len(table) == -(-n // BS)
            released = len(table) - bm.num_owned_blocks(sid)
            assert released <= self._behind_window(self.first_query[sid]) and table[:released] == [NB] * released
            owned = table[released:]
            assert len(set(owned)) == len(owned)
            for i, b in enumerate(owned, start=released):
                owners.setdefault(b, []).append((sid, i))
            seen_from = 0 if self.window is None else max(0, self.first_query[sid] - self.window + 1)
            for p in range(seen_from, n):  # nobody overwrote KV this sequence's queries can see
                assert self.kv[self._slot(sid, p)] == tuple(toks[: p + 1]), (sid, p)
        for b, users in owners.items():
            if len(users) > 1:  # shared: a full block at the same index with the same prefix
                (s0, i0) = users[0]
                for sid, i in users:
                    assert i == i0 and self.nslots[sid] >= (i + 1) * BS
                    assert self.tokens[sid][: (i + 1) * BS] == self.tokens[s0][: (i + 1) * BS]
        assert bm.num_free_blocks + len(owners) == NB
        assert bm.usage == pytest.approx(len(owners) / NB)
        assert 0 <= bm.prefix_cache_hits <= bm.prefix_cache_queries
        if not self.caching:
            assert bm.prefix_cache_queries == 0


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_manager_state_machine = BlockManagerMachine.TestCase
