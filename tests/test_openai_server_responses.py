"""The Responses API (``/v1/responses``), as vLLM's server serves it, through OpenAI's client: the
text equals the chat completions route's for the same messages (greedy: the oracle), the
streamed events come in the Responses order and add up to the whole response, ``text.format``
output parses, tool calls are ``function_call`` items, reasoning a ``reasoning`` item, stored
responses are read back and continued, and bad input is a 400 naming the field."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

import test_openai_server
from test_openai_server import hang_up_after_first_event, wait_idle
from test_openai_server_tools import CALL, PARIS, TOOLS, forced, serving
from vllmini.entrypoints.openai.api_server import build_app
from vllmini.entrypoints.openai.serving_responses import ResponseNotFoundError, ResponseStore

NAME = "m"
GREEDY = {"temperature": 0, "max_output_tokens": 12, "extra_body": {"ignore_eos": True}}
FLAT_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]  # (the Responses API's shape)


@pytest.fixture(scope="module")
def engines(tiny_dir, default_model_dir):
    """The tiny random model (quick: structured outputs force its texts) and the default one (whose
    JSON a schema shapes: the random one writes whitespace the schema allows until max_tokens)."""
    with serving(tiny_dir) as tiny, serving(default_model_dir) as default:
        yield {"tiny": tiny, "default": default}


@pytest.fixture
def engine(engines):
    return engines["tiny"]


def client(engine, **parsers) -> openai.AsyncOpenAI:
    """A client of one app (its response store with it) with these parsers, in process."""
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, NAME, **parsers)), base_url="http://test")
    return openai.AsyncOpenAI(api_key="none", base_url="http://test/v1", http_client=http, max_retries=0)


async def chat_text(c: openai.AsyncOpenAI, messages: list, **kwargs) -> tuple[str, int]:
    """The chat route's content and prompt tokens (the oracle), greedy."""
    out = await c.chat.completions.create(model=NAME, messages=messages, temperature=0, **kwargs)
    return out.choices[0].message.content, out.usage.prompt_tokens


async def test_text_and_usage_equal_the_chat_route_and_max_output_tokens_makes_it_incomplete(engine):
    c = client(engine)
    parts = [{"role": "user", "content": [{"type": "input_text", "text": "Tell me "}, {"type": "input_text", "text": "a story."}]}]
    out = await c.responses.create(model=NAME, instructions="You are terse.", input=parts, **GREEDY)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me \na story."}]
    text, prompt_tokens = await chat_text(c, messages, max_tokens=12, extra_body={"ignore_eos": True})
    assert out.output_text == text and text
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    (item,) = out.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert out.usage.input_tokens == prompt_tokens and out.usage.output_tokens == 12
    assert out.usage.total_tokens == prompt_tokens + 12
    assert out.object == "response" and out.id.startswith("resp_") and out.model == NAME
    assert out.instructions == "You are terse." and out.max_output_tokens == 12 and out.temperature == 0
    await wait_idle(engine)


async def test_the_stream_sends_the_responses_events_in_order_and_adds_up_to_the_whole_response(engine):
    c = client(engine)
    whole = await c.responses.create(model=NAME, input="Once upon a time", **GREEDY)
    stream = await c.responses.create(model=NAME, input="Once upon a time", stream=True, **GREEDY)
    events = [event async for event in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2 and kinds == ["response.created", "response.in_progress", "response.output_item.added",
                                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                                     "response.output_text.done", "response.content_part.done",
                                     "response.output_item.done", "response.completed"]  # fmt: skip
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text == events[-3].part.text
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:-2]) and events[-2].item.id == item_id
    final = events[-1].response
    assert final.output_text == text and final.status == "incomplete" and final.output[0].id == item_id
    usage = ("input_tokens", "output_tokens", "total_tokens")
    assert [getattr(final.usage, n) for n in usage] == [getattr(whole.usage, n) for n in usage]
    # (the whole request's prompt is in the prefix cache now)
    assert whole.usage.input_tokens_details.cached_tokens < final.usage.input_tokens_details.cached_tokens
    await wait_idle(engine)


