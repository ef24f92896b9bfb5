"""SamplingParams.prompt_logprobs: every prompt token's logprob (plus the top N) equals
transformers' log_softmax of the same prompt, through chunked prefill, the prefix cache
(a hit computes no logits, so it must not be taken), preemption mid-prompt (recomputed
positions are not recorded twice), n > 1, delta outputs and async scheduling. Also the
``max_logprobs`` cap on both logprob fields."""
from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama

from helpers import save_tiny_model, tiny_llama_config
from test_engine import assert_no_leaks, kv_bytes
from vllmini import LLM, EngineArgs, SamplingParams
from vllmini.engine import prompt_logprobs
from vllmini.engine.async_engine import AsyncLLMEngine
from vllmini.engine.llm_engine import LLMEngine
from vllmini.engine.model_runner import flatten_step
from vllmini.kv.block_manager import BlockManager
from vllmini.scheduler.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput
from vllmini.scheduler.sequence import Sequence

CONFIG = tiny_llama_config(vocab_size=49152, initializer_range=0.05)
ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    torch.manual_seed(0)
    hf = HFLlama(CONFIG).eval()
    return str(save_tiny_model(hf, tmp_path_factory.mktemp("tiny-plp"), default_model_dir)), hf


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """Row i: transformers' log_softmax at position i (it scores token i + 1)."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def assert_prompt_logprobs(got, ids: list[int], ref: torch.Tensor, num_top: int) -> None:
    assert got is not None and len(got) == len(ids), f"{None if got is None else len(got)} entries for {len(ids)} tokens"
    assert got[0] is None
    for pos in range(1, len(ids)):
        entry, row = got[pos], ref[pos - 1]
        assert ids[pos] in entry and len(entry) in (num_top, num_top + 1), (pos, entry)
        for token, value in entry.items():
            assert abs(value - row[token].item()) < ATOL, (pos, token, value, row[token].item())
            # vLLM's rank: how many tokens are at least as likely (near ties may count either way)
            lo, hi = (int((row >= row[token] + d).sum()) for d in (ATOL, -ATOL))
            assert lo <= value.rank <= hi, (pos, token, value.rank, lo, hi)
        if num_top:  # the entry's N largest are transformers' top N (compared by value: ties may swap ids)
            got_top = sorted(entry.values(), reverse=True)[:num_top]
            assert max(abs(a - b) for a, b in zip(got_top, row.topk(num_top).values.tolist())) < ATOL, pos


def test_default_model_matches_transformers(default_model_dir):
    """Real weights, prefill in 32-token chunks, prompts of 1..~60 tokens; a request without
    prompt_logprobs in the same batch gets the tokens it gets alone."""
    from transformers import AutoModelForCausalLM

    llm = LLM(model=str(default_model_dir), max_num_batched_tokens=32)
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    prompts = ["The quick brown fox jumps over the lazy dog. " * 5, "Hello, my name is", "x", "What is 2+2?"]
    plain = SamplingParams(max_tokens=8, temperature=0)
    alone = llm.generate(prompts[1], plain, use_tqdm=False)[0].outputs[0].token_ids
    params = [SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=k) for k in (5, 0, 3)] + [plain]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, p in zip(outs[:3], params):
        assert_prompt_logprobs(out.prompt_logprobs, out.prompt_token_ids, hf_logprobs(hf, out.prompt_token_ids), p.prompt_logprobs)
    assert outs[2].prompt_logprobs == [None]  # one token: nothing scores it
    assert outs[3].prompt_logprobs is None
    assert llm.generate(prompts[1], plain, use_tqdm=False)[0].outputs[0].token_ids == alone
    assert_no_leaks(llm)


def test_prefix_cache_hit_is_not_taken_for_scored_positions(tiny):
    model_dir, hf = tiny
    llm = LLM(model=model_dir, enable_prefix_caching=True)
    ids = list(range(300, 360))  # 3 full blocks + 12 tokens
    llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2), use_tqdm=False)  # cache it
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.metrics.num_cached_tokens == 0
    assert_prompt_logprobs(out.prompt_logprobs, ids, hf_logprobs(hf, ids), 2)
    again = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert again.num_cached_tokens == 48  # the cache still serves requests that do not score
    assert_no_leaks(llm)


def test_preempted_mid_prompt_records_each_position_once(tiny):
    """A prompt_logprobs request is preempted halfway through its prompt, then re-admitted with
    a prefix-cache hit capped below the first unscored position: it recomputes the K/V of a few
    positions it already scored and must score each prompt token exactly once."""
    model_dir, hf = tiny
    args = EngineArgs(model=model_dir, kv_cache_memory=kv_bytes(CONFIG, 8), max_num_batched_tokens=16,
                      max_num_seqs=4, max_model_len=128)  # fmt: skip
    engine = LLMEngine(args)
    long_ids = [(7 * i) % 3000 + 100 for i in range(100)]
    engine.add_request("b", {"prompt_token_ids": list(range(1000, 1020))}, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request("a", {"prompt_token_ids": long_ids}, SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=1))
    seq_a = engine.requests["a"].seqs[0]
    preempted_at, resumed_from, final = [], [], None
    while engine.has_unfinished_requests():
        was_waiting = seq_a.num_computed_tokens == 0 and seq_a.num_preemptions > 0
        for out in engine.step():
            if out.request_id == "a" and out.finished:
                final = out
        if was_waiting and seq_a.num_computed_tokens:
            resumed_from.append(engine.block_manager.num_cached_tokens(seq_a.seq_id))  # this admission's hit
        if seq_a.num_preemptions > len(preempted_at):
            preempted_at.append(seq_a.prompt_logits_from)
    assert preempted_at and preempted_at[0] is not None and preempted_at[0] > 16, preempted_at  # mid-prompt
    assert resumed_from and 0 < resumed_from[0] <= preempted_at[0], resumed_from  # capped cache hit
    assert_prompt_logprobs(final.prompt_logprobs, long_ids, hf_logprobs(hf, long_ids), 1)
    assert_no_leaks(SimpleNamespace(engine=engine))


@pytest.mark.parametrize("async_scheduling", [False, True])
async def test_streams_n_and_delta(tiny, async_scheduling):
    """Cumulative streams carry the prompt logprobs in every output, delta streams in the first
    only (then [], as vLLM's); n = 2 scores the prompt once for both completions."""
    model_dir, hf = tiny
    ids = list(range(500, 540))
    ref = hf_logprobs(hf, ids)
    args = EngineArgs(model=model_dir, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    async with AsyncLLMEngine.from_engine_args(args) as engine:

        async def collect(kind: str, rid: str) -> list:
            params = SamplingParams(max_tokens=6, n=2, seed=1, ignore_eos=True, prompt_logprobs=3, output_kind=kind)
            return [out async for out in engine.generate({"prompt_token_ids": ids}, params, request_id=rid)]

        cumulative, delta = await asyncio.gather(collect("cumulative", "c"), collect("delta", "d"))
        assert_no_leaks(engine)
    assert len(cumulative) > 1 and len(delta) > 1
    for out in cumulative:
        assert_prompt_logprobs(out.prompt_logprobs, ids, ref, 3)
    assert_prompt_logprobs(delta[0].prompt_logprobs, ids, ref, 3)
    assert all(out.prompt_logprobs == [] for out in delta[1:])  # vLLM's pop_prompt_logprobs leaves []
    assert len(cumulative[-1].outputs) == 2 and all(len(c.token_ids) == 6 for c in cumulative[-1].outputs)


def test_prompt_rows_never_make_a_decode_graph_step():
    """One-token prompt chunks that are scored but sample nothing must not look decode-only
    (a decode graph computes exactly one sampled logits row per sequence)."""
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    seq = Sequence(0, "r", [1, 2, 3, 4, 5], None, 4)
    seq.prompt_logits_from = 0
    assert bm.allocate(0, seq.token_ids, 1)
    flat = flatten_step(SchedulerOutput([ScheduledSeq(seq, 1)]), bm, 4)
    assert flat.logits_rows == [0] and flat.prompt_rows == [(0, 0, 1)] and flat.sample_indices == []
    assert not flat.is_decode_only


def test_logprob_fields_are_validated_and_capped(tiny):
    model_dir, _ = tiny
    for bad in (-2, "2", True, 1.5):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(ValueError, match="max_logprobs"):
        EngineArgs(max_logprobs=-2).validate()
    llm = LLM(model=model_dir)
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{field}=21 exceeds max_logprobs=20"):
            llm.generate("hi", SamplingParams(**{field: 21}), use_tqdm=False)
    assert_no_leaks(llm)
    assert len(llm.generate("hi", SamplingParams(max_tokens=2, logprobs=20), use_tqdm=False)[0].outputs[0].logprobs) == 2
    vocab = llm.llm_engine.vocab_size
    with pytest.raises(ValueError, match=rf"logprobs=-1 \(the whole vocabulary, {vocab}\) exceeds max_logprobs=20"):
        llm.generate("hi", SamplingParams(logprobs=-1), use_tqdm=False)
    unlimited = LLM(model=model_dir, max_logprobs=-1)
    out = unlimited.generate("hi there", SamplingParams(max_tokens=1, logprobs=100, prompt_logprobs=100), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) in (100, 101) and len(out.prompt_logprobs[1]) in (100, 101)
    params = SamplingParams(max_tokens=1, logprobs=-1, prompt_logprobs=-1)  # vLLM's "every token"
    out = unlimited.generate({"prompt_token_ids": [5, 6]}, params, use_tqdm=False)[0]
    assert params.logprobs == -1  # the caller's object is left as it was
    for entry in (out.outputs[0].logprobs[0], out.prompt_logprobs[1]):
        assert sorted(entry) == list(range(vocab))
        assert math.isclose(sum(math.exp(lp.logprob) for lp in entry.values()), 1.0, rel_tol=1e-4)


def test_scheduler_caps_the_prompt_positions_scored_per_step():
    """``max_prompt_logits_rows``: a scored chunk stops at the cap; positions scored before
    (a recompute after preemption) are free; a second scored prompt waits for the next step;
    other sequences are scheduled as usual."""
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(8, 100, 512, max_prompt_logits_rows=10), bm)
    plain = Sequence(0, "p", list(range(30)), None, 4)
    scored = [Sequence(i, f"s{i}", list(range(50)), None, 4) for i in (1, 2)]
    for seq in scored:
        seq.prompt_logits_from = 0
    for seq in (scored[0], plain, scored[1]):
        sched.add(seq)
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("s1", 10), ("p", 30)]
    assert scored[0].prompt_logits_rows(0, 10) == 10
    # a recompute from 0 of a prompt scored up to 20: 20 free positions + 10 new ones
    assert scored[0].cap_prompt_logits_rows(0, 50, 10) == 10
    scored[0].prompt_logits_from = 20
    assert scored[0].cap_prompt_logits_rows(0, 50, 10) == 30 and scored[0].prompt_logits_rows(0, 30) == 10
    assert scored[0].cap_prompt_logits_rows(0, 50, 0) == 20 and scored[0].prompt_logits_rows(0, 20) == 0
    # the last prompt position is sampled, not scored: a 50-token prompt has 49 rows
    assert scored[0].prompt_logits_rows(20, 30) == 29


