"""Answers as vLLM 0.32's OpenAI server gives them, where a differential run against it (the same
requests to both, the default model, fp32) found vllmini's different: ``error.param``, the legacy
completion logprobs (the sampled token among the top ones), ``echo`` with ``max_tokens=0``, the echoed
stream chunk's prompt ids, ``logprob_token_ids`` without ``logprobs``, ``prompt_logprobs=0`` streamed,
and the model cards; and (below) the keys of its answers. The expected values are vLLM's, written
out: these tests need neither vLLM nor the network."""
from __future__ import annotations

import re

import httpx
import pytest

from test_openai_server import events, wait_idle
from vllmini import AsyncLLMEngine, EngineArgs
from vllmini.entrypoints.openai.api_server import build_app

NAME = "tiny"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine(tiny_dir):
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), kv_cache_memory=32 << 20,
                                                     served_model_name=NAME))  # fmt: skip
    yield eng
    eng.shutdown()


@pytest.fixture
def http(engine):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, NAME)), base_url="http://test")


# (route, body, vLLM's error.param); None: vLLM names no field there
PARAMS = [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -2}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "x", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 5000}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": "x " * 2000}, "input_tokens"),
    ("/v1/completions", {"prompt": "x", "logprob_token_ids": [5]}, "logprob_token_ids"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "a"}, "body.max_tokens"),  # (vLLM's pydantic loc)
    ("/v1/completions", {"prompt": "x", "seed": "x"}, "body.seed"),
    ("/v1/completions", {"prompt": "x", "model": "zz"}, "model"),
    ("/v1/chat/completions", {"messages": "hi"}, "body.messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprob_token_ids": [5]}, "logprob_token_ids"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": []}, "tools"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "bogus",
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": {"type": "function", "function": {"name": "g"}},
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "xml"}}, "body.response_format.type"),
    ("/v1/chat/completions", {"messages": MESSAGES, "model": "zz"}, "model"),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": 0, "n": 2}, None),
]


@pytest.mark.parametrize("path, body, param", PARAMS, ids=[f"{p[0][4:]}-{p[2]}-{i}" for i, p in enumerate(PARAMS)])
async def test_an_error_names_its_field_in_param_as_vllm(http, engine, path, body, param):
    r = await http.post(path, json={"max_tokens": 2, **body})
    error = r.json()["error"]
    assert r.status_code == (404 if param == "model" else 400) and error["param"] == param, r.text
    if param == "model":
        assert error["message"] == f"The model `zz` does not exist. Valid aliases: {NAME}."
    await wait_idle(engine)


async def test_completion_top_logprobs_hold_the_chosen_token_too_as_vllm(http, engine):
    """OpenAI's legacy logprobs (vLLM's): the chosen token and the ``logprobs`` most likely, so up to
    logprobs + 1 entries; with 0 the chosen token alone (it was an empty dict)."""
    for logprobs in (0, 1, 2):
        body = {"prompt": "The sky is", "max_tokens": 12, "temperature": 1.5, "seed": 1, "logprobs": logprobs}
        lp = (await http.post("/v1/completions", json=body)).json()["choices"][0]["logprobs"]
        for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert next(iter(top)) == token and top[token] == pytest.approx(logprob)  # (first, as vLLM's dict)
            assert logprobs <= len(top) <= logprobs + 1 and (len(top) == logprobs + 1 or logprob == max(top.values()))
    body = {"prompt": "The sky is", "max_tokens": 2, "temperature": 0, "logprobs": 0, "echo": True}
    lp = (await http.post("/v1/completions", json=body)).json()["choices"][0]["logprobs"]
    assert lp["top_logprobs"][0] is None  # (the first prompt token has none)
    assert all(list(top) == [token] for token, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:]))
    await wait_idle(engine)