async def test_output_logprobs_are_the_chat_routes_whole_and_streamed(engine):
    c = client(engine)
    kwargs = {"model": NAME, "input": "Hi", "include": ["message.output_text.logprobs"], "top_logprobs": 2, **GREEDY}
    out = await c.responses.create(**kwargs)
    chat = await c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                           max_tokens=12, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})  # fmt: skip
    logprobs = out.output[0].content[0].logprobs
    assert [lp.model_dump() for lp in logprobs] == [lp.model_dump() for lp in chat.choices[0].logprobs.content]
    assert len(logprobs) == 12 and all(len(lp.top_logprobs) == 2 for lp in logprobs) and out.top_logprobs == 2
    events = [event async for event in await c.responses.create(**kwargs, stream=True)]
    done = next(e for e in events if e.type == "response.output_text.done")
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in done.logprobs][: len(streamed)]
    whole = [(lp.token, lp.logprob) for lp in logprobs]
    assert [(lp.token, lp.logprob) for lp in done.logprobs] == whole
    assert [(lp.token, lp.logprob) for lp in events[-1].response.output[0].content[0].logprobs] == whole
    plain = await c.responses.create(model=NAME, input="Hi", **GREEDY)
    assert plain.output[0].content[0].logprobs is None and plain.output_text == out.output_text
    await wait_idle(engine)


async def test_store_get_previous_response_id_and_cancel(engine):
    c = client(engine)
    first = await c.responses.create(model=NAME, input="Hello!", instructions="Answer in French.", **GREEDY)
    got = await c.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()
    second = await c.responses.create(model=NAME, input="And then?", previous_response_id=first.id, **GREEDY)
    # the conversation goes on; the first request's instructions are not carried over (OpenAI's rule)
    messages = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And then?"}]  # fmt: skip
    text, prompt_tokens = await chat_text(c, messages, max_tokens=12, extra_body={"ignore_eos": True})
    assert second.output_text == text and second.usage.input_tokens == prompt_tokens
    assert second.previous_response_id == first.id
    unstored = await c.responses.create(model=NAME, input="Hi", store=False, **GREEDY)
    for missing in (unstored.id, "resp_nope"):
        with pytest.raises(openai.NotFoundError, match=missing):
            await c.responses.retrieve(missing)
        with pytest.raises(openai.NotFoundError, match=missing):
            await c.responses.create(model=NAME, input="Hi", previous_response_id=missing)
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        await c.responses.cancel(first.id)
    with pytest.raises(openai.NotFoundError):
        await c.responses.cancel("resp_nope")
    with pytest.raises(openai.NotFoundError):  # another app (server) has its own store
        await client(engine).responses.retrieve(first.id)
    await wait_idle(engine)


served = test_openai_server.served  # (the app on a real socket, with this module's engine)


async def test_clients_that_hang_up_are_aborted(served, engine):
    body = {"model": NAME, "input": "Count:", "max_output_tokens": 400, "ignore_eos": True}
    generated = engine.engine.num_generated_tokens
    async with httpx.AsyncClient(base_url=served, timeout=30) as c:
        await hang_up_after_first_event(c, "/v1/responses", {**body, "stream": True})
        with pytest.raises(httpx.ReadTimeout):  # a whole (not streamed) response, given up on
            await c.post("/v1/responses", json=body, timeout=0.5)
    await wait_idle(engine)
    assert engine.engine.num_generated_tokens - generated < 400  # neither ran to the end


def test_the_store_drops_the_oldest_past_its_size():
    store = ResponseStore(2)
    for i in range(3):
        store.put({"id": f"resp_{i}"}, [{"role": "user", "content": str(i)}])
    with pytest.raises(ResponseNotFoundError):
        store.get("resp_0")
    response, conversation = store.get("resp_2")
    conversation.append({"role": "user", "content": "more"})  # (a copy: the stored one is unchanged)
    assert response == {"id": "resp_2"} and store.get("resp_2")[1] == [{"role": "user", "content": "2"}]


async def test_text_format_json_schema_and_json_object(engines):
    real = engines["default"]
    c = client(real)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}  # fmt: skip
    fmt = {"type": "json_schema", "name": "person", "schema": schema}
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    out, (text, _), obj = await asyncio.gather(  # (one batch)
        c.responses.create(model=NAME, input="Describe a person.", temperature=0, max_output_tokens=60,
                           text={"format": fmt}),
        chat_text(c, [{"role": "user", "content": "Describe a person."}], max_tokens=60, response_format=response_format),
        c.responses.create(model=NAME, input='Return {"ok": true} as JSON.', temperature=0, max_output_tokens=60,
                           text={"format": {"type": "json_object"}}),
    )  # fmt: skip
    person = json.loads(out.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int) and out.output_text == text
    assert out.status == "completed" and out.incomplete_details is None and out.text.format.type == "json_schema"
    assert obj.status == "completed" and json.loads(obj.output_text) == {"ok": True}
    await wait_idle(real)


