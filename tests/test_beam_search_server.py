"""Beam search on the async engine (vLLM's ``EngineClient.beam_search``) and over HTTP
(``use_beam_search`` on completions and chat): the same beams as the offline ``LLM.beam_search``
(which tests/test_beam_search.py holds to transformers), their text without a final EOS, one
final output; a search given up is aborted with nothing left behind; a bad n is a 400 naming it."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from test_beam_search import KV, eos_case, tiny  # noqa: F401 (fixtures)
from vllmini import AsyncLLMEngine, BeamSearchParams, EngineArgs
from vllmini.entrypoints.openai.api_server import build_app


@pytest.fixture
async def served(eos_case):  # noqa: F811
    llm = eos_case[0]
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(llm.llm_engine.model_dir), kv_cache_memory=KV,
                                                        served_model_name="tiny"))  # fmt: skip
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine)), base_url="http://t") as http:
            yield engine, http
    finally:
        await engine.shutdown()


def beams(llm, prompt: list[int], k: int, n: int) -> list:
    (out,) = llm.beam_search([prompt], BeamSearchParams(k, n))
    return out.sequences


async def test_the_async_search_is_the_offline_one(eos_case, served):  # noqa: F811
    llm, _, prompt, eos = eos_case
    engine, _ = served
    want = beams(llm, prompt, 3, 8)
    outs = [o async for o in engine.beam_search({"prompt_token_ids": prompt}, "b", BeamSearchParams(3, 8))]
    assert len(outs) == 1 and outs[0].finished and outs[0].prompt_token_ids == prompt
    got = outs[0].outputs
    assert [c.token_ids for c in got] == [s.tokens[len(prompt) :] for s in want]
    assert [c.cumulative_logprob for c in got] == pytest.approx([s.cum_logprob for s in want], abs=1e-4)
    assert [(c.finish_reason, c.stop_reason) for c in got] == [(s.finish_reason, s.stop_reason) for s in want]
    tok = llm.get_tokenizer()
    stopped = [c for c in got if c.finish_reason == "stop"]
    assert stopped and all(c.token_ids[-1] == eos and c.text == tok.decode(c.token_ids[:-1], skip_special_tokens=True) for c in stopped)
    assert all(len(c.logprobs) == len(c.token_ids) and c.token_ids[-1] in c.logprobs[-1] for c in got)
    assert not engine.engine.has_unfinished_requests()


async def test_completions_and_chat_use_beam_search(eos_case, served):  # noqa: F811
    llm, _, prompt, _ = eos_case
    engine, http = served
    want = beams(llm, prompt, 3, 8)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "n": 3, "use_beam_search": True, "return_token_ids": True}
    choices = (await http.post("/v1/completions", json=body)).json()["choices"]
    assert [c["token_ids"] for c in choices] == [s.tokens[len(prompt) :] for s in want]
    assert [c["finish_reason"] for c in choices] == [s.finish_reason for s in want]
    r = await http.post("/v1/completions", json={**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert sorted((c["index"], c["token_ids"]) for chunk in chunks for c in chunk["choices"]) == \
        [(i, c["token_ids"]) for i, c in enumerate(choices)]  # fmt: skip
    for bad in (0, 11):  # each step reads 2n logprobs: max_logprobs (20) allows n <= 10
        r = await http.post("/v1/completions", json={**body, "n": bad})
        assert r.status_code == 400 and "n (the beam width" in r.json()["error"]["message"]
    assert not engine.engine.has_unfinished_requests()


async def test_chat_uses_beam_search(tiny_dir):
    """(A model of SmolLM2's whole vocabulary: the chat template's tokens.)"""
    from vllmini import LLM

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), served_model_name="tiny"))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine)), base_url="http://t") as http:
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6, "n": 2,
                    "use_beam_search": True, "return_token_ids": True}  # fmt: skip
            out = (await http.post("/v1/chat/completions", json=chat)).json()
    finally:
        await engine.shutdown()
    prompt = out["prompt_token_ids"]
    want = beams(LLM(str(tiny_dir)), prompt, 2, 6)
    assert [c["token_ids"] for c in out["choices"]] == [s.tokens[len(prompt) :] for s in want]
    assert [c["message"]["content"] for c in out["choices"]] == [s.text[len(engine.engine.tokenizer.decode(prompt, skip_special_tokens=True)):] for s in want]


async def test_a_search_given_up_is_aborted(eos_case, served):  # noqa: F811
    llm, _, prompt, _ = eos_case
    engine, _ = served

    async def first():
        async for out in engine.beam_search({"prompt_token_ids": prompt}, "long", BeamSearchParams(4, 400)):
            return out

    task = asyncio.ensure_future(first())
    await asyncio.sleep(0.3)
    for _ in range(200):  # cancelled while a step's beams are queued or running (not between two steps)
        if engine.engine.has_unfinished_requests():
            break
        await asyncio.sleep(0.005)
    assert not task.done() and engine.engine.has_unfinished_requests()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    for _ in range(100):  # (the aborts are done at the engine's next step)
        if not engine.engine.has_unfinished_requests():
            break
        await asyncio.sleep(0.02)
    bm = engine.engine.block_manager
    assert not engine.engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks
