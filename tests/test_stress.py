"""Everything at once on the async engine: concurrent streams with mixed sampling parameters
(greedy, seeded, n > 1, stop strings and ids, penalties, min_tokens, logprobs, prompt logprobs,
logit bias, allowed tokens, bad words, delta outputs), shared prompt prefixes, a KV cache tight
enough to preempt, prefill chunks of 32 tokens, and consumers that leave early (break, task
cancel, abort); with async scheduling, the priority policy and random priorities too. Each feature has its own tests; this one checks that together they keep the
invariants: every stream ends the way its consumer chose, finished outputs are well-formed,
greedy rows equal transformers' tokens, nothing leaks."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama

from helpers import assert_greedy_matches, hf_greedy, save_tiny_model, tiny_llama_config
from test_engine import assert_no_leaks, kv_bytes
from test_prompt_logprobs import assert_prompt_logprobs, hf_logprobs
from vllmini import EngineArgs, SamplingParams
from vllmini.engine.async_engine import AsyncLLMEngine

CONFIG = tiny_llama_config(vocab_size=49152, initializer_range=0.05)
NUM_REQUESTS = 48


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    torch.manual_seed(0)
    hf = HFLlama(CONFIG).eval()
    return save_tiny_model(hf, tmp_path_factory.mktemp("tiny-stress"), default_model_dir), hf


def random_request(rng: random.Random, shared: list[int]) -> tuple[dict, SamplingParams]:
    tokens = [rng.randint(100, 4000) for _ in range(rng.choice([1, 5, 17, 40, 90]))]
    if rng.random() < 0.3:  # a prefix other requests share: prefix-cache hits and shared blocks
        tokens = shared[: rng.choice([16, 32, 48])] + tokens
    kw: dict = {"max_tokens": rng.randint(1, 40), "ignore_eos": True}
    if rng.random() < 0.5:
        kw.update(temperature=0)
    else:
        kw.update(temperature=rng.choice([0.7, 1.2]), seed=rng.randint(0, 10**6), top_p=rng.choice([1.0, 0.9]),
                  top_k=rng.choice([0, 20]), n=rng.choice([1, 1, 2, 3]))  # fmt: skip
    if rng.random() < 0.25:
        kw["stop"] = [rng.choice(["e", "a ", "\n"])]
    if rng.random() < 0.2:
        kw["stop_token_ids"] = [rng.randint(100, 4000)]
    if rng.random() < 0.2:
        kw["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.2:
        kw.update(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.3)
    if rng.random() < 0.2:
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
    if rng.random() < 0.3:
        kw["output_kind"] = "delta"
    if rng.random() < 0.15:
        kw["prompt_logprobs"] = rng.randint(0, 2)
    if rng.random() < 0.1:
        kw["allowed_token_ids"] = rng.sample(range(100, 4000), 40)
    if rng.random() < 0.1:
        kw["logit_bias"] = {rng.randint(100, 4000): rng.choice([-100.0, 5.0, 100.0])}
    if rng.random() < 0.1:
        kw["bad_words"] = ["e", "the cat"]
    return {"prompt_token_ids": tokens}, SamplingParams(**kw)


def is_plain_greedy(p: SamplingParams) -> bool:
    """Rows transformers' greedy generate reproduces: no stops, penalties or min_tokens."""
    return (p.temperature == 0 and not p.stop and not p.stop_token_ids and p.repetition_penalty == 1.0
            and p.presence_penalty == 0 and p.frequency_penalty == 0 and p.logit_bias is None
            and p.allowed_token_ids is None and p.bad_words is None)  # fmt: skip


