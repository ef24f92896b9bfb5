"""The OpenAI-compatible server: answers equal the engine's own, as OpenAI's client reads them
(whole and streamed), bad requests refused naming the field with nothing leaked, clients that
hang up aborted, and ``vllmini serve`` as a user starts it."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import time

import httpx
import msgspec
import openai
import pytest

from test_engine import assert_no_leaks
from vllmini import LLM, AsyncLLMEngine, EngineArgs, SamplingParams
from vllmini.entrypoints.openai.api_server import build_app

KV = 64 << 20
NAME = "tiny"


@pytest.fixture(scope="module")
def engine(tiny_dir):
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), kv_cache_memory=KV, served_model_name=NAME))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def offline(tiny_dir):
    return LLM(model=str(tiny_dir), kv_cache_memory=KV)


@pytest.fixture
def http(engine):
    """An HTTP client for the app, in process (no socket)."""
    transport = httpx.ASGITransport(app=build_app(engine, NAME))
    return httpx.AsyncClient(transport=transport, base_url="http://test")


@pytest.fixture
def client(http):
    return openai.AsyncOpenAI(api_key="none", base_url="http://test/v1", http_client=http, max_retries=0)


def events(text: str) -> list:
    """The server-sent events of a streamed body, [DONE] last."""
    datas = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    return [json.loads(d) for d in datas[:-1]]


async def wait_idle(engine, timeout: float = 10.0) -> None:
    """Until the engine has no request left (aborts land at its next step)."""
    deadline = time.monotonic() + timeout
    while engine.engine.has_unfinished_requests() or engine._streams:
        assert time.monotonic() < deadline, "requests were left running"
        await asyncio.sleep(0.02)
    assert_no_leaks(engine)


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


async def test_completions_equal_the_engine_for_text_and_token_prompts(client, engine, offline):
    ids = offline.get_tokenizer()("Hello there").input_ids
    expected = offline.generate([*PROMPTS, {"prompt_token_ids": ids}],
                                SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)  # fmt: skip
    texts = await client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True})  # fmt: skip
    tokens = await client.completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0,
                                             extra_body={"ignore_eos": True})  # fmt: skip
    got = [c.text for c in sorted(texts.choices, key=lambda c: c.index)] + [tokens.choices[0].text]
    assert got == [o.outputs[0].text for o in expected]
    assert [c.finish_reason for c in texts.choices] == ["length"] * 3
    assert texts.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected[:3])
    assert texts.usage.completion_tokens == 36 and texts.usage.total_tokens == texts.usage.prompt_tokens + 36
    assert texts.object == "text_completion" and texts.model == NAME and texts.id.startswith("cmpl-")
    await wait_idle(engine)


async def test_a_streamed_completion_adds_up_to_the_whole_one(http, engine):
    body = {"model": NAME, "prompt": PROMPTS[:2], "max_tokens": 10, "n": 2, "temperature": 0.8, "seed": 7,
            "ignore_eos": True}  # fmt: skip
    whole = (await http.post("/v1/completions", json=body)).json()
    streamed = await http.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    chunks = events(streamed.text)
    texts, finishes = {}, {}
    for chunk in chunks[:-1]:
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"] is not None:
                assert c["index"] not in finishes, "a choice finished twice"
                finishes[c["index"]] = c["finish_reason"]
    assert sorted(texts) == [0, 1, 2, 3]  # prompt * n + completion
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}  # seeded: the same samples
    assert finishes == {i: "length" for i in range(4)}
    # (the usage chunk leaves out the details the whole response has as null, as vLLM's)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {k: v for k, v in whole["usage"].items() if v is not None}
    assert whole["usage"]["completion_tokens"] == 40
    await wait_idle(engine)


async def test_completion_logprobs_and_echo(client, engine, offline):
    prompt = "The capital of France is"
    ref = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=3,
                                                  ignore_eos=True), use_tqdm=False)[0]  # fmt: skip
    out = await client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                          echo=True, extra_body={"ignore_eos": True})  # fmt: skip
    choice = out.choices[0]
    assert choice.text == prompt + ref.outputs[0].text
    lp = choice.logprobs
    n_prompt = len(ref.prompt_token_ids)
    assert len(lp.tokens) == n_prompt + 6 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [e[t] for t, e in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:])]
    expected += [e[t] for t, e in zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs)]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, token_lp, top in zip(lp.tokens[n_prompt:], lp.token_logprobs[n_prompt:], lp.top_logprobs[n_prompt:]):
        assert len(top) == 3 and max(top.values()) == pytest.approx(token_lp)  # greedy: the best one
        assert top[token] == pytest.approx(token_lp)
    await wait_idle(engine)


async def test_a_streamed_echo_has_the_prompt_logprobs_in_every_choice(tiny_dir):
    """Delta outputs carry the prompt's logprobs once; each of the n choices echoes them, also
    one that starts in a later output (here: max_num_seqs=2 runs the third one later)."""
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), kv_cache_memory=KV, max_num_seqs=2,
                                                           served_model_name=NAME))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(eng, NAME)), base_url="http://test")
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 4, "n": 3, "temperature": 1, "top_k": 1, "logprobs": 1,
            "echo": True, "ignore_eos": True}  # fmt: skip
    whole = (await http.post("/v1/completions", json=body)).json()
    streamed = events((await http.post("/v1/completions", json={**body, "stream": True})).text)
    firsts = {}
    for chunk in streamed:
        for c in chunk["choices"]:
            firsts.setdefault(c["index"], c["logprobs"]["token_logprobs"])
    assert sorted(firsts) == [0, 1, 2]
    for c in whole["choices"]:
        n_prompt = len(c["logprobs"]["tokens"]) - 4
        assert None not in firsts[c["index"]][1:n_prompt]
        assert firsts[c["index"]][:n_prompt] == pytest.approx(c["logprobs"]["token_logprobs"][:n_prompt], abs=1e-4)
    await wait_idle(eng)
    await eng.shutdown()


async def test_chat_equals_llm_chat_whole_and_streamed(client, engine, offline):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    whole = await client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=10,
                                                 temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert whole.choices[0].message.content == ref.outputs[0].text
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(ref.prompt_token_ids) and whole.usage.completion_tokens == 10
    stream = await client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                                  stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})  # fmt: skip
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].object == "chat.completion.chunk"
    await wait_idle(engine)


async def test_chat_logprobs_n_and_response_format(client, engine):
    messages = [{"role": "user", "content": "Name a colour."}]
    out = await client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, n=3, temperature=1.0,
                                               seed=1, logprobs=True, top_logprobs=2)  # fmt: skip
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    for choice in out.choices:
        content = choice.logprobs.content
        assert 1 <= len(content) <= 5
        for item in content:
            assert len(item.top_logprobs) == 2 and item.bytes == list(item.token.encode())
            assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob >= item.logprob - 1e-6 or any(
                t.token == item.token for t in item.top_logprobs
            )
    schema = {"type": "string", "enum": ["red", "green", "blue"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "colour", "schema": schema}}
    structured = await client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                                      response_format=fmt)  # fmt: skip
    assert json.loads(structured.choices[0].message.content) in schema["enum"]
    assert structured.choices[0].finish_reason == "stop"
    choice = await client.completions.create(model=NAME, prompt="Pick:", max_tokens=10, temperature=0,
                                             extra_body={"structured_outputs": {"choice": ["yes", "no"]}})  # fmt: skip
    assert choice.choices[0].text in ("yes", "no")
    await wait_idle(engine)


BAD = [
    ({"prompt": "x", "n": "two"}, "$.n"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"prompt": "x", "stop": 5}, "$.stop"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", [1, 2]]}, "prompt"),
    ({"prompt": [99999999]}, "token"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
    ({"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"prompt": "x", "response_format": {"type": "xml"}}, "$.response_format.type"),
    ({"prompt": "word " * 3000}, "max_model_len"),
    ({}, "prompt"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"prompt": "x", "seed": 2**64}, "$.seed"),  # a signed 64-bit int, as vLLM's server
    ({"prompt": "x", "seed": -(2**63) - 1}, "$.seed"),
]


@pytest.mark.parametrize("body, named", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
async def test_a_bad_completion_request_is_a_400_naming_the_field(http, engine, body, named):
    r = await http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert named in error["message"] and error["type"] == "BadRequestError" and error["code"] == 400
    await wait_idle(engine)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_a_chat_request_for_zero_tokens_is_a_400(http, engine, field):
    """0 is refused as in /v1/completions, not taken for "not given" (the end of the context)."""
    r = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], field: 0})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"{field} must be")
    await wait_idle(engine)


@pytest.mark.parametrize("extra, named", [
    ({"max_completion_tokens": -1}, "max_completion_tokens must be an int >= 1"),
    ({"max_completion_tokens": 10**6}, "max_completion_tokens=1000000 cannot be greater than max_model_len"),
    ({"logprobs": True, "top_logprobs": -2}, "top_logprobs must be an int >= 0"),
    ({"logprobs": True, "top_logprobs": 10**6}, "top_logprobs=1000000 asks for more than the server's max_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs=-1 asks for more than the server's max_logprobs"),
])  # fmt: skip
async def test_a_bad_chat_request_names_the_field_it_sent(http, engine, extra, named):
    """Not the SamplingParams field its value goes to (max_tokens, logprobs): a chat request's
    logprobs is a bool, and its max_completion_tokens may be all it sets; also as ``error.param``."""
    r = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **extra})
    error = r.json()["error"]
    assert r.status_code == 400 and named in error["message"], r.text
    assert error["param"] == named.split()[0].split("=")[0], r.text
    await wait_idle(engine)


@pytest.mark.parametrize("key", ["tokenizer", "messages"])
async def test_chat_template_kwargs_that_clash_with_the_renderer_are_a_400(http, engine, key):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "chat_template_kwargs": {key: 1}}
    r = await http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "chat_template_kwargs" in r.json()["error"]["message"] and key in r.text
    await wait_idle(engine)


async def test_a_request_chat_template_naming_a_server_file_is_refused(engine, tmp_path):
    """A client must not make the server read its files, even one that trusts request templates
    (the --chat-template option may name one; a request's chat_template is Jinja text or one of
    the tokenizer's template names)."""
    path = tmp_path / "secret.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "chat_template": str(path)}
    app = build_app(engine, trust_request_chat_template=True)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        r = await http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "not a file path" in r.json()["error"]["message"]
    await wait_idle(engine)


async def test_bad_requests_leave_others_streaming_and_nothing_leaked(client, http, engine):
    async def good(i: int) -> str:
        out = await client.completions.create(model=NAME, prompt=PROMPTS[i % 3], max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True})  # fmt: skip
        return out.choices[0].text

    bad_chat = [
        {"messages": []}, {"messages": [{"content": "no role"}]}, {"messages": "hi"},
        {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ raise_exception('no') }}"},
    ]
    goods = [asyncio.ensure_future(good(i)) for i in range(6)]
    statuses = [(await http.post("/v1/chat/completions", json=b)).status_code for b in bad_chat]
    statuses.append((await http.post("/v1/completions", content=b"{not json")).status_code)
    statuses.append((await http.post("/v1/completions", content=b"[1, 2]")).status_code)
    assert statuses == [400] * len(statuses)
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        await client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        await client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], temperature=-2)
    assert len(set(await asyncio.gather(*goods))) == 3  # each prompt's own greedy text
    await wait_idle(engine)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/invocations"])
