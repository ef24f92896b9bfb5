"""Speculative decoding with a draft model (vLLM's method "draft_model"): outputs are those of
plain decoding, a draft model equal to the target has nearly every draft accepted (which it
only has when its own KV cache, on the target's blocks, holds the right K/V at the right
positions through chunked prefill, preemption, forks and rollbacks), and no KV block leaks."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaForCausalLM, Qwen3ForCausalLM

from helpers import assert_greedy_matches, hf_greedy, save_tiny_model, tiny_llama_config, tiny_qwen3_config
from test_engine import assert_no_leaks, kv_bytes
from vllmini import LLM, SamplingParams
from vllmini.spec_decode import SpeculativeConfig


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    """A tiny random Llama (the target, and as its own draft) and a tiny random Qwen3 of the same
    vocabulary (another draft: other weights, layer count and head shape)."""
    torch.manual_seed(0)
    hf = LlamaForCausalLM(tiny_llama_config()).eval()
    target = save_tiny_model(hf, tmp_path_factory.mktemp("target"), default_model_dir)
    torch.manual_seed(1)
    other = Qwen3ForCausalLM(tiny_qwen3_config(num_hidden_layers=2)).eval()
    return target, hf, save_tiny_model(other, tmp_path_factory.mktemp("draft"), default_model_dir)


def prompts(n: int, seed: int = 1, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (5 + 11 * i,), generator=g).tolist() for i in range(n)]


def run(llm: LLM, params, ps: list[list[int]]) -> list[list[list[int]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


def draft(model, k: int = 4, **extra) -> dict:
    return {"model": str(model), "num_speculative_tokens": k, **extra}


def test_config_infers_the_method_and_names_bad_fields():
    parse = SpeculativeConfig.parse
    assert parse({"model": "default", "num_speculative_tokens": 3}).method == "draft_model"
    c = parse('{"model": "d", "num_speculative_tokens": 2, "method": "draft_model", "disable_by_batch_size": 4}')
    assert (c.model, c.num_speculative_tokens, c.disable_by_batch_size) == ("d", 2, 4)
    assert parse({"model": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"  # vLLM's older spelling
    for bad, field in [
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        ({"model": "", "num_speculative_tokens": 2}, "speculative_config.model"),
        ({"model": "d", "num_speculative_tokens": 2, "method": "ngram"}, "speculative_config.model"),
        ({"model": "d", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "prompt_lookup_max"),
        ({"model": "d"}, "num_speculative_tokens"), ({"model": "d", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"model": "d", "num_speculative_tokens": 2, "method": "eagle"}, "speculative_config.method"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=field):
            parse(bad)


def test_drafts_that_cannot_work_are_refused_at_start_up(tiny, tmp_path, default_model_dir):
    target, _, _ = tiny
    torch.manual_seed(2)
    small_vocab = save_tiny_model(LlamaForCausalLM(tiny_llama_config(vocab_size=256)), tmp_path / "v", default_model_dir)
    with pytest.raises(ValueError, match=r"speculative_config.model=.*vocabulary has 256 tokens, the target's 512"):
        LLM(model=str(target), speculative_config=draft(small_vocab))
    swapped = save_tiny_model(LlamaForCausalLM(tiny_llama_config()), tmp_path / "t", default_model_dir)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    (a, i), (b, j) = list(vocab.items())[1000:1002]
    vocab[a], vocab[b] = j, i  # same size, two tokens' ids swapped
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match=r"speculative_config.model=.*tokenizer's vocabulary differs"):
        LLM(model=str(target), speculative_config=draft(swapped))
    short = save_tiny_model(LlamaForCausalLM(tiny_llama_config(max_position_embeddings=64)), tmp_path / "s", default_model_dir)
    with pytest.raises(ValueError, match=r"speculative_config.model=.*context \(64 tokens\).*max_model_len=1024"):
        LLM(model=str(target), speculative_config=draft(short))
    assert LLM(model=str(target), max_model_len=64, speculative_config=draft(short)).llm_engine.speculator.drafter is not None
    windowed = save_tiny_model(LlamaForCausalLM(tiny_llama_config()), tmp_path / "w", default_model_dir)
    config = (windowed / "config.json").read_text().replace('"architectures"', '"sliding_window": 32, "architectures"')
    (windowed / "config.json").write_text(config.replace("LlamaForCausalLM", "MistralForCausalLM"))
    with pytest.raises(ValueError, match=r"speculative_config.model=.*the draft model has sliding-window attention"):
        LLM(model=str(target), speculative_config=draft(windowed))
    with pytest.raises(ValueError, match=r"speculative_config.model=.*the target model has sliding-window attention"):
        LLM(model=str(windowed), speculative_config=draft(target))


def test_the_target_as_its_own_draft_is_plain_decoding_with_nearly_every_draft_accepted(tiny):
    """Under chunked prefill (a small token budget), preemption (a small KV cache), n = 2 (the
    sibling's copied block) and drafts cut to the budget: outputs equal plain decoding and
    transformers', and >90% of drafts are accepted (a draft model reading stale or misplaced
    K/V would guess wrong)."""
    target, hf, _ = tiny
    ps = prompts(12)
    max_tokens = [20 + (i * 7) % 19 for i in range(12)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    params[3] = SamplingParams(max_tokens=max_tokens[3], temperature=0.01, seed=3, n=2, ignore_eos=True)  # ~greedy
    small = dict(max_num_batched_tokens=40, max_num_seqs=6)
    base = LLM(model=str(target), **small, kv_cache_memory=kv_bytes(hf.config, 16))
    want = run(base, params, ps)
    llm = LLM(model=str(target), **small, kv_cache_memory=2 * kv_bytes(hf.config, 16), speculative_config=draft(target))
    got = run(llm, params, ps)
    eng = llm.llm_engine
    assert eng.num_blocks == 16  # the draft's cache counts in the budget: half of it here
    assert eng.scheduler.stats.num_preemptions > 0 and eng.scheduler.stats.num_chunked_prefills > 0
    assert got == want
    for p, m, out in [*zip(ps, max_tokens, got)][4:]:
        tokens, gaps = hf_greedy(hf, p, m)
        assert_greedy_matches(out[0], tokens, gaps, f"prompt of {len(p)} tokens")
    stats = eng.spec_stats
    assert stats.num_draft_tokens > 100 and stats.acceptance_rate > 0.9, stats
    assert_no_leaks(llm)


def test_another_draft_model_changes_no_output(tiny):
    """A draft of other weights and shapes (a 2-layer Qwen3 for a 3-layer Llama): few drafts
    accepted, outputs still plain decoding's; also with seeded sampling and penalties, stops
    and n = 2, where a draft's row samples as plain decoding's would."""
    target, _, other = tiny
    ps = prompts(6, seed=3)
    base = LLM(model=str(target))
    llm = LLM(model=str(target), speculative_config=draft(other, k=3))
    cases = [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=7, repetition_penalty=1.1, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=1.0, top_k=20, seed=3, presence_penalty=0.3, min_tokens=10, n=2),
        SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[7, 11, 13]),
    ]
    for params in cases:
        assert run(llm, params, ps) == run(base, params, ps), params
    assert llm.llm_engine.spec_stats.num_draft_tokens > 100
    assert_no_leaks(llm)


def test_seeded_sampling_with_the_target_as_draft(tiny):
    """Seeded sampling draws the same tokens as plain decoding; the greedy drafts of the same
    model are kept where the draw agrees with them (often, at a low temperature)."""
    target, _, _ = tiny
    ps = prompts(5, seed=4)
    base = LLM(model=str(target))
    llm = LLM(model=str(target), speculative_config=draft(target, k=3))
    for params in (SamplingParams(max_tokens=40, temperature=0.3, seed=5, ignore_eos=True),
                   SamplingParams(max_tokens=40, temperature=0.7, top_p=0.9, seed=9, frequency_penalty=0.2, n=2)):  # fmt: skip
        assert run(llm, params, ps) == run(base, params, ps), params
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 20
    assert_no_leaks(llm)


def test_prefix_cache_hits_carry_the_drafts_kv(tiny):
    """A prompt that extends a finished output reuses its cached blocks (the draft's K/V for
    them was written when they were computed): drafts stay accepted, output unchanged; the
    metrics count the drafts."""
    target, _, _ = tiny
    llm = LLM(model=str(target), speculative_config=draft(target), disable_log_stats=False)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    p = prompts(1, seed=6)[0] * 3
    first = run(llm, params, [p])[0][0]
    follow = p + first[:40]
    hits, stats = llm.llm_engine.block_manager.prefix_cache_hits, llm.llm_engine.spec_stats
    before = (stats.num_draft_tokens, stats.num_accepted_tokens)
    got = run(llm, params, [follow])[0][0]
    assert llm.llm_engine.block_manager.prefix_cache_hits - hits >= 48
    assert got == run(LLM(model=str(target)), params, [follow])[0][0]
    assert (stats.num_accepted_tokens - before[1]) / (stats.num_draft_tokens - before[0]) > 0.9
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}
    assert metrics["vllm:spec_decode_num_draft_tokens"] == stats.num_draft_tokens > 0  # the server's counters
    assert metrics["vllm:spec_decode_num_accepted_tokens"] == stats.num_accepted_tokens
    assert_no_leaks(llm)


def test_structured_outputs_keep_the_drafts_the_grammar_takes(tiny_dir, default_model_dir):
    """Drafts are made before the grammar sees them: those it refuses are cut (their slots given
    back) and the rest verified; outputs equal plain decoding's. (A random model's unmasked
    guesses rarely fit a grammar: all cut; the default model's often do.)"""
    pytest.importorskip("xgrammar")
    from vllmini import StructuredOutputsParams

    numbers = StructuredOutputsParams(regex=r"(\d+, ){5,40}\d+")
    for model, prompt in ((tiny_dir, "List:"), (default_model_dir, "Write the numbers from 1 to 40 separated by commas.")):
        base, llm = LLM(model=str(model)), LLM(model=str(model), speculative_config=draft(model))
        params = SamplingParams(max_tokens=40, temperature=0, structured_outputs=numbers)
        w, g = (o.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0].outputs[0] for o in (base, llm))
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
        assert_no_leaks(llm)
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 20


