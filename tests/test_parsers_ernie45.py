"""vLLM's ``ernie45`` reasoning and tool-call parsers (ERNIE 4.5 Thinking: ``reasoning\\n</think>``,
then ``<response>content</response>`` or ``<tool_call>`` JSON blocks): whole and streamed at any
split alike, what is content and what is not, then both through the chat route by the flags'
names, the tiny model made to write the text with ``structured_outputs.choice``."""
from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from test_openai_server_tools import (
    MESSAGES, PARIS, SETTINGS, arguments, both, calls_after_reasoning, canonical, dumps, events, forced, http, layouts,
    names, serving, wait_idle, whole,
)  # fmt: skip
from vllmini.engine.sampling_params import SamplingParams
from vllmini.engine.thinking_budget import ReasoningConfig
from vllmini.entrypoints.openai.output_parser import ChatOutputParser
from vllmini.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser
from vllmini.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser

plain = st.text(max_size=12).filter(lambda t: "<" not in t)  # (no tag, nor the start of one)
newlines = st.sampled_from(["", "\n", "\n\n", "\n\n\n"])


def ernie(tools: bool = False, reasoning: bool = True):
    """A choice's output parser with ernie45's parsers (as the server makes it: in reasoning from the start)."""
    cls = get_reasoning_parser("ernie45")
    return lambda: ChatOutputParser(cls(in_reasoning=cls.starts_in_reasoning("")) if reasoning else None,
                                    get_tool_parser("ernie45")() if tools else None)  # fmt: skip


# -- reasoning


@SETTINGS
@given(reasoning=plain, content=plain, opened=st.booleans(), gap=newlines, tail=newlines, data=st.data())
def test_ernie45_content_is_between_the_response_tags_after_think_end(reasoning, content, opened, gap, tail, data):
    text = ("<think>" if opened else "") + reasoning + "</think>" + gap + "<response>" + content + "</response>" + tail
    assert both(ernie(), text, data) == {"reasoning": reasoning or None, "content": content or None, "calls": []}
    # (vLLM's reading keeps the text between the tags as it is, newlines too)
    text = reasoning + "\n</think>\n\n<response>\n" + content + "\n</response>\n"
    assert both(ernie(), text, data) == {"reasoning": reasoning + "\n", "content": "\n" + content + "\n", "calls": []}


@SETTINGS
@given(reasoning=plain, content=plain, gap=newlines, data=st.data())
def test_ernie45_plain_content_after_think_end_loses_its_leading_newlines(reasoning, content, gap, data):
    got = both(ernie(), reasoning + "</think>" + gap + content, data)
    assert got == {"reasoning": reasoning or None, "content": content.lstrip("\n") or None, "calls": []}


@SETTINGS
@given(text=st.text(max_size=30).filter(lambda t: "</think>" not in t and not t.lstrip().startswith("<")), data=st.data())
def test_ernie45_without_think_end_is_all_reasoning(text, data):
    assert get_reasoning_parser("ernie45").starts_in_reasoning("")
    assert both(ernie(), text, data) == {"reasoning": text or None, "content": None, "calls": []}


@SETTINGS
@given(data=st.data())
def test_ernie45_response_edges(data):
    """A <response> cut short keeps its text, text after </response> is content (its whitespace
    dropped), a <response> after other content is plain text."""
    cases = {"r</think>\n\n<response>\ncut sh": "\ncut sh", "r</think><response>a</response> \n b": "ab",
             "r</think>ok <response>x</response>": "ok <response>x</response>", "r</think>\n\n<resp": "<resp",
             "r</think><response></response>\n": None, "r</think>\n\n": None}  # fmt: skip
    for text, content in cases.items():
        assert both(ernie(), text, data) == {"reasoning": "r", "content": content, "calls": []}, text


def test_both_are_registered_by_vllms_name_and_leave_the_request_as_it_is():
    """(As vLLM's: ERNIE's tags are plain text, special tokens skipped as the request asks.) The
    thinking budget reads the reasoning parser's strings."""
    assert REASONING_PARSERS["ernie45"] is get_reasoning_parser("ernie45") and TOOL_PARSERS["ernie45"] is get_tool_parser("ernie45")
    params = SamplingParams(max_tokens=4)
    assert get_reasoning_parser("ernie45").adjust_request(params) is params
    assert get_tool_parser("ernie45")().adjust_request(params) is params
    assert ReasoningConfig.coerce({"reasoning_parser": "ernie45"}).strings() == ("<think>", "</think>")