async def test_a_body_nested_too_deeply_is_a_400(http, engine, path):
    """msgspec raises RecursionError past its depth limit (a 500 before), not a DecodeError."""
    body = b'{"model": "tiny", "prompt": "x", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = await http.post(path, content=body)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], r.text[:300]
    await wait_idle(engine)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/invocations"])
async def test_a_number_past_the_float_range_is_a_400_naming_its_field(http, engine, path):
    """1e999 reads as inf, as in vLLM's server (Python's json), which its field refuses naming
    itself; msgspec's "Number out of range - at `$[...]`" named none. In an ignored field it is ignored."""
    chat = {"messages": [{"role": "user", "content": "x"}]} if path == "/v1/chat/completions" else {"prompt": "x"}
    for field, value in (("temperature", b"1e999"), ("max_tokens", b"1e999"), ("presence_penalty", b"-1e999"),
                         ("logit_bias", b'{"1": 1e999}')):  # fmt: skip
        body = msgspec.json.encode({"model": NAME, **chat})[:-1] + b', "%s": %s}' % (field.encode(), value)
        r = await http.post(path, content=body)
        assert r.status_code == 400 and field in r.json()["error"]["message"], (field, r.text)
    body = msgspec.json.encode({"model": NAME, "max_tokens": 2, **chat})[:-1] + b', "not_a_field": 1e999}'
    assert (await http.post(path, content=body)).status_code == 200
    r = await http.post(path, content=b'{"prompt": "x", "temperature": 1e999, "n": NaN}')
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]  # (still JSON's grammar)
    await wait_idle(engine)


