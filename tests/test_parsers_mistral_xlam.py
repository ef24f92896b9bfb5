"""vLLM's ``mistral`` reasoning parser (Magistral's ``[THINK]...[/THINK]``) and ``xlam`` tool
parser (xLAM-2's JSON array of calls, bare, fenced, wrapped or after ``</think>``): whole and
streamed at any split alike, what is content and what is not, the thinking token budget's
strings, then each through the chat route and the Responses API by the flag's name, the tiny
model made to write the text with ``structured_outputs.choice`` (as test_openai_server_tools.py,
whose test_reasoning_and_content_apart_whole_and_streamed runs ``mistral`` through the chat route)."""
from __future__ import annotations

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from test_openai_server_tools import (
    MESSAGES, NAME, PARIS, SETTINGS, TOOLS, XLAM_ID, arguments, both, canonical, client, cut, dumps, forced, layouts,
    serving, streamed, streamed_calls, wait_idle, whole,
)  # fmt: skip
from vllmini.engine.sampling_params import SamplingParams
from vllmini.engine.thinking_budget import ReasoningConfig, ThinkingBudget
from vllmini.entrypoints.openai.output_parser import ChatOutputParser
from vllmini.entrypoints.openai.protocol import ChatCompletionRequest
from vllmini.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser
from vllmini.entrypoints.openai.serving_chat import OpenAIServingChat
from vllmini.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser

plain = st.text(max_size=12).filter(lambda t: "[THINK]" not in t and "[/THINK]" not in t)


def mistral(in_reasoning: bool = False):
    return lambda: ChatOutputParser(get_reasoning_parser("mistral")(in_reasoning=in_reasoning), None)


def xlam(reasoning: str | None = None):
    cls = None if reasoning is None else get_reasoning_parser(reasoning)
    return lambda: ChatOutputParser(cls and cls(), get_tool_parser("xlam")())


# -- mistral (reasoning)


@SETTINGS
@given(before=plain, reasoning=plain, content=plain, lead=st.sampled_from(["", " ", "\n"]), data=st.data())
def test_mistral_reasoning_is_between_think_and_its_end_whole_and_streamed(before, reasoning, content, lead, data):
    text = lead + before + "[THINK]" + reasoning + "[/THINK]" + content
    got = both(mistral(), text, data)
    # (whitespace alone before [THINK] is dropped, as the other parsers' before <think>)
    head = (lead + before) if before.strip() else ""
    assert got == {"reasoning": reasoning or None, "content": (head + content) or None, "calls": []}


@SETTINGS
@given(text=plain, end=st.booleans(), data=st.data())
def test_mistral_without_think_is_content_unless_the_prompt_left_it_open(text, end, data):
    """As vLLM's: no [THINK] written, no reasoning, and a stray [/THINK] is dropped; a prompt that
    ends inside [THINK] (as Qwen's <think>) starts the output in reasoning."""
    full = text + ("[/THINK]after" if end else "")
    assert both(mistral(), full, data) == {"reasoning": None, "content": (text + ("after" if end else "")) or None, "calls": []}
    opened = both(mistral(in_reasoning=True), full, data)
    assert opened == {"reasoning": text or None, "content": "after" if end else None, "calls": []}


@SETTINGS
@given(before=plain, reasoning=plain, data=st.data())
def test_mistral_think_without_its_end_makes_the_rest_reasoning_and_one_section_only(before, reasoning, data):
    got = both(mistral(), before + "[THINK]" + reasoning, data)
    assert got == {"reasoning": reasoning or None, "content": before if before.strip() else None, "calls": []}
    later = "[THINK]a[/THINK]b[THINK]c[/THINK]d"  # (after the section, all is content)
    assert both(mistral(), later, data) == {"reasoning": "a", "content": "b[THINK]c[/THINK]d", "calls": []}


def test_mistral_starts_in_reasoning_only_when_the_prompt_leaves_think_open():
    m = get_reasoning_parser("mistral")
    system = "[SYSTEM_PROMPT]Draft your thinking: [THINK]your thoughts[/THINK] then the answer.[/SYSTEM_PROMPT]"
    assert not m.starts_in_reasoning(system + "[INST]Hi[/INST]")  # (Magistral's system prompt closes it)
    assert m.starts_in_reasoning(system + "[INST]Hi[/INST][THINK]")
    assert not m.starts_in_reasoning("[INST]Hi[/INST]") and not m.starts_in_reasoning("<think>")


def test_mistral_keeps_its_special_tokens_in_the_text_and_is_named_in_errors():
    params = SamplingParams(max_tokens=4)
    assert get_reasoning_parser("mistral").adjust_request(params).skip_special_tokens is False
    assert get_reasoning_parser("qwen3").adjust_request(params) is params
    assert list(REASONING_PARSERS) == ["deepseek_r1", "ernie45", "exaone4", "glm45", "granite", "mistral", "olmo3", "openai_gptoss", "qwen3"]
    with pytest.raises(ValueError, match="deepseek_r1, ernie45, exaone4, glm45, granite, mistral, olmo3, openai_gptoss, qwen3"):
        get_reasoning_parser("magistral")


