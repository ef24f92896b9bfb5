"""Speculative decoding (ngram prompt lookup): the tokens are those plain decoding gives
(greedy equal to transformers; seeded sampling, penalties, logprobs and stops equal to the
engine without it), drafts are really accepted, and no KV block or cache hash outlives them."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen3ForCausalLM as HFQwen3

from helpers import assert_greedy_matches, hf_greedy, save_tiny_model, tiny_qwen3_config
from test_engine import assert_no_leaks, kv_bytes
from vllmini import LLM, AsyncLLMEngine, EngineArgs, SamplingParams
from vllmini.kv.block_manager import BlockManager
from vllmini.spec_decode import NgramProposer, SpeculativeConfig

DIGITS = "1234567890123456789012"  # REPEAT[1]'s output says this first at its 22nd token
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
REPEAT = [
    "Repeat the following list exactly, twice: apple, banana, cherry, date, elderberry, fig, grape, kiwi.",
    "Write the numbers from 1 to 40 separated by commas.",
    "Copy this sentence three times: the quick brown fox jumps over the lazy dog.",
    "Tell me a story about a cat.",
]


# ---- the proposer ----------------------------------------------------------------------------
def test_ngram_proposer_takes_the_longest_latest_match():
    p = NgramProposer(3, 1, 3)
    assert p.propose([1, 2, 3, 4, 1, 2, 3]) == [4, 1, 2]
    assert p.propose([1, 2, 3, 4, 5]) == []  # 5 never occurred before
    # the suffix [9, 1, 2] does not occur earlier; [1, 2] does, latest at index 1 (then 9, 9)
    assert p.propose([5, 1, 2, 8, 1, 2, 9, 9, 1, 2]) == [9, 9, 1]
    # the longest suffix wins over a later shorter one: [3, 1, 2] occurred at 0 (followed by 7)
    assert p.propose([3, 1, 2, 7, 1, 2, 5, 3, 1, 2]) == [7, 1, 2]
    assert p.propose([7, 7, 7, 7]) == [7, 7, 7]  # a loop goes on looping past the end
    assert p.propose([1, 2, 1, 2], max_tokens=2) == [1, 2]
    assert p.propose([1, 2, 1, 2], max_tokens=0) == []
    assert NgramProposer(3, 3, 3).propose([1, 2, 9, 1, 2]) == []  # [9, 1, 2] is new: shorter n-grams not tried


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=40), st.integers(1, 3), st.integers(0, 2), st.integers(1, 5))
def test_a_proposal_continues_an_earlier_occurrence(tokens, min_n, extra, k):
    """What the proposal claims: some n in [min_n, max_n] has the last n tokens occurring
    earlier, followed by the draft (the sequence extended by the draft itself); and no longer
    suffix (up to max_n) occurs earlier."""
    max_n = min_n + extra
    draft = NgramProposer(k, min_n, max_n).propose(tokens)
    ext, L = tokens + draft, len(tokens)

    def occurs(n: int) -> list[int]:
        return [i for i in range(L - n) if tokens[i : i + n] == tokens[L - n :]] if L > n else []

    ns = [n for n in range(min_n, max_n + 1) if occurs(n)]
    if not ns:
        assert draft == []
        return
    n = max(ns)
    assert len(draft) == k
    i = occurs(n)[-1]
    assert ext[i + n : i + n + k] == draft


def test_speculative_config_defaults_and_errors():
    parse = SpeculativeConfig.parse
    assert parse({"num_speculative_tokens": 3}) == SpeculativeConfig(3, "ngram", 5, 5)
    assert parse({"num_speculative_tokens": 3, "prompt_lookup_max": 4}).prompt_lookup_min == 4
    assert parse({"num_speculative_tokens": 3, "prompt_lookup_min": 2}).prompt_lookup_max == 2
    assert parse('{"method": "ngram", "num_speculative_tokens": 2}').num_speculative_tokens == 2  # the CLI's JSON
    for bad, field in [
        ({}, "num_speculative_tokens"), ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens"), ({"num_speculative_tokens": 2, "method": "eagle"}, "method"),
        ({"num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "unknown"), ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3}, "prompt_lookup_min"),
        ("{not json", "JSON"), ([1], "dict"), ({"num_speculative_tokens": 2, "disable_by_batch_size": 1}, "disable_by_batch_size"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=field):
            parse(bad)
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineArgs(speculative_config=NGRAM, async_scheduling=True).validate()
    with pytest.raises(ValueError, match="speculative_config.method"):
        EngineArgs(speculative_config={"num_speculative_tokens": 1, "method": "medusa"}).validate()


def test_rollback_releases_the_rejected_slots_and_keeps_hashes():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    tokens = list(range(10))
    assert bm.allocate("s", tokens, 10)  # 3 blocks, 2 full and hashed
    assert bm.allocate("s", tokens, 6)  # a decode + 5 drafts: 16 slots, 4 blocks; no new hash (drafts unknown)
    assert bm.num_owned_blocks("s") == 4
    bm.check_invariants()
    bm.rollback("s", 11)  # 1 draft accepted
    assert bm.num_tokens("s") == 11 and bm.num_owned_blocks("s") == 3 and bm.num_free_blocks == 5
    bm.check_invariants()
    with pytest.raises(ValueError, match="roll"):
        bm.rollback("s", 12)  # never grows
    with pytest.raises(ValueError, match="roll"):
        bm.rollback("s", 7)  # hashed blocks stay
    bm.free("s")
    bm.check_invariants()


# ---- the engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(default_model_dir):
    base = LLM(model=str(default_model_dir))
    spec = LLM(model=str(default_model_dir), speculative_config=NGRAM)
    return base, spec


def chats(llm, params, prompts=REPEAT):
    return llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)


def test_greedy_equals_plain_decoding_and_drafts_are_accepted(engines):
    base, spec = engines
    params = SamplingParams(max_tokens=80, temperature=0, logprobs=3)
    before = spec.llm_engine.spec_stats.num_accepted_tokens
    want, got = chats(base, params), chats(spec, params)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text and g.outputs[0].finish_reason == w.outputs[0].finish_reason
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            assert lw.keys() == lg.keys()
            for t in lw:
                assert lg[t].logprob == pytest.approx(lw[t].logprob, abs=2e-4) and lg[t].rank == lw[t].rank
        assert g.outputs[0].cumulative_logprob == pytest.approx(w.outputs[0].cumulative_logprob, abs=2e-3)
    stats = spec.llm_engine.spec_stats
    assert stats.num_accepted_tokens - before > 40, "the repetitive prompts should accept many drafts"
    assert stats.num_accepted_tokens_per_pos[0] >= stats.num_accepted_tokens_per_pos[-1] > 0
    assert_no_leaks(spec)
    spec.llm_engine.block_manager.check_invariants()


def test_every_verification_is_counted_even_the_one_that_ends_a_request(engines):
    """The counters see every scheduled draft, including those of the step whose tokens stop the
    sequence (max_tokens or a stop string among the accepted drafts)."""
    _, spec = engines
    eng, scheduled = spec.llm_engine, []
    real = eng.scheduler.schedule

    def schedule():
        out = real()
        scheduled.extend(s.spec_token_ids for s in out.scheduled if s.spec_token_ids)
        return out

    eng.scheduler.schedule = schedule
    before = (eng.spec_stats.num_drafts, eng.spec_stats.num_draft_tokens)
    try:
        for params in (SamplingParams(max_tokens=30, temperature=0), SamplingParams(max_tokens=80, temperature=0, stop=[DIGITS])):
            out = chats(spec, params, REPEAT[1:2])[0].outputs[0]
        assert out.stop_reason == DIGITS  # (the last run stopped on its string)
    finally:
        del eng.scheduler.schedule
    assert len(scheduled) > 2
    assert eng.spec_stats.num_drafts - before[0] == len(scheduled)
    assert eng.spec_stats.num_draft_tokens - before[1] == sum(map(len, scheduled))


def test_seeded_sampling_penalties_and_stops_equal_plain_decoding(engines):
    """A draft's row samples as if the drafts before it had been sampled: its seed, penalties
    and min_tokens see them, so seeded tokens are those of plain decoding; stops inside a run
    of accepted drafts end the output at the same token. (Up to rounding: a draft's logits come
    from a several-token row, last bits apart from a decode row's, so a draw landing in the long
    tail of tiny probabilities may pick a neighbour; the cases cut the tail with top_p/top_k.)"""
    base, spec = engines
    cases = [
        SamplingParams(max_tokens=60, temperature=0.7, top_p=0.95, seed=7, repetition_penalty=1.1, frequency_penalty=0.2),
        SamplingParams(max_tokens=60, temperature=1.0, top_k=20, seed=3, presence_penalty=0.3, min_tokens=10),
        SamplingParams(max_tokens=7, temperature=0),  # max_tokens inside a draft run
        # each prompt's output says one of these (the digits after ~12 tokens of accepted drafts)
        SamplingParams(max_tokens=80, temperature=0, stop=["Cherry", DIGITS, "Lazy", "feline"]),
        SamplingParams(max_tokens=80, temperature=0, stop=["Cherry", DIGITS, "feline"], include_stop_str_in_output=True),
        SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=11, n=2),
    ]
    # every case on every prompt in one batch: one pass of decode steps per engine, not one per case
    params = [case for case in cases for _ in REPEAT]
    prompts = REPEAT * len(cases)
    stopped = 0
    for w, g, p in zip(chats(base, params, prompts), chats(spec, params, prompts), params):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs], p
        assert [c.text for c in g.outputs] == [c.text for c in w.outputs]
        assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in w.outputs]
        assert [c.stop_reason for c in g.outputs] == [c.stop_reason for c in w.outputs]
        stopped += sum(isinstance(c.stop_reason, str) for c in g.outputs)
    assert stopped == 7, "the stop strings should end 7 of the 8 outputs that have them"
    assert_no_leaks(spec)


def test_disable_by_batch_size_drafts_only_for_a_small_batch(default_model_dir, engines):
    base, _ = engines
    llm = LLM(model=str(default_model_dir), speculative_config={**NGRAM, "disable_by_batch_size": 2})
    eng, prompts = llm.llm_engine, REPEAT[:3]
    same = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    chats(llm, same, prompts)  # three requests to the end: never two or fewer left before the last step
    assert eng.spec_stats.num_drafts == 0
    staggered = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (6, 32, 32)]
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    got = llm.chat(msgs, staggered, use_tqdm=False)
    assert eng.spec_stats.num_drafts > 0  # once the first request finished
    want = base.chat(msgs, staggered, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert_no_leaks(llm)


def test_prefix_cache_after_speculation_holds_the_right_kv(engines):
    """Blocks filled by accepted drafts are cached: a later prompt that extends a finished
    output reuses them and still decodes exactly as a fresh engine would."""
    base, spec = engines
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    first = spec.generate([REPEAT[1]], params, use_tqdm=False)[0]
    follow = {"prompt_token_ids": first.prompt_token_ids + first.outputs[0].token_ids[:50]}
    hits = spec.llm_engine.block_manager.prefix_cache_hits
    params = params.clone(max_tokens=32)  # (the follow-up decodes on from the cached blocks)
    got = spec.generate([follow], params, use_tqdm=False)[0]
    assert spec.llm_engine.block_manager.prefix_cache_hits - hits >= 48  # the output's blocks too
    assert got.outputs[0].token_ids == base.generate([follow], params, use_tqdm=False)[0].outputs[0].token_ids
    assert_no_leaks(spec)


def test_structured_outputs_verify_drafts_the_grammar_takes(engines):
    """Drafts under a grammar are cut to what it takes, and each draft's row is masked in the
    grammar's state after the drafts before it: outputs equal plain decoding's, drafts accepted."""
    from vllmini import StructuredOutputsParams

    pytest.importorskip("xgrammar")
    base, spec = engines
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}},
              "required": ["items"]}  # fmt: skip
    cases = [
        ("ab ab ab ab ab ab", StructuredOutputsParams(regex="(ab ){1,20}")),
        (REPEAT[0] + " Answer in JSON.", StructuredOutputsParams(json=schema)),
        (REPEAT[1], StructuredOutputsParams(regex=r"(\d+, ){5,40}\d+")),
    ]
    before = spec.llm_engine.spec_stats.num_accepted_tokens
    prompts = [prompt for prompt, _ in cases]
    params = [SamplingParams(max_tokens=60, temperature=0, structured_outputs=so) for _, so in cases]
    for prompt, want, got in zip(prompts, chats(base, params, prompts), chats(spec, params, prompts)):  # one batch
        w, g = want.outputs[0], got.outputs[0]
        assert g.token_ids == w.token_ids and g.text == w.text and g.finish_reason == w.finish_reason, prompt
    assert spec.llm_engine.spec_stats.num_accepted_tokens - before > 20
    assert_no_leaks(spec)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory, default_model_dir):
    torch.manual_seed(0)
    hf = HFQwen3(tiny_qwen3_config()).eval()
    return save_tiny_model(hf, tmp_path_factory.mktemp("tiny-qwen3"), default_model_dir), hf


def test_greedy_equals_transformers_under_chunking_and_preemption(tiny_qwen3):
    """Many sequences, small token budget (drafts cut to fit), a KV cache small enough to
    preempt: every output is transformers' greedy one, and drafts were accepted."""
    model_dir, hf = tiny_qwen3
    g = torch.Generator().manual_seed(1)
    prompts = []
    for i in range(16):  # half of them quote themselves, so their outputs often repeat
        p = torch.randint(0, hf.config.vocab_size, (8 + 9 * i,), generator=g).tolist()
        prompts.append(p + p[:20] if i % 2 else p)
    max_tokens = [24 + (i * 5) % 17 for i in range(16)]
    llm = LLM(model=str(model_dir), max_num_batched_tokens=48, max_num_seqs=8, kv_cache_memory=kv_bytes(hf.config, 40),
              speculative_config={"num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 3})  # fmt: skip
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    eng = llm.llm_engine
    assert eng.scheduler.stats.num_preemptions > 0 and eng.scheduler.stats.num_chunked_prefills > 0
    assert eng.spec_stats.num_accepted_tokens > 8 and eng.spec_stats.num_accepted_tokens_per_pos[1] > 0
    for p, m, out in zip(prompts, max_tokens, outs):
        assert len(out.outputs[0].token_ids) == m
        tokens, gaps = hf_greedy(hf, p, m)
        assert_greedy_matches(out.outputs[0].token_ids, tokens, gaps, f"prompt of {len(p)} tokens")
    assert_no_leaks(llm)


def test_lora_requests_speculate_as_base_ones(tiny_qwen3, tmp_path):
    """Adapters' rows and the base model's, with drafts, in one step: each output equals the
    same engine's without speculation (LoRA itself is checked against PEFT in test_lora.py)."""
    pytest.importorskip("peft")
    from helpers import save_tiny_lora
    from vllmini import LoRARequest

    model_dir, _ = tiny_qwen3
    lora = LoRARequest("a", 1, save_tiny_lora(model_dir, tmp_path / "a", seed=3, r=4))
    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": (p := torch.randint(0, 512, (12,), generator=g).tolist()) + p} for _ in range(4)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    loras = [lora, None, lora, None]
    spec = {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    outs = {}
    for name, extra in (("plain", {}), ("spec", {"speculative_config": spec})):
        llm = LLM(model=str(model_dir), enable_lora=True, max_loras=1, max_lora_rank=8, **extra)
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras, use_tqdm=False)]
        assert_no_leaks(llm)
    assert outs["spec"] == outs["plain"]
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 0


def test_async_engine_streams_several_tokens_a_step(default_model_dir, engines):
    async def main():
        engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(default_model_dir), speculative_config=NGRAM))
        params = SamplingParams(max_tokens=30, temperature=0, output_kind="delta")
        prompt = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22,"
        deltas = [o.outputs[0] async for o in engine.generate(prompt, params, request_id="r")]
        engine.shutdown()
        return deltas, engine.engine

    deltas, eng = asyncio.run(main())
    whole = engines[0].generate(
        ["1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22,"],
        SamplingParams(max_tokens=30, temperature=0), use_tqdm=False,
    )[0].outputs[0]  # fmt: skip
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert "".join(d.text for d in deltas) == whole.text
    assert max(len(d.token_ids) for d in deltas) > 1, "no step delivered accepted drafts"
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


