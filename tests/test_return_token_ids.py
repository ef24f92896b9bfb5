"""vLLM's server fields ``return_token_ids`` (each choice's token ids and the prompt's, in a stream
the new ids of each chunk and the prompt's in the first) and ``return_tokens_as_token_ids``
(logprobs name tokens ``"token_id:<id>"``), on completions and chat."""
from __future__ import annotations

import json

import httpx
import pytest

from vllmini import LLM, AsyncLLMEngine, EngineArgs, SamplingParams
from vllmini.entrypoints.openai.api_server import build_app

PROMPTS = [[5, 17, 99, 342, 7], [8, 8, 1000, 3]]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir))


@pytest.fixture
async def http(tiny_dir):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), served_model_name="tiny"))
    try:
        app = build_app(engine, reasoning_parser="qwen3")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            yield client
    finally:
        await engine.shutdown()


async def events(http: httpx.AsyncClient, route: str, body: dict) -> list[dict]:
    async with http.stream("POST", route, json={**body, "stream": True}) as r:
        lines = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


async def test_completions_return_token_ids_whole_and_streamed(http, llm):
    params = SamplingParams(temperature=0.8, seed=4, max_tokens=6, n=2, ignore_eos=True)
    want = [[list(c.token_ids) for c in o.outputs] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                                          use_tqdm=False)]  # fmt: skip
    body = {"model": "tiny", "prompt": PROMPTS, "max_tokens": 6, "n": 2, "temperature": 0.8, "seed": 4,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    choices = (await http.post("/v1/completions", json=body)).json()["choices"]
    assert [c["token_ids"] for c in choices] == [ids for per_prompt in want for ids in per_prompt]
    assert [c["prompt_token_ids"] for c in choices] == [p for p in PROMPTS for _ in range(2)]
    streamed: dict[int, list[int]] = {}
    firsts: dict[int, list[int]] = {}
    for chunk in await events(http, "/v1/completions", body):
        for c in chunk["choices"]:
            streamed.setdefault(c["index"], []).extend(c["token_ids"])
            if c["prompt_token_ids"] is not None:  # (null in the other chunks, as vLLM's)
                assert c["index"] not in firsts  # the first chunk of a choice only
                firsts[c["index"]] = c["prompt_token_ids"]
    assert [streamed[i] for i in range(4)] == [c["token_ids"] for c in choices]
    assert [firsts[i] for i in range(4)] == [c["prompt_token_ids"] for c in choices]
    plain = (await http.post("/v1/completions", json={**body, "return_token_ids": None})).json()["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None  # (vLLM's nulls)


async def test_chat_returns_token_ids_whole_and_streamed(http, llm):
    """Also through the reasoning parser, whose stream skips chunks with no text to show: their
    token ids still come."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "continue_final_message": True, "add_generation_prompt": False, "return_token_ids": True}  # fmt: skip
    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False,
                    continue_final_message=True, add_generation_prompt=False)[0]  # fmt: skip
    whole = (await http.post("/v1/chat/completions", json=body)).json()
    assert whole["prompt_token_ids"] == list(want.prompt_token_ids)
    assert whole["choices"][0]["token_ids"] == list(want.outputs[0].token_ids)
    chunks = await events(http, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == list(want.prompt_token_ids)
    assert all("prompt_token_ids" not in c for c in chunks[1:])  # (the role chunk's only, as vLLM's)
    assert [t for c in chunks[1:] for ch in c["choices"] for t in ch["token_ids"]] == list(want.outputs[0].token_ids)
    assert (await http.post("/v1/chat/completions", json={**body, "return_token_ids": False})).json()["prompt_token_ids"] is None
    held = await events(http, "/v1/chat/completions", {**body, "max_tokens": 3, "logit_bias": {"9617": 100}})  # "</" x 3
    assert [t for c in held[1:] for ch in c["choices"] for t in ch["token_ids"]] == [9617] * 3  # the first "</" is held back


async def test_logprobs_name_tokens_by_id(http):
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0, "logprobs": 2,
            "return_tokens_as_token_ids": True, "return_token_ids": True}  # fmt: skip
    choice = (await http.post("/v1/completions", json=body)).json()["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(k.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for k in top)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True, "return_token_ids": True}  # fmt: skip
    c = (await http.post("/v1/chat/completions", json=chat)).json()["choices"][0]
    assert [e["token"] for e in c["logprobs"]["content"]] == [f"token_id:{t}" for t in c["token_ids"]]
    assert all(e["bytes"] == list(e["token"].encode()) and all(t["token"].startswith("token_id:") for t in e["top_logprobs"])
               for e in c["logprobs"]["content"])  # fmt: skip
