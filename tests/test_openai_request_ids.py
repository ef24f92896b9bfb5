"""Request ids and SageMaker's routes, as vLLM's server: an ``X-Request-Id`` header (else the body's
``request_id``) is the base of the engine request's id and the response's (``cmpl-<base>``...); an
id still running refuses a second request (400 naming it) without disturbing the first;
``--enable-request-id-headers`` puts ``X-Request-Id`` on every response; ``/ping`` answers as
``/health``; ``/invocations`` hands a body to the route whose request it is, in vLLM's order."""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from helpers import save_tiny_classifier
from vllmini import AsyncLLMEngine, EngineArgs
from vllmini.cli import build_parser
from vllmini.entrypoints.openai.api_server import build_app

HI = [{"role": "user", "content": "hi"}]
POOLING = dict(runner="pooling", kv_cache_memory=16 << 20, max_model_len=64, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def engine(tiny_dir):
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), kv_cache_memory=16 << 20))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def poolers(tiny_dir, tmp_path_factory, default_model_dir):
    """An embedding model (the tiny Llama) and a sequence classifier, each on a pooling engine."""
    classifier, _ = save_tiny_classifier("llama", tmp_path_factory.mktemp("inv_cls"), default_model_dir, 2, seed=5)
    engs = {name: AsyncLLMEngine.from_engine_args(EngineArgs(model=str(d), **POOLING))
            for name, d in (("embed", tiny_dir), ("classify", classifier))}  # fmt: skip
    yield engs
    for eng in engs.values():
        eng.shutdown()


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def stream_events(text: str) -> list:
    return [json.loads(e) for e in re.findall(r"^data: (.*)$", text, re.M) if e != "[DONE]"]


async def test_the_header_is_the_base_of_the_request_id_and_no_header_comes_back_by_default(engine):
    async with client(build_app(engine)) as c:
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"X-Request-Id": "trace-1"})
        assert r.status_code == 200 and r.json()["id"] == "cmpl-trace-1"
        assert "x-request-id" not in r.headers  # (off unless --enable-request-id-headers)
        r = await c.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2}, headers={"X-Request-Id": "t2"})
        assert r.json()["id"] == "chatcmpl-t2" and "x-request-id" not in r.headers
        streamed = await c.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2, "stream": True},
                                headers={"X-Request-Id": "t3"})  # fmt: skip
        assert {e["id"] for e in stream_events(streamed.text)} == {"chatcmpl-t3"}
        # the body's request_id (vLLM's field) is the base without a header; the header wins over it
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "request_id": "mine"})
        assert r.json()["id"] == "cmpl-mine"
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "request_id": "mine"},
                         headers={"X-Request-Id": "theirs"})  # fmt: skip
        assert r.json()["id"] == "cmpl-theirs"
        r = await c.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2})
        assert re.fullmatch(r"cmpl-[0-9a-f]{32}", r.json()["id"])


async def test_a_live_id_refuses_a_second_request_and_the_first_completes(engine):
    """The engine runs the request under the header's id; a second request with it, while the first
    runs, is a 400 naming it; the first goes on to its last token; the id is free again after."""
    body = {"prompt": "Once upon a time", "max_tokens": 96, "ignore_eos": True}
    async with client(build_app(engine)) as c:
        first = asyncio.ensure_future(c.post("/v1/completions", json=body, headers={"X-Request-Id": "dup"}))
        for _ in range(2000):
            if "cmpl-dup" in engine._streams:
                break
            await asyncio.sleep(0.002)
        assert "cmpl-dup" in engine._streams
        second = await c.post("/v1/completions", json={**body, "max_tokens": 2}, headers={"X-Request-Id": "dup"})
        assert second.status_code == 400 and "'cmpl-dup' is already in use" in second.json()["error"]["message"]
        assert not first.done()
        done = (await first).json()
        assert done["id"] == "cmpl-dup" and done["choices"][0]["finish_reason"] == "length"
        assert done["usage"]["completion_tokens"] == 96
        again = await c.post("/v1/completions", json={**body, "max_tokens": 2}, headers={"X-Request-Id": "dup"})
        assert again.status_code == 200 and again.json()["id"] == "cmpl-dup"


async def test_enable_request_id_headers_puts_the_id_on_every_response(engine):
    app = build_app(engine, api_key="k", enable_request_id_headers=True)
    key = {"Authorization": "Bearer k"}
    async with client(app) as c:
        mine = {**key, "X-Request-Id": "abc-123"}
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=mine)
        assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123" and r.json()["id"] == "cmpl-abc-123"
        streamed = await c.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2, "stream": True}, headers=mine)
        assert streamed.headers["x-request-id"] == "abc-123" and streamed.text.endswith("data: [DONE]\n\n")
        for refused in (await c.post("/v1/completions", json={"prompt": "hi", "temperature": -1}, headers=mine),
                        await c.post("/v1/completions", json={"prompt": "hi"}, headers={"X-Request-Id": "abc-123"}),
                        await c.get("/nowhere", headers=mine)):  # fmt: skip
            assert refused.status_code in (400, 401, 404) and refused.headers["x-request-id"] == "abc-123"
        fresh = [(await c.get("/health")).headers["x-request-id"] for _ in range(2)]
        assert all(re.fullmatch(r"[0-9a-f]{32}", h) for h in fresh) and fresh[0] != fresh[1]
    ns = build_parser().parse_args(["serve", "--enable-request-id-headers"])
    assert ns.enable_request_id_headers and not build_parser().parse_args(["serve"]).enable_request_id_headers


