"""Features that must not change a greedy output, stacked: each engine's tokens and logprobs equal a
reference engine's that has only the features that do change outputs (the KV cache's dtype, the
model, a LoRA adapter), over two rounds (the second one from the prefix cache), and no KV block is
left behind. Each feature has its own tests; these are about where they meet (the pairs checked
by an exploratory sweep that found a bug there: n > 1 over an fp8 cache)."""
from __future__ import annotations

import pytest
import torch
from transformers import Gemma2ForCausalLM, MistralForCausalLM

from helpers import randomize_norms, save_tiny_lora, save_tiny_model, tiny_gemma2_config, tiny_mistral_config
from test_engine import assert_no_leaks
from vllmini import LLM, SamplingParams
from vllmini.lora.request import LoRARequest

SHARED = [5, 17, 300, 42, 9, 1200, 77, 3] * 5  # a common prefix, repeating (n-gram drafts find it)
PROMPTS = [SHARED + [11, 12, 13], SHARED + [901, 44], [901, 44, 3, 3, 12], list(range(200, 251)),
           SHARED[:20] + list(range(600, 640))]  # fmt: skip


@pytest.fixture(scope="module")
def lora_dir(tiny_dir, tmp_path_factory) -> str:
    return save_tiny_lora(tiny_dir, tmp_path_factory.mktemp("combo_lora"), seed=1)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory, default_model_dir) -> str:
    """A sliding window (24) shorter than most prompts."""
    torch.manual_seed(0)
    hf = MistralForCausalLM(tiny_mistral_config(vocab_size=49152, initializer_range=0.05, sliding_window=24)).eval()
    return str(save_tiny_model(hf, tmp_path_factory.mktemp("combo_mistral"), default_model_dir))


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory, default_model_dir) -> str:
    """Sliding (12) and full layers, capped attention scores (the cpu backend's C kernel and eager prefill) and logits."""
    torch.manual_seed(0)
    hf = randomize_norms(Gemma2ForCausalLM(tiny_gemma2_config(vocab_size=49152))).eval()
    return str(save_tiny_model(hf, tmp_path_factory.mktemp("combo_gemma2"), default_model_dir))


def _generate(model, params: SamplingParams, lora=None, priority=None, **engine) -> list:
    """Two rounds of PROMPTS: each completion's (token ids, their logprobs)."""
    llm = LLM(model=str(model), **engine)
    outs = []
    for _ in range(2):
        res = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False, priority=priority,
                           lora_request=lora)  # fmt: skip
        outs += [(c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
                 for o in res for c in o.outputs]  # fmt: skip
        assert_no_leaks(llm)
    if engine.get("num_gpu_blocks_override"):
        assert llm.llm_engine.scheduler.stats.num_preemptions > 0, "the small cache never preempted"
    return outs


def _assert_same(got: list, want: list) -> None:
    for i, ((tokens, lps), (want_tokens, want_lps)) in enumerate(zip(got, want, strict=True)):
        assert tokens == want_tokens, f"completion {i}"
        assert max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-4, f"completion {i}"


GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=1)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "bfloat16"])
def test_narrow_cache_with_prefix_hits_preemption_and_chunking(tiny_dir, kv_cache_dtype):
    want = _generate(tiny_dir, GREEDY, kv_cache_dtype=kv_cache_dtype)
    got = _generate(tiny_dir, GREEDY, kv_cache_dtype=kv_cache_dtype, num_gpu_blocks_override=17, block_size=8,
                    max_num_batched_tokens=16, long_prefill_token_threshold=8)  # fmt: skip
    _assert_same(got, want)


def test_sliding_window_fp8_with_prefix_hits_preemption_and_chunking(mistral_dir):
    want = _generate(mistral_dir, GREEDY, kv_cache_dtype="fp8")
    got = _generate(mistral_dir, GREEDY, kv_cache_dtype="fp8", num_gpu_blocks_override=8, max_num_batched_tokens=16)
    _assert_same(got, want)


def test_draft_model_with_lora_and_preemption(tiny_dir, lora_dir):
    """Some prompts with the adapter, some without; the draft (the base model) has none."""
    loras = [LoRARequest("a", 1, lora_dir) if i % 2 == 0 else None for i in range(len(PROMPTS))]
    want = _generate(tiny_dir, GREEDY, lora=loras, enable_lora=True, max_lora_rank=8)
    got = _generate(tiny_dir, GREEDY, lora=loras, enable_lora=True, max_lora_rank=8, num_gpu_blocks_override=13,
                    speculative_config={"model": str(tiny_dir), "num_speculative_tokens": 3})  # fmt: skip
    _assert_same(got, want)


def test_priority_preemption_async_scheduling_and_forks_over_fp8(tiny_dir):
    """n = 2 (top_k=1: greedy siblings) forks the prompt's partial blocks, copied as fp8 bytes."""
    params = SamplingParams(max_tokens=20, top_k=1, n=2, ignore_eos=True, logprobs=1)
    want = _generate(tiny_dir, params, kv_cache_dtype="fp8_e5m2")
    got = _generate(tiny_dir, params, priority=[3, 1, 2, 0, 1], kv_cache_dtype="fp8_e5m2", scheduling_policy="priority",
                    async_scheduling=True, num_gpu_blocks_override=13)  # fmt: skip
    _assert_same(got, want)


def test_gemma2_draft_model_sampled_forks_over_fp8_with_preemption_and_chunking(gemma2_dir):
    """Gemma 2 drafting for itself (a draft over sliding and full layers), n = 2 seeded samples per prompt,
    an fp8 cache, priority preemption, 8-token blocks and 16-token steps: the reference's samples."""
    params = SamplingParams(max_tokens=20, temperature=0.9, top_k=50, seed=7, n=2, ignore_eos=True, logprobs=1)
    want = _generate(gemma2_dir, params, kv_cache_dtype="fp8_e5m2")
    got = _generate(gemma2_dir, params, priority=[3, 1, 2, 0, 1], kv_cache_dtype="fp8_e5m2", scheduling_policy="priority",
                    speculative_config={"model": gemma2_dir, "num_speculative_tokens": 2}, num_gpu_blocks_override=20,
                    block_size=8, max_num_batched_tokens=16)  # fmt: skip
    _assert_same(got, want)
