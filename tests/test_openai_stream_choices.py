"""Streams of n > 1 choices (and several prompts) send one choice a chunk, as vLLM's server: each
chunk's ``choices`` holds exactly one entry with its ``index``, the choices of one engine step in
the engine's order; put back together per index they are the whole response, each index
finishing once, and the usage chunk stays last (``choices`` empty)."""
from __future__ import annotations

import json

import httpx
import pytest

from test_openai_server import KV, NAME, events, wait_idle
from test_openai_server_tools import CALL, HERMES, MESSAGES, PARIS, TOOLS, forced
from vllmini import AsyncLLMEngine, EngineArgs
from vllmini.entrypoints.openai.api_server import build_app

USAGE = {"stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def engine(tiny_dir):
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), kv_cache_memory=KV, served_model_name=NAME))
    yield eng
    eng.shutdown()


def http(engine, **options) -> httpx.AsyncClient:
    """A client of the app (build_app's keywords: parsers), in process."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, NAME, **options)),
                             base_url="http://test")  # fmt: skip


async def whole_and_streamed(h: httpx.AsyncClient, path: str, body: dict) -> tuple[dict, list[dict], dict]:
    """(the whole response, the streamed chunks before the usage chunk, the usage chunk); checks
    each of those chunks holds one choice, and the usage chunk none."""
    whole = (await h.post(path, json=body)).json()
    *chunks, last = events((await h.post(path, json={**body, "stream": True, **USAGE})).text)
    for chunk in chunks:
        assert len(chunk["choices"]) == 1, chunk  # (vLLM's: one choice a chunk)
        assert "usage" not in chunk
    # (the usage chunk leaves out the details the whole response has as null, as vLLM's)
    assert last["choices"] == [] and last["usage"] == {k: v for k, v in whole["usage"].items() if v is not None}
    return whole, chunks, last


def finishes(chunks: list[dict]) -> dict[int, str]:
    """Each index's finish_reason; checks none is sent twice."""
    got: dict[int, str] = {}
    for chunk in chunks:
        (c,) = chunk["choices"]
        if c["finish_reason"] is not None:
            assert c["index"] not in got, f"choice {c['index']} finished twice"
            got[c["index"]] = c["finish_reason"]
    return got


def chat_choices(chunks: list[dict]) -> dict[int, dict]:
    """Per index what a client puts together: role, content, reasoning, tool calls, logprobs,
    token ids."""
    got: dict[int, dict] = {}
    for chunk in chunks:
        (c,) = chunk["choices"]
        delta, mine = c["delta"], got.setdefault(c["index"], {"content": "", "reasoning": "", "calls": {},
                                                              "logprobs": [], "token_ids": []})  # fmt: skip
        if "role" in delta:
            assert "role" not in mine and not mine["content"], "the role is a choice's first delta"
            mine["role"] = delta["role"]
        mine["content"] += delta.get("content") or ""
        mine["reasoning"] += delta.get("reasoning") or ""
        for call in delta.get("tool_calls") or []:
            name = call["function"].get("name")
            if name:
                mine["calls"][call["index"]] = [name, call["function"].get("arguments") or ""]
            else:
                mine["calls"][call["index"]][1] += call["function"]["arguments"]
        mine["logprobs"] += (c.get("logprobs") or {}).get("content") or []
        mine["token_ids"] += c.get("token_ids") or []
    return got