def test_mistral_gives_the_thinking_budget_its_strings(tiny_dir):
    from transformers import AutoTokenizer

    config = ReasoningConfig.coerce({"reasoning_parser": "mistral"})
    assert config.strings() == ("[THINK]", "[/THINK]")
    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    rule = ThinkingBudget.from_config(config, tok, len(tok))
    assert tok.decode(rule.start_ids) == "[THINK]" and tok.decode(rule.end_ids) == "[/THINK]"
    prompt = tok.encode("Hi", add_special_tokens=False) + list(rule.start_ids)  # (a prompt that opens the section)
    assert rule.forced_token(prompt, [5, 6], budget=2) == rule.end_ids[0]
    assert rule.forced_token(prompt, [5], budget=2) is None


def test_serve_flag_reasoning_parser_mistral_sets_the_reasoning_config():
    from vllmini.cli import _serve_engine_args, build_parser

    ns = build_parser().parse_args(["serve", "--reasoning-parser", "mistral"])
    assert ReasoningConfig.coerce(_serve_engine_args(ns).reasoning_config).strings() == ("[THINK]", "[/THINK]")


# -- xlam (tool calls)

calls_st = st.lists(st.tuples(st.text(min_size=1, max_size=8), arguments), min_size=1, max_size=3)
WRAPS = {"bare": ("", ""), "fence": ("```json\n", "\n```"), "plain_fence": ("```", "```"),
         "tool_calls": ("[TOOL_CALLS]", ""), "tool_call": ("<tool_call>", "</tool_call>")}  # fmt: skip
text_st = st.text(max_size=12).filter(lambda t: not any(m in t for m in ("`", "[TOOL_CALLS", "<tool_call", "</think")))


def array(calls, layout) -> str:
    return dumps([{"name": n, "arguments": a} for n, a in calls], layout)


@SETTINGS
@given(calls=calls_st, wrap=st.sampled_from(sorted(WRAPS)), layout=layouts, before=text_st, after=text_st,
       gap=st.sampled_from(["", " ", "\n"]), data=st.data())  # fmt: skip
def test_xlam_reads_the_array_bare_fenced_or_wrapped_whole_and_streamed(calls, wrap, layout, before, after, gap, data):
    opening, closing = WRAPS[wrap]
    if wrap == "bare":
        before = ""  # (a bare array opens the output: text before it makes it all content)
        after = after if not after.lstrip().startswith(("[", ";")) else ""
    if wrap == "tool_calls":
        after = "\n" + after  # ([TOOL_CALLS]'s calls end at the line's end in vLLM's reading)
    text = before + opening + gap + array(calls, layout) + gap + closing + after
    got = both(xlam(), text, data)
    assert got["calls"] == [(n, canonical(a)) for n, a in calls]
    assert got["content"] == ((before.rstrip() + after.lstrip()) or None)


@SETTINGS
@given(data=st.data())
def test_xlam_text_opening_with_a_bracket_that_is_no_array_of_calls_leaves_a_later_fence_readable(data):
    """A "[" that does not open an array of objects is text (as vLLM's, which looks for fences
    first): the fenced calls after it are still read, streamed as whole."""
    fenced = '```json\n[{"name": "f", "arguments": {"a": 1}}]\n```'
    for before in ("[", "[ hi ", "[1] then ", "[]\n"):
        got = both(xlam(), before + fenced, data)
        assert got == {"reasoning": None, "content": before.rstrip(), "calls": [("f", '{"a": 1}')]}


@SETTINGS
@given(calls=calls_st, thought=text_st, gap=st.sampled_from(["", "\n\n", " "]), data=st.data())
def test_xlam_reads_the_array_after_think_end(calls, thought, gap, data):
    """As vLLM's: the text through </think> is content, the array after it the calls; with a
    reasoning parser the reasoning is taken out first."""
    text = "<think>" + thought + "</think>" + gap + array(calls, {})
    got = both(xlam(), text, data)
    assert got == {"reasoning": None, "content": "<think>" + thought + "</think>", "calls": [(n, canonical(a)) for n, a in calls]}
    got = both(xlam("qwen3"), text, data)
    assert got == {"reasoning": thought or None, "content": None, "calls": [(n, canonical(a)) for n, a in calls]}


