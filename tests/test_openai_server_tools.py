"""Tool calls and reasoning in the chat server, as vLLM's: the parsers read what Python's json
module reads (the oracle) whole and streamed at any split, and the server answers with
``tool_calls`` / ``reasoning`` through OpenAI's client. The default model writes no tool calls by
itself: structured outputs force the text it writes (``structured_outputs.choice``, allowed with
tool_choice "auto" as in vLLM), and a named or "required" tool choice is made with them for real."""
from __future__ import annotations

import asyncio
import contextlib
import json
import re

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_openai_server import KV, events, wait_idle
from vllmini import AsyncLLMEngine, EngineArgs
from vllmini.entrypoints.openai.api_server import build_app
from vllmini.entrypoints.openai.output_parser import ChatOutputParser
from vllmini.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from vllmini.entrypoints.openai.tool_parsers import get_tool_parser
from vllmini.entrypoints.openai.tool_parsers.forced_tool_parser import NamedToolParser, RequiredToolParser
from vllmini.entrypoints.openai.tool_parsers.json_stream import JsonStream
from vllmini.entrypoints.openai.tool_parsers.mistral_tool_parser import MistralToolParser
from vllmini.entrypoints.openai.tool_parsers.xlam_tool_parser import XLAMToolParser

NAME = "m"
VLLM_ID, MISTRAL_ID = r"chatcmpl-tool-[0-9a-f]{32}", r"[A-Za-z0-9]{9}"  # vLLM's call ids; Mistral's
XLAM_ID = r"call_\d+_[0-9a-f]{32}"  # (vLLM's xlam parser's)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- the parsers, whole and streamed

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**20), 10**20) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)  # fmt: skip
arguments = st.dictionaries(st.text(max_size=6), json_values, max_size=4)
names = st.text(min_size=1, max_size=8)
layouts = st.sampled_from([{}, {"indent": 2}, {"separators": (",", ":")}, {"ensure_ascii": False}, {"indent": 0}])


def cut(text: str, data: st.DataObject) -> list[str]:
    """``text`` split at random points (deltas, some empty)."""
    points = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def streamed(parser: ChatOutputParser, deltas: list[str]) -> dict:
    """What a client puts together from the streamed deltas; checks each call's first delta
    carries its index, id, type and name and the later ones only arguments."""
    got: dict = {"content": "", "reasoning": "", "calls": {}}
    ids = {MistralToolParser: MISTRAL_ID, XLAMToolParser: XLAM_ID}.get(type(parser.tools), VLLM_ID)
    messages = [parser.delta(d) for d in deltas[:-1]] + [parser.delta(deltas[-1], final=True)]
    for m in messages:
        if m is None:
            continue
        got["content"] += m.content or ""
        assert m.reasoning == m.reasoning_content
        got["reasoning"] += m.reasoning or ""
        for call in m.tool_calls:
            if call.index not in got["calls"]:
                assert re.fullmatch(ids, call.id) and call.type == "function" and call.function.name
                got["calls"][call.index] = [call.function.name, call.function.arguments]
            else:
                assert call.id is None and call.function.name is None
                got["calls"][call.index][1] += call.function.arguments
    assert sorted(got["calls"]) == list(range(len(got["calls"])))
    return {"content": got["content"] or None, "reasoning": got["reasoning"] or None,
            "calls": [tuple(got["calls"][i]) for i in sorted(got["calls"])]}  # fmt: skip


def whole(parser: ChatOutputParser, text: str) -> dict:
    reasoning, content, calls = parser.parse(text)
    calls = [(c.function.name, c.function.arguments) for c in calls]
    return {"content": content or None, "reasoning": reasoning, "calls": calls}


def both(make, text: str, data: st.DataObject) -> dict:
    """The whole parse, checked equal to the streamed one at random splits."""
    expected = whole(make(), text)
    assert streamed(make(), cut(text, data)) == expected
    return expected


def dumps(value, layout: dict) -> str:
    return json.dumps(value, **layout)


def canonical(args: dict) -> str:
    return json.dumps(args, ensure_ascii=False)  # vLLM's arguments text


@SETTINGS
@given(value=st.dictionaries(st.text(max_size=5), json_values, max_size=4) | st.lists(json_values, max_size=4),
       layout=layouts, data=st.data())  # fmt: skip
