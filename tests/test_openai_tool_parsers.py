"""vLLM's pythonic, mistral, phi4_mini_json, granite and qwen3_coder tool-call parsers: each reads what Python's own
readers read (``repr``/``ast`` for the Python calls, ``json`` for Mistral's array, the schema's
types for Qwen3-Coder's XML), whole and streamed at any split of the text alike; text before and
after the calls is content; broken calls are content and never an error. Then each through the
chat server, the tiny model made to write the calls with ``structured_outputs.choice`` (as
test_openai_server_tools.py does)."""
from __future__ import annotations

import json
import keyword
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from test_openai_server_tools import (
    MESSAGES, MISTRAL_ID, NAME, PARIS, SETTINGS, TOOLS, VLLM_ID, arguments, both, canonical, client, cut, dumps,
    events, forced, http, json_values, layouts, serving, streamed, streamed_calls, wait_idle, whole,
)  # fmt: skip
from vllmini.entrypoints.openai.output_parser import ChatOutputParser
from vllmini.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser
from vllmini.entrypoints.openai.tool_parsers.qwen3coder_tool_parser import convert


def parser(name: str, tools: list | None = None):
    return lambda: ChatOutputParser(None, get_tool_parser(name)(None, tools))


identifiers = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True).filter(lambda n: not keyword.iskeyword(n))


def as_json(value):
    """What a Python literal is in JSON (tuples are arrays)."""
    if isinstance(value, (list, tuple)):
        return [as_json(v) for v in value]
    if isinstance(value, dict):
        return {k: as_json(v) for k, v in value.items()}
    return value


def python(value, style: int) -> str:
    """``value`` as Python source, in one of a few styles (quotes, tuples, spacing)."""
    if isinstance(value, str):
        return [repr(value), json.dumps(value, ensure_ascii=False), repr(value), "r" + repr(value) if "\\" not in repr(value) else repr(value)][style]
    if isinstance(value, list):
        items = [python(v, style) for v in value]
        if style == 1 and value:
            return "(" + ", ".join(items) + ",)"  # a tuple: an array in JSON
        return "[" + (",\n " if style == 2 else ", ").join(items) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{python(k, style)}: {python(v, style)}" for k, v in value.items()) + "}"
    return repr(value)


py_calls = st.lists(st.tuples(identifiers, st.dictionaries(identifiers, json_values, max_size=4)), min_size=1, max_size=3)


# -- pythonic


@SETTINGS
@given(calls=py_calls, style=st.integers(0, 3), sep=st.sampled_from([", ", ",", ",\n  "]),
       eq=st.sampled_from(["=", " = "]), lead=st.sampled_from(["", " ", "\n"]),
       after=st.sampled_from(["", " Done.", "\nok"]), data=st.data())  # fmt: skip
def test_pythonic_reads_the_call_list_whole_and_streamed(calls, style, sep, eq, lead, after, data):
    text = lead + "[" + sep.join(f"{n}({sep.join(f'{k}{eq}{python(v, style)}' for k, v in a.items())})"
                                  for n, a in calls) + "]" + after  # fmt: skip
    got = both(parser("pythonic"), text, data)
    assert got["calls"] == [(n, canonical(as_json(a))) for n, a in calls]
    assert got["content"] == (after.strip() or None)


@SETTINGS
@given(before=st.text(max_size=10).filter(lambda t: t.strip() and not t.lstrip().startswith("[")), data=st.data())
def test_pythonic_text_before_the_list_makes_it_all_content(before, data):
    """As vLLM: the calls are a list that opens the output."""
    text = before + "[get_weather(city='Paris')]"
    assert both(parser("pythonic"), text, data) == {"content": text, "reasoning": None, "calls": []}