async def test_a_bad_prompt_in_a_batch_refuses_the_request_and_frees_the_others(http, engine):
    """The second prompt is refused, the first with it, never queued. (max_tokens null: to the end of
    the context, so that the server checks no length before the engine does.)"""
    body = {"prompt": [[1, 2, 3], [99999999]], "max_tokens": None, "ignore_eos": True}
    r = await http.post("/v1/completions", json=body)
    assert r.status_code == 400 and "99999999" in r.json()["error"]["message"]
    await wait_idle(engine)
    r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "request_id": "mine"})
    assert r.json()["id"] == "cmpl-mine"  # (vLLM's: the request_id is the base of the id)


async def test_unknown_routes_and_methods_are_answered_in_json_as_in_vllm(http):
    """vLLM's FastAPI app answers them {"detail": ...} (Starlette's were plain text)."""
    for method, path, status, detail in (("GET", "/v1/nope", 404, "Not Found"), ("POST", "/nope", 404, "Not Found"),
                                         ("GET", "/v1/completions", 405, "Method Not Allowed")):  # fmt: skip
        r = await http.request(method, path)
        assert r.status_code == status and r.json() == {"detail": detail}, (path, r.text)
        assert r.headers["content-type"] == "application/json"
    assert (await http.get("/v1/chat/completions")).headers["allow"] == "POST"


async def test_a_bad_last_prompt_of_many_queues_none_of_them(http, engine):
    """As vLLM's server, every prompt is checked before any is queued: none runs and /metrics counts
    no abort (the 32 queued ahead of the bad one were aborted, each counted, after sampling a token)."""
    await wait_idle(engine)
    before, generated = await _scrape(http), engine.engine.num_generated_tokens
    for path, body in (("/v1/completions", {"prompt": [[1, 2, 3]] * 32 + [[99999999]], "max_tokens": None}),
                       ("/v1/completions", {"prompt": [[1, 2, 3]] * 2 + [[]], "max_tokens": 2, "n": 2}),
                       ("/v1/completions", {"prompt": ["a", "b", [1, 2, 3], 7], "max_tokens": 2})):  # fmt: skip
        r = await http.post(path, json={**body, "ignore_eos": True})
        assert r.status_code == 400, r.text
    await wait_idle(engine)
    assert engine.engine.num_generated_tokens == generated  # (was 32 tokens)
    finished = [{k: v for k, v in counts.items() if k[0] == "vllm:request_success_total"}
                for counts in (before, await _scrape(http))]  # fmt: skip
    assert finished[0] == finished[1]  # (was one "abort" per prompt queued)


