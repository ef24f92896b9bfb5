"""Continuous batching, chunked prefill, preemption and prefix caching are exact
(greedy tokens equal transformers' for each prompt alone), and no KV block leaks."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers import Qwen3ForCausalLM as HFQwen3

from helpers import assert_greedy_matches, hf_greedy, save_tiny_model, tiny_qwen3_config
from vllmini import LLM, SamplingParams
from vllmini.kv.cache import KVCacheSpec


def assert_no_leaks(llm) -> None:
    """Nothing queued or running, every KV block free (or cached with no owner)."""
    eng = llm.llm_engine if isinstance(llm, LLM) else llm.engine
    bm = eng.block_manager
    bm.check_invariants()
    assert not eng.has_unfinished_requests()
    assert not eng.scheduler.running and not eng.scheduler.waiting
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"


def kv_bytes(llm_config, blocks: int, block_size: int = 16) -> int:
    """Budget for exactly ``blocks`` blocks of this model."""
    head_dim = getattr(llm_config, "head_dim", None) or llm_config.hidden_size // llm_config.num_attention_heads
    spec = KVCacheSpec(llm_config.num_hidden_layers, llm_config.num_key_value_heads, head_dim, block_size, torch.float32)
    return blocks * spec.bytes_per_block


def staggered_workload(vocab: int, n: int = 48, max_len: int = 600, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = [1 + (i * (max_len - 1)) // (n - 1) for i in range(n)]
    order = torch.randperm(n, generator=g).tolist()  # submission order mixes long and short prompts
    prompts = [torch.randint(0, vocab, (lengths[i],), generator=g).tolist() for i in order]
    max_tokens = [1 + (i * 7) % 16 for i in range(n)]
    return prompts, max_tokens


def check_exact_under_pressure(model_dir, hf, kv_blocks: int, n: int = 48, max_len: int = 600) -> LLM:
    prompts, max_tokens = staggered_workload(hf.config.vocab_size, n, max_len)
    llm = LLM(
        model=str(model_dir), max_num_batched_tokens=96, max_num_seqs=16,
        kv_cache_memory=kv_bytes(hf.config, kv_blocks),
    )  # fmt: skip
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.llm_engine.scheduler.stats
    assert stats.num_chunked_prefills > 0, "chunked prefill never happened"
    assert stats.num_preemptions > 0, "preemption never happened"
    for p, m, out in zip(prompts, max_tokens, outs):
        got = out.outputs[0].token_ids
        assert out.prompt_token_ids == p and out.finished
        assert out.outputs[0].finish_reason == "length" and len(got) == m
        tokens, gaps = hf_greedy(hf, p, m)
        assert_greedy_matches(got, tokens, gaps, f"prompt of {len(p)} tokens")
    assert_no_leaks(llm)
    return llm


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory, default_model_dir):
    torch.manual_seed(0)
    hf = HFQwen3(tiny_qwen3_config()).eval()
    return save_tiny_model(hf, tmp_path_factory.mktemp("tiny-qwen3"), default_model_dir), hf


def test_continuous_batching_exact_tiny_qwen3(tiny_qwen3):
    model_dir, hf = tiny_qwen3
    check_exact_under_pressure(model_dir, hf, kv_blocks=60)


@pytest.mark.slow
def test_continuous_batching_exact_default_model(default_model_dir):
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    # An eighth of the tiny model's prompt tokens (real weights cost ~10x per token on 2 cores, and
    # both engines here are compute-bound on them); the smaller pool keeps the pressure:
    # chunks and preemptions are still asserted (16 and 4 of them).
    check_exact_under_pressure(default_model_dir, hf, kv_blocks=24, n=12, max_len=300)


def test_prefix_caching_exact_and_skips_shared_prefix(tiny_qwen3):
    model_dir, hf = tiny_qwen3
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 512, (256,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, 512, (n,), generator=g).tolist() for n in (37, 50)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    results = {}
    for caching in (True, False):
        llm = LLM(model=str(model_dir), enable_prefix_caching=caching)
        first = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)[0]
        before = llm.llm_engine.scheduler.stats.num_prefill_tokens
        second = llm.generate({"prompt_token_ids": prompts[1]}, params, use_tqdm=False)[0]
        computed = llm.llm_engine.scheduler.stats.num_prefill_tokens - before
        results[caching] = (first.outputs[0].token_ids, second.outputs[0].token_ids)
        if caching:
            assert second.metrics.num_cached_tokens == 256
            assert computed == len(prompts[1]) - 256 == 50
            assert llm.llm_engine.block_manager.prefix_cache_hits > 0
        else:
            assert second.metrics.num_cached_tokens == 0 and computed == len(prompts[1])
        assert_no_leaks(llm)
    assert results[True] == results[False]
    tokens, gaps = hf_greedy(hf, prompts[1], 12)
    assert_greedy_matches(results[True][1], tokens, gaps, "prefix-cached prompt")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_forward_leaves_nothing_in_the_prefix_cache(tiny_qwen3, async_scheduling):
    """A step's new full blocks are registered in the prefix cache before its forward writes
    them: when the forward fails (a CUDA OOM, a kernel error), a later prompt with the same
    prefix must not take a hit on those never-written blocks."""
    from vllmini.engine.llm_engine import StepError

    model_dir, hf = tiny_qwen3
    prompt = torch.randint(0, 512, (50,), generator=torch.Generator().manual_seed(11)).tolist()  # 3 full blocks
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm = LLM(model=str(model_dir), enable_prefix_caching=True, async_scheduling=async_scheduling)
    eng = llm.llm_engine
    real, eng.runner.run_flat = eng.runner.run_flat, lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected"))
    eng.add_request("bad", {"prompt_token_ids": prompt}, params)
    with pytest.raises(StepError):
        eng.step()
    eng.runner.run_flat = real
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert out.metrics.num_cached_tokens == 0
    tokens, gaps = hf_greedy(hf, prompt, 8)
    assert_greedy_matches(out.outputs[0].token_ids, tokens, gaps, "after a failed step")
    assert_no_leaks(llm)


def test_reset_prefix_cache_only_when_idle(tiny_qwen3):
    """vLLM's ``LLM.reset_prefix_cache()``: afterwards the same prompt is computed again from
    scratch; while a request is unfinished it is refused (False) and the cache is kept."""
    model_dir, hf = tiny_qwen3
    prompt = {"prompt_token_ids": list(range(1, 51))}  # 3 full blocks
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm = LLM(model=str(model_dir))
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    assert llm.generate(prompt, params, use_tqdm=False)[0].metrics.num_cached_tokens == 48
    llm.llm_engine.add_request("busy", {"prompt_token_ids": [7, 8, 9]}, params)
    assert llm.reset_prefix_cache() is False
    llm.llm_engine.abort_request("busy")
    assert llm.generate(prompt, params, use_tqdm=False)[0].metrics.num_cached_tokens == 48
    assert llm.reset_prefix_cache() is True
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert again.metrics.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_no_leaks(llm)


def test_num_cached_tokens_is_the_first_admissions_prompt_hit(tiny_qwen3):
    """vLLM's num_cached_tokens: prompt tokens served from the prefix cache when the request was
    first scheduled. A preempted request's recompute hits its own blocks, prompt and output
    alike; that is neither its hit nor a prompt token."""
    model_dir, hf = tiny_qwen3
    llm = LLM(model=str(model_dir), block_size=4, kv_cache_memory=kv_bytes(hf.config, 16, block_size=4), max_num_seqs=4)
    params = SamplingParams(max_tokens=45, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9, 10]}], params, use_tqdm=False)
    stats = llm.llm_engine.scheduler.stats
    assert stats.num_preemptions > 0
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 0]
    assert stats.num_cached_prompt_tokens <= 6
    assert_no_leaks(llm)


@pytest.fixture(scope="module")
def small_llm(tiny_qwen3):
    model_dir, hf = tiny_qwen3
    return LLM(model=str(model_dir), max_model_len=512, kv_cache_memory=kv_bytes(hf.config, 20))


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ({"prompt_token_ids": []}, SamplingParams(max_tokens=4), "empty"),
        ("", SamplingParams(max_tokens=4), "empty"),
        ({"prompt_token_ids": [i % 500 for i in range(600)]}, SamplingParams(max_tokens=4), "max_model_len"),
        ({"prompt_token_ids": [1, 2, 999]}, SamplingParams(max_tokens=4), "outside the vocabulary"),
        ({"prompt_token_ids": [1, -2]}, SamplingParams(max_tokens=4), "outside the vocabulary"),
        ({"prompt_token_ids": [1, 2]}, SamplingParams(stop_token_ids=[5, 999]), r"stop_token_ids has token ids outside the vocabulary \[0, \d+\): \[999\]"),
        ({"prompt_token_ids": None}, SamplingParams(max_tokens=4), "prompt_token_ids must be a list"),
        ({"prompt_token_ids": list(range(300))}, SamplingParams(max_tokens=100), "whole KV cache"),
        ({"prompt_token_ids": [1, 2]}, "greedy", "SamplingParams"),
        ({"prompt_token_ids": [1, 2]}, SamplingParams(truncate_prompt_tokens=513), "truncate_prompt_tokens=513"),
    ],
)
def test_bad_requests_rejected_at_submit_without_side_effects(small_llm, prompt, params, match):
    eng = small_llm.llm_engine
    eng.add_request("ok", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=5, temperature=0))
    eng.step()  # the good request is running
    with pytest.raises(ValueError, match=match):
        small_llm.generate([{"prompt_token_ids": [4, 5]}, prompt], [SamplingParams(max_tokens=3), params], use_tqdm=False)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    final = [o for o in outs if o.finished]
    assert [o.request_id for o in final] == ["ok"] and len(final[0].outputs[0].token_ids) == 5
    assert_no_leaks(small_llm)


def test_a_request_that_fills_the_whole_cache_exactly_runs(small_llm, tiny_qwen3):
    """The last sampled token is never fed back, so a sequence one token longer than the cache
    (20 blocks, 320 tokens) fits: it runs to the end, exact and leak-free; one more is refused."""
    prompt = [(11 * i) % 400 + 20 for i in range(300)]
    params = SamplingParams(max_tokens=21, temperature=0, ignore_eos=True)
    out = small_llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length"
    assert_greedy_matches(out.token_ids, *hf_greedy(tiny_qwen3[1], prompt, 21), "a cache-filling request")
    assert small_llm.llm_engine.input_processor.room(300) == 21
    with pytest.raises(ValueError, match="whole KV cache"):
        small_llm.generate({"prompt_token_ids": prompt}, params.clone(max_tokens=22), use_tqdm=False)
    assert_no_leaks(small_llm)


def test_truncate_prompt_tokens_keeps_the_prompts_end(small_llm, tiny_qwen3):
    """vLLM's left truncation: the request runs on the last k prompt tokens, exactly as if only
    those had been sent; -1 keeps what max_model_len leaves beside max_tokens."""
    long = [(7 * i) % 400 + 50 for i in range(700)]
    greedy = {"max_tokens": 6, "temperature": 0}
    cut = small_llm.generate({"prompt_token_ids": long}, SamplingParams(truncate_prompt_tokens=40, **greedy), use_tqdm=False)[0]
    alone = small_llm.generate({"prompt_token_ids": long[-40:]}, SamplingParams(**greedy), use_tqdm=False)[0]
    assert cut.prompt_token_ids == long[-40:] and cut.outputs[0].token_ids == alone.outputs[0].token_ids
    short = small_llm.generate({"prompt_token_ids": long[:5]}, SamplingParams(truncate_prompt_tokens=40, **greedy), use_tqdm=False)[0]
    assert short.prompt_token_ids == long[:5]
    roomy = LLM(model=str(tiny_qwen3[0]), max_model_len=64)
    fill = roomy.generate({"prompt_token_ids": long}, SamplingParams(truncate_prompt_tokens=-1, **greedy), use_tqdm=False)[0]
    assert fill.prompt_token_ids == long[-(64 - 6) :] and len(fill.outputs[0].token_ids) == 6
    with pytest.raises(ValueError, match="leaves no prompt"):
        roomy.generate({"prompt_token_ids": long}, SamplingParams(truncate_prompt_tokens=-1, max_tokens=64), use_tqdm=False)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
    assert_no_leaks(small_llm)


def test_truncating_a_text_prompt_keeps_bos(default_model_dir, tmp_path):
    """A text prompt is cut like the tokenizer's own left truncation: the special tokens it adds
    around the text (here a BOS, as Llama's tokenizers add) stay."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    for f in default_model_dir.iterdir():  # the default model, with a tokenizer that adds a BOS
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "tokenizer.json").unlink()
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    bos = tok.convert_tokens_to_ids("<|im_start|>")
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    tok.save_pretrained(tmp_path)
    text = "one two three four five six seven eight nine ten"
    want = AutoTokenizer.from_pretrained(tmp_path, truncation_side="left")(text, truncation=True, max_length=4).input_ids
    assert want[0] == bos and len(want) == 4
    llm = LLM(model=str(tmp_path))
    out = llm.generate(text, SamplingParams(max_tokens=2, truncate_prompt_tokens=4), use_tqdm=False)[0]
    assert out.prompt_token_ids == want
    ids = llm.generate({"prompt_token_ids": [bos, 5, 6, 7, 8]}, SamplingParams(max_tokens=1, truncate_prompt_tokens=2),
                       use_tqdm=False)[0]  # fmt: skip
    assert ids.prompt_token_ids == [7, 8]  # ids given by the caller are cut as they are