async def test_ping_answers_as_health(tiny_dir, engine):
    async with client(build_app(engine)) as c:
        assert [(await c.get("/ping")).status_code, (await c.post("/ping")).status_code] == [200, 200]
    dead = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), kv_cache_memory=4 << 20))
    app = build_app(dead)
    dead.shutdown()
    async with client(app) as c:
        statuses = [(await c.get("/health")).status_code, (await c.get("/ping")).status_code,
                    (await c.post("/ping")).status_code]  # fmt: skip
    assert statuses == [503, 503, 503]


async def test_invocations_dispatch_to_chat_and_completions_streaming_too(engine):
    async with client(build_app(engine)) as c:
        chat = {"messages": HI, "max_tokens": 4, "temperature": 0}
        r = await c.post("/invocations", json=chat, headers={"X-Request-Id": "sm-1"})
        assert r.status_code == 200 and r.json()["object"] == "chat.completion" and r.json()["id"] == "chatcmpl-sm-1"
        direct = (await c.post("/v1/chat/completions", json=chat)).json()["choices"][0]["message"]["content"]
        assert r.json()["choices"][0]["message"]["content"] == direct
        both = await c.post("/invocations", json={**chat, "prompt": "x"})  # chat comes first, as in vLLM
        assert both.json()["object"] == "chat.completion"
        r = await c.post("/invocations", json={"prompt": "The sky is", "max_tokens": 4, "temperature": 0})
        assert r.json()["object"] == "text_completion" and r.json()["id"].startswith("cmpl-")
        streamed = await c.post("/invocations", json={**chat, "stream": True})
        assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
        events = stream_events(streamed.text)
        assert streamed.text.endswith("data: [DONE]\n\n") and {e["object"] for e in events} == {"chat.completion.chunk"}
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == direct
        bad = await c.post("/invocations", json={"messages": HI, "temperature": -2})  # chat's own 400
        assert bad.status_code == 400 and "temperature" in bad.json()["error"]["message"]
        for body in ({"input": "x"}, {}, [1, 2]):
            refused = await c.post("/invocations", json=body)
            message = refused.json()["error"]["message"]
            assert refused.status_code == 400 and refused.json()["error"]["type"] == "BadRequestError"
            assert ("ChatCompletionRequest (messages), CompletionRequest (prompt)" in message) == isinstance(body, dict)
        assert (await c.post("/invocations", content=b"{not json")).status_code == 400


async def test_invocations_on_pooling_models_follow_vllms_order(poolers):
    async with client(build_app(poolers["embed"])) as c:
        r = await c.post("/invocations", json={"input": "hello"}, headers={"X-Request-Id": "e1"})
        direct = await c.post("/v1/embeddings", json={"input": "hello"}, headers={"X-Request-Id": "e2"})
        assert r.json()["id"] == "embd-e1" and direct.json()["id"] == "embd-e2"
        assert r.json()["data"][0]["embedding"] == direct.json()["data"][0]["embedding"]
        assert (await c.post("/invocations", json={"messages": HI})).json()["data"][0]["object"] == "embedding"
        rerank = (await c.post("/invocations", json={"query": "q", "documents": ["a", "b"]})).json()
        assert len(rerank["results"]) == 2 and rerank["id"].startswith("rerank-")
        score = (await c.post("/invocations", json={"text_1": "a", "text_2": ["b", "c"]})).json()
        assert [d["object"] for d in score["data"]] == ["score", "score"]
        refused = await c.post("/invocations", json={"prompt": "x"})  # no generating route on a pooling model
        message = refused.json()["error"]["message"]
        assert refused.status_code == 400 and "EmbeddingRequest (input | messages)" in message
        assert "ChatCompletionRequest" not in message and "PoolingRequest" in message
    async with client(build_app(poolers["classify"])) as c:
        r = (await c.post("/invocations", json={"input": ["good", "bad"]}, headers={"X-Request-Id": "c1"})).json()
        assert r["id"] == "classify-c1" and [d["num_classes"] for d in r["data"]] == [2, 2]
        pooled = (await c.post("/invocations", json={"messages": HI})).json()  # classify takes no messages: pooling
        assert pooled["id"].startswith("pool-") and pooled["data"][0]["object"] == "pooling"