async def test_prompts_are_tokenized_off_the_event_loop_once(http, engine, monkeypatch):
    """As vLLM's async tokenizer: a long prompt took seconds to tokenize on the event loop (twice
    for a completion), holding every stream meanwhile; the routes tokenize on their own thread."""
    import threading

    tok = engine.get_tokenizer()
    seen: list[str] = []
    original = type(tok).__call__

    def spy(self, text, *args, **kwargs):
        if isinstance(text, str) and "MARK" in text:
            seen.append(threading.current_thread().name)
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tok), "__call__", spy)
    chat = {"messages": [{"role": "user", "content": "MARK"}], "max_tokens": 2}
    for path, body, calls in (
        ("/v1/completions", {"prompt": "MARK", "max_tokens": 2}, 1),
        # (the truncation tokenizes each text again, without special tokens, to keep them)
        ("/v1/completions", {"prompt": ["MARK", "MARK"], "max_tokens": 2, "truncate_prompt_tokens": 1}, 4),
        ("/v1/completions", {"prompt": "MARK", "max_tokens": 2, "add_special_tokens": False, "echo": True}, 1),
        ("/v1/chat/completions", chat, 1), ("/v1/chat/completions", {**chat, "add_special_tokens": True}, 2),
        ("/v1/responses", {"input": "MARK", "max_output_tokens": 2}, 1), ("/tokenize", {"prompt": "MARK"}, 1),
    ):  # fmt: skip
        seen.clear()
        r = await http.post(path, json=body)
        assert r.status_code == 200, r.text
        assert len(seen) == calls and all(name.startswith("vllmini-tokenize") for name in seen), (path, body, seen)
    await wait_idle(engine)


async def test_max_tokens_past_max_model_len_is_a_400_and_past_the_prompt_is_cut_as_in_vllm(http, engine):
    """vLLM's server (0.32) refuses a max_tokens past max_model_len, naming it (error.param too), and
    cuts one that fits max_model_len but not after the prompt to what the prompt leaves (it was a 400
    here, as older vLLM's); a prompt truncated by truncate_prompt_tokens counts as truncated."""
    max_len = engine.engine.max_model_len
    ids = list(range(5, 105))
    messages = [{"role": "user", "content": "hi"}]
    for path, body, field in (("/v1/completions", {"prompt": ids, "max_tokens": max_len + 1}, "max_tokens"),
                              ("/v1/chat/completions", {"messages": messages, "max_tokens": max_len + 1}, "max_tokens"),
                              ("/v1/chat/completions", {"messages": messages, "max_completion_tokens": max_len + 1},
                               "max_completion_tokens")):  # fmt: skip
        r = await http.post(path, json=body)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == field, r.text
        assert error["message"] == (f"{field}={max_len + 1} cannot be greater than max_model_len={max_len}. "
                                    "Please request fewer output tokens.")  # fmt: skip (vLLM's words)
    await wait_idle(engine)
    fits = [{"prompt": ids, "max_tokens": max_len - 99},  # (one past what the prompt leaves)
            {"prompt": [ids[:3], ids], "max_tokens": max_len - 50},  # each prompt its own end
            {"prompt": ids, "max_tokens": max_len - 10, "truncate_prompt_tokens": 10},
            {"prompt": ids, "max_tokens": max_len - 10, "truncate_prompt_tokens": -1}]  # (-1: what max_tokens leaves)
    # (all at once: they decode in the same steps, to the end of the context)
    replies = await asyncio.gather(
        *[http.post("/v1/completions", json={**body, "ignore_eos": True, "temperature": 0}) for body in fits],
        http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": max_len, "ignore_eos": True}),
        http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": None, "ignore_eos": True}),
    )  # fmt: skip
    completions = [[max_len - 100], [max_len - 50, max_len - 100], [max_len - 10], [max_len - 10]]
    for r, expected in zip(replies, completions):  # (the second prompt of two: exactly at the end of the context)
        assert r.status_code == 200, r.text
        assert all(c["finish_reason"] == "length" for c in r.json()["choices"])
        assert r.json()["usage"]["completion_tokens"] == sum(expected), r.text
    for r in replies[-2:]:
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"  # to the end of the context
        assert r.json()["usage"]["total_tokens"] == max_len


async def test_completions_max_tokens_null_is_the_default_16_as_in_vllm(http, engine):
    """vLLM's server reads a null max_tokens as its default (16), not as "to the end of the context"."""
    r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": None, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text
    await wait_idle(engine)