async def test_echo_with_zero_max_tokens_returns_the_prompt_alone_as_vllm(http, engine):
    """vLLM generates one token (usage counts it) and returns only the prompt, with its logprobs."""
    prompt = "The capital of France is"
    ids = (await http.post("/tokenize", json={"prompt": prompt})).json()["tokens"]
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    r = await http.post("/v1/completions", json=body)
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    assert r.status_code == 200 and choice["text"] == prompt, r.text
    assert len(choice["logprobs"]["tokens"]) == len(ids) and choice["logprobs"]["token_logprobs"][0] is None
    assert usage == {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1,
                     "prompt_tokens_details": None, "completion_tokens_details": None}
    assert len(choice["prompt_logprobs"]) == len(ids)  # (echo with logprobs asked for them: vLLM returns them)
    stream = await http.post("/v1/completions", json={**body, "stream": True})
    chunks = events(stream.text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == prompt
    assert chunks[0]["choices"][0]["prompt_token_ids"] == ids  # (vLLM's echoed chunk carries them)
    for bad in ({"max_tokens": 0}, {"max_tokens": 0, "echo": True, "logprobs": 1, "logprob_token_ids": [5]}):
        r = await http.post("/v1/completions", json={"prompt": prompt, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] in ("max_tokens", "logprob_token_ids"), r.text
    await wait_idle(engine)


async def test_prompt_logprobs_zero_may_be_streamed_as_vllm(http, engine):
    """vLLM refuses only prompt_logprobs > 0 (or -1) with stream=true; 0 streams as usual."""
    for path, extra in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": MESSAGES})):
        r = await http.post(path, json={**extra, "max_tokens": 2, "stream": True, "prompt_logprobs": 0})
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
    await wait_idle(engine)


async def test_model_cards_are_vllms(http):
    card = (await http.get("/v1/models")).json()["data"][0]
    assert card["owned_by"] == "vllm" and card["id"] == NAME
    (permission,) = card["permission"]
    assert permission["id"].startswith("modelperm-") and permission["object"] == "model_permission"
    assert {k: v for k, v in permission.items() if k not in ("id", "created")} == {
        "object": "model_permission", "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
        "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
        "group": None, "is_blocking": False}  # fmt: skip


async def test_echo_takes_prompt_logprobs_too_as_vllm(http, engine):
    """vLLM takes both (it was a 400 here): the choice's prompt_logprobs are the request's."""
    body = {"prompt": "The capital of France is", "max_tokens": 2, "echo": True, "prompt_logprobs": 1}
    r = await http.post("/v1/completions", json=body)
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["text"].startswith(body["prompt"]) and choice["logprobs"] is None, r.text
    assert choice["prompt_logprobs"][0] is None and all(1 <= len(p) <= 2 for p in choice["prompt_logprobs"][1:])
    await wait_idle(engine)


async def test_named_template_switches_win_over_chat_template_kwargs(http, engine):
    """vLLM 0.32's server merges chat_template_kwargs under add_generation_prompt / continue_final_message
    (merge_kwargs), as LLM.chat does: the kwargs' copy of a switch is overridden by the request's field."""
    messages = [{"role": "user", "content": "hi"}]
    plain = (await http.post("/tokenize", json={"messages": messages})).json()["tokens"]
    for body in ({"chat_template_kwargs": {"add_generation_prompt": False}},
                 {"add_generation_prompt": True, "chat_template_kwargs": {"add_generation_prompt": False}}):  # fmt: skip
        r = await http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, **body})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(plain), body
    await wait_idle(engine)


# The keys of the server's answers as vLLM 0.32's OpenAI server sends them, found by sending the
# same requests to both (the default model, fp32) and diffing the JSON key sets: the fields vLLM
# has nothing for it sends as null (OpenAI's ``refusal``, ``service_tier``, the usage details...,
# and its own ``kv_transfer_params``, ``token_ids``...), a ``system_fingerprint`` on whole answers
# and on a stream's last chunk, and a stream's chunks share one ``created``. A stream's finish
# comes on the chunk of its last token (an EOS's delta is ``{"content": ""}``), never on a chunk of
# its own. A message's ``content: null`` is a 400 unless it is an assistant's (or a function's).
# The expected keys are vLLM's, written out: these tests need neither vLLM nor the network.
HEAD = {"id", "object", "created", "model", "choices"}
FINGERPRINT = re.compile(r"vllmini-[0-9.]+-[0-9a-f]{8}")
# vLLM 0.32's keys (``chat``: the default model's answer to MESSAGES, max_tokens 5, temperature 0)
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


async def test_whole_answers_have_vllms_keys_with_its_nulls(http, engine):
    body = {"model": NAME, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    chat = (await http.post("/v1/chat/completions", json={**body, "messages": MESSAGES})).json()
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
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "stream": True,
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