PY_BROKEN = [
    "[1, 2, 3] are numbers", "[]", "[get_weather('Paris')]", "[f(a=b)]", "[f(a=1, a=2)]", "[x.f(a=1)]",
    "[f(**kw)]", "[f(a=open('/etc/passwd').read())]", "[f(a=__import__('os').system('exit 3'))]", "[f(a=1) g()]",
    "[f(a=[1, 2)]", "[None(a=1)]", "[f(class=1)]", "[f(a=)]", "[f(a={1, 2})]", "[f(a=b'x')]", "[f(a=1e999)]",
    "[f(a=1 # c\n)]", "[f(a=f'{x}')]", "[f(a=lambda: 1)]",
]  # fmt: skip


@SETTINGS
@given(data=st.data())
def test_pythonic_calls_that_are_not_literal_keyword_calls_are_content(data):
    """Nothing is run (open, __import__...): such a list is content, whole and streamed when no
    call was written yet; a list cut short is content in the whole answer."""
    for text in PY_BROKEN:
        got = whole(parser("pythonic")(), text)
        assert got == {"content": text, "reasoning": None, "calls": []}, text
        if not re.match(r"\[\w+\(", text):  # (no call's name written before the break)
            assert streamed(parser("pythonic")(), cut(text, data)) == got
    assert whole(parser("pythonic")(), "[f(a='x'") == {"content": "[f(a='x'", "reasoning": None, "calls": []}
    assert streamed(parser("pythonic")(), cut("[f(a=1, b='x'", data))["calls"] == [("f", '{"a": 1')]


def test_pythonic_reads_python_literal_syntax():
    text = """[f(a='''it's "x"''', b=r'\\d+', c=-1_000, d=(1, 'two'), e={'k': None, 1: True}, g='a' 'b', h=0x1F, i=.5)]"""
    (call,) = whole(parser("pythonic")(), text)["calls"]
    assert json.loads(call[1]) == {"a": 'it\'s "x"', "b": "\\d+", "c": -1000, "d": [1, "two"], "e": {"k": None, "1": True},
                                   "g": "ab", "h": 31, "i": 0.5}  # fmt: skip


# -- mistral


@SETTINGS
@given(before=st.text(max_size=12).filter(lambda t: "[TOOL_CALLS]" not in t), calls=st.lists(st.tuples(identifiers, arguments), min_size=1, max_size=3),
       layout=layouts, gap=st.sampled_from(["", " ", "\n"]), after=st.sampled_from(["", " Done.", "\nok"]), data=st.data())  # fmt: skip
def test_mistral_reads_the_array_after_tool_calls_whole_and_streamed(before, calls, layout, gap, after, data):
    text = before + "[TOOL_CALLS]" + gap + dumps([{"name": n, "arguments": a} for n, a in calls], layout) + after
    got = both(parser("mistral"), text, data)
    assert got["calls"] == [(n, canonical(a)) for n, a in calls]
    assert got["content"] == ((before.rstrip() + after.lstrip()) or None)


def test_mistral_call_ids_are_nine_letters_and_digits():
    text = '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"a": 1}}]'
    calls = parser("mistral")().parse(text)[2]
    assert [c.function.name for c in calls] == ["f", "g"] and all(re.fullmatch(MISTRAL_ID, c.id) for c in calls)
    assert len({c.id for c in calls}) == 2
    assert streamed(parser("mistral")(), [text[:20], text[20:]])["calls"] == [("f", "{}"), ("g", '{"a": 1}')]


@SETTINGS
@given(before=st.text(max_size=12).filter(lambda t: "functools" not in t), calls=st.lists(st.tuples(identifiers, arguments), min_size=1, max_size=3),
       layout=layouts, gap=st.sampled_from(["", " ", "\n"]), key=st.sampled_from(["arguments", "parameters"]), data=st.data())  # fmt: skip
