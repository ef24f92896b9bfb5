"""The keys of the server's answers as vLLM 0.32's OpenAI server sends them, found by sending the
same requests to both (the default model, fp32) and diffing the JSON key sets: the fields vLLM
has nothing for it sends as null (OpenAI's ``refusal``, ``service_tier``, the usage details...,
and its own ``kv_transfer_params``, ``token_ids``...), a ``system_fingerprint`` on whole answers
and on a stream's last chunk, and a stream's chunks share one ``created``. A stream's finish
comes on the chunk of its last token (an EOS's delta is ``{"content": ""}``), never on a chunk of
its own. A message's ``content: null`` is a 400 unless it is an assistant's (or a function's).
The expected keys are vLLM's, written out: these tests need neither vLLM nor the network."""
from __future__ import annotations

import re

import httpx
import pytest

from test_openai_server import events, wait_idle
from vllmini import AsyncLLMEngine, EngineArgs
from vllmini.entrypoints.openai.api_server import build_app

NAME = "tiny"
HI = [{"role": "user", "content": "hi"}]
HEAD = {"id", "object", "created", "model", "choices"}
FINGERPRINT = re.compile(r"vllmini-[0-9.]+-[0-9a-f]{8}")
# vLLM 0.32's keys (``chat``: the default model's answer to HI, max_tokens 5, temperature 0)
CHAT = HEAD | {"service_tier", "system_fingerprint", "usage", "prompt_logprobs", "prompt_token_ids", "prompt_text",
               "kv_transfer_params", "ec_transfer_params", "metrics"}  # fmt: skip
CHAT_CHOICE = {"index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids", "routed_experts"}
MESSAGE = {"role", "content", "refusal", "annotations", "audio", "function_call", "reasoning"}
USAGE = {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details", "completion_tokens_details"}
COMPLETION = HEAD | {"service_tier", "system_fingerprint", "usage", "kv_transfer_params", "ec_transfer_params", "metrics"}
COMPLETION_CHOICE = {"index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids", "prompt_logprobs",
                     "prompt_token_ids", "routed_experts"}  # fmt: skip
ROLE_CHUNK_CHOICE = {"index", "delta", "logprobs", "finish_reason"}
CHUNK_CHOICE = ROLE_CHUNK_CHOICE | {"token_ids"}
COMPLETION_CHUNK_CHOICE = {"index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids", "token_ids"}
COUNTS = {"prompt_tokens", "completion_tokens", "total_tokens"}


@pytest.fixture(scope="module")
def engine(tiny_dir):
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), kv_cache_memory=32 << 20,
                                                     served_model_name=NAME))  # fmt: skip
    yield eng
    eng.shutdown()


@pytest.fixture
def http(engine):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, NAME)), base_url="http://test")