async def test_server_answers_as_plain_decoding_and_reports_acceptance(default_model_dir, engines):
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from vllmini.entrypoints.openai.api_server import build_app

    base, _ = engines
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(default_model_dir), speculative_config=NGRAM,
                                                        served_model_name="m"))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, "m")), base_url="http://t") as http:
            body = {"model": "m", "messages": [{"role": "user", "content": REPEAT[1]}], "max_tokens": 60, "temperature": 0}
            whole = (await http.post("/v1/chat/completions", json=body)).json()
            streamed = (await http.post("/v1/chat/completions", json={**body, "stream": True})).text
            metrics = (await http.get("/metrics")).text
    finally:
        engine.shutdown()
    want = chats(base, SamplingParams(max_tokens=60, temperature=0), REPEAT[1:2])[0].outputs[0].text
    assert whole["choices"][0]["message"]["content"] == want
    chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == want
    samples = {(s.name, s.labels.get("position")): s.value for f in text_string_to_metric_families(metrics) for s in f.samples}
    stats = engine.engine.spec_stats
    assert samples[("vllm:spec_decode_num_draft_tokens_total", None)] == stats.num_draft_tokens > 0
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", None)] == stats.num_accepted_tokens > 0
    assert samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", "0")] == stats.num_accepted_tokens_per_pos[0]
