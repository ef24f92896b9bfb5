"""The hybrid KV cache (kv/kv_groups.py, kv/hybrid_block_manager.py): a model mixing sliding-window
and full-attention layers (Gemma 2/3, Qwen2's max_window_layers) keeps a block table per group of
layers over one shared pool, and releases the sliding groups' blocks behind their window, as vLLM's
hybrid KV cache manager does. Greedy tokens stay transformers', and a pool that cannot hold every
layer's blocks holds the sequences."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from helpers import assert_greedy_matches, hf_greedy, save_tiny_model, tiny_gemma2_config, tiny_gemma3_config
from test_architectures import tiny_dir
from test_block_manager import SequenceRules
from test_engine import assert_no_leaks, kv_bytes
from test_sliding_window_kv import track_owned_blocks
from vllmini import LLM, SamplingParams
from vllmini.kv.block_manager import NoFreeBlocksError
from vllmini.kv.hybrid_block_manager import HybridBlockManager
from vllmini.kv.kv_groups import plan_kv_layout


# ---- layout -------------------------------------------------------------------------------------
def test_layers_are_grouped_by_window_in_groups_of_the_smallest_kind():
    gemma3_1b = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]  # 4 full layers, 22 sliding
    layout = plan_kv_layout(gemma3_1b)
    assert layout.group_size == 4 and layout.group_windows == (None,) + (512,) * 6
    assert [layout.layer_groups[i] for i in (5, 11, 17, 23)] == [0] * 4
    assert [layout.layer_slots[i] for i in (5, 11, 17, 23)] == [0, 1, 2, 3]
    sliding = [i for i in range(26) if gemma3_1b[i]]
    assert [(layout.layer_groups[i], layout.layer_slots[i]) for i in sliding[:5]] == [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0)]
    assert [layout.layer_groups[i] for i in sliding[-2:]] == [6, 6]  # the last group: two slots unused
    # no layer shares a (group, slot) with another
    assert len({(g, s) for g, s in zip(layout.layer_groups, layout.layer_slots)}) == 26
    gemma2 = plan_kv_layout([4096, None] * 13)
    assert gemma2.group_size == 13 and gemma2.group_windows == (None, 4096)
    assert plan_kv_layout([None] * 4) is None and plan_kv_layout([12] * 4) is None  # one table serves
    two_windows = plan_kv_layout([8, 16, 8, 16, 16, 16])
    assert two_windows.group_windows == (8, 16, 16) and two_windows.group_size == 2


# ---- the manager, against a simulated KV cache ---------------------------------------------------
NB, BS = 40, 4
BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [1, 2, 3, 4, 7, 7, 7, 7, 1, 2, 3, 4], [5] * 16]


class HybridMachine(SequenceRules, RuleBasedStateMachine):
    """Drives a HybridBlockManager and simulates its cache: ``kv[slot]`` is the group and the prefix
    the KV at a slot was computed by (block ids are one pool: a block moves between groups only
    when freed). Every live sequence reads back, in every group, the positions that group's window
    lets its next query see; every prefix-cache hit returns, in every group, blocks holding the
    prompt's prefix where that group can see it."""

    @initialize(windows=st.sampled_from([(None, 3), (None, 1, 1), (None, None, 6), (2, 5)]),
                caching=st.sampled_from([True, True, False]))  # fmt: skip
    def setup(self, windows, caching) -> None:
        self.windows = windows
        self.bm = HybridBlockManager(NB, BS, caching, windows, null_block=NB)
        self.tokens: dict[object, list[int]] = {}
        self.nslots: dict[object, int] = {}
        self.first_query: dict[object, int] = {}
        self.kv: dict[int, tuple[int, ...]] = {}
        self.next_id = 0

    def _seen_from(self, group: int, first_query: int) -> int:
        window = self.windows[group]
        return 0 if window is None else max(0, first_query - window + 1)

    def _write(self, sid, start: int, end: int) -> None:
        for group, table in enumerate(self.bm.block_tables(sid)):  # (a group's layers' KV: its own)
            for p in range(start, end):
                self.kv[table[p // BS] * BS + p % BS] = (group, *self.tokens[sid][: p + 1])

    def _extend(self, sid, tokens: list[int], num_new: int) -> None:
        lens = [len(t) for t in self.bm.block_tables(sid)]
        start = self.nslots[sid]
        if self.bm.allocate(sid, tokens, num_new):
            self.tokens[sid], self.nslots[sid], self.first_query[sid] = tokens, start + num_new, start
            self._write(sid, start, start + num_new)
        else:  # none of the groups grew
            assert [len(t) for t in self.bm.block_tables(sid)] == lens
            self.first_query[sid] = start
            self._preempt_newest()

    @rule(base=st.sampled_from(BASES), prefix_len=st.integers(0, 16), tail=st.lists(st.integers(0, 2), max_size=4),
          chunk=st.integers(1, 12), limit=st.sampled_from([None, None, 5]))  # fmt: skip
    def admit(self, base, prefix_len, tail, chunk, limit) -> None:
        prompt = base[:prefix_len] + tail or [0]
        blocks, n = self.bm.find_cached_prefix(prompt, max_tokens=limit)
        assert n % BS == 0 and n < len(prompt) and (limit is None or n <= limit)
        assert len(blocks) == len(self.windows) and all(len(b) == n // BS for b in blocks)
        for group, group_blocks in enumerate(blocks):
            for p in range(self._seen_from(group, n), n):
                assert self.kv[group_blocks[p // BS] * BS + p % BS] == (group, *prompt[: p + 1])
        sid, self.next_id = self.next_id, self.next_id + 1
        before = self.bm.num_free_blocks
        if self.bm.allocate(sid, prompt, min(chunk, len(prompt) - n), blocks):
            self.tokens[sid], self.nslots[sid], self.first_query[sid] = prompt, n + min(chunk, len(prompt) - n), n
            assert self.bm.num_cached_tokens(sid) == n
            self._write(sid, n, self.nslots[sid])
        else:
            assert sid not in self.bm and self.bm.num_free_blocks == before
            self._preempt_newest()

    @precondition(lambda self: any(self.nslots[s] == len(t) for s, t in self.tokens.items()))
    @rule(data=st.data(), tok=st.integers(0, 2), drafts=st.integers(0, 3))
    def decode(self, data, tok, drafts) -> None:
        """A decode, with ``drafts`` speculative slots rolled back after it (rejected drafts)."""
        sid = self._pick(data, lambda s: self.nslots[s] == len(self.tokens[s]))
        self._extend(sid, self.tokens[sid] + [tok], 1 + drafts)
        if sid in self.tokens and drafts and self.nslots[sid] == len(self.tokens[sid]) + drafts:
            self.bm.rollback(sid, len(self.tokens[sid]))
            self.nslots[sid] = len(self.tokens[sid])

    @precondition(lambda self: any(self.nslots[s] == len(t) for s, t in self.tokens.items()))
    @rule(data=st.data())
    def fork(self, data) -> None:
        """n > 1: a child at the parent's whole length (what the engine forks)."""
        parent = self._pick(data, lambda s: self.nslots[s] == len(self.tokens[s]))
        n, child = self.nslots[parent], f"fork-{self.next_id}"
        self.next_id += 1
        if not self.bm.can_fork(parent, n):
            free = self.bm.num_free_blocks
            with pytest.raises(NoFreeBlocksError):
                self.bm.fork(parent, child, n)
            assert child not in self.bm and self.bm.num_free_blocks == free
            return
        copies = self.bm.fork(parent, child, n)
        assert len(copies) == (n % BS != 0) * len(self.windows)
        for src, dst in copies:  # what the model runner does
            for off in range(BS):
                if src * BS + off in self.kv:
                    self.kv[dst * BS + off] = self.kv[src * BS + off]
        # (the child's table is the parent's as of its last allocation: released up to that step's window)
        self.tokens[child], self.nslots[child], self.first_query[child] = self.tokens[parent], n, self.first_query[parent]

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data(), reset=st.integers(0, 3))
    def free(self, data, reset) -> None:
        sid = self._pick(data, lambda s: True)
        self.bm.free(sid)
        del self.tokens[sid], self.nslots[sid], self.first_query[sid]
        assert sid not in self.bm
        if reset == 0:
            self.bm.reset_prefix_cache()

    @invariant()
    def consistent(self) -> None:
        bm = self.bm
        bm.check_invariants()
        held = set()
        for sid, toks in self.tokens.items():
            n = self.nslots[sid]
            assert bm.num_tokens(sid) == n
            for group, table in enumerate(bm.block_tables(sid)):
                assert len(table) == -(-n // BS)
                seen_from = self._seen_from(group, self.first_query[sid])
                for p in range(seen_from, n):
                    assert self.kv[table[p // BS] * BS + p % BS] == (group, *toks[: p + 1]), (sid, group, p)
                window = self.windows[group]
                if window is not None:  # a sliding group holds its window and the last step's slots only
                    assert len([b for b in table if b != NB]) <= -(-(window - 1 + n - self.first_query[sid]) // BS) + 1
                held.update(b for b in table if b != NB)
        assert bm.num_free_blocks + len(held) == NB


HybridMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
test_hybrid_block_manager_state_machine = HybridMachine.TestCase


def test_a_hit_in_a_sliding_group_needs_only_the_blocks_its_window_sees():
    """Blocks behind the window of the first query after the hit may be gone (evicted); a
    full-attention group needs them all, so the hit is what every group serves."""
    from vllmini.kv.block_manager import BlockManager

    prompt = list(range(1, 26))  # 6 full blocks of 4 and one token
    sliding = BlockManager(12, BS, True, sliding_window=5, null_block=12)
    assert sliding.allocate("a", prompt, 25)
    head = sliding.block_table("a")[:2]
    sliding.free("a")
    for bid in reversed(head):  # the first two blocks are evicted (made the least recently used first)
        sliding._evictable.move_to_end(bid, last=False)
    sliding._free.extend(sliding._drop_lru(evict=True) for _ in range(2))
    full = BlockManager(12, BS, True, null_block=12)  # (without a window, the hit would stop at once)
    assert full.allocate("a", prompt, 25)
    full.free("a")
    full._evictable.move_to_end(full.blocks[0].block_id, last=False)
    full._free.append(full._drop_lru(evict=True))
    assert full.find_cached_prefix(prompt) == ([], 0)
    blocks, n = sliding.find_cached_prefix(prompt)
    assert n == 24 and blocks[:5] == [12] * 5  # behind the window of position 24 (it sees 20..24): placeholders
    assert sliding.allocate("b", prompt, 1, blocks) and sliding.num_cached_tokens("b") == 24
    sliding.check_invariants()


# ---- the engine ---------------------------------------------------------------------------------
def gemma_dir(tmp_path_factory, default_model_dir, arch: str, **overrides):
    torch.manual_seed(0)
    config = {"gemma3": tiny_gemma3_config, "gemma2": tiny_gemma2_config}[arch](vocab_size=49152, **overrides)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(config).eval()
    return str(save_tiny_model(hf, tmp_path_factory.mktemp(arch), default_model_dir)), hf


@pytest.mark.parametrize(("async_scheduling", "speculative", "backend"),
                         [(False, False, "cpu"), (True, False, "cpu"), (False, True, "cpu"), (False, False, "torch")])
def test_gemma3_holds_what_keeping_every_block_cannot(tmp_path_factory, default_model_dir, async_scheduling, speculative,
                                                      backend):  # fmt: skip
    """Gemma 3 ([s, s, f, s], a 12-token window): four sequences of ~190 tokens, n = 2, on a
    cache of 40 blocks' worth of every layer. Keeping every block, they preempt one another;
    grouped (one full group, three sliding ones, one layer per block id: 160 ids) they all run
    at once, each holding its full group's table and three windows. Greedy tokens are
    transformers' either way."""
    model_dir, hf = gemma_dir(tmp_path_factory, default_model_dir, "gemma3")
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(100, 4000, (n,), generator=g).tolist() for n in (150, 131, 40)]
    prompts.append(prompts[0][:100] + prompts[2][:30])  # a prefix-cache hit longer than the window
    spec = {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2} if speculative else None
    params = SamplingParams(max_tokens=40, temperature=1.0, top_k=1, ignore_eos=True, n=2)
    runs = {}
    for hybrid in (True, False):
        llm = LLM(model=model_dir, max_num_batched_tokens=16, kv_cache_memory=kv_bytes(hf.config, 40),
                  async_scheduling=async_scheduling, speculative_config=spec, attention_backend=backend,
                  disable_hybrid_kv_cache_manager=not hybrid)  # fmt: skip
        eng = llm.llm_engine
        assert eng.block_manager.num_groups == (4 if hybrid else 1)
        assert eng.num_blocks == (160 if hybrid else 40) and len(eng.runner.kv_caches) == (1 if hybrid else 4)
        most = track_owned_blocks(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for p, out in zip(prompts, outs):
            want, gaps = hf_greedy(hf, p, 40)
            for completion in out.outputs:
                assert_greedy_matches(completion.token_ids, want, gaps, f"hybrid={hybrid}, prompt of {len(p)}")
        runs[hybrid] = (eng.scheduler.stats.num_preemptions, max(most.values()), [o.outputs[0].token_ids for o in outs])
        if hybrid:  # the full group's table (190 tokens: 12 blocks) and at most a window plus a step per sliding group
            assert max(most.values()) <= 12 + 3 * eng.block_manager.groups[1].max_blocks_per_step(16)
            assert eng.block_manager.prefix_cache_hits > 0
        assert not speculative or eng.spec_stats.num_drafts > 0
        assert_no_leaks(llm)
    assert runs[True][0] == 0  # grouped: no preemption
    # every block kept: preemptions (with drafts, which never preempt, the steps run otherwise: not always)
    assert runs[False][0] > 0 or speculative
    assert runs[True][2] == runs[False][2]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_gemma2_softcapped_alternating_layers_decode_past_the_window(tmp_path_factory, default_model_dir, backend):
    """Gemma 2 (sliding and full layers alternating, capped scores): prompts several windows
    long, prefilled in chunks and decoded, grouped, greedy equal to transformers."""
    model_dir, hf = gemma_dir(tmp_path_factory, default_model_dir, "gemma2", num_hidden_layers=4)
    llm = LLM(model=model_dir, max_num_batched_tokens=16, attention_backend=backend)
    assert llm.llm_engine.runner.kv_layout.group_windows == (None, 12)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 4000, (n,), generator=g).tolist() for n in (70, 33, 5)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False)  # fmt: skip
    for p, out in zip(prompts, outs):
        want, gaps = hf_greedy(hf, p, 30)
        assert_greedy_matches(out.outputs[0].token_ids, want, gaps, f"gemma2 {backend}, prompt of {len(p)}")
    assert_no_leaks(llm)


def test_a_sequence_longer_than_every_layers_blocks_fits_when_grouped(tmp_path_factory, default_model_dir):
    """Qwen2 with max_window_layers=1 (a full layer, a sliding one) on 10 blocks' worth of both:
    keeping every block, a 190-token sequence does not fit (160 slots) and is refused; grouped, the
    pool is 20 one-layer blocks, the full group takes 12 and the sliding one at most 3."""
    model_dir, hf = tiny_dir(tmp_path_factory, default_model_dir, "qwen2", num_hidden_layers=2,
                             use_sliding_window=True, sliding_window=12, max_window_layers=1)  # fmt: skip
    llm = LLM(model=model_dir, max_num_batched_tokens=16, kv_cache_memory=kv_bytes(hf.config, 10))
    eng = llm.llm_engine
    assert eng.capacity_tokens == (20 - 3) * 16  # the full group's blocks once the sliding one has its 3
    assert eng.block_manager.blocks_held(190, 16) == 12 + 3 and eng.block_manager.blocks_held(20, 16) == 2 + 2
    prompt = torch.randint(100, 4000, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]  # fmt: skip
    want, gaps = hf_greedy(hf, prompt, 40)
    assert_greedy_matches(out.outputs[0].token_ids, want, gaps, "qwen2 max_window_layers")
    with pytest.raises(ValueError, match="KV"):  # past the full group's 17 blocks
        llm.generate({"prompt_token_ids": prompt * 2}, SamplingParams(max_tokens=1), use_tqdm=False)
    assert_no_leaks(llm)


def test_padded_static_decode_over_groups_equals_eager(tmp_path_factory, default_model_dir):
    """What a CUDA graph replays on a grouped cache (every group's slots and tables in static
    buffers, padding rows in the pad block) equals the eager step, and both equal the step on
    a cache that keeps every layer's blocks (rows run on the CPU: use_graphs=False)."""
    from vllmini.engine.cuda_graph import DecodeGraphRunner
    from vllmini.engine.model_runner import FlatBatch
    from vllmini.models.base import AttentionMetadata

    model_dir, _ = gemma_dir(tmp_path_factory, default_model_dir, "gemma3", sliding_window=6)
    llm = LLM(model=model_dir, block_size=4, num_gpu_blocks_override=200, enable_prefix_caching=False,
              attention_backend="torch")  # fmt: skip
    model, layout = llm.llm_engine.model, llm.llm_engine.runner.kv_layout
    bs, num_blocks, max_len = 4, 200, 40
    bm = HybridBlockManager(num_blocks, bs, False, layout.group_windows, null_block=num_blocks + 1)
    shape = (num_blocks + 2, bs, model.num_kv_heads, model.head_dim)  # the pool, the pad block, the null block
    grouped = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(layout.group_size)]
    flat_caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in model.model.layers]  # one table, every layer
    g = torch.Generator().manual_seed(1)
    lens = [39, 5, 22, 13, 30]
    prompts = [torch.randint(100, 4000, (n,), generator=g).tolist() for n in lens]

    def step(seq_ids, tokens, starts, counts):
        flat = FlatBatch([], [], [], [], [], [], [], [])
        for sid, toks, start, count in zip(seq_ids, tokens, starts, counts):
            table = bm.block_table(sid)
            flat.ids += toks[start : start + count]
            flat.positions += list(range(start, start + count))
            flat.slots += [table[p // bs] * bs + p % bs for p in range(start, start + count)]
            flat.query_lens.append(count)
            flat.seq_lens.append(start + count)
            flat.block_tables.append(table)
            flat.logits_rows.append(len(flat.ids) - 1)
        flat.sample_indices = list(range(len(seq_ids)))
        flat.add_groups(seq_ids, bm, bs)
        return flat

    for sid, p in enumerate(prompts):
        assert bm.allocate(sid, p, len(p))
    prefill = step(range(5), prompts, [0] * 5, lens)
    with torch.no_grad():
        ids, positions = torch.tensor(prefill.ids), torch.tensor(prefill.positions)
        model(ids, positions, prefill.to_model_input("cpu", layout).attn_metadata, grouped)
        full = AttentionMetadata.paged(prefill.query_lens, prefill.seq_lens, prefill.slots, prefill.block_tables)
        model(ids, positions, full, flat_caches)
    new = [p + [7] for p in prompts]
    for sid, p in enumerate(new):
        assert bm.allocate(sid, p, 1)
    decode = step(range(5), new, lens, [1] * 5)
    assert decode.group_tables[0][0][0] == num_blocks + 1  # a sliding group's first block: released, the null block
    static = [(k.clone(), v.clone()) for k, v in grouped]
    with torch.no_grad():
        eager = model(torch.tensor(decode.ids), torch.tensor(decode.positions),
                      decode.to_model_input("cpu", layout).attn_metadata, grouped)  # fmt: skip
        keep_all = model(torch.tensor(decode.ids), torch.tensor(decode.positions),
                         AttentionMetadata.paged([1] * 5, decode.seq_lens, decode.slots, decode.block_tables), flat_caches)  # fmt: skip
    runner = DecodeGraphRunner(model, static, bs, 8, max_len, num_blocks, torch.device("cpu"), use_graphs=False,
                               kv_layout=layout)  # fmt: skip
    assert runner.can_run(decode) and runner.padded_size(5) == 8
    torch.testing.assert_close(runner.run(decode), eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(eager, keep_all, atol=1e-5, rtol=1e-5)
    assert all(not k[num_blocks + 1].any() for k, _ in static)  # padding wrote the pad block, never the null one


def test_every_group_claims_its_hit_before_any_group_takes_a_new_block():
    """A new block comes off the LRU of unreferenced cached blocks when none is free: had the first
    group grown before the second claimed its hit, it would have evicted that hit's block."""
    bm = HybridBlockManager(6, BS, True, (None, None))
    a, d = [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9]
    assert bm.allocate("a", a, 8) and bm.allocate("d", d, 4)
    bm.free("a")
    bm.free("d")  # the LRU: a's blocks (group 0's, then group 1's), then d's; nothing free
    assert bm.num_free_blocks == 6 and not bm.pool._free
    blocks, n = bm.find_cached_prefix(a + [1])
    assert n == 8
    assert bm.allocate("b", a + [1], 1, blocks)  # 4 claimed, 2 new: d's evicted, not a's
    assert bm.num_cached_tokens("b") == 8 and bm.block_tables("b") == [blocks[0] + [bm.block_tables("b")[0][2]],
                                                                       blocks[1] + [bm.block_tables("b")[1][2]]]
    assert bm.num_evictions == 2
    bm.check_invariants()


def test_preempted_sequences_recompute_over_groups(tmp_path_factory, default_model_dir):
    """A pool of 30 block ids for four Gemma 3 sequences (each holds its full table and three
    windows): they preempt one another, and the recomputes (prefix-cache hits that every group
    serves, windows skipping released blocks) give transformers' greedy tokens."""
    model_dir, hf = gemma_dir(tmp_path_factory, default_model_dir, "gemma3")
    llm = LLM(model=model_dir, max_num_batched_tokens=16, num_gpu_blocks_override=30, enable_prefix_caching=True)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 4000, (n,), generator=g).tolist() for n in (120, 70, 95, 30)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False)  # fmt: skip
    assert llm.llm_engine.scheduler.stats.num_preemptions > 0 and llm.llm_engine.block_manager.prefix_cache_hits > 0
    for p, out in zip(prompts, outs):
        want, gaps = hf_greedy(hf, p, 30)
        assert_greedy_matches(out.outputs[0].token_ids, want, gaps, f"prompt of {len(p)}")
    assert_no_leaks(llm)
