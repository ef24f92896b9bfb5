"""Bad input over HTTP, generated: every field of a completion or chat request, given values of
the wrong type, out of range or absurd (hypothesis), is answered 200 or a 400 whose message
names a field the body has; never a 500, and afterwards nothing is left queued or holding a
KV block and the server still answers."""
from __future__ import annotations

import asyncio

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_engine import assert_no_leaks
from vllmini import AsyncLLMEngine, EngineArgs
from vllmini.entrypoints.openai.api_server import build_app
from vllmini.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

# fields left to their fixed values: what the request is (and max_tokens, so that none runs long)
FIXED = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream"}
COMPLETION_FIELDS = sorted(f.name for f in msgspec.structs.fields(CompletionRequest) if f.name not in FIXED)
CHAT_FIELDS = sorted(f.name for f in msgspec.structs.fields(ChatCompletionRequest) if f.name not in FIXED)

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 5), st.sampled_from([2**31, -(2**63) - 1, 2**70, 10**6]),
    st.floats(allow_nan=False, allow_infinity=False, width=64), st.sampled_from([1e300, -1e300, 0.5, 1.5]),
    st.text(max_size=8), st.sampled_from(["", "auto", "none", "json_object", "token_id:1"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                      max_leaves=6)  # fmt: skip


def bodies(fields: list[str], fixed: dict) -> st.SearchStrategy[dict]:
    return st.builds(lambda extra, stream: {**fixed, **extra, "stream": stream},
                     st.dictionaries(st.sampled_from(fields), values, min_size=1, max_size=3), st.booleans())  # fmt: skip


@pytest.fixture(scope="module")
def served(tiny_dir):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), served_model_name="tiny", max_model_len=256))
    yield engine, build_app(engine)
    engine.shutdown()


def check(served, body: dict) -> None:
    engine, app = served

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            return await http.post(route, content=msgspec.json.encode(body), headers={"content-type": "application/json"})

    r = asyncio.run(post())
    assert r.status_code in (200, 400), (r.status_code, r.text, body)
    if r.status_code == 400:
        message = r.json()["error"]["message"]
        assert any(key in message for key in body), (message, body)
    elif body["stream"]:
        assert r.text.rstrip().endswith("data: [DONE]"), (r.text[-300:], body)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bodies(COMPLETION_FIELDS, {"model": "tiny", "prompt": "hi there", "max_tokens": 2}))
def test_completion_fields_fuzzed(served, body):
    check(served, body)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bodies(CHAT_FIELDS, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
def test_chat_fields_fuzzed(served, body):
    check(served, body)


def test_nothing_is_left_behind(served):
    engine, _ = served
    assert_no_leaks(engine)
    check(served, {"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": False})