@SETTINGS
@given(data=st.data())
def test_xlam_text_that_is_not_calls_is_content_as_it_is(data):
    for text in ("Sure! [1, 2]", "[1] is a citation", "[]", '[{"arguments": {}}]', '[{"name": 3}]', "[not json",
                 "```python\nx = [1]\n```\nDone.", "```\n{\"a\": 1}\n```", '<tool_call>{"name": "f", "arguments": {}}</tool_call>',
                 "Say [TOOL_CALLS] then", "```j", "Here: [{\"name\": \"f\", \"arguments\": {}}]", "</think>ok"):  # fmt: skip
        assert both(xlam(), text, data) == {"content": text, "reasoning": None, "calls": []}, text
    cut_short = '[{"name": "f", "arguments": {"a": '
    assert whole(xlam()(), cut_short) == {"content": cut_short, "reasoning": None, "calls": []}
    assert streamed(xlam()(), cut(cut_short, data))["calls"] == [("f", '{"a": ')]  # (already sent, as vLLM's)


def test_xlam_code_blocks_are_content_and_a_later_fence_holds_the_calls():
    text = "Code:\n```python\nprint([1])\n```\nCalls:\n```json\n" + array([("f", {"a": 1})], {}) + "\n```"
    assert whole(xlam()(), text) == {"content": "Code:\n```python\nprint([1])\n```\nCalls:", "reasoning": None,
                                     "calls": [("f", '{"a": 1}')]}  # fmt: skip


def test_xlam_call_ids_are_vllms_and_numbered():
    text = array([("f", {}), ("g", {"a": 1})], {})
    calls = xlam()().parse(text)[2]
    assert [c.id[:7] for c in calls] == ["call_0_", "call_1_"] and all(re.fullmatch(XLAM_ID, c.id) for c in calls)
    parser = xlam()()
    deltas = [parser.delta(text[:25]), parser.delta(text[25:], final=True)]
    ids = [call.id for d in deltas if d for call in d.tool_calls if call.id]
    assert [i[:7] for i in ids] == ["call_0_", "call_1_"]


FRAGMENTS = ["[", "]", "{", "}", ":", ",", " ", "\n", '"name"', '"arguments"', '"f"', "1", "```", "json", "```json\n",
             "[TOOL_CALLS]", "<tool_call>", "</tool_call>", "</think>", "x"]  # fmt: skip


@SETTINGS
@given(pieces=st.lists(st.sampled_from(FRAGMENTS), max_size=25), data=st.data())
def test_xlam_any_output_is_read_without_error_and_calls_read_whole_stream_alike(pieces, data):
    text = "".join(pieces)
    expected = whole(xlam()(), text)
    got = streamed(xlam()(), cut(text, data))
    if expected["calls"]:
        assert got == expected
    else:
        assert expected == {"content": text or None, "reasoning": None, "calls": []}


def test_xlam_is_registered_by_vllms_name():
    assert TOOL_PARSERS["xlam"] is get_tool_parser("xlam")
    params = SamplingParams(max_tokens=4)
    assert get_tool_parser("xlam")().adjust_request(params) is params  # (as vLLM's: special tokens as asked)


# -- through the server


@pytest.fixture(scope="module")
def engine(tiny_dir):
    with serving(tiny_dir) as eng:
        yield eng


async def test_mistral_reasoning_turns_off_skip_special_tokens_in_the_request(engine):
    request = ChatCompletionRequest(model=NAME, messages=MESSAGES, max_tokens=4)
    mistral, qwen3 = (OpenAIServingChat(engine, NAME, reasoning_parser=name) for name in ("mistral", "qwen3"))
    assert (await mistral.prepare(request)).params.skip_special_tokens is False
    assert (await qwen3.prepare(request)).params.skip_special_tokens is True


async def test_xlam_calls_through_the_chat_route_whole_and_streamed(engine):
    text = ('```json\n[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
            '{"name": "get_time", "arguments": {"tz": "CET"}}]\n```')  # fmt: skip
    c = client(engine, enable_auto_tool_choice=True, tool_call_parser="xlam")
    kwargs = {"model": NAME, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 300, "extra_body": forced(text)}
    out = await c.chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls]
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", PARIS), ("get_time", {"tz": "CET"})]
    assert all(re.fullmatch(XLAM_ID, call.id) for call in choice.message.tool_calls)
    chunks = [chunk async for chunk in await c.chat.completions.create(**kwargs, stream=True)]
    assert streamed_calls(chunks, XLAM_ID) == ("", calls, "tool_calls")
    await wait_idle(engine)


async def test_mistral_reasoning_and_xlam_calls_in_the_responses_api(engine):
    text = '[THINK]I need the weather tool.[/THINK][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]'
    tools = [{"type": "function", **tool["function"]} for tool in TOOLS]
    c = client(engine, reasoning_parser="mistral", enable_auto_tool_choice=True, tool_call_parser="xlam")
    kwargs = {"model": NAME, "input": "Weather in Paris?", "tools": tools, "max_output_tokens": 200, "extra_body": forced(text)}
    out = await c.responses.create(**kwargs)
    reasoning, call = out.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "I need the weather tool."
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == PARIS
    streamed_events = [event async for event in await c.responses.create(**kwargs, stream=True)]
    final = streamed_events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "function_call"]
    assert final.output[0].content[0].text == reasoning.content[0].text and final.output[1].arguments == call.arguments
    await wait_idle(engine)