def test_json_stream_writes_what_json_reads_at_any_split(value, layout, data):
    text = dumps(value, layout) + "trailing"
    stream, written, read = JsonStream(), "", 0
    for delta in cut(text, data):
        n, pieces = stream.feed(delta)
        written += "".join(piece for _, piece in pieces)
        read += n
    assert stream.done and text[read:] == "trailing"
    assert written == json.dumps(json.loads(text[:read]), ensure_ascii=False)


def hermes(auto_reasoning: str | None = None):
    reasoning = None if auto_reasoning is None else get_reasoning_parser(auto_reasoning)(in_reasoning=False)
    return lambda: ChatOutputParser(reasoning and type(reasoning)(), get_tool_parser("hermes")())


@SETTINGS
@given(before=st.text(max_size=12).filter(lambda t: "<tool_call>" not in t),
       calls=st.lists(st.tuples(names, arguments), min_size=1, max_size=3), layout=layouts, gaps=st.sampled_from(["", "\n", " \n "]), close=st.booleans(), data=st.data())  # fmt: skip
def test_hermes_reads_tool_call_blocks_whole_and_streamed(before, calls, layout, gaps, close, data):
    text = before + "".join(f"<tool_call>{gaps}{dumps({'name': n, 'arguments': a}, layout)}{gaps}"
                            + ("</tool_call>" if close else "") + gaps for n, a in calls)  # fmt: skip
    got = both(hermes(), text, data)
    assert got["calls"] == [(n, canonical(a)) for n, a in calls]
    assert got["content"] == (before.rstrip() or None) and got["reasoning"] is None


@SETTINGS
@given(text=st.text(max_size=40).filter(lambda t: "<tool_call>" not in t), data=st.data())
def test_text_without_calls_is_content_as_it_is(text, data):
    for make in (hermes(), lambda: ChatOutputParser(None, get_tool_parser("llama3_json")())):
        got = both(make, text, data)
        if not text.lstrip().startswith("{"):
            assert got == {"content": text or None, "reasoning": None, "calls": []}


@SETTINGS
@given(calls=st.lists(st.tuples(names, arguments, st.sampled_from(["parameters", "arguments"])), min_size=1, max_size=3),
       tag=st.sampled_from(["", "<|python_tag|>", " <|python_tag|> "]), sep=st.sampled_from([";", "; ", " ;\n"]),
       after=st.sampled_from(["", " Done.", "\nok"]), layout=layouts, data=st.data())  # fmt: skip
def test_llama3_json_reads_calls_separated_by_semicolons(calls, tag, sep, after, layout, data):
    text = tag + sep.join(dumps({"name": n, key: a}, layout) for n, a, key in calls) + after
    got = both(lambda: ChatOutputParser(None, get_tool_parser("llama3_json")()), text, data)
    assert got["calls"] == [(n, canonical(a)) for n, a, _ in calls]
    assert got["content"] == (after.strip() or None)


@SETTINGS
@given(calls=st.lists(st.tuples(names, arguments), min_size=1, max_size=3), layout=layouts, data=st.data())
def test_a_required_choice_reads_the_array_and_a_named_one_takes_the_output_as_arguments(calls, layout, data):
    text = dumps([{"name": n, "parameters": a} for n, a in calls], layout)
    got = both(lambda: ChatOutputParser(None, RequiredToolParser()), text, data)
    assert got["calls"] == [(n, canonical(a)) for n, a in calls] and got["content"] is None
    named = both(lambda: ChatOutputParser(None, NamedToolParser(name="f")), text, data)
    assert named["calls"] == [("f", text)]


@SETTINGS
@given(reasoning=st.text(max_size=15).filter(lambda t: "<" not in t), content=st.text(max_size=15), opened=st.booleans(),
       data=st.data())  # fmt: skip
def test_reasoning_is_the_text_before_think_end(reasoning, content, opened, data):
    text = ("<think>" if opened else "") + reasoning + "</think>" + content
    for name, in_reasoning in (("deepseek_r1", True), ("olmo3", True), ("qwen3", True), ("qwen3", False), ("exaone4", True),
                               ("exaone4", False)):  # fmt: skip
        cls = get_reasoning_parser(name)
        got = both(lambda: ChatOutputParser(cls(in_reasoning=in_reasoning), None), text, data)
        if opened or in_reasoning:
            assert got == {"reasoning": reasoning or None, "content": content or None, "calls": []}
        else:  # qwen3 (exaone4) whose <think> was neither written nor left open by the prompt: all content
            assert got == {"reasoning": None, "content": text, "calls": []}


