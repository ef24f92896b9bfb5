"""Server-wide options, with vLLM's flags. CORS (--allowed-origins, --allowed-methods, --allowed-headers,
--allow-credentials): off unless origins are given; then a browser's preflight is answered before the API
key check, and the key's refusals carry the headers a page needs to read them. --response-role and
--return-tokens-as-token-ids."""
from __future__ import annotations

import json

import httpx
import pytest

from vllmini import AsyncLLMEngine, EngineArgs
from vllmini.cli import main
from vllmini.entrypoints.openai.api_server import build_app
from vllmini.entrypoints.openai.cors import CorsOptions, cors_from_flags

UI = "http://localhost:3000"
PREFLIGHT = {"Origin": UI, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip
KEY = {"Authorization": "Bearer s3cret"}


@pytest.fixture(scope="module")
def engine(tiny_dir):
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), kv_cache_memory=16 << 20))
    yield eng
    eng.shutdown()


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def test_without_allowed_origins_no_cors_headers_are_sent(engine):
    async with client(build_app(engine)) as c:
        assert "access-control-allow-origin" not in (await c.options("/v1/chat/completions", headers=PREFLIGHT)).headers
        plain = await c.get("/v1/models", headers={"Origin": UI})
        assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


async def test_allowed_origins_are_answered_before_the_api_key(engine):
    app = build_app(engine, api_key="s3cret", cors=CorsOptions((UI,)))
    async with client(app) as c:
        pre = await c.options("/v1/chat/completions", headers=PREFLIGHT)  # a browser sends no key here
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == UI
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        refused = await c.get("/v1/models", headers={"Origin": UI})  # no key: 401 the page can read
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == UI
        ok = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"Origin": UI, **KEY})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == UI
        other = await c.options("/v1/chat/completions", headers={**PREFLIGHT, "Origin": "http://elsewhere.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


async def test_methods_headers_and_credentials_are_as_given(engine):
    cors = cors_from_flags(f'["{UI}"]', '["POST"]', '["content-type"]', True)
    async with client(build_app(engine, cors=cors)) as c:
        pre = await c.options("/v1/completions", headers={**PREFLIGHT, "Access-Control-Request-Headers": "content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-credentials"] == "true"
        assert pre.headers["access-control-allow-methods"].split(", ") == ["POST"]
        denied = await c.options("/v1/completions", headers=PREFLIGHT)  # asks for authorization too
        assert denied.status_code == 400


def test_bad_cors_options_are_refused_by_name():
    with pytest.raises(ValueError, match="allow_credentials with allowed_origins"):
        CorsOptions(("*",), allow_credentials=True)
    with pytest.raises(ValueError, match="allowed_origins must be a non-empty list"):
        CorsOptions(())
    with pytest.raises(ValueError, match="allowed_headers must be"):
        CorsOptions((UI,), allowed_headers="content-type")
    with pytest.raises(ValueError, match="--allowed-methods must be a JSON list"):
        cors_from_flags(f'["{UI}"]', "POST", None, False)
    with pytest.raises(ValueError, match="need --allowed-origins"):
        cors_from_flags(None, None, None, True)
    assert cors_from_flags(None, None, None, False) is None


def test_serve_refuses_bad_cors_flags_before_loading_the_model(capsys):
    assert main(["serve", "--allowed-origins", "http://localhost:3000"]) == 2
    assert "--allowed-origins must be a JSON list" in capsys.readouterr().err


async def test_the_response_role_and_the_role_of_a_continued_message(engine):
    app = build_app(engine, response_role="bot")
    hi = [{"role": "user", "content": "hi"}]
    async with client(app) as c:
        whole = (await c.post("/v1/chat/completions", json={"messages": hi, "max_tokens": 2})).json()
        assert whole["choices"][0]["message"]["role"] == "bot"
        streamed = await c.post("/v1/chat/completions", json={"messages": hi, "max_tokens": 2, "stream": True})
        first = json.loads(streamed.text.split("data: ")[1])
        assert first["choices"][0]["delta"]["role"] == "bot"
        # no generation prompt: the answer continues the last message, in its role (vLLM's rule)
        body = {"messages": hi, "max_tokens": 2, "add_generation_prompt": False}
        assert (await c.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]["role"] == "user"
        said = [*hi, {"role": "assistant", "content": "Well,"}]
        body = {"messages": said, "max_tokens": 2, "add_generation_prompt": False, "continue_final_message": True, "echo": True}
        message = (await c.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
        assert message["role"] == "assistant" and message["content"].startswith("Well,")
    with pytest.raises(ValueError, match="response_role must be a non-empty role name"):
        build_app(engine, response_role="")


async def test_tokens_as_token_ids_by_default_unless_a_request_says(engine):
    async with client(build_app(engine, return_tokens_as_token_ids=True)) as c:
        body = {"prompt": "hi", "max_tokens": 3, "logprobs": 1}
        tokens = (await c.post("/v1/completions", json=body)).json()["choices"][0]["logprobs"]["tokens"]
        assert len(tokens) == 3 and all(t.startswith("token_id:") for t in tokens)
        own = (await c.post("/v1/completions", json={**body, "return_tokens_as_token_ids": False})).json()
        assert not any(t.startswith("token_id:") for t in own["choices"][0]["logprobs"]["tokens"])
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True}
        content = (await c.post("/v1/chat/completions", json=chat)).json()["choices"][0]["logprobs"]["content"]
        assert all(entry["token"].startswith("token_id:") for entry in content)
    async with client(build_app(engine)) as c:  # (the default: text)
        tokens = (await c.post("/v1/completions", json=body)).json()["choices"][0]["logprobs"]["tokens"]
        assert not any(t.startswith("token_id:") for t in tokens)


def _sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("forced", [False, True])
async def test_force_include_usage(engine, forced):
    """--enable-force-include-usage (vLLM's): every stream ends with a usage chunk, even unasked;
    continuous usage still needs include_usage (or the flag), as in vLLM's should_include_usage."""
    base = {"max_tokens": 3, "ignore_eos": True, "stream": True}
    async with client(build_app(engine, enable_force_include_usage=forced)) as c:
        for url, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            chunks = _sse((await c.post(url, json={**base, **body})).text)
            assert ("usage" in chunks[-1] and chunks[-1]["usage"]["completion_tokens"] == 3) is forced
            assert chunks[-1]["choices"] == [] if forced else chunks[-1]["choices"]
            continuous = {"stream_options": {"continuous_usage_stats": True}}
            chunks = _sse((await c.post(url, json={**base, **body, **continuous})).text)
            assert all(("usage" in chunk) is forced for chunk in chunks)