def test_a_long_prompt_is_scored_over_several_steps(tiny, monkeypatch):
    """With the cap at 7 rows (the vocabulary-wide logits a step may hold), two scored prompts
    and a plain request run together: no step projects more than 7 prompt rows, the values are
    transformers', and the plain request's tokens are those it gets alone."""
    model_dir, hf = tiny
    monkeypatch.setattr(prompt_logprobs, "MAX_PROMPT_LOGITS_ELEMENTS", 7 * CONFIG.vocab_size + 3)
    engine = LLMEngine(EngineArgs(model=model_dir, max_num_batched_tokens=64))
    assert engine.scheduler.config.max_prompt_logits_rows == 7
    rows_per_step = []
    execute = engine.runner.execute

    def counting(sched, bm):
        logits, flat = execute(sched, bm)
        rows_per_step.append(sum(count for _, _, count in flat.prompt_rows))
        return logits, flat

    monkeypatch.setattr(engine.runner, "execute", counting)
    prompts = {"a": list(range(200, 240)), "b": list(range(900, 925)), "plain": list(range(40, 70))}
    plain = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0)
    for rid, ids in prompts.items():
        params = plain if rid == "plain" else SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=2)
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
    assert max(rows_per_step) == 7 and sum(rows_per_step) == 39 + 24
    for rid in ("a", "b"):
        assert_prompt_logprobs(finals[rid].prompt_logprobs, prompts[rid], hf_logprobs(hf, prompts[rid]), 2)
    alone = LLM(model=model_dir).generate({"prompt_token_ids": prompts["plain"]}, plain, use_tqdm=False)[0]
    assert finals["plain"].outputs[0].token_ids == alone.outputs[0].token_ids
    assert_no_leaks(SimpleNamespace(engine=engine))