def test_max_tokens_below_one_rejected():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_abort_frees_blocks_and_duplicate_ids_rejected(small_llm):
    eng = small_llm.llm_engine
    eng.add_request("a", {"prompt_token_ids": list(range(40))}, SamplingParams(max_tokens=50, temperature=0))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("a", {"prompt_token_ids": [1]}, SamplingParams(max_tokens=2))
    eng.step()
    assert eng.block_manager.num_free_blocks < eng.block_manager.num_blocks
    eng.abort_request("a")
    assert_no_leaks(small_llm)


def test_outputs_in_input_order_with_text(default_model_dir):
    llm = LLM(model=str(default_model_dir))
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Hello"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    tok = llm.get_tokenizer()
    for p, o in zip(prompts, outs):
        assert o.prompt == p and o.prompt_token_ids == tok(p).input_ids
        c = o.outputs[0]
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True) and c.finish_reason in ("stop", "length")
    ids_only = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, detokenize=False), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ids_only] == [o.outputs[0].token_ids for o in outs]
    assert [o.outputs[0].text for o in ids_only] == ["", "", ""]  # vLLM's detokenize=False: ids only
    chat = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    assert chat[0].outputs[0].text.strip()
    assert_no_leaks(llm)


def test_chat_template_options(small_llm, monkeypatch):
    """LLM.chat's vLLM options: a custom chat_template, chat_template_kwargs reaching it (as Qwen3's
    enable_thinking does), continue_final_message leaving the assistant turn open. (The prompts
    chat() builds are checked; this tiny model's vocabulary is smaller than the tokenizer's.)"""
    tok = small_llm.get_tokenizer()
    monkeypatch.setattr(small_llm, "generate", lambda prompts, *args, **kw: [
        SimpleNamespace(prompt_token_ids=p["prompt_token_ids"]) for p in prompts])  # fmt: skip
    template = ("{% for m in messages %}[{{ m['role'] }}{{ '|' + mood if mood is defined }}] {{ m['content'] }}"
                "{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}{{ '\\n[assistant] ' }}{% endif %}")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, I am"}]
    greedy = SamplingParams(max_tokens=3, temperature=0)

    def prompt_text(**kw) -> str:
        return tok.decode(small_llm.chat(msgs[:1] if kw.pop("one", False) else msgs, greedy, use_tqdm=False,
                                         chat_template=template, **kw)[0].prompt_token_ids)  # fmt: skip

    assert prompt_text(one=True) == "[user] hi\n[assistant] "
    assert prompt_text(one=True, chat_template_kwargs={"mood": "glad"}) == "[user|glad] hi\n[assistant] "
    continued = prompt_text(add_generation_prompt=False, continue_final_message=True)
    assert continued == "[user] hi\n[assistant] Hello, I am"  # no end of turn: the model continues it
    # as vLLM 0.32, the named options win over chat_template_kwargs (its own only fill what is left None)
    assert prompt_text(one=True, chat_template_kwargs={"add_generation_prompt": False}) == "[user] hi\n[assistant] "
    assert prompt_text(one=True, add_generation_prompt=False, chat_template_kwargs={"add_generation_prompt": True}) == "[user] hi"
    assert tok.decode(small_llm.chat(msgs[:1], greedy, use_tqdm=False, chat_template_kwargs={"chat_template": template})[0]
                      .prompt_token_ids) == "[user] hi\n[assistant] "  # fmt: skip
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        small_llm.chat(msgs, greedy, continue_final_message=True)
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        small_llm.chat(msgs, greedy, chat_template_kwargs=["mood"])


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_nan_kv_left_in_a_reused_block_reaches_no_other_request(tmp_path, default_model_dir, backend):
    """A request whose K/V are NaN (a token whose embedding overflows) fails alone; its freed
    blocks are reused, and the slots it left there, masked for the next owner, must not change
    that owner's tokens (0 * NaN is NaN: the torch path zeroes the masked K/V it gathers)."""
    from transformers import LlamaForCausalLM

    from helpers import tiny_llama_config

    torch.manual_seed(0)
    hf = LlamaForCausalLM(tiny_llama_config(vocab_size=49152, num_hidden_layers=2)).eval()
    with torch.no_grad():
        hf.model.embed_tokens.weight[5] = float("inf")
    model_dir = save_tiny_model(hf, tmp_path / "m", default_model_dir)
    llm = LLM(model=str(model_dir), block_size=4, attention_backend=backend, enable_prefix_caching=False,
              kv_cache_memory=kv_bytes(hf.config, 16, block_size=4))  # fmt: skip
    g = torch.Generator().manual_seed(4)
    bad = [5] + torch.randint(100, 4000, (40,), generator=g).tolist()
    good = torch.randint(100, 4000, (6,), generator=g).tolist()
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    poisoned = llm.generate({"prompt_token_ids": bad}, params, use_tqdm=False)[0]
    after = llm.generate({"prompt_token_ids": good}, params, use_tqdm=False)[0]  # on the freed blocks
    assert poisoned.outputs[0].finish_reason == "error"
    with torch.no_grad():
        hf.model.embed_tokens.weight[5] = 0.0  # (transformers' reference; token 5 is not in ``good``)
    tokens, gaps = hf_greedy(hf, good, 20)
    assert_greedy_matches(after.outputs[0].token_ids, tokens, gaps, f"{backend}, after a NaN request")
    assert_no_leaks(llm)