@pytest.mark.parametrize("async_scheduling", [False, True])
async def test_everything_at_once(tiny, async_scheduling):
    model_dir, hf = tiny
    rng = random.Random(7)
    shared = [rng.randint(100, 4000) for _ in range(48)]
    requests = [random_request(rng, shared) for _ in range(NUM_REQUESTS)]
    leave = {i: rng.choice(["break", "cancel", "abort"]) for i in rng.sample(range(NUM_REQUESTS), 12)}
    policy = "priority" if async_scheduling else "fcfs"
    prio = random.Random(11)
    priorities = [prio.randint(-2, 2) if policy == "priority" else 0 for _ in range(NUM_REQUESTS)]
    args = EngineArgs(model=str(model_dir), kv_cache_memory=kv_bytes(CONFIG, 20), max_num_batched_tokens=32,
                      max_num_seqs=8, max_model_len=256, async_scheduling=async_scheduling,
                      scheduling_policy=policy)  # fmt: skip
    async with AsyncLLMEngine.from_engine_args(args) as engine:

        async def consume(i: int) -> list:
            await asyncio.sleep(rng.random() * 0.05)  # staggered arrivals
            outs = []
            async for out in engine.generate(*requests[i], request_id=f"s{i}", priority=priorities[i]):
                outs.append(out)
                if i in leave and len(outs) == 2:
                    if leave[i] == "break":
                        break
                    if leave[i] == "abort":
                        await engine.abort(f"s{i}")
                    else:
                        asyncio.current_task().cancel()
            return outs

        tasks = [asyncio.create_task(consume(i)) for i in range(NUM_REQUESTS)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        while engine.engine.has_unfinished_requests():  # a break or cancel frees at the next step
            await asyncio.sleep(0.01)
        stats = engine.engine.scheduler.stats
        assert stats.num_preemptions > 0 and stats.num_chunked_prefills > 0, stats
        assert_no_leaks(engine)

    for i, ((prompt, params), res) in enumerate(zip(requests, results)):
        how = leave.get(i)
        if isinstance(res, BaseException):
            assert how == "cancel" and isinstance(res, asyncio.CancelledError), f"request {i}: {res!r}"
            continue
        last = res[-1]
        if how == "abort":  # the stream ends with a finished output ("abort", or it finished first)
            assert last.finished and {c.finish_reason for c in last.outputs} <= {"abort", "stop", "length"}, i
        if how is not None:
            continue  # it left (or finished just before it could)
        assert last.finished, f"request {i}"
        if params.output_kind == "delta":  # pieces add up to whole completions, each ended once
            tokens, ends = {}, {}
            for out in res:
                for c in out.outputs:
                    tokens[c.index] = tokens.get(c.index, []) + c.token_ids
                    if c.finish_reason is not None:
                        assert c.index not in ends, f"request {i}: completion {c.index} ended twice"
                        ends[c.index] = c
            finals = [ends[k] for k in sorted(ends)]
            completions = [tokens[c.index] for c in finals]
        else:
            finals = last.outputs
            completions = [c.token_ids for c in finals]
        assert sorted(c.index for c in finals) == list(range(params.n)), f"request {i}"
        for c in finals:
            assert c.finish_reason in ("stop", "length"), (i, c.finish_reason)
        for c, toks in zip(finals, completions):
            assert len(toks) <= params.max_tokens and len(toks) >= min(params.min_tokens, params.max_tokens)
            assert (c.finish_reason == "length") == (len(toks) == params.max_tokens and c.stop_reason is None)
            if params.logprobs is not None and params.output_kind != "delta":
                assert len(c.logprobs) == len(toks)
        if params.allowed_token_ids is not None:
            assert all(set(toks) <= set(params.allowed_token_ids) for toks in completions), f"request {i}"
        if params.prompt_logprobs is not None:  # whole, once, and transformers' values
            carried = [out.prompt_logprobs for out in res if out.prompt_logprobs]
            assert len(carried) == (1 if params.output_kind == "delta" else len(res)), f"request {i}"
            assert all(out.prompt_logprobs is not None for out in res), f"request {i}"  # later deltas: [], as vLLM
            ids = prompt["prompt_token_ids"]
            assert_prompt_logprobs(carried[0], ids, hf_logprobs(hf, ids), params.prompt_logprobs)
        if is_plain_greedy(params):
            want, gaps = hf_greedy(hf, prompt["prompt_token_ids"], params.max_tokens)
            assert_greedy_matches(completions[0], want, gaps, f"request {i}")