def test_a_bad_chat_template_stops_the_server_before_it_listens(engine, tmp_path):
    """build_app runs before uvicorn binds (run_server); `vllmini serve` turns the error into exit 2."""
    with pytest.raises(ValueError, match="no/such.jinja"):
        build_app(engine, NAME, chat_template="no/such.jinja")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>")
    assert build_app(engine, NAME, chat_template=str(template)) is not None


async def test_a_server_chat_template_is_used_and_a_request_may_name_its_own(engine, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]")
    app = build_app(engine, NAME, chat_template=str(template), trust_request_chat_template=True)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        server = (await http.post("/v1/chat/completions", json=body)).json()
        own = (await http.post("/v1/chat/completions", json={**body, "chat_template": "<{{ messages[0]['content'] }}>"})).json()
    tok = engine.get_tokenizer()
    assert server["usage"]["prompt_tokens"] == len(tok("[user] hi\n[assistant]", add_special_tokens=False).input_ids)
    assert own["usage"]["prompt_tokens"] == len(tok("<hi>", add_special_tokens=False).input_ids)


OWN_TEMPLATE = "<{{ messages[0]['content'] }}>"


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"max_tokens": 1, "chat_template": OWN_TEMPLATE}),
    ("/v1/chat/completions", {"max_tokens": 1, "chat_template_kwargs": {"chat_template": OWN_TEMPLATE}}),
    ("/tokenize", {"chat_template": OWN_TEMPLATE}),
])  # fmt: skip
async def test_a_request_chat_template_is_refused_unless_the_server_trusts_them(engine, http, route, body):
    """As vLLM's (--trust-request-chat-template, off by default): Jinja's sandbox bounds no work,
    and a template of two nested range(100000) loops (10^10 turns, rendered on the event loop)
    held every stream for minutes."""
    r = await http.post(route, json={"messages": [{"role": "user", "content": "hi"}], **body})
    error = r.json()["error"]["message"]
    assert r.status_code == 400 and "trust-request-chat-template" in error, r.text
    assert error.startswith("chat_template_kwargs.chat_template" if "chat_template_kwargs" in body else "chat_template:")
    await wait_idle(engine)


async def test_models_health_version_and_api_key(engine, http):
    models = (await http.get("/v1/models")).json()
    assert models["data"][0]["id"] == NAME and models["data"][0]["max_model_len"] == engine.engine.max_model_len
    assert (await http.get("/health")).status_code == 200
    assert (await http.get("/version")).json()["version"]
    locked = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, NAME, api_key="s3cret")),
                               base_url="http://test")  # fmt: skip
    body = {"prompt": "x", "max_tokens": 2}
    assert (await locked.post("/v1/completions", json=body)).status_code == 401
    assert (await locked.get("/v1/models")).status_code == 401  # every /v1 route, as vLLM's
    assert (await locked.get("/health")).status_code == 200
    wrong = {"Authorization": "Bearer nope"}
    assert (await locked.post("/v1/completions", json=body, headers=wrong)).status_code == 401
    right = {"Authorization": "Bearer s3cret"}
    assert (await locked.post("/v1/completions", json=body, headers=right)).status_code == 200


async def test_the_api_key_guards_the_v1_routes_under_a_root_path(engine):
    """Behind a proxy's prefix (``--root-path /api``), ``scope["path"]`` is ``/api/v1/...``: the routes still match."""
    app = build_app(engine, NAME, api_key="s3cret")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, root_path="/api"), base_url="http://test") as c:
        assert (await c.get("/api/v1/models")).status_code == 401
        assert (await c.get("/api/v1/models", headers={"Authorization": "Bearer s3cret"})).status_code == 200
        assert (await c.get("/api/health")).status_code == 200