async def test_a_named_or_required_tool_choice_is_a_function_call_item(engines):
    """Made with structured outputs (no server flags), as on the chat route."""
    c = client(engines["default"])
    choices = ({"type": "function", "name": "get_weather"}, "required")
    outs = await asyncio.gather(*(c.responses.create(model=NAME, input="What is the weather in Paris?", tools=FLAT_TOOLS,
                                                     tool_choice=choice, temperature=0, max_output_tokens=100)
                                  for choice in choices))  # (one batch)  # fmt: skip
    for choice, out in zip(choices, outs):
        assert out.output and all(item.type == "function_call" for item in out.output) and out.output_text == ""
        for call in out.output:
            schema = next(t["parameters"] for t in FLAT_TOOLS if t["name"] == call.name)
            assert set(json.loads(call.arguments)) == set(schema["properties"])
        assert out.tool_choice == choice or out.tool_choice.name == "get_weather"
    await wait_idle(engines["default"])


async def test_tool_calls_are_function_call_items_whole_and_streamed_and_their_output_continues(engine):
    c = client(engine, enable_auto_tool_choice=True, tool_call_parser="hermes")
    kwargs = {"model": NAME, "input": "What is the weather in Paris?", "tools": FLAT_TOOLS, "max_output_tokens": 200,
              "extra_body": forced("Let me check.\n" + CALL)}  # fmt: skip
    out = await c.responses.create(**kwargs)
    message, call = out.output
    assert message.type == "message" and out.output_text == "Let me check." and out.status == "completed"
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == PARIS
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    events = [event async for event in await c.responses.create(**kwargs, stream=True)]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(pieces) == done.arguments == call.arguments and done.name == "get_weather"
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["message", "function_call"]
    final = events[-1].response
    assert [(i.type, getattr(i, "name", None)) for i in final.output] == [("message", None), ("function_call", "get_weather")]
    assert final.output[1].id == done.item_id
    # the call's output continues the conversation: the chat route's answer to the same messages
    follow = [{"type": "function_call_output", "call_id": call.call_id, "output": "22 degrees"}]
    nxt = await c.responses.create(model=NAME, input=follow, previous_response_id=out.id, tools=FLAT_TOOLS,
                                   tool_choice="none", **GREEDY)  # fmt: skip
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": "Let me check.", "tool_calls": [
                    {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "22 degrees"}]  # fmt: skip
    text, prompt_tokens = await chat_text(c, messages, tools=TOOLS, tool_choice="none", max_tokens=12,
                                          extra_body={"ignore_eos": True})  # fmt: skip
    assert nxt.output_text == text and nxt.usage.input_tokens == prompt_tokens
    await wait_idle(engine)


async def test_reasoning_is_a_reasoning_item_whole_and_streamed(engine):
    c = client(engine, reasoning_parser="deepseek_r1")
    kwargs = {"model": NAME, "input": "Weather?", "max_output_tokens": 200,
              "extra_body": forced("<think>The user wants the weather.</think>\n\nIt is sunny.")}  # fmt: skip
    out = await c.responses.create(**kwargs)
    reasoning, message = out.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "The user wants the weather."
    assert message.type == "message" and out.output_text == "\n\nIt is sunny."
    events = [event async for event in await c.responses.create(**kwargs, stream=True)]
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning.content[0].text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == out.output_text
    assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]
    await wait_idle(engine)


@pytest.mark.parametrize("body, named", [
    ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, "max_output_tokens=1000000 cannot be greater than max_model_len"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
    ({"tool_choice": {"type": "file_search"}, "tools": FLAT_TOOLS}, "tool_choice"),
    ({"tools": FLAT_TOOLS}, "--enable-auto-tool-choice"),  # ("auto" without the server's parser, as chat)
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
    ({"temperature": "hot"}, "$.temperature"),
    ({"seed": 2**63}, "$.seed"),
])  # fmt: skip
async def test_bad_requests_are_400s_naming_the_field(engine, body, named):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, NAME)), base_url="http://t") as h:
        answer = await h.post("/v1/responses", json={"model": NAME, "input": "Hi", **body})
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert named in error["message"] and error["type"] == "BadRequestError" and error["code"] == 400
        ok = await h.post("/v1/responses", json={"model": NAME, "input": "Hi", "max_output_tokens": 2})
        assert ok.status_code == 200 and ok.json()["status"] in ("completed", "incomplete")
    await wait_idle(engine)