def test_phi4_mini_reads_the_array_after_functools_whole_and_streamed(before, calls, layout, gap, key, data):
    """Phi-4-mini's ``functools[...]``: the word is plain text, split across tokens when streamed."""
    text = before + "functools" + gap + dumps([{"name": n, key: a} for n, a in calls], layout)
    got = both(parser("phi4_mini_json"), text, data)
    assert got["calls"] == [(n, canonical(a)) for n, a in calls]
    assert got["content"] == (before.rstrip() or None)
    assert both(parser("phi4_mini_json"), "functional tools[1]", data)["calls"] == []  # (not the word: content)


@SETTINGS
@given(calls=st.lists(st.tuples(identifiers, arguments), min_size=1, max_size=3), tags=st.sampled_from(["<|tool_call|>", "<tool_call>", "<|tool_call|><tool_call>", ""]),
       lead=st.sampled_from(["", " ", "\n"]), gap=st.sampled_from(["", " ", "\n"]), after=st.sampled_from(["", "\n", " Done."]), layout=layouts,
       data=st.data())  # fmt: skip
def test_granite_reads_the_array_after_either_tag_whole_and_streamed(calls, tags, lead, gap, after, layout, data):
    """Granite 3.0's <|tool_call|> token, 3.1's <tool_call> string, both or neither, then the array."""
    text = lead + tags + gap + dumps([{"name": n, "arguments": a} for n, a in calls], layout) + after
    got = both(parser("granite"), text, data)
    assert got["calls"] == [(n, canonical(a)) for n, a in calls]
    assert got["content"] == (after.strip() or None)


@SETTINGS
@given(data=st.data())
def test_granite_output_not_opening_with_calls_is_content(data):
    for text in ('Sure. <|tool_call|>[{"name": "f", "arguments": {}}]', "<tool_call>not json", "<|tool_call|>[1]",
                 '{"name": "f", "arguments": {}}', "<tool_calls are>", "[] is empty"):  # fmt: skip
        assert both(parser("granite"), text, data) == {"content": text, "reasoning": None, "calls": []}, text


@SETTINGS
@given(data=st.data())
def test_mistral_broken_calls_are_content(data):
    for text in ('[TOOL_CALLS]{"name": "f", "arguments": {}}', "Hi[TOOL_CALLS] not json", "[TOOL_CALLS][]",
                 '[TOOL_CALLS][{"arguments": {}}]', '[TOOL_CALLS][{"name": 3}]', "[TOOL_CALLS][1]"):  # fmt: skip
        assert both(parser("mistral"), text, data) == {"content": text, "reasoning": None, "calls": []}, text
    text = '[TOOL_CALLS][{"name": "f", "arguments": {"a": '
    assert whole(parser("mistral")(), text) == {"content": text, "reasoning": None, "calls": []}


# -- qwen3_coder

KINDS = {
    "string": st.text(max_size=8).filter(lambda t: "<" not in t and t.lower() != "null" and t.strip("\n") == t),
    "integer": st.integers(-(10**12), 10**12), "number": st.floats(allow_nan=False, allow_infinity=False),
    "boolean": st.booleans(), "object": st.dictionaries(st.text(max_size=4), json_values, max_size=3),
    "array": st.lists(json_values, max_size=3),
}  # fmt: skip


def xml_value(kind: str, value) -> tuple[str, object]:
    """(the parameter's text as Qwen3-Coder writes it, the value it means)."""
    if kind == "string":
        return value, value
    if kind == "boolean":
        return ("true" if value else "false"), value
    if kind == "number":
        return repr(value), int(value) if value.is_integer() else value
    if kind == "integer":
        return str(value), value
    return json.dumps(value, ensure_ascii=False), value


coder_params = st.dictionaries(identifiers, st.sampled_from(sorted(KINDS)).flatmap(lambda k: st.tuples(st.just(k), KINDS[k])), max_size=4)