@contextlib.asynccontextmanager
async def on_a_socket(app):
    """The app on a real socket (uvicorn); yields its URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@pytest.fixture
async def served(engine):
    """The app on a real socket, for clients that hang up (the engine's served name)."""
    async with on_a_socket(build_app(engine)) as url:
        yield url


def test_the_served_name_is_the_engines(engine, tiny_dir):
    """One source: the engine's EngineArgs.served_model_name (its metrics' label too); build_app's
    argument may repeat it, never contradict it. A bad body limit is refused naming it."""
    assert build_app(engine) is not None
    with pytest.raises(ValueError, match="served_model_name 'other' differs from the engine's 'tiny'"):
        build_app(engine, "other")
    with pytest.raises(ValueError, match="max_request_body_size must be a number of bytes >= 0"):
        build_app(engine, max_request_body_size=-1)
    assert EngineArgs(model=str(tiny_dir)).get_served_model_name() == str(tiny_dir)


async def test_the_app_serves_and_labels_the_engines_name(engine):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine)), base_url="http://t") as http:
        assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == [NAME]
        r = await http.post("/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == NAME
        assert f'vllm:generation_tokens_total{{model_name="{NAME}"}}' in (await http.get("/metrics")).text
    await wait_idle(engine)


def refused_for_size(r: httpx.Response, limit: int) -> bool:
    error = r.json()["error"]
    return r.status_code == 413 and error["code"] == 413 and f"limit of {limit} bytes" in error["message"]


async def test_a_body_over_the_limit_is_refused_413_unread_and_others_go_on(engine):
    """A declared Content-Length over the limit is refused before any byte is read; a chunked
    body (no length) once its chunks pass the limit, the rest of it never pulled."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, max_request_body_size=1000)),
                                 base_url="http://t") as http:  # fmt: skip
        small = {"model": NAME, "prompt": "Hi", "max_tokens": 2}
        assert refused_for_size(await http.post("/v1/completions", json={**small, "prompt": "x" * 1000}), 1000)
        pulled = 0

        async def chunks(n: int, size: int):
            nonlocal pulled
            for _ in range(n):
                pulled += 1
                yield b" " * size

        assert refused_for_size(await http.post("/v1/completions", content=chunks(10_000, 300)), 1000)
        assert pulled <= 5  # (4 chunks pass 1000 bytes)
        assert (await http.post("/v1/completions", json=small)).status_code == 200
    # the default limit, 32 MiB, read off the header alone
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine)), base_url="http://t") as http:
        pulled = 0
        huge = await http.post("/v1/completions", content=chunks(1, 10), headers={"content-length": str((32 << 20) + 1)})
        assert refused_for_size(huge, 32 << 20) and pulled == 0
    await wait_idle(engine)


async def test_a_chunked_upload_over_the_limit_on_a_socket_is_refused_and_the_connection_serves_on(engine):
    """uvicorn reads and drops the rest of a refused body: the client gets its 413 and the same
    keep-alive connection answers the next request."""
    async with on_a_socket(build_app(engine, max_request_body_size=1 << 20)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(max_connections=1)) as c:

            async def chunks():
                for _ in range(64):
                    yield b" " * (64 << 10)  # 4 MiB in all

            assert refused_for_size(await c.post("/v1/completions", content=chunks()), 1 << 20)
            r = await c.post("/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    await wait_idle(engine)


@pytest.mark.parametrize("path", ["/v1/completions", "/invocations"])
async def test_a_client_gone_while_sending_its_body_is_not_a_server_error(engine, path, caplog):
    """Starlette raises ClientDisconnect into the route reading the body: answered 499 (no one
    reads it), not raised out of the app, which uvicorn logged as an error with a traceback."""
    messages = [{"type": "http.request", "body": b'{"model": "tiny", "prompt": ', "more_body": True},
                {"type": "http.disconnect"}]  # fmt: skip
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "server": ("t", 80), "client": ("c", 1)}  # fmt: skip
    await build_app(engine)(scope, receive, send)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    await wait_idle(engine)


async def hang_up_after_first_event(c: httpx.AsyncClient, path: str, body: dict) -> None:
    """Stream a request and close the stream after its first event (its request is aborted)."""
    async with c.stream("POST", path, json=body) as r:
        lines = r.aiter_lines()
        while not (await anext(lines)).startswith("data: "):
            pass


async def test_clients_that_hang_up_are_aborted_and_others_finish(served, engine):
    long = {"model": NAME, "prompt": "Count:", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "ignore_eos": True}
    generated = engine.engine.num_generated_tokens
    async with httpx.AsyncClient(base_url=served, timeout=30) as c:
        others = [asyncio.ensure_future(c.post("/v1/completions", json={**long, "max_tokens": 20})) for _ in range(3)]
        await hang_up_after_first_event(c, "/v1/completions", {**long, "stream": True})
        with pytest.raises(httpx.ReadTimeout):  # a whole (not streamed) request, given up on
            await c.post("/v1/chat/completions", json=chat, timeout=0.5)
        done = await asyncio.gather(*others)
    assert [r.json()["usage"]["completion_tokens"] for r in done] == [20, 20, 20]
    await wait_idle(engine)
    assert engine.engine.num_generated_tokens - generated < 3 * 20 + 400  # the long ones did not run to the end


def test_vllmini_serve_starts_answers_and_stops_on_ctrl_c(tiny_dir, tmp_path):
    """As a user runs it: ``vllmini serve MODEL --port 0`` (with a LoRA adapter), an OpenAI client, then Ctrl-C."""
    from helpers import save_tiny_lora, vllmini_serve

    adapter = save_tiny_lora(tiny_dir, tmp_path / "adapter", seed=1)
    with vllmini_serve(str(tiny_dir), "--served-model-name", "m", "--kv-cache-memory", str(KV), "--enable-lora",
                       "--lora-modules", f"lora={adapter}") as url:  # fmt: skip
        with openai.OpenAI(api_key="none", base_url=url + "/v1", max_retries=0) as c:
            assert [model.id for model in c.models.list()] == ["m", "lora"]
            out = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            assert out.usage.completion_tokens <= 4 and out.choices[0].message.role == "assistant"
            tuned = c.completions.create(model="lora", prompt="hi", max_tokens=4)
            assert tuned.model == "lora" and tuned.usage.completion_tokens <= 4


async def test_continuous_usage_in_a_chat_stream_counts_the_prompt_from_the_first_chunk(http, engine):
    body = {"model": NAME, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    chunks = events((await http.post("/v1/chat/completions", json=body)).text)
    prompt = chunks[-1]["usage"]["prompt_tokens"]
    assert prompt > 0 and all(c["usage"]["prompt_tokens"] == prompt for c in chunks)
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2, 3, 4, 4]
    await wait_idle(engine)


async def test_continuous_usage_is_each_choices_own_as_in_vllm(http, engine):
    """With n > 1 and several prompts, vLLM's continuous usage is per chunk of one choice: its
    prompt's tokens and the tokens it has so far (it was the sums over every choice and prompt)."""
    options = {"model": NAME, "max_tokens": 3, "n": 2, "ignore_eos": True, "return_token_ids": True, "stream": True,
               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    for path, body, num_prompts in (("/v1/completions", {"prompt": ["Hi", PROMPTS[0]]}, 2),
                                    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi!"}]}, 1)):
        *chunks, last = events((await http.post(path, json={**options, **body})).text)
        prompts, generated = {}, {}
        for chunk in chunks:
            (choice,) = chunk["choices"]  # (one choice a chunk, as vLLM's)
            i = choice["index"]
            prompts[i] = len(chunk.get("prompt_token_ids") or choice.get("prompt_token_ids") or []) or prompts[i]
            generated[i] = generated.get(i, 0) + len(choice.get("token_ids") or [])
            details = {"completion_tokens_details": None} if "chat" in path else {}  # (vLLM's chat chunks have it)
            assert chunk["usage"] == {"prompt_tokens": prompts[i], "completion_tokens": generated[i],
                                      "total_tokens": prompts[i] + generated[i], **details}, (path, chunk)  # fmt: skip
        assert sorted(generated.items()) == [(i, 3) for i in range(2 * num_prompts)]
        assert last["usage"]["completion_tokens"] == 6 * num_prompts
        assert last["usage"]["prompt_tokens"] == sum(prompts[i] for i in range(0, 2 * num_prompts, 2))
    await wait_idle(engine)


async def test_prompt_logprobs_come_back_as_vllm_returns_them(http, engine, offline):
    prompt = "The capital of France is"
    ref = offline.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    body = {"model": NAME, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2}
    (choice,) = (await http.post("/v1/completions", json=body)).json()["choices"]
    got = choice["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ref.prompt_token_ids)
    for token, entry, theirs in zip(ref.prompt_token_ids[1:], got[1:], ref.prompt_logprobs[1:]):
        assert list(entry)[0] == str(token) and len(entry) in (2, 3)  # the token, then the top 2
        assert entry[str(token)]["logprob"] == pytest.approx(float(theirs[token]), abs=1e-4)
        assert entry[str(token)]["rank"] == theirs[token].rank and entry[str(token)]["decoded_token"]
    chat = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0}
    answer = (await http.post("/v1/chat/completions", json=chat)).json()
    assert answer["prompt_logprobs"][0] is None and len(answer["prompt_logprobs"]) == answer["usage"]["prompt_tokens"]
    assert (await http.post("/v1/completions", json={**body, "prompt_logprobs": None})).json()["choices"][0]["prompt_logprobs"] is None
    await wait_idle(engine)


async def test_tokenize_and_detokenize(http, engine):
    tok = engine.get_tokenizer()
    r = (await http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})).json()
    assert r["tokens"] == tok("Hello world").input_ids and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == engine.engine.max_model_len and r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    messages = [{"role": "user", "content": "Hi!"}]
    chat = (await http.post("/tokenize", json={"messages": messages})).json()
    answer = (await http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})).json()
    assert chat["count"] == answer["usage"]["prompt_tokens"] and chat["token_strs"] is None
    special = (await http.post("/tokenize", json={"messages": messages, "add_special_tokens": True})).json()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert special["tokens"] == tok(text, add_special_tokens=True).input_ids
    back = (await http.post("/detokenize", json={"tokens": r["tokens"]})).json()
    assert back == {"prompt": "Hello world"}
    for path, body, named in [("/detokenize", {"tokens": [10**9]}, "tokens"), ("/tokenize", {}, "prompt and messages"),
                              ("/tokenize", {"prompt": "a", "messages": messages}, "prompt and messages"),
                              ("/tokenize", {"prompt": "a", "model": "other"}, "other")]:  # fmt: skip
        bad = await http.post(path, json=body)
        assert bad.status_code in (400, 404) and named in bad.json()["error"]["message"]