async def test_a_chat_stream_of_n_choices_sends_one_choice_a_chunk(engine):
    body = {"model": NAME, "messages": [{"role": "user", "content": "Name a colour."}], "n": 3, "max_tokens": 6,
            "temperature": 1.0, "seed": 3, "ignore_eos": True, "logprobs": True, "top_logprobs": 2,
            "return_token_ids": True}  # fmt: skip
    async with http(engine) as h:
        whole, chunks, _ = await whole_and_streamed(h, "/v1/chat/completions", body)
    # first the role of each choice, a chunk each (each with the prompt's token ids, as vLLM's)
    assert [c["choices"][0]["index"] for c in chunks[:3]] == [0, 1, 2]
    assert all(c["choices"][0]["delta"]["role"] == "assistant" for c in chunks[:3])
    assert all(c["prompt_token_ids"] == whole["prompt_token_ids"] for c in chunks[:3])
    # then a chunk per choice each step, in the engine's order: the three decode side by side
    assert [c["choices"][0]["index"] for c in chunks[3:]] == [0, 1, 2] * 6
    got = chat_choices(chunks)
    assert sorted(got) == [0, 1, 2] and finishes(chunks) == {0: "length", 1: "length", 2: "length"}
    for choice in whole["choices"]:
        mine = got[choice["index"]]
        assert mine["role"] == choice["message"]["role"] and mine["content"] == choice["message"]["content"]
        assert mine["token_ids"] == choice["token_ids"]  # seeded: the same samples
        assert [(t["token"], t["top_logprobs"]) for t in mine["logprobs"]] == \
            [(t["token"], t["top_logprobs"]) for t in choice["logprobs"]["content"]]  # fmt: skip
    await wait_idle(engine)


async def test_a_completion_stream_of_n_choices_and_prompts_sends_one_choice_a_chunk(engine):
    """(best_of: vLLM's V1 takes it equal to n only.)"""
    body = {"model": NAME, "prompt": ["The capital of France is", "Once upon a time"], "n": 3, "best_of": 3,
            "max_tokens": 5, "temperature": 0.8, "seed": 11, "ignore_eos": True, "logprobs": 1, "return_token_ids": True}  # fmt: skip
    async with http(engine) as h:
        whole, chunks, _ = await whole_and_streamed(h, "/v1/completions", body)
    texts, logprobs, token_ids, prompts = {}, {}, {}, {}
    for chunk in chunks:
        (c,) = chunk["choices"]
        i = c["index"]
        texts[i] = texts.get(i, "") + c["text"]
        logprobs[i] = logprobs.get(i, []) + c["logprobs"]["token_logprobs"]
        token_ids[i] = token_ids.get(i, []) + c["token_ids"]
        if c["prompt_token_ids"] is not None:  # (null in the other chunks, as vLLM's)
            assert i not in prompts, "the prompt's ids come with a choice's first chunk only"
            prompts[i] = c["prompt_token_ids"]
    assert sorted(texts) == list(range(6)) and sorted(prompts) == list(range(6))  # prompt * n + completion
    assert finishes(chunks) == {i: "length" for i in range(6)}
    for c in whole["choices"]:
        assert texts[c["index"]] == c["text"] and token_ids[c["index"]] == c["token_ids"]  # seeded
        assert logprobs[c["index"]] == pytest.approx(c["logprobs"]["token_logprobs"], abs=1e-4)
    assert prompts[0] == prompts[2] != prompts[3] == prompts[5]
    await wait_idle(engine)


@pytest.mark.parametrize("text", ["<think>I need the weather tool.</think>Let me check.\n" + CALL,
                                  "<think>Sunny days.</think>It is sunny."])  # fmt: skip
async def test_reasoning_content_and_tool_call_deltas_of_n_choices_come_a_choice_a_chunk(engine, text):
    body = {"model": NAME, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 200, **forced(text), "n": 3,
            "temperature": 1.0, "top_k": 1}  # (greedy refuses n > 1; one choice of text: the grammar allows no other)
    async with http(engine, reasoning_parser="qwen3", **HERMES) as h:
        whole, chunks, _ = await whole_and_streamed(h, "/v1/chat/completions", body)
    got = chat_choices(chunks)
    assert finishes(chunks) == {c["index"]: c["finish_reason"] for c in whole["choices"]}
    for choice in whole["choices"]:
        message, mine = choice["message"], got[choice["index"]]
        assert (mine["reasoning"], mine["content"]) == (message["reasoning"], message["content"])
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
        assert [tuple(mine["calls"][i]) for i in sorted(mine["calls"])] == calls
    if CALL in text:
        assert {c["finish_reason"] for c in whole["choices"]} == {"tool_calls"}
        assert all(json.loads(c["message"]["tool_calls"][0]["function"]["arguments"]) == PARIS for c in whole["choices"])
    await wait_idle(engine)