@SETTINGS
@given(before=st.text(max_size=12).filter(lambda t: "<tool_call>" not in t),
       calls=st.lists(st.tuples(identifiers, coder_params), min_size=1, max_size=3, unique_by=lambda c: c[0]), nl=st.sampled_from(["", "\n"]),
       close=st.booleans(), one_block=st.booleans(), after=st.sampled_from(["", " Done.", "\nok"]), data=st.data())  # fmt: skip
def test_qwen3_coder_reads_xml_calls_typed_by_the_schema_whole_and_streamed(before, calls, nl, close, one_block, after, data):
    tools, functions, expected = [], [], []
    for name, params in calls:
        props = {p: {"type": kind} for p, (kind, _) in params.items()}
        tools.append({"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}})
        body = "".join(f"<parameter={p}>{nl}{xml_value(kind, v)[0]}{nl}" + ("</parameter>" + nl if close else "")
                       for p, (kind, v) in params.items())  # fmt: skip
        functions.append(f"<function={name}>{nl}{body}</function>")
        expected.append((name, canonical({p: xml_value(kind, v)[1] for p, (kind, v) in params.items()})))
    if one_block:
        blocks = f"<tool_call>{nl}" + nl.join(functions) + f"{nl}</tool_call>"
    else:
        blocks = nl.join(f"<tool_call>{nl}{f}{nl}</tool_call>" for f in functions)
    text = before + blocks + after
    got = both(parser(data.draw(st.sampled_from(["qwen3_coder", "qwen3_xml"])), tools), text, data)  # (one format)
    assert got["calls"] == expected
    assert got["content"] == ((before.rstrip() + after.lstrip()) or None)


def test_qwen3_coder_converts_values_as_vllm():
    assert convert("null", {"type": "integer"}) is None and convert("NULL", None) is None
    assert convert("42", {"type": "integer"}) == 42 and convert("4.2", {"type": "integer"}) == "4.2"
    assert convert("3.0", {"type": "number"}) == 3 and convert("2.5", {"type": "float"}) == 2.5
    assert convert("inf", {"type": "number"}) == "inf" and convert("x", {"type": "number"}) == "x"
    assert convert("True", {"type": "boolean"}) is True and convert("yes", {"type": "boolean"}) is False
    assert convert('{"a": [1]}', {"type": "object"}) == {"a": [1]} and convert("{'a': 1}", {"type": "dict"}) == {"a": 1}
    assert convert("[1, 2", {"type": "array"}) == "[1, 2" and convert("Paris", {"type": "string"}) == "Paris"
    assert convert("7", {}) == "7" and convert("(1, 2)", {"type": "tuple"}) == (1, 2)
    assert convert("__import__('os')", {"type": "object"}) == "__import__('os')"  # (read, never run)


def test_qwen3_coder_without_tools_or_for_unknown_parameters_keeps_text():
    text = "<tool_call>\n<function=f>\n<parameter=n>\n5\n</parameter>\n<parameter=s>\nnull\n</parameter>\n</function>\n</tool_call>"
    assert whole(parser("qwen3_coder")(), text)["calls"] == [("f", '{"n": "5", "s": null}')]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}}]
    assert whole(parser("qwen3_coder", tools)(), text)["calls"] == [("f", '{"n": 5, "s": null}')]


@SETTINGS
@given(data=st.data())
def test_qwen3_coder_broken_calls_are_content(data):
    for text in ("Hi <tool_call>not xml</tool_call> bye", "<tool_call><function=></function></tool_call>",
                 "<tool_call>\n<parameter=a>1</parameter>\n</tool_call>"):  # fmt: skip
        assert both(parser("qwen3_coder"), text, data) == {"content": text, "reasoning": None, "calls": []}, text
    for text in ("<tool_call><function=f><parameter=a>1</parameter><parameter=a>2</parameter></function></tool_call>",
                 "<tool_call><function=f><bogus/></function></tool_call>",
                 "<tool_call><function=f>\n<parameter=a>\n1"):  # (a parameter twice; not XML; cut short)  # fmt: skip
        assert whole(parser("qwen3_coder")(), text) == {"content": text, "reasoning": None, "calls": []}, text