async def _scrape(http: httpx.AsyncClient) -> dict[tuple[str, str | None], float]:
    """/metrics as {(sample name, finished_reason label): value}, this model's samples only."""
    from prometheus_client.parser import text_string_to_metric_families

    r = await http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, s.labels.get("finished_reason")): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples
            if s.labels.get("model_name") == NAME}  # fmt: skip


def _delta(after: dict, before: dict, name: str, reason: str | None = None) -> float:
    return after[(name, reason)] - before.get((name, reason), 0.0)


async def test_metrics_in_prometheus_format_with_vllms_names(engine, http):
    """The engine's registry (labelled with its served_model_name) counts as requests run: the
    deltas over two API requests are theirs."""
    await wait_idle(engine)
    before = await _scrape(http)
    body = {"model": NAME, "prompt": PROMPTS, "max_tokens": 4, "ignore_eos": True}
    await http.post("/v1/completions", json=body)
    await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                                                  "n": 2, "ignore_eos": True, "stream": True})  # fmt: skip
    after = await _scrape(http)
    assert _delta(after, before, "vllm:request_success_total", "length") == 4  # one per request (n=2 included)
    assert _delta(after, before, "vllm:time_to_first_token_seconds_count") == 4
    assert _delta(after, before, "vllm:request_generation_tokens_sum") == 3 * 4 + 2 * 3
    # a gap per sequence and step after its first token: 3 x 3 for the completions, 2 x 2 for the chat
    assert _delta(after, before, "vllm:inter_token_latency_seconds_count") == 3 * 3 + 2 * 2
    assert _delta(after, before, "vllm:request_params_n_sum") == 3 + 2
    assert _delta(after, before, "vllm:e2e_request_latency_seconds_sum") > 0
    assert after[("vllm:num_requests_running", None)] == 0 and after[("vllm:kv_cache_usage_perc", None)] == 0
    assert after[("vllm:generation_tokens_total", None)] == engine.engine.num_generated_tokens
    # every token of the steps, prompt and generated, in vllm:iteration_tokens_total (as vLLM's)
    assert _delta(after, before, "vllm:iteration_tokens_total_sum") == _delta(
        after, before, "vllm:prompt_tokens_total") + _delta(after, before, "vllm:generation_tokens_total") > 0
    assert after[("vllm:iteration_tokens_total_count", None)] >= 5  # (the chat stream's decodes at least)
    info = 'vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True"'
    assert info in (await http.get("/metrics")).text