# -- tool calls


def blocks(calls, layout: dict, gap: str, close: bool) -> str:
    return "".join(f"<tool_call>{gap}{dumps({'name': n, 'arguments': a}, layout)}{gap}"
                   + ("</tool_call>" if close else "") + gap for n, a in calls)  # fmt: skip


calls_st = st.lists(st.tuples(names, arguments), min_size=1, max_size=3)
no_call = st.text(max_size=12).filter(lambda t: "<tool_call>" not in t)


@SETTINGS
@given(before=no_call, calls=calls_st, layout=layouts, gap=st.sampled_from(["", "\n", " \n "]), close=st.booleans(),
       after=no_call, data=st.data())  # fmt: skip
def test_ernie45_reads_tool_call_blocks_and_keeps_no_text_after_them(before, calls, layout, gap, close, after, data):
    text = before + blocks(calls, layout, gap, close) + after
    got = both(ernie(tools=True, reasoning=False), text, data)
    assert got == {"reasoning": None, "content": before.rstrip() or None, "calls": [(n, canonical(a)) for n, a in calls]}


@SETTINGS
@given(reasoning=plain, calls=calls_st, layout=layouts, data=st.data())
def test_ernie45_reads_the_calls_after_its_reasoning(reasoning, calls, layout, data):
    text = reasoning + "\n</think>\n\n\n" + blocks(calls, layout, "\n", True)
    got = both(ernie(tools=True), text, data)
    assert got == {"reasoning": reasoning + "\n", "content": None, "calls": [(n, canonical(a)) for n, a in calls]}
    # without the reasoning parser the text through </think> is the content (as vLLM's)
    got = both(ernie(tools=True, reasoning=False), text, data)
    assert got["content"] == reasoning + "\n</think>" and len(got["calls"]) == len(calls)


def test_ernie45_reads_vllms_examples():
    text = ('I need to call two tools to handle these two issues separately.\n</think>\n\n<tool_call>\n'
            '{"name": "get_current_temperature", "arguments": {"location": "Beijing"}}\n</tool_call>\n<tool_call>\n'
            '{"name": "get_temperature_unit", "arguments": {"location": "Guangzhou", "unit": "c"}}\n</tool_call>\n')  # fmt: skip
    got = whole(ernie(tools=True, reasoning=False)(), text)
    assert got["content"] == "I need to call two tools to handle these two issues separately.\n</think>"
    assert got["calls"] == [("get_current_temperature", '{"location": "Beijing"}'),
                            ("get_temperature_unit", '{"location": "Guangzhou", "unit": "c"}')]  # fmt: skip
    assert whole(ernie(tools=True, reasoning=False)(), "This is a test") == \
        {"content": "This is a test", "reasoning": None, "calls": []}  # fmt: skip
    broken = '<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>'
    assert whole(ernie(tools=True, reasoning=False)(), broken) == {"content": broken, "reasoning": None, "calls": []}


# -- through the server


@pytest.fixture(scope="module")
def engine(tiny_dir):
    with serving(tiny_dir) as eng:
        yield eng


ERNIE = {"reasoning_parser": "ernie45", "enable_auto_tool_choice": True, "tool_call_parser": "ernie45"}


async def test_ernie45_calls_after_reasoning_through_the_chat_route(engine):
    # (a forced output is not in reasoning unless it opens <think>: serving_chat._parsing)
    text = ('<think>I need the weather tool.\n</think>\n\n\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n')  # fmt: skip
    reasoning, ((name, args),) = await calls_after_reasoning(engine, ERNIE, forced(text))
    assert reasoning == "I need the weather tool.\n" and name == "get_weather" and json.loads(args) == PARIS


async def test_ernie45_response_through_the_chat_route(engine):
    text = "<think>Sunny, I think.\n</think>\n\n<response>\nIt is sunny.\n</response>\n"
    body = {"messages": MESSAGES, "max_tokens": 300, **forced(text)}
    async with http(engine, reasoning_parser="ernie45") as h:
        message = (await h.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
        chunks = events((await h.post("/v1/chat/completions", json={**body, "stream": True})).text)
    assert (message["reasoning"], message["content"]) == ("Sunny, I think.\n", "\nIt is sunny.\n")
    deltas = [ch["delta"] for chunk in chunks for ch in chunk["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == message["reasoning"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    await wait_idle(engine)