async def test_whole_answers_have_vllms_keys_with_its_nulls(http, engine):
    body = {"model": NAME, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    chat = (await http.post("/v1/chat/completions", json={**body, "messages": HI})).json()
    assert set(chat) == CHAT and set(chat["choices"][0]) == CHAT_CHOICE and set(chat["usage"]) == USAGE
    assert set(chat["choices"][0]["message"]) == MESSAGE  # (no tool_calls: vLLM leaves out an empty list)
    nulls = {k for k, v in {**chat, **chat["choices"][0], **chat["choices"][0]["message"], **chat["usage"]}.items()
             if v is None}  # fmt: skip
    assert nulls == {"service_tier", "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params",
                     "ec_transfer_params", "metrics", "logprobs", "stop_reason", "token_ids", "routed_experts",
                     "refusal", "annotations", "audio", "function_call", "reasoning", "prompt_tokens_details",
                     "completion_tokens_details"}  # fmt: skip
    assert FINGERPRINT.fullmatch(chat["system_fingerprint"])
    completion = (await http.post("/v1/completions", json={**body, "prompt": ["Hello", "Hi"], "logprobs": 1})).json()
    assert set(completion) == COMPLETION and set(completion["usage"]) == USAGE
    assert all(set(c) == COMPLETION_CHOICE for c in completion["choices"])
    assert completion["system_fingerprint"] == chat["system_fingerprint"]  # (one server's)
    await wait_idle(engine)


@pytest.mark.parametrize("options", [None, {"include_usage": True}, {"include_usage": True,
                                                                     "continuous_usage_stats": True}])
async def test_a_chat_stream_has_vllms_keys_and_finishes_on_its_last_token(http, engine, options):
    """The role chunk carries the prompt's ids and text (null); each token's chunk its ids (null);
    the last token's chunk the finish, its stop_reason and (without a usage chunk) the fingerprint;
    with include_usage the usage chunk has it, no nulls; with continuous_usage_stats each chunk has
    its usage, chat's ``completion_tokens_details`` null among it."""
    body = {"model": NAME, "messages": HI, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "stream": True,
            **({"stream_options": options} if options else {})}  # fmt: skip
    chunks = events((await http.post("/v1/chat/completions", json=body)).text)
    usage_chunk = chunks.pop() if options else None
    role, *tokens = chunks
    continuous = {"usage"} if options and options.get("continuous_usage_stats") else set()
    assert set(role) == HEAD | {"prompt_token_ids", "prompt_text"} | continuous
    assert role["prompt_token_ids"] is None and role["prompt_text"] is None
    assert set(role["choices"][0]) == ROLE_CHUNK_CHOICE and role["choices"][0]["delta"] == {"role": "assistant",
                                                                                           "content": ""}
    assert len(tokens) == 3 and [c["choices"][0]["finish_reason"] for c in tokens] == [None, None, "length"]
    for chunk in tokens[:-1]:
        assert set(chunk) == HEAD | continuous and set(chunk["choices"][0]) == CHUNK_CHOICE
        assert chunk["choices"][0]["token_ids"] is None
    last = tokens[-1]
    assert set(last["choices"][0]) == CHUNK_CHOICE | {"stop_reason"} and last["choices"][0]["delta"]["content"]
    assert set(last) == HEAD | continuous | (set() if options else {"system_fingerprint"})
    assert len({c["created"] for c in chunks}) == 1  # (one request's: vLLM's)
    if continuous:
        assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2, 3]
        assert all(set(c["usage"]) == COUNTS | {"completion_tokens_details"} for c in chunks)
    if usage_chunk is not None:
        assert set(usage_chunk) == HEAD | {"usage", "system_fingerprint"} and set(usage_chunk["usage"]) == COUNTS
        assert FINGERPRINT.fullmatch(usage_chunk["system_fingerprint"]) and usage_chunk["created"] == role["created"]
    await wait_idle(engine)


@pytest.mark.parametrize("options", [None, {"include_usage": True, "continuous_usage_stats": True}])
async def test_a_completion_stream_has_vllms_keys(http, engine, options):
    body = {"model": NAME, "prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True, "stream": True,
            **({"stream_options": options} if options else {})}  # fmt: skip
    chunks = events((await http.post("/v1/completions", json=body)).text)
    usage_chunk = chunks.pop() if options else None
    continuous = {"usage"} if options else set()
    assert [set(c) for c in chunks] == [HEAD | continuous] * 2 + [HEAD | continuous | (set() if options else
                                                                                       {"system_fingerprint"})]
    assert all(set(c["choices"][0]) == COMPLETION_CHUNK_CHOICE for c in chunks)
    assert all(c["choices"][0]["token_ids"] is None and c["choices"][0]["prompt_token_ids"] is None for c in chunks)
    if usage_chunk is not None:  # (a completion chunk's usage has no completion_tokens_details)
        assert all(set(c["usage"]) == COUNTS for c in chunks + [usage_chunk])
        assert set(usage_chunk) == HEAD | {"usage", "system_fingerprint"}
    assert len({c["created"] for c in chunks}) == 1
    await wait_idle(engine)


@pytest.mark.parametrize("role", ["user", "system", "developer", "tool"])
async def test_content_null_is_a_400_naming_the_field_as_vllm(http, engine, role):
    """vLLM's pydantic message types refuse it; ``param`` is the first of their errors' locations."""
    messages = [{"role": "user", "content": "hi"}, {"role": role, "content": None, "tool_call_id": "a"}]
    r = await http.post("/v1/chat/completions", json={"model": NAME, "max_tokens": 2, "messages": messages})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "body.messages.1.ChatCompletionDeveloperMessageParam.content"
    assert "messages[1].content" in error["message"] and "null" in error["message"]
    r = await http.post("/v1/chat/completions", json={"model": NAME, "max_tokens": 2, "messages": [
        {"role": "user", "content": 5}]})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.messages.0.ChatCompletionDeveloperMessageParam.content"
    assert (await http.post("/tokenize", json={"model": NAME, "messages": messages})).status_code == 400
    await wait_idle(engine)


async def test_content_null_of_an_assistant_or_a_function_and_no_content_at_all_are_taken_as_vllm(http, engine):
    for messages in ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                      {"role": "user", "content": "hi"}],
                     [{"role": "user", "content": "hi"}, {"role": "function", "content": None, "name": "f"}],
                     [{"role": "user"}]):  # fmt: skip
        r = await http.post("/v1/chat/completions", json={"model": NAME, "max_tokens": 2, "messages": messages})
        assert r.status_code == 200, (messages, r.text)
    await wait_idle(engine)