@pytest.mark.parametrize("stream", [False, True])
async def test_the_time_per_output_token_of_n_completions_is_per_sequence(engine, http, stream):
    """n sequences are decoded side by side: n x 5 tokens take 4 gaps, not 5n - 1."""
    await wait_idle(engine)
    before = await _scrape(http)
    body = {"model": NAME, "prompt": "Hi", "n": 3, "max_tokens": 5, "ignore_eos": True, "stream": stream}
    assert (await http.post("/v1/completions", json=body)).status_code == 200
    after = await _scrape(http)
    assert _delta(after, before, "vllm:request_generation_tokens_sum") == 15
    between = _delta(after, before, "vllm:e2e_request_latency_seconds_sum") - _delta(
        after, before, "vllm:time_to_first_token_seconds_sum")
    assert _delta(after, before, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(between / 4)
    await wait_idle(engine)


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_a_stream_whose_send_fails_aborts_its_requests(engine, spec_version):
    """A server may report a client gone by raising from ``send`` (ASGI 2.4: OSError, which
    Starlette turns into ClientDisconnect) instead of a disconnect message: Starlette then skips
    the response's background task, which must not be what aborts the requests (they ran on to
    max_tokens, and the streams stayed until a garbage collection)."""
    await wait_idle(engine)
    body = json.dumps({"prompt": PROMPTS, "n": 2, "max_tokens": 300, "ignore_eos": True, "stream": True}).encode()
    events: list[bytes] = []
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")]}  # fmt: skip
    sent = asyncio.Event()

    async def receive() -> dict:
        if not sent.is_set():
            sent.set()
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # (no disconnect message: the client's leaving shows only in send)

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            if events:
                raise OSError("the client has gone")
            events.append(message["body"])

    gc_was_on = gc.isenabled()
    gc.disable()  # (a collection would close the streams' generators, hiding the leak)
    try:
        with contextlib.suppress(Exception):
            await build_app(engine, NAME)(scope, receive, send)
        assert events[0].startswith(b"data: {") and not engine._streams
    finally:
        if gc_was_on:
            gc.enable()
    await wait_idle(engine)


async def test_a_stream_given_up_between_two_events_aborts_its_requests(engine):
    """Starlette leaves the events unread when a client hangs up while one is being sent; the
    response's close (its background task) must still stop the readers and abort every request."""
    from vllmini.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from vllmini.entrypoints.openai.serving_chat import OpenAIServingChat
    from vllmini.entrypoints.openai.serving_completion import OpenAIServingCompletion

    completion, chat = OpenAIServingCompletion(engine, NAME), OpenAIServingChat(engine, NAME)
    many = CompletionRequest(prompt=PROMPTS, n=2, max_tokens=300, ignore_eos=True, stream=True)
    one = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], max_tokens=300, ignore_eos=True,
                                stream=True)  # fmt: skip
    for start in (lambda: completion.create_completion(many), lambda: chat.create_chat_completion(one)):
        result = await start()
        for _ in range(3):
            assert (await anext(result.events)).startswith("data: {")
        await result.close()
        await wait_idle(engine)
