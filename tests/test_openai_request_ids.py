"""Request ids, as vLLM's server: an ``X-Request-Id`` header (else the body's ``request_id``) is the
base of the engine request's id and the response's (``cmpl-<base>``...); an id still running
refuses a second request (400 naming it) without disturbing the first; ``--enable-request-id-headers``
puts ``X-Request-Id`` on every response."""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from vllmini import AsyncLLMEngine, EngineArgs
from vllmini.cli import build_parser
from vllmini.entrypoints.openai.api_server import build_app

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine(tiny_dir):
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), kv_cache_memory=16 << 20))
    yield eng
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