def test_lora_requests_draft_with_the_base_draft_model(tiny, tmp_path):
    """The draft model has no adapters: a LoRA request's drafts are the base model's guesses, and
    its outputs still equal the same engine's without speculation; base rows accept them all."""
    pytest.importorskip("peft")
    from helpers import save_tiny_lora
    from vllmini import LoRARequest

    target, _, _ = tiny
    lora = LoRARequest("a", 1, save_tiny_lora(target, tmp_path / "a", seed=3, r=4))
    ps, loras = prompts(4, seed=8), [lora, None, lora, None]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    outs = {}
    for name, extra in (("plain", {}), ("draft", {"speculative_config": draft(target)})):
        llm = LLM(model=str(target), enable_lora=True, max_loras=1, max_lora_rank=8, **extra)
        outs[name] = llm.generate([{"prompt_token_ids": p} for p in ps], params, lora_request=loras, use_tqdm=False)
        assert_no_leaks(llm)
    assert [o.outputs[0].token_ids for o in outs["draft"]] == [o.outputs[0].token_ids for o in outs["plain"]]
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 20


def test_a_mixture_of_experts_drafting_for_itself(tmp_path, default_model_dir):
    """A Qwen3-MoE as its own draft: the draft's experts are prepacked on the CPU as the target's
    are (engine/model_loading.py), and a draft equal to the target has nearly every draft accepted,
    outputs those of plain decoding."""
    from transformers import Qwen3MoeForCausalLM

    from helpers import tiny_qwen3_moe_config
    from vllmini.models.packed_linear import packing_available

    torch.manual_seed(0)
    target = save_tiny_model(Qwen3MoeForCausalLM(tiny_qwen3_moe_config()).eval(), tmp_path, default_model_dir)
    ps, params = prompts(4, seed=5), SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    llm = LLM(model=str(target), speculative_config=draft(target, k=3))
    packed = [m.experts.prepacked is not None for m in llm.llm_engine.speculator.drafter.model.modules()
              if hasattr(m, "experts")]  # fmt: skip
    assert packed and all(packed) == packing_available(torch.device("cpu"), torch.float32)
    assert run(llm, params, ps) == run(LLM(model=str(target)), params, ps)
    stats = llm.llm_engine.spec_stats
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens > 0
    assert_no_leaks(llm)