@pytest.mark.parametrize("max_logprobs", [20, -1])
def test_memory_warm_up_runs_the_costliest_step(tiny, monkeypatch, max_logprobs):
    """The CUDA KV budget is what the warm-up leaves: it must project max_num_seqs sampled rows
    plus the prompt-logprob cap, sample the former with the costly options and score the latter
    (run here on the CPU, where the same code runs; only the memory reading is CUDA's)."""
    model_dir, _ = tiny
    from vllmini.engine import kv_budget
    from vllmini.models.weight_loader import load_model

    model, _ = load_model(model_dir, torch.float32, torch.device("cpu"))
    seen = {}
    real_sampler, real_score = kv_budget.Sampler.__call__, prompt_logprobs.score_rows

    def sampler(self, logits, t, sync_free=False):
        seen["sampled"] = (logits.shape, t.num_logprobs, t.top_p_rows, t.do_penalties, t.disallowed is not None)
        return real_sampler(self, logits, t, sync_free)

    def score(logits, targets, num_top):
        seen["scored"] = (logits.shape, num_top)
        return real_score(logits, targets, num_top)

    import vllmini.engine.sampler as sampler_module

    nucleus_widths, real_nucleus = [], sampler_module._nucleus

    def nucleus(vals, *args):
        nucleus_widths.append(vals.shape)
        return real_nucleus(vals, *args)

    monkeypatch.setattr(kv_budget.Sampler, "__call__", sampler)
    monkeypatch.setattr(prompt_logprobs, "score_rows", score)
    monkeypatch.setattr(sampler_module, "_nucleus", nucleus)
    args = EngineArgs(model=model_dir, max_num_seqs=6, max_num_batched_tokens=64, max_logprobs=max_logprobs)
    kv_budget.warm_up_step(model, args, 256, 9, torch.device("cpu"))
    top = CONFIG.vocab_size if max_logprobs == -1 else 20
    assert seen["sampled"] == ((6, CONFIG.vocab_size), top, list(range(6)), True, True)
    assert seen["scored"] == ((9, CONFIG.vocab_size), top)
    assert (5, CONFIG.vocab_size) in nucleus_widths  # top-p sorted whole rows (all but the masked one)
    # speculative decoding: each decode samples its drafts' rows too (6 sequences x (1 + 3))
    args = EngineArgs(model=model_dir, max_num_seqs=6, max_num_batched_tokens=64, max_logprobs=max_logprobs,
                      speculative_config={"num_speculative_tokens": 3})  # fmt: skip
    kv_budget.warm_up_step(model, args, 256, 9, torch.device("cpu"))
    assert seen["sampled"][0] == (24, CONFIG.vocab_size)


def test_ranks_count_in_int32():
    """A rank counts the row's logprobs >= the target's in int32: a bool ``sum``'s default int64
    widens the whole [rows, vocab] mask to 8 bytes first (1.6x slower: ~4% of a long prompt's op
    time, in ``aten::copy_``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from vllmini.engine.prompt_logprobs import score_rows

    class Sums(TorchDispatchMode):
        dtypes: list[torch.dtype] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket is torch.ops.aten.sum and args[0].dtype == torch.bool:
                Sums.dtypes.append(out.dtype)
            return out

    logits = torch.randn(8, 1000)
    with Sums():
        scored = score_rows(logits, list(range(8)), 3)
    lp = logits.log_softmax(-1)
    assert [rank for _, rank, _, _ in scored] == (lp >= lp[:, :8].diagonal()[:, None]).sum(-1).tolist()
    assert Sums.dtypes == [torch.int32]