@SETTINGS
@given(text=st.text(max_size=30).filter(lambda t: "</think>" not in t and not t.lstrip().startswith("<")), data=st.data())
def test_without_think_end_deepseek_r1_is_all_reasoning_and_qwen3_all_content(text, data):
    for name in ("deepseek_r1", "olmo3"):
        parser = get_reasoning_parser(name)
        assert both(lambda: ChatOutputParser(parser(in_reasoning=parser.starts_in_reasoning("")), None), text, data) == \
            {"reasoning": text or None, "content": None, "calls": []}  # fmt: skip
    for name in ("qwen3", "exaone4"):
        parser = get_reasoning_parser(name)
        assert both(lambda: ChatOutputParser(parser(in_reasoning=parser.starts_in_reasoning("")), None), text, data) == \
            {"reasoning": None, "content": text or None, "calls": []}  # fmt: skip


@SETTINGS
@given(reasoning=st.text(max_size=15).filter(lambda t: "Here" not in t), content=st.text(max_size=15),
       opening=st.sampled_from(["Here is my thought process:", "Here's my thought process:"]),
       closing=st.sampled_from(["Here is my response:", "Here's my response:"]), closed=st.booleans(), data=st.data())  # fmt: skip
def test_granite_reasons_between_its_plain_text_markers(reasoning, content, opening, closing, closed, data):
    """Granite 3.2's markers in either wording; without the response marker the rest is reasoning."""
    granite = lambda: ChatOutputParser(get_reasoning_parser("granite")(), None)  # noqa: E731
    got = both(granite, opening + reasoning + (closing + content if closed else ""), data)
    assert got == {"reasoning": reasoning or None, "content": (content if closed else "") or None, "calls": []}
    text = "Sure. " + opening + reasoning + closing + content  # (not opening the output: all content)
    assert both(granite, text, data) == {"reasoning": None, "content": text, "calls": []}


def test_qwen3_starts_in_reasoning_only_when_the_prompt_leaves_think_open():
    qwen3 = get_reasoning_parser("qwen3")
    assert qwen3.starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not qwen3.starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking=False
    assert not qwen3.starts_in_reasoning("<|im_start|>assistant\n")
    assert get_reasoning_parser("deepseek_r1").starts_in_reasoning("<|Assistant|>")
    exaone4 = get_reasoning_parser("exaone4")  # EXAONE 4.0's template, enable_thinking on and off
    assert exaone4.starts_in_reasoning("[|assistant|]<think>\n") and not exaone4.starts_in_reasoning("[|assistant|]")
    assert get_reasoning_parser("olmo3").starts_in_reasoning("<|im_start|>assistant\n")


@SETTINGS
@given(reasoning=st.text(max_size=10).filter(lambda t: "<" not in t),
       calls=st.lists(st.tuples(names, arguments), min_size=1, max_size=2), data=st.data())  # fmt: skip
def test_tool_calls_are_read_in_the_content_after_the_reasoning(reasoning, calls, data):
    blocks = [f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls]
    text = f"<think>{reasoning}</think>\n\n" + "\n".join(blocks)
    got = both(hermes("deepseek_r1"), text, data)
    assert got == {"reasoning": reasoning or None, "content": None, "calls": [(n, canonical(a)) for n, a in calls]}


@SETTINGS
@given(data=st.data())
def test_an_unreadable_call_is_content_whole_and_streamed(data):
    """As vLLM, a block whose JSON cannot be read makes the output content (the streamed deltas
    too, as nothing of the call was sent); a truncated call is content in the whole answer."""
    for text in ("Hi <tool_call>not json</tool_call> bye", "<tool_call>{\"arguments\": {}}</tool_call>",
                 "<tool_call>{\"name\": 3, \"arguments\": {}}</tool_call>"):  # fmt: skip
        assert both(hermes(), text, data) == {"content": text, "reasoning": None, "calls": []}
    truncated = '<tool_call>{"name": "f", "arguments": {"a": '
    assert whole(hermes()(), truncated) == {"content": truncated, "reasoning": None, "calls": []}
    assert streamed(hermes()(), cut(truncated, data))["calls"] == [("f", '{"a": ')]  # (already sent, as vLLM's)
    assert whole(ChatOutputParser(None, get_tool_parser("llama3_json")()), '{"name": "f"} x') == \
        {"content": "x", "reasoning": None, "calls": [("f", "{}")]}  # (no parameters: {})  # fmt: skip


