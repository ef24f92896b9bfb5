"""KV blocks behind a sliding window are released as a sequence advances (vLLM's sliding-window
KV manager): a model whose every layer slides holds a window's worth of blocks per sequence,
so sequences longer than the whole cache run, with transformers' greedy tokens."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_greedy_matches, hf_greedy
from test_architectures import tiny_dir
from test_engine import assert_no_leaks, kv_bytes
from vllmini import LLM, SamplingParams

WINDOW, BLOCKS = 12, 10  # a 160-slot pool; each sequence below reaches 150-190 tokens


def track_owned_blocks(llm) -> dict[int, int]:
    """Record, after every allocation, the most blocks each sequence has held."""
    bm = llm.llm_engine.block_manager
    most: dict[int, int] = {}
    allocate = bm.allocate

    def recording(seq_id, *args, **kwargs):
        ok = allocate(seq_id, *args, **kwargs)
        if seq_id in bm:
            most[seq_id] = max(most.get(seq_id, 0), bm.num_owned_blocks(seq_id))
        return ok

    bm.allocate = recording
    return most


@pytest.mark.parametrize(("backend", "async_scheduling", "speculative"),
                         [("cpu", False, False), ("cpu", True, False), ("torch", False, False), ("cpu", False, True)])
def test_sequences_longer_than_the_cache_run_within_their_window(tmp_path_factory, default_model_dir, backend,
                                                                 async_scheduling, speculative):  # fmt: skip
    """(speculative: drafts verified in the window, their rejected slots rolled back)"""
    model_dir, hf = tiny_dir(tmp_path_factory, default_model_dir, "mistral", num_hidden_layers=3,
                             sliding_window=WINDOW)  # fmt: skip
    spec = {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2} if speculative else None
    llm = LLM(model=model_dir, max_num_batched_tokens=16, kv_cache_memory=kv_bytes(hf.config, BLOCKS),
              enable_prefix_caching=True, async_scheduling=async_scheduling, attention_backend=backend,
              speculative_config=spec)  # fmt: skip
    eng = llm.llm_engine
    assert eng.block_manager.sliding_window == WINDOW and eng.num_blocks == BLOCKS
    assert eng.capacity_tokens == eng.max_model_len  # a window plus a step's chunk fits the pool
    most = track_owned_blocks(llm)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(100, 4000, (n,), generator=g).tolist() for n in (150, 131, 40)]
    prompts.append(prompts[0][:100] + prompts[2][:30])  # a prefix-cache hit longer than the window
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=40, temperature=1.0, top_k=1, ignore_eos=True, n=2), use_tqdm=False)  # fmt: skip
    for p, out in zip(prompts, outs):
        want, gaps = hf_greedy(hf, p, 40)
        for completion in out.outputs:  # n = 2 (top_k=1: greedy n > 1 is refused): the forked sibling too
            assert_greedy_matches(completion.token_ids, want, gaps, f"prompt of {len(p)}")
    assert max(most.values()) <= eng.block_manager.max_blocks_per_step(16) == 3  # never the whole sequence
    assert eng.block_manager.prefix_cache_hits > 0
    assert not speculative or eng.spec_stats.num_drafts > 0
    assert_no_leaks(llm)


def test_preempted_windowed_sequence_recomputes_exactly(tmp_path_factory, default_model_dir):
    """Four long sequences on a pool that holds two windows: preemption frees and recomputes
    them (the recompute takes prefix-cache hits, skipping the blocks behind the window)."""
    model_dir, hf = tiny_dir(tmp_path_factory, default_model_dir, "phi3", num_hidden_layers=2, sliding_window=9)
    llm = LLM(model=model_dir, max_num_batched_tokens=16, kv_cache_memory=kv_bytes(hf.config, 5),
              enable_prefix_caching=True)  # fmt: skip
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(100, 4000, (n,), generator=g).tolist() for n in (70, 45, 90, 20)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False)  # fmt: skip
    assert llm.llm_engine.scheduler.stats.num_preemptions > 0
    for p, out in zip(prompts, outs):
        want, gaps = hf_greedy(hf, p, 30)
        assert_greedy_matches(out.outputs[0].token_ids, want, gaps, f"prompt of {len(p)}")
    assert_no_leaks(llm)


def test_blocks_stay_when_some_layer_attends_to_everything(tmp_path_factory, default_model_dir):
    """Qwen2 with max_window_layers, its KV groups turned off (vLLM's disable_hybrid_kv_cache_manager):
    its first layer reads every position, so nothing is released and a sequence must fit the cache
    whole (grouped, the default, its sliding layer's blocks are released: test_hybrid_kv.py)."""
    model_dir, hf = tiny_dir(tmp_path_factory, default_model_dir, "qwen2", num_hidden_layers=2,
                             use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)  # fmt: skip
    llm = LLM(model=model_dir, max_num_batched_tokens=16, kv_cache_memory=kv_bytes(hf.config, BLOCKS),
              disable_hybrid_kv_cache_manager=True)  # fmt: skip
    eng = llm.llm_engine
    assert eng.model.sliding_window == WINDOW and eng.block_manager.sliding_window is None
    assert eng.block_manager.num_groups == 1
    assert eng.capacity_tokens == BLOCKS * 16
    with pytest.raises(ValueError, match="KV"):
        llm.generate({"prompt_token_ids": list(range(100, 250))}, SamplingParams(max_tokens=40), use_tqdm=False)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_released_entries_read_a_zeroed_block_so_nan_kv_stays_in_its_request(tmp_path, default_model_dir, backend):
    """Released table entries point at a null block outside the pool, which stays zero. Were they
    a pool block, K/V another request left there (here NaN, from a token whose embedding
    overflows) would poison this request's attention through the masked positions."""
    from helpers import save_tiny_model, tiny_mistral_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_mistral_config(vocab_size=49152, num_hidden_layers=2,
                                                              sliding_window=WINDOW)).eval()  # fmt: skip
    with torch.no_grad():
        hf.model.embed_tokens.weight[5] = float("inf")  # that token's K/V become NaN
    model_dir = save_tiny_model(hf, tmp_path / "m", default_model_dir)
    llm = LLM(model=str(model_dir), block_size=4, kv_cache_memory=kv_bytes(hf.config, 32, block_size=4),
              max_num_batched_tokens=16, attention_backend=backend, enable_prefix_caching=False)  # fmt: skip
    eng = llm.llm_engine
    assert eng.block_manager.null_block == eng.num_blocks == 32
    assert eng.runner.kv_caches[0][0].shape[0] == 33  # the pool and the null block
    g = torch.Generator().manual_seed(4)
    bad = [5] + torch.randint(100, 4000, (6,), generator=g).tolist()
    good = torch.randint(100, 4000, (60,), generator=g).tolist()
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    # the poisoned prompt first: it takes the pool's first blocks (block 0 among them)
    poisoned, healthy = llm.generate([{"prompt_token_ids": bad}, {"prompt_token_ids": good}], params, use_tqdm=False)
    alone = llm.generate({"prompt_token_ids": good}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert poisoned.outputs[0].finish_reason == "error"
    assert healthy.outputs[0].finish_reason == "length" and healthy.outputs[0].token_ids == alone
    assert all(not k[32].any() and not v[32].any() for k, v in eng.runner.kv_caches)  # never written
    assert_no_leaks(llm)