# -- every parser: any text


FRAGMENTS = ["[", "]", "(", ")", "f", "a", "=", "'x'", '"y"', ",", " ", "\n", "1", "null", "{", "}", ":", '"name"',
             '"arguments"', "[TOOL_CALLS]", "<tool_call>", "</tool_call>", "<|tool_call|>", "<function=f>", "</function>",
             "<parameter=p>", "</parameter>", "\\", "'''", "#"]  # fmt: skip


@SETTINGS
@given(pieces=st.lists(st.sampled_from(FRAGMENTS), max_size=25), name=st.sampled_from(sorted(TOOL_PARSERS)), data=st.data())
def test_any_output_is_read_without_error_and_calls_read_whole_stream_alike(pieces, name, data):
    text = "".join(pieces)
    expected = whole(parser(name)(), text)
    got = streamed(parser(name)(), cut(text, data))
    if expected["calls"]:
        assert got == expected
    else:
        assert expected == {"content": text or None, "reasoning": None, "calls": []}


def test_unknown_parser_names_the_new_choices():
    with pytest.raises(ValueError, match="ernie45, glm45, granite, hermes, llama3_json, llama4_json, mistral, openai, phi4_mini_json, pythonic, qwen3_coder, qwen3_xml"):
        get_tool_parser("granite-20b-fc")


# -- through the chat server


@pytest.fixture(scope="module")
def engine(tiny_dir):
    with serving(tiny_dir) as eng:
        yield eng


FORECAST = {"type": "function", "function": {"name": "get_forecast", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "hourly": {"type": "boolean"}}}}}  # fmt: skip

SERVED = [
    ("pythonic", "[get_weather(city='Paris', unit='celsius'), get_time(tz='CET')]", None, VLLM_ID),
    ("mistral", 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": {"tz": "CET"}}]', "Let me check.", MISTRAL_ID),
    ("qwen3_coder", "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
                    "<parameter=tz>\nCET\n</parameter>\n</function>\n</tool_call>", "Let me check.", VLLM_ID),
]  # fmt: skip


@pytest.mark.parametrize("name, text, content, ids", SERVED, ids=[s[0] for s in SERVED])
async def test_each_parser_through_the_chat_route_whole_and_streamed(engine, name, text, content, ids):
    c = client(engine, enable_auto_tool_choice=True, tool_call_parser=name)
    kwargs = {"model": NAME, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 300, "extra_body": forced(text)}
    out = await c.chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == content
    calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls]
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", PARIS), ("get_time", {"tz": "CET"})]
    assert all(re.fullmatch(ids, call.id) for call in choice.message.tool_calls)
    chunks = [chunk async for chunk in await c.chat.completions.create(**kwargs, stream=True)]
    assert streamed_calls(chunks, ids) == (content or "", calls, "tool_calls")
    await wait_idle(engine)


async def test_qwen3_coder_types_the_parameters_by_the_request_tools(engine):
    text = ("<tool_call>\n<function=get_forecast>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n<parameter=hourly>\ntrue\n</parameter>\n</function>\n</tool_call>")  # fmt: skip
    body = {"messages": MESSAGES, "tools": [FORECAST], "max_tokens": 300, **forced(text)}
    async with http(engine, enable_auto_tool_choice=True, tool_call_parser="qwen3_coder") as h:
        message = (await h.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
        chunks = events((await h.post("/v1/chat/completions", json={**body, "stream": True})).text)
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "get_forecast", "arguments": '{"city": "Paris", "days": 3, "hourly": true}'}
    pieces = [c["function"].get("arguments", "") for chunk in chunks for ch in chunk["choices"]
              for c in ch["delta"].get("tool_calls", [])]  # fmt: skip
    assert "".join(pieces) == call["function"]["arguments"]
    await wait_idle(engine)