def test_only_the_first_call_is_kept_without_parallel_tool_calls():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    parser = ChatOutputParser(None, get_tool_parser("hermes")(), parallel_tool_calls=False)
    assert [c.function.name for c in parser.parse(text)[2]] == ["a"]
    parser = ChatOutputParser(None, get_tool_parser("hermes")(), parallel_tool_calls=False)
    assert streamed(parser, [text[:30], text[30:]])["calls"] == [("a", "{}")]


def test_unknown_parser_names_are_refused_naming_the_choices():
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        get_tool_parser("nope")
    with pytest.raises(ValueError, match="deepseek_r1, ernie45, exaone4, glm45, granite, mistral, olmo3, openai_gptoss, qwen3"):
        get_reasoning_parser("nope")


# -- the server

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "required": ["city", "unit"],
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}},
]  # fmt: skip
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
PARIS = {"city": "Paris", "unit": "celsius"}


@contextlib.contextmanager
def serving(model_dir):
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(model_dir), kv_cache_memory=KV, served_model_name=NAME))
    try:
        yield eng
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def engine(tiny_dir):
    """The tiny random model: quick, for the texts that structured outputs force."""
    with serving(tiny_dir) as eng:
        yield eng


@pytest.fixture(scope="module")
def real(default_model_dir):
    """The default model, whose JSON a tool's schema shapes (the random one writes whitespace
    the schema allows until max_tokens)."""
    with serving(default_model_dir) as eng:
        yield eng


def http(engine, **parsers) -> httpx.AsyncClient:
    """A client of the app with these parsers (build_app's keywords), in process."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, NAME, **parsers)), base_url="http://test")


def client(engine, **parsers) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key="none", base_url="http://test/v1", http_client=http(engine, **parsers), max_retries=0)


HERMES = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}


def forced(text: str) -> dict:
    """The model writes exactly ``text`` (then its EOS), in the same tokens each time (greedy)."""
    return {"structured_outputs": {"choice": [text]}, "temperature": 0}


def streamed_calls(chunks, ids: str = VLLM_ID) -> tuple[str, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], last finish_reason) of an OpenAI client's stream (``ids``:
    the calls' id format)."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        assert "<tool_call>" not in (delta.content or "")
        for call in delta.tool_calls or []:
            if call.index not in calls:
                assert re.fullmatch(ids, call.id) and call.type == "function"
                calls[call.index] = [call.function.name, call.function.arguments or ""]
            else:
                assert call.id is None and call.function.name is None
                calls[call.index][1] += call.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


async def calls_after_reasoning(engine, parsers: dict, extra_body: dict) -> tuple[str | None, list[tuple[str, str]]]:
    """The reasoning and (name, arguments) calls of an output (``extra_body``: how it is made)
    through the chat route with these parsers (build_app's keywords), checked alike whole and
    streamed, with no content and finish_reason "tool_calls"."""
    c = client(engine, **parsers)
    kwargs = {"model": NAME, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 300, "extra_body": extra_body}
    choice = (await c.chat.completions.create(**kwargs)).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls]
    chunks = [chunk async for chunk in await c.chat.completions.create(**kwargs, stream=True)]
    assert streamed_calls(chunks) == ("", calls, "tool_calls")
    reasoning = "".join(getattr(ch.choices[0].delta, "reasoning", None) or "" for ch in chunks)
    assert (reasoning or None) == choice.message.reasoning
    await wait_idle(engine)
    return choice.message.reasoning, calls


async def test_auto_tool_calls_whole_and_streamed_through_the_openai_client(engine):
    text = "Let me check.\n" + CALL
    raw = await client(engine).chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=200,
                                                       extra_body=forced(text))  # fmt: skip
    assert raw.choices[0].message.content == text  # what the model writes: the server without a parser says so
    c = client(engine, **HERMES)
    out = await c.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                          extra_body=forced(text))  # (tool_choice left out: "auto")  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == PARIS
    stream = await c.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                                             max_tokens=200, stream=True, extra_body=forced(text))  # fmt: skip
    chunks = [chunk async for chunk in stream]
    assert streamed_calls(chunks) == ("Let me check.", [("get_weather", call.function.arguments)], "tool_calls")
    await wait_idle(engine)


async def test_llama3_json_calls_and_parallel_tool_calls_false(engine):
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; ' \
           '{"name": "get_time", "parameters": {"tz": "CET"}}'  # fmt: skip
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 200, **forced(text)}
    async with http(engine, enable_auto_tool_choice=True, tool_call_parser="llama3_json") as h:
        both_calls = (await h.post("/v1/chat/completions", json=body)).json()["choices"][0]
        first = (await h.post("/v1/chat/completions", json={**body, "parallel_tool_calls": False})).json()["choices"][0]
        streamed_first = events((await h.post("/v1/chat/completions", json={**body, "parallel_tool_calls": False,
                                                                             "stream": True})).text)  # fmt: skip
    assert both_calls["message"]["content"] is None and both_calls["finish_reason"] == "tool_calls"
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in both_calls["message"]["tool_calls"]]
    assert calls == [("get_weather", PARIS), ("get_time", {"tz": "CET"})]
    (kept,) = first["message"]["tool_calls"]
    assert kept == {**both_calls["message"]["tool_calls"][0], "id": kept["id"]}
    indices = {c["index"] for chunk in streamed_first for ch in chunk["choices"] for c in ch["delta"].get("tool_calls", [])}
    assert indices == {0}
    await wait_idle(engine)


@pytest.mark.parametrize("name, text, content", [
    ("deepseek_r1", "<think>The user wants the weather.</think>\n\nIt is sunny.", "\n\nIt is sunny."),
    ("mistral", "[THINK]The user wants the weather.[/THINK]It is sunny.", "It is sunny."),  # (Magistral's)
])  # fmt: skip
async def test_reasoning_and_content_apart_whole_and_streamed(engine, name, text, content):
    body = {"messages": MESSAGES, "max_tokens": 200, **forced(text)}
    async with http(engine, reasoning_parser=name) as h:
        whole_msg = (await h.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
        chunks = events((await h.post("/v1/chat/completions", json={**body, "stream": True})).text)
    assert whole_msg["reasoning"] == whole_msg["reasoning_content"] == "The user wants the weather."
    assert whole_msg["content"] == content and "tool_calls" not in whole_msg
    deltas = [ch["delta"] for chunk in chunks[1:] for ch in chunk["choices"]]
    assert "".join(d.get("reasoning", "") for d in deltas) == whole_msg["reasoning"]
    assert "".join(d.get("content", "") for d in deltas) == whole_msg["content"]
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert not any(d.get("reasoning") for d in deltas[first_content:])  # reasoning first, then content
    async with http(engine, reasoning_parser=name) as h:  # vLLM's include_reasoning=false: left out
        hidden = (await h.post("/v1/chat/completions", json={**body, "include_reasoning": False})).json()["choices"][0]["message"]
        chunks = events((await h.post("/v1/chat/completions", json={**body, "include_reasoning": False, "stream": True})).text)
    assert hidden["reasoning"] is None and hidden["content"] == whole_msg["content"]
    deltas = [ch["delta"] for chunk in chunks[1:] for ch in chunk["choices"]]
    assert not any(d.get("reasoning") for d in deltas) and "".join(d.get("content", "") for d in deltas) == hidden["content"]
    await wait_idle(engine)


async def test_unforced_output_is_reasoning_for_deepseek_r1_and_content_for_qwen3(engine):
    """The model's own greedy text (the plain server's content is the oracle): DeepSeek-R1's
    output starts in reasoning, Qwen3's is content without a <think>."""
    body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    async with http(engine) as h:
        plain = (await h.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]["content"]
    async with http(engine, reasoning_parser="deepseek_r1") as h:
        r1 = (await h.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
    async with http(engine, reasoning_parser="qwen3") as h:
        kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
        qwen3 = (await h.post("/v1/chat/completions", json={**body, **kwargs})).json()["choices"][0]["message"]
    assert "<think>" not in plain and "</think>" not in plain
    assert (r1["reasoning"], r1["content"]) == (plain, None)
    assert (qwen3["reasoning"], qwen3["content"]) == (None, plain)
    await wait_idle(engine)


async def test_reasoning_then_tool_calls(engine):
    text = "<think>I need the weather tool.</think>\n\n" + CALL
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 200, **forced(text)}
    async with http(engine, reasoning_parser="qwen3", **HERMES) as h:
        choice = (await h.post("/v1/chat/completions", json=body)).json()["choices"][0]
        chunks = events((await h.post("/v1/chat/completions", json={**body, "stream": True})).text)
    message = choice["message"]
    assert (message["reasoning"], message["content"]) == ("I need the weather tool.", None)
    assert choice["finish_reason"] == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == PARIS
    deltas = [ch["delta"] for chunk in chunks[1:] for ch in chunk["choices"]]
    assert "".join(d.get("reasoning", "") for d in deltas) == message["reasoning"]
    assert not any(d.get("content") for d in deltas)
    pieces = [c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", [])]
    assert "".join(pieces) == call["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    await wait_idle(engine)


async def test_named_and_required_tool_choices_are_made_with_structured_outputs(real):
    """No flags needed (as vLLM): the output follows the function's parameters (named) or an
    array of {name, parameters} (required); greedy, so the stream writes the same calls."""
    c = client(real)
    named = {"type": "function", "function": {"name": "get_weather"}}

    async def whole_and_streamed(tool_choice):
        kwargs = {"model": NAME, "messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 100,
                  "temperature": 0}  # fmt: skip
        stream = await c.chat.completions.create(**kwargs, stream=True)
        whole, chunks = await asyncio.gather(c.chat.completions.create(**kwargs), stream_chunks(stream))
        return whole.choices[0], chunks

    async def stream_chunks(stream):
        return [chunk async for chunk in stream]

    results = await asyncio.gather(whole_and_streamed(named), whole_and_streamed("required"))  # (one batch)
    for (choice, chunks), finish in zip(results, ("stop", "tool_calls")):  # (OpenAI's and vLLM's finish reasons)
        assert choice.finish_reason == finish and choice.message.content == ""
        calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls]
        for name, arguments in calls:
            schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
            args = json.loads(arguments)
            assert set(args) == set(schema["properties"]) and all(isinstance(v, str) for v in args.values())
            assert args.get("unit", "celsius") in ("celsius", "fahrenheit")
        if finish == "stop":
            assert [name for name, _ in calls] == ["get_weather"]
        assert streamed_calls(chunks) == ("", calls, finish)
    await wait_idle(real)


async def test_tool_choice_none_parses_nothing_and_still_hands_the_tools_to_the_template(engine):
    text = "Let me check.\n" + CALL
    template = ("{% for t in tools %}{{ t['function']['name'] }};{% endfor %}"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}")  # fmt: skip
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none", "max_tokens": 200, "chat_template": template,
            **forced(text)}  # fmt: skip
    async with http(engine, **HERMES, trust_request_chat_template=True) as h:
        out = (await h.post("/v1/chat/completions", json=body)).json()
    assert out["choices"][0]["message"] == {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                                            "audio": None, "function_call": None, "reasoning": None}  # (vLLM's nulls)
    assert out["choices"][0]["finish_reason"] == "stop"
    tok = engine.get_tokenizer()
    expected = tok("get_weather;get_time;" + MESSAGES[0]["content"], add_special_tokens=False).input_ids
    assert out["usage"]["prompt_tokens"] == len(expected)
    await wait_idle(engine)


async def test_tool_messages_and_assistant_tool_calls_render_through_the_template(engine):
    """As vLLM: an assistant message's arguments (JSON text) reach the template as a dict."""
    template = ("{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}call {{ c.function.name }}"
                "({{ c.function.arguments.city }}){% endfor %}{% elif m.role == 'tool' %}[{{ m.tool_call_id }}] "
                "{{ m.content }}{% else %}{{ m.role }}: {{ m.content }}{% endif %}{{ '\\n' }}{% endfor %}")  # fmt: skip
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(PARIS)}}]
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]  # fmt: skip
    async with http(engine, **HERMES, trust_request_chat_template=True) as h:
        tokens = (await h.post("/tokenize", json={"messages": messages, "chat_template": template})).json()["tokens"]
        reply = await h.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS, "chat_template": template,
                                                             "max_tokens": 3})  # fmt: skip
    expected = f"user: {MESSAGES[0]['content']}\ncall get_weather(Paris)\n[call_1] 18 C\n"
    assert tokens == engine.get_tokenizer()(expected, add_special_tokens=False).input_ids
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == len(tokens)
    await wait_idle(engine)


async def test_a_call_cut_short_is_content_not_an_error(engine):
    """As vLLM: a call whose JSON the output does not finish comes back as content, not an error."""
    text = "Let me check.\n" + CALL
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 200, **forced(text)}
    async with http(engine, **HERMES) as h:
        full = (await h.post("/v1/chat/completions", json=body)).json()["usage"]["completion_tokens"]
        cut_short = {**body, "max_tokens": full // 2}  # (inside the call's JSON)
        choice = (await h.post("/v1/chat/completions", json=cut_short)).json()["choices"][0]
        streamed_body = (await h.post("/v1/chat/completions", json={**cut_short, "stream": True})).text
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert text.startswith(choice["message"]["content"]) and '<tool_call>\n{"name"' in choice["message"]["content"]
    assert all("error" not in chunk for chunk in events(streamed_body))
    await wait_idle(engine)


BAD = [
    ({}, {"tools": TOOLS}, "--enable-auto-tool-choice and --tool-call-parser"),
    ({}, {"tools": TOOLS, "tool_choice": "auto"}, "--enable-auto-tool-choice and --tool-call-parser"),
    (HERMES, {"tools": []}, "tools must not be an empty array"),
    (HERMES, {"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0].function.name"),
    (HERMES, {"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    (HERMES, {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    (HERMES, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    (HERMES, {"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function.name"),
    (HERMES, {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    (HERMES, {"tool_choice": "required"}, "tools must be set"),
    (HERMES, {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    (HERMES, {"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
]  # fmt: skip


async def test_bad_tool_requests_are_a_400_naming_the_field_and_others_go_on(engine):
    async with http(engine, **HERMES) as h:
        good = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 200, **forced("Let me check.\n" + CALL)}
        goods = [asyncio.ensure_future(h.post("/v1/chat/completions", json={**good, "stream": i % 2 == 1}))
                 for i in range(4)]  # fmt: skip
        for parsers, body, named in BAD:
            async with http(engine, **parsers) as bad:
                r = await bad.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **body})
            assert r.status_code == 400 and named in r.json()["error"]["message"], (body, r.text)
        done = await asyncio.gather(*goods)
    assert [r.status_code for r in done] == [200] * 4
    assert all(r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather" for r in done[::2])
    assert all('"name":"get_weather"' in r.text for r in done[1::2])
    await wait_idle(engine)


def test_the_serve_flags(tiny_dir, engine, capsys, monkeypatch):
    """vLLM's flags: an unknown parser name exits naming the choices, --enable-auto-tool-choice
    without a parser stops before the model loads, and the flags reach the app."""
    from vllmini.cli import main

    for flag in ("--tool-call-parser", "--reasoning-parser"):
        with pytest.raises(SystemExit) as exit_:
            main(["serve", str(tiny_dir), flag, "nope"])
        assert exit_.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err
    assert main(["serve", str(tiny_dir), "--enable-auto-tool-choice"]) == 2
    assert "--enable-auto-tool-choice requires --tool-call-parser" in capsys.readouterr().err
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        build_app(engine, NAME, enable_auto_tool_choice=True)
    seen = {}

    def run_server(engine, name, host, port, chat_template, api_key, lora_modules, uvicorn_options, **parsers):
        seen.update(parsers)
        build_app(engine, name, **parsers)
        engine.shutdown()

    monkeypatch.setattr("vllmini.entrypoints.openai.api_server.run_server", run_server)
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json", "--reasoning-parser", "qwen3"]
    assert main(["serve", str(tiny_dir), "--kv-cache-memory", str(KV), *flags]) == 0
    assert seen == {"enable_auto_tool_choice": True, "tool_call_parser": "llama3_json", "reasoning_parser": "qwen3",
                    "max_request_body_size": 32 << 20, "enable_prompt_tokens_details": False, "cors": None,
                    "response_role": "assistant", "return_tokens_as_token_ids": False,
                    "enable_request_id_headers": False, "enable_force_include_usage": False,
                    "trust_request_chat_template": False}  # (the defaults)
    assert main(["serve", str(tiny_dir), "--max-request-body-size", "1000", "--kv-cache-memory", str(KV)]) == 0
    assert seen["max_request_body_size"] == 1000
    assert main(["serve", str(tiny_dir), "--trust-request-chat-template", "--kv-cache-memory", str(KV)]) == 0
    assert seen["trust_request_chat_template"] is True
    assert main(["serve", str(tiny_dir), "--enable-prompt-tokens-details", "--kv-cache-memory", str(KV)]) == 0
    assert seen["enable_prompt_tokens_details"] is True
    assert main(["serve", str(tiny_dir), "--max-request-body-size", "-1"]) == 2  # (before the model loads)
    assert "--max-request-body-size must be >= 0" in capsys.readouterr().err
